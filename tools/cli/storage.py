"""``metalog storage verify|recover``: offline checks of a broker's log (the
broker must be stopped; the log's lock file enforces it for ``recover``).

    metalog storage verify  --data-dir DIR
        Verify every batch of every segment (header, length, magic, CRC-32C,
        offsets, epochs). Exit 0 if whole, 1 if anything is damaged.
    metalog storage format --config FILE [--set KEY=VALUE ...] (--standalone
                           | --initial-controllers LIST | --no-initial-controllers)
        KIP-853, as kafka-storage format: bind a new data dir (meta.properties
        with a new directory.id) and, for the first voters of a dynamic
        cluster, write the bootstrap checkpoint
        (00000000000000000000-0000000000.checkpoint: KRaftVersionRecord(1) +
        VotersRecord). --standalone: this node is the only voter (at its
        `listen` address). --initial-controllers id@host:port:directory-id,...:
        every first voter; this node's entry gives its directory id.
        --no-initial-controllers: a node that joins later (AddRaftVoter).
        Run with dynamic_voters: true in the config.
    metalog storage upgrade --data-dir DIR
        Convert a stopped broker's data dir from metalog format version 1
        (our own record framing) to version 2 (Kafka's v2 records and control
        records): every segment and snapshot rewritten durably, meta.properties
        stamped last. Idempotent: run it again after an interruption.
    metalog storage recover --data-dir DIR --truncate-at-corruption
        The operator's explicit consent to lose data when no other copy
        exists (a single voter, or every copy damaged): truncate the log at
        its first corruption, rename the damaged segment and all later ones
        ``.corrupt`` (never deleted) and clear the quarantine so the broker
        may start and vote. Without the flag: the same report as ``verify``.
"""

from __future__ import annotations

import os
import re
import sys

from metalog.storage.errors import CorruptionReport
from metalog.storage.segments import SegmentedLog, segment_file_name
from metalog.storage.scrub import verify_segment_fd

PARTITION_DIR = "__cluster_metadata-0"
_SEGMENT = re.compile(r"^(\d{20})\.log$")


def log_dir_of(data_dir: str) -> str:
    """Accept the broker's data_dir or the log directory itself."""
    inner = os.path.join(data_dir, PARTITION_DIR)
    return inner if os.path.isdir(inner) else data_dir


def verify_log_dir(directory: str) -> tuple[list[CorruptionReport], int, int]:
    """(problems, segments, bytes) of a full offline verification, first problem first."""
    bases = sorted(int(m.group(1)) for m in map(_SEGMENT.match, os.listdir(directory)) if m)
    problems: list[CorruptionReport] = []
    epoch = -1
    total = 0
    for i, base in enumerate(bases):
        path = os.path.join(directory, f"{base:020d}.log")
        next_base = bases[i + 1] if i + 1 < len(bases) else None
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            check = verify_segment_fd(fd, path, os.fstat(fd).st_size, base, next_base, epoch)
        finally:
            os.close(fd)
        total += check.bytes_read
        epoch = check.last_epoch
        if check.report is not None:
            problems.append(check.report)
    return problems, len(bases), total


def _print_report(r: CorruptionReport) -> None:
    f = r.as_log_fields()
    print(f"  corrupt: {f['file']} at byte {f['position']} (offset {f['offset']}, epoch {f['epoch']}, "
          f"stored CRC {f['expected_crc']}, computed CRC {f['actual_crc']}): {f['reason']}")


def cmd_verify(args) -> int:
    directory = log_dir_of(args.data_dir)
    if not os.path.isdir(directory):
        print(f"metalog storage: {directory} is not a directory", file=sys.stderr)
        return 2
    problems, segments, total = verify_log_dir(directory)
    print(f"verified {segments} segment(s), {total} bytes in {directory}")
    for r in problems:
        _print_report(r)
    if not problems:
        print("no corruption found")
        return 0
    print(f"{len(problems)} damaged segment(s). With another healthy replica, start the broker: it "
          "quarantines the damage and fetches the rest from the leader. With no other copy: "
          f"metalog storage recover --data-dir {args.data_dir} --truncate-at-corruption")
    return 1


def cmd_upgrade(args) -> int:
    from metalog.storage.format_upgrade import FORMAT_VERSION, FormatError, upgrade_data_dir

    try:
        report = upgrade_data_dir(args.data_dir)
    except (FormatError, OSError) as exc:
        print(f"metalog storage upgrade: {exc}", file=sys.stderr)
        return 1
    if report.already:
        print(f"{args.data_dir} is in format version {FORMAT_VERSION} already: nothing to do")
        return 0
    for path in report.rewritten:
        print(f"  rewritten: {path}")
    print(f"upgraded {args.data_dir} to format version {FORMAT_VERSION}: {len(report.rewritten)} file(s) "
          f"rewritten, {len(report.unchanged)} already converted, {report.batches} batch(es)")
    return 0


def cmd_recover(args) -> int:
    if not args.truncate_at_corruption:
        return cmd_verify(args)
    directory = log_dir_of(args.data_dir)
    problems, segments, total = verify_log_dir(directory)
    if not problems:
        print(f"verified {segments} segment(s), {total} bytes in {directory}: no corruption found, nothing to do")
        return 0
    first = problems[0]
    _print_report(first)
    print(f"will truncate the log at offset {first.base_offset} ({first.path} byte {first.position}), "
          "rename that segment and every later one .corrupt (kept, never deleted), and clear the "
          "quarantine: records from that offset on are lost on this replica")
    before = set(os.listdir(directory))
    log = SegmentedLog.open(directory, on_corruption="quarantine")
    try:
        if first.path in _segment_paths(log):
            log.quarantine_from(first)
        end = log.log_end_offset
        log.clear_quarantine()  # the operator's consent: this copy is all there is
    finally:
        log.close()
    renamed = sorted(set(os.listdir(directory)) - before)
    for name in renamed:
        if ".corrupt" in name:
            print(f"  renamed: {os.path.join(directory, name)}")
    print(f"done: the log now ends at offset {end}")
    return 0


