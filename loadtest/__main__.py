"""`python -m loadtest`: see loadtest/cli.py and docs/loadtest.md."""

import sys

from loadtest.cli import main

sys.exit(main())
