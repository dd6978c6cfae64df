"""``python -m extract.top``: the command lives in ``extract.cli.top``; this name is the one users know."""

import sys

from .cli.top import main

if __name__ == "__main__":
    sys.exit(main())
