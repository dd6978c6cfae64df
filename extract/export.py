"""``python -m extract.export``: the command lives in ``extract.cli.export``; this name is the one users know."""

import sys

from .cli.export import main

if __name__ == "__main__":
    sys.exit(main())
