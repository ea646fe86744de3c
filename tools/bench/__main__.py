"""``python -m tools.bench ARGS`` is ``metalog bench ARGS``; ``python -m tools.bench worker SPEC``
is one load-generator process that ``metalog bench`` starts."""

import sys

from tools.bench.bench import worker_main
from tools.cli import main

if len(sys.argv) > 1 and sys.argv[1] == "worker":
    sys.exit(worker_main(sys.argv[2:]))
sys.exit(main(["bench", *sys.argv[1:]]))
