"""`metalog dump FILE`: decode a snapshot (`.checkpoint`) or log segment (`.log`).

One line per record: ``offset=<n> epoch=<e> <Type> {fields}``; control records
are tagged ``control``. For a snapshot, offsets are positions within the file
(the header is offset 0). Everything readable is printed first, then a bad
batch, a truncated tail or a broken snapshot structure is reported on stderr
with the file and byte position, and the exit code is 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TextIO

import msgspec

from storage import batch as b
from storage import control_records as cr
from storage import metadata_records as r
from storage.snapshot import CorruptSnapshotError, parse_snapshot_filename, verify_snapshot_bytes


def _fields(rec) -> str:
    return json.dumps(msgspec.to_builtins(msgspec.structs.asdict(rec)), sort_keys=False)


def _record_line(offset: int, epoch: int, value: bytes, control: bool) -> str:
    try:
        rec = cr.decode_control(value) if control else r.decode_record(value)
    except (cr.ControlRecordError, r.MetadataRecordError) as exc:
        return f"offset={offset} epoch={epoch} UNDECODABLE ({exc})"
    tag = "control " if control else ""
    return f"offset={offset} epoch={epoch} {tag}{type(rec).__name__} {_fields(rec)}"


def dump(path: str, out: TextIO, err: TextIO, max_records: int | None = None) -> int:
    """Print the records of `path`; 0 if the file is whole, 1 otherwise."""
    try:
        with open(path, "rb") as f:
            data = f.read()
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
    try:
        for pos, h in b.iter_batches(data):
            end = pos + h.size
            for i, value in enumerate(b.decode_records(memoryview(data)[pos:end], h)):
                if max_records is not None and printed >= max_records:
                    break
                print(_record_line(h.base_offset + i, h.leader_epoch, value, h.is_control),
                      file=out)
                printed += 1
    except b.CorruptBatchError as exc:
        print(f"metalog dump: {path}: corrupt batch at byte {exc.position}: {exc}", file=err)
        return 1
    if end != len(data):
        print(f"metalog dump: {path}: truncated: {len(data) - end} byte(s) after the last "
              f"whole batch at byte {end}", file=err)
        return 1
    if is_snapshot:
        sid = parse_snapshot_filename(name)
        if sid is None:
            print(f"metalog dump: {path}: {name!r} is not a snapshot file name "
                  "(<20-digit offset>-<10-digit epoch>.checkpoint)", file=err)
            return 1
        try:
            layout = verify_snapshot_bytes(data, sid, path)
        except CorruptSnapshotError as exc:
            print(f"metalog dump: {exc}", file=err)
            return 1
        print(f"# snapshot end_offset={sid.end_offset} epoch={sid.epoch} "
              f"records={layout.records} bytes={layout.size}", file=out)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="metalog dump", description=__doc__.splitlines()[0])
    _add_args(parser)
    args = parser.parse_args(argv)
    return _run(args)


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="a <offset>-<epoch>.checkpoint snapshot or a <offset>.log segment")
    p.add_argument("--max-records", type=int, default=None, help="stop printing after N records")


def _run(args: argparse.Namespace) -> int:
    return dump(args.path, sys.stdout, sys.stderr, args.max_records)


def register_cli(subparsers) -> None:
    """Hook for tools.cli: adds `metalog dump`."""
    p = subparsers.add_parser("dump", help="decode a .checkpoint snapshot or .log segment")
    _add_args(p)
    p.set_defaults(func=_run)


if __name__ == "__main__":
    sys.exit(main())
