"""Old entry point, kept because docs and users run it: ``python -m tools.bench_hostile`` is tools/bench/hostile.py."""

from tools.bench.hostile import main

if __name__ == "__main__":
    raise SystemExit(main())
