import sys

from kvl.cli import main

sys.exit(main())
