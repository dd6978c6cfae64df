import sys

from .cli.extract import main

sys.exit(main())
