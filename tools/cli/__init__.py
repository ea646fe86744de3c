"""The ``metalog`` command line (console script ``metalog = metalog.tools.cli:main``).

``main`` only dispatches: ``metalog broker ...`` goes to the broker
(broker/server/main.py) before any CLI module is imported; everything else goes to
tools/cli/app.py (the parser and the client commands). Subcommand groups
live in their own modules here (admin, cluster, certs, storage, dump) or
with their tool (tools/drill, tools/bench, tools/spark)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["broker"]:
        # Imported here so that a broker process starts without the CLI's tool
        # modules (measured: they add ~0.3 s to every broker start).
        from metalog.broker.server.main import main as broker_main

        # Hand every argument (--config, --set ...) to the broker's own parser.
        return broker_main(argv[1:])
    # Imported here so that the dispatch above stays cheap (see there).
    from metalog.tools.cli.app import main as cli_main

    return cli_main(argv)
