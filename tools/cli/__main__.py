"""``python -m metalog.tools.cli ...`` runs the ``metalog`` command (what the console script runs)."""

import sys

from metalog.tools.cli import main

sys.exit(main())
