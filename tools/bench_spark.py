"""Old entry point, kept because docs and users run it as a script:
``python tools/bench_spark.py`` is ``python -m metalog.tools.bench.spark``."""

import os
import sys

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from metalog.tools.bench.spark import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
