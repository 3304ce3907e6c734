"""Entry point for `python -m kvlab`."""

import sys

from kvlab.cli import main

sys.exit(main())
