"""`metalog dump FILE`: decode a snapshot (`.checkpoint`) or log segment (`.log`),
with kafka-dump-log's options.

Without options, one JSON line per batch (base and last offset, count, leader
epoch, byte position, size, CRC, control or not), as kafka-dump-log prints.
``--deep-iteration`` adds one line per record (offset, epoch);
``--print-data-log`` (implies it) adds each record's content, decoded:
metadata and control records as ``{"offset", "epoch", "type", "version",
"fields"}`` with the decoders of storage/, produced values as UTF-8 text when
they are valid UTF-8, else base64 (``"encoding"`` says which); ``--raw`` gives
every value as base64 of its bytes, undecoded. A metadata record of a Kafka
type we do not model is printed by Kafka's name with ``"unmodelled": true``
and its body as hex, and a last line ``{"unmodelled_records": {name: count}}``
sums them. ``record_json`` (tools/record_json.py) is shared with
``metalog consume``.

For a snapshot, offsets are positions within the file (the header is offset
0). Everything readable is printed first, then a bad batch, a truncated tail
or a broken snapshot structure is reported on stderr with the file and byte
position, and the exit code is 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TextIO

from metalog.storage import batch as b
from metalog.storage.snapshot import CorruptSnapshotError, parse_snapshot_filename, verify_snapshot_bytes
from metalog.tools.record_json import record_json, value_json  # noqa: F401  (re-exported: app.py, tests)


def batch_json(pos: int, h: b.BatchHeader) -> dict:
    """kafka-dump-log's batch line."""
    return {"batch": {"base_offset": h.base_offset, "last_offset": h.last_offset, "count": h.records_count,
                      "epoch": h.leader_epoch, "position": pos, "size": h.size, "crc": h.crc,
                      "is_control": h.is_control, "timestamp_ms": h.max_timestamp_ms,
                      # kafka-dump-log's producerId / producerEpoch / baseSequence (-1: not idempotent)
                      "producer_id": h.producer_id, "producer_epoch": h.producer_epoch,
                      "base_sequence": h.base_sequence}}


def dump(path: str, out: TextIO, err: TextIO, max_records: int | None = None, *, deep: bool = True,
         data: bool = True, raw: bool = False) -> int:
    """Print the batches of `path` (and with deep, each record's offset and epoch;
    with data, its decoded content); 0 if the file is whole, 1 otherwise."""
    try:
        with open(path, "rb") as f:
            buf = f.read()
    except FileNotFoundError:
        print(f"metalog dump: {path}: no such file", file=err)
        return 1
    except IsADirectoryError:
        print(f"metalog dump: {path}: is a directory, give a .checkpoint or .log file", file=err)
        return 1
    name = os.path.basename(path)
    is_snapshot = name.endswith(".checkpoint")
    if not (is_snapshot or name.endswith(".log")):
        print(f"metalog dump: {path}: not a .checkpoint or .log file", file=err)
        return 1
    printed = 0
    end = 0
    unmodelled: dict[str, int] = {}  # Kafka record types we do not model, by name
    try:
        for pos, h in b.iter_batches(buf):
            end = pos + h.size
            if max_records is not None and printed >= max_records:
                continue  # keep verifying the rest of the file
            print(json.dumps(batch_json(pos, h)), file=out)
            if not (deep or data):
                printed += 1  # without records, --max-records counts batches
                continue
            for i, value in enumerate(b.decode_records(memoryview(buf)[pos:end], h)):
                if max_records is not None and printed >= max_records:
                    break
                if data:
                    line = record_json(h.base_offset + i, h.leader_epoch, bytes(value), h.is_control, raw)
                    if line.get("unmodelled"):
                        unmodelled[line["type"]] = unmodelled.get(line["type"], 0) + 1
                else:
                    line = {"offset": h.base_offset + i, "epoch": h.leader_epoch, "size": len(value)}
                print(json.dumps(line), file=out)
                printed += 1
    except b.CorruptBatchError as exc:
        print(f"metalog dump: {path}: corrupt batch at byte {exc.position}: {exc}", file=err)
        return 1
    if unmodelled:
        print(json.dumps({"unmodelled_records": dict(sorted(unmodelled.items()))}), file=out)
    if end != len(buf):
        print(f"metalog dump: {path}: truncated: {len(buf) - end} byte(s) after the last "
              f"whole batch at byte {end}", file=err)
        return 1
    if is_snapshot:
        sid = parse_snapshot_filename(name)
        if sid is None:
            print(f"metalog dump: {path}: {name!r} is not a snapshot file name "
                  "(<20-digit offset>-<10-digit epoch>.checkpoint)", file=err)
            return 1
        try:
            layout = verify_snapshot_bytes(buf, sid, path)
        except CorruptSnapshotError as exc:
            print(f"metalog dump: {exc}", file=err)
            return 1
        print(json.dumps({"snapshot": {"end_offset": sid.end_offset, "epoch": sid.epoch,
                                       "records": layout.records, "bytes": layout.size_bytes}}), file=out)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="metalog dump", description=__doc__.splitlines()[0])
    _add_args(parser)
    args = parser.parse_args(argv)
    return _run(args)


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="a <offset>-<epoch>.checkpoint snapshot or a <offset>.log segment")
    p.add_argument("--max-records", type=int, default=None, help="stop printing after N records")
    p.add_argument("--deep-iteration", action="store_true", help="one line per record too (offset, epoch, size)")
    p.add_argument("--print-data-log", action="store_true",
                   help="each record's content, decoded (implies --deep-iteration)")
    p.add_argument("--raw", action="store_true", help="with --print-data-log: values as base64, undecoded")


def _run(args: argparse.Namespace) -> int:
    return dump(args.path, sys.stdout, sys.stderr, args.max_records, deep=args.deep_iteration,
                data=args.print_data_log or args.raw, raw=args.raw)


def register_cli(subparsers) -> None:
    """Hook for metalog.tools.cli: adds `metalog dump`."""
    p = subparsers.add_parser("dump", help="decode a .checkpoint snapshot or .log segment")
    _add_args(p)
    p.set_defaults(func=_run)


if __name__ == "__main__":
    sys.exit(main())
