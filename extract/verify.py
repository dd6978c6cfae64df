"""``python -m extract.verify``: the command lives in ``extract.cli.verify``; this name is the one users know."""

import sys

from .cli.verify import main

if __name__ == "__main__":
    sys.exit(main())