def _segment_paths(log) -> set[str]:
    return {os.path.join(log.directory, segment_file_name(b)) for b in log.segment_base_offsets}


def parse_initial_controllers(text: str) -> list[tuple[int, str, int, str]]:
    """id@host:port:directory-id,... -> [(id, host, port, directory id)];
    ValueError naming the bad entry."""
    from metalog.broker.server.recovery import valid_directory_id

    out: list[tuple[int, str, int, str]] = []
    for item in (x.strip() for x in text.split(",")):
        m = re.fullmatch(r"(\d+)@(.+):(\d+):([A-Za-z0-9_-]{22})", item)
        if m is None:
            raise ValueError(f"--initial-controllers: expected id@host:port:directory-id, got {item!r}")
        nid, host, port, dir_id = int(m.group(1)), m.group(2), int(m.group(3)), m.group(4)
        if not valid_directory_id(dir_id):
            raise ValueError(f"--initial-controllers: {dir_id!r} (node {nid}) is not a directory id")
        if not 0 < port < 65536:
            raise ValueError(f"--initial-controllers: port {port} of node {nid} is out of range")
        if any(o[0] == nid for o in out) or any(o[3] == dir_id for o in out):
            raise ValueError(f"--initial-controllers: node {nid} or directory id {dir_id} listed twice")
        out.append((nid, host, port, dir_id))
    return out


def cmd_format(args) -> int:
    from metalog.broker.server.config import ConfigError, load_config
    from metalog.broker.server.main import parse_overrides
    from metalog.broker.server.recovery import StartupError, format_data_dir, new_directory_id

    try:
        cfg = load_config(args.config, parse_overrides(args.settings))
        controllers = parse_initial_controllers(args.initial_controllers) if args.initial_controllers else None
    except (ConfigError, ValueError) as exc:
        print(f"metalog storage format: {exc}", file=sys.stderr)
        return 2
    if not cfg.dynamic_voters:
        print("metalog storage format: the config has dynamic_voters: false (static voters, kraft.version 0); "
              "set dynamic_voters: true to keep the voter set in the log", file=sys.stderr)
        return 2
    directory_id = new_directory_id()
    if args.standalone:
        ep = cfg.listen_endpoint()
        controllers = [(cfg.node_id, ep.host, ep.port, directory_id)]
    elif controllers is not None:
        mine = [c for c in controllers if c[0] == cfg.node_id]
        if mine:
            directory_id = mine[0][3]  # the id the other first voters know us by
    try:
        meta, checkpoint = format_data_dir(cfg.data_dir, cfg.cluster_id, cfg.node_id, directory_id, controllers)
    except (StartupError, OSError) as exc:
        print(f"metalog storage format: {exc}", file=sys.stderr)
        return 1
    print(f"formatted {cfg.data_dir}: {meta} (node {cfg.node_id}, directory.id {directory_id})")
    if checkpoint is not None:
        print(f"bootstrap checkpoint {checkpoint}: voters "
              + ", ".join(f"{n}:{d}" for n, _h, _p, d in controllers))
    return 0


def register_cli(sub) -> None:
    p = sub.add_parser("storage", help="offline log checks: verify | recover --truncate-at-corruption | "
                                       "format | upgrade")
    ssub = p.add_subparsers(dest="storage_command", required=True)
    v = ssub.add_parser("verify", help="verify every batch of a stopped broker's log (exit 1 if damaged)")
    v.add_argument("--data-dir", required=True, help="the broker's data_dir (or its log directory)")
    v.set_defaults(func=cmd_verify)
    u = ssub.add_parser("upgrade", help="convert a stopped broker's data dir to the current format version")
    u.add_argument("--data-dir", required=True, help="the broker's data_dir (holding meta.properties)")
    u.set_defaults(func=cmd_upgrade)
    r = ssub.add_parser("recover", help="truncate at the first corruption, with explicit consent")
    r.add_argument("--data-dir", required=True, help="the broker's data_dir (or its log directory)")
    r.add_argument("--truncate-at-corruption", action="store_true",
                   help="consent to losing every record from the first corrupt batch on (no other copy exists)")
    r.set_defaults(func=cmd_recover)
    f = ssub.add_parser("format", help="bind a new data dir; the first voter set of a dynamic cluster (KIP-853)")
    f.add_argument("--config", required=True, help="the broker's config file (node_id, cluster_id, data_dir)")
    f.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="settings",
                   help="override a config key, as `metalog broker --set` (repeatable): one shared config "
                        "file, the node's own keys on its command line (a Kubernetes StatefulSet's pods)")
    how = f.add_mutually_exclusive_group(required=True)
    how.add_argument("--standalone", action="store_true", help="this node is the only voter")
    how.add_argument("--initial-controllers", metavar="ID@HOST:PORT:DIRECTORY-ID,...",
                     help="every first voter, this node included")
    how.add_argument("--no-initial-controllers", action="store_true",
                     help="no voter set: the node replicates as an observer until added")
    f.set_defaults(func=cmd_format)
