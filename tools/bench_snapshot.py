"""Old entry point, kept because docs and users run it: ``python -m metalog.tools.bench_snapshot`` is tools/bench/snapshot.py."""

from metalog.tools.bench.snapshot import main

if __name__ == "__main__":
    raise SystemExit(main())
