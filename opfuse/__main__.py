import sys

from opfuse.cli import main

sys.exit(main())
