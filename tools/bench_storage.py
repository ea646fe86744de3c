"""Old entry point, kept because docs and users run it: ``python -m metalog.tools.bench_storage`` is tools/bench/storage_engine.py."""

from metalog.tools.bench.storage_engine import main

if __name__ == "__main__":
    raise SystemExit(main())
