"""Run one broker process: ``python -m metalog.broker.server.main --config broker.yaml``.

SIGHUP re-reads the TLS certificate files (rotation without restart).

``--help-config`` prints every config key (generated from broker/server/config.py).

Exit codes: 0 after a graceful stop (SIGTERM/SIGINT), 2 for a bad config,
3 when the broker refuses to start (wrong cluster id, corrupt log...), 4 after
a fatal invariant breach.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import uvloop

from metalog.broker.server.config import ConfigError, help_text, load_config
from metalog.broker.server.logging_setup import configure_logging


def parse_overrides(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected key=value")
        out[key] = value
    return out


async def run(cfg) -> int:
    from metalog.broker.server.recovery import StartupError
    from metalog.broker.server.runtime import Broker
    from metalog.storage.batch import CorruptBatchError
    from metalog.storage.epochs import EpochCheckpointError
    from metalog.storage.errors import StorageError
    from metalog.storage.snapshot import CorruptSnapshotError

    stream = open(cfg.log_file, "a", buffering=1) if cfg.log_file else None
    logger = configure_logging(cfg.log_level, stream)
    broker = Broker(cfg, logger)
    try:
        await broker.start()
    except (StartupError, StorageError, CorruptBatchError, CorruptSnapshotError, EpochCheckpointError,
            OSError, ValueError) as exc:
        logger.critical("fatal", cause="refused_to_start", reason=str(exc), error_type=type(exc).__name__,
                        data_dir=cfg.data_dir)
        print(f"metalog broker {cfg.node_id}: refusing to start: {exc}", file=sys.stderr)
        return 3
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: loop.create_task(broker.stop(graceful=True)))
    if broker.tls is not None:
        # Certificate rotation: new handshakes use the re-read files (the mtime check does it too).
        loop.add_signal_handler(signal.SIGHUP, lambda: broker.tls.reload(trigger="sighup"))
    await broker.stopped.wait()
    return 4 if broker.fatal else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="metalog broker", description="Run one metalog broker.")
    parser.add_argument("--config", help="YAML or JSON broker config file (required to run)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, flat or as section.key (repeatable)")
    parser.add_argument("--help-config", action="store_true",
                        help="print every config key (section, type, default, description) and exit")
    parser.add_argument("--insecure", action="store_true",
                        help="plaintext, no authentication (security_protocol PLAINTEXT); logs a warning")
    args = parser.parse_args(argv)
    if args.help_config:
        sys.stdout.write(help_text())
        return 0
    if not args.config:
        parser.error("the following arguments are required: --config")
    try:
        overrides = parse_overrides(args.set)
        if args.insecure:
            overrides["security_protocol"] = "PLAINTEXT"
        cfg = load_config(args.config, overrides)
    except ConfigError as exc:
        print(f"metalog: config error: {exc}", file=sys.stderr)
        return 2
    return uvloop.run(run(cfg))


if __name__ == "__main__":
    sys.exit(main())
