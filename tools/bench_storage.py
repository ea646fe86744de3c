"""Old entry point, kept because docs and users run it: ``python -m tools.bench_storage`` is tools/bench/storage_engine.py."""

from tools.bench.storage_engine import main

if __name__ == "__main__":
    raise SystemExit(main())
