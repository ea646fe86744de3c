"""Old entry point, kept because docs and users run it: ``python -m metalog.tools.bench_hostile`` is tools/bench/hostile.py."""

from metalog.tools.bench.hostile import main

if __name__ == "__main__":
    raise SystemExit(main())
