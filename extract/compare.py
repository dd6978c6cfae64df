"""``python -m extract.compare``: the command lives in ``extract.cli.compare``; this name is the one users know."""

import sys

from .cli.compare import main

if __name__ == "__main__":
    sys.exit(main())
