import sys

from minisarathi.cli import main

sys.exit(main())
