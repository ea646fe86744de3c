"""``python -m tools.cli ...`` runs the ``metalog`` command (what the console script runs)."""

import sys

from tools.cli import main

sys.exit(main())
