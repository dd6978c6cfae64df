"""``python -m extract.probe``: the command lives in ``extract.cli.probe``; this name is the one users know."""

import sys

from .cli.probe import main

if __name__ == "__main__":
    sys.exit(main())
