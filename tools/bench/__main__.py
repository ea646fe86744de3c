"""``python -m metalog.tools.bench ARGS`` is ``metalog bench ARGS``; ``python -m metalog.tools.bench worker SPEC``
is one load-generator process that ``metalog bench`` starts."""

import sys

from metalog.tools.bench.bench import worker_main
from metalog.tools.cli import main

if len(sys.argv) > 1 and sys.argv[1] == "worker":
    sys.exit(worker_main(sys.argv[2:]))
sys.exit(main(["bench", *sys.argv[1:]]))
