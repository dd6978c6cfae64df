"""``python -m extract.report``: the command lives in ``extract.cli.report``; this name is the one users know."""

import sys

from .cli.report import main

if __name__ == "__main__":
    sys.exit(main())
