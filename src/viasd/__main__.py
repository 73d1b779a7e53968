import sys

from viasd.cli import main

sys.exit(main())
