import sys

from rayzero.cli import main

sys.exit(main())
