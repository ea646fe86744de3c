"""Old entry point, kept because docs and users submit it as a script:
``spark-submit ... tools/spark_job.py snapshot ...`` runs tools/spark/job.py."""

import os
import sys

if __package__ in (None, ""):  # spark-submit tools/spark_job.py: make the repo importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from metalog.tools.spark.job import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
