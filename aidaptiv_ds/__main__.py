import sys

from aidaptiv_ds.cli import main

sys.exit(main())
