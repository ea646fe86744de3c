"""Optional extras: the Spark job needs ``metalog[spark]`` (pyspark, pyarrow,
pandas; matplotlib for its plots, which are skipped without it) and the drill's
timeline picture ``metalog[bench]`` (matplotlib); the
broker and the rest of the CLI install without them. ``missing()`` tells a
command, before it starts any work, which extra to install."""

from __future__ import annotations

import importlib.util

SPARK_MODULES = ("pyspark", "pyarrow", "pandas")
PLOT_MODULES = ("matplotlib",)


def missing(modules: tuple[str, ...], extra: str) -> str | None:
    """None when every module can be imported; else one line naming the first
    missing module and the pip command that installs it (``extra``)."""
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except ImportError:  # a parent package is missing or refuses to load
            found = False
        if not found:
            return f"{name} is not installed: pip install 'metalog[{extra}]'"
    return None
