import sys

from .cli.startup import main

sys.exit(main())
