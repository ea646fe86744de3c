"""Boot: open a broker's data dir and recover everything the core is built from.

Binds the data dir to one cluster and node (meta.properties), opens the log
with crash recovery (quarantining corruption when another copy exists, else
refusing to start), applies KIP-630's boot rules to the snapshots, loads the
newest snapshot into the controller, rebuilds the leader-epoch history if it
is missing or damaged, and reads the quorum state. A refusal is a
StartupError whose message says why and what to do (exit code 3).
"""

from __future__ import annotations

import base64
import binascii
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

from metalog.broker.server.config import BrokerConfig
from metalog.broker.controller.state import Controller, load_latest
from metalog.broker.server.metrics import BrokerMetrics
from metalog.broker.quorum import api as qa
from metalog.broker.quorum.voters import VoterSet, voter_set_of, voter_sets_in
from metalog.protocol import messages as m
from metalog.storage.batch import CorruptBatchError
from metalog.storage.atomic import atomic_write
from metalog.storage.epochs import EpochCheckpointError, EpochHistory, read_checkpoint
from metalog.storage.format_upgrade import (FORMAT_KEY, FORMAT_VERSION, PARTITION_DIR, UPGRADABLE_VERSIONS, format_version_of,
                                    holds_data, read_props)
from metalog.storage.errors import CorruptionReport, CorruptLogError, QuorumStateError, StorageError
from metalog.storage.segments import SegmentedLog
from metalog.storage.quorum_state import QuorumStateFile
from metalog.storage.snapshot import CorruptSnapshotError, SnapshotInvariantError, SnapshotStore, read_snapshot_voters

META_FILE = "meta.properties"
PARTITION_DIR = "__cluster_metadata-0"  # the metadata log's directory inside a data dir
# Kafka's Uuid.ZERO_UUID, ONE_UUID and METADATA_TOPIC_ID: never a directory id.
_RESERVED_DIRECTORY_IDS = frozenset({"AAAAAAAAAAAAAAAAAAAAAA", "AAAAAAAAAAAAAAAAAAAAAQ"})


class StartupError(Exception):
    """The broker refuses to start; the message says why and what to do."""


@dataclass
class LocalState:
    seg_log: SegmentedLog
    snapshots: SnapshotStore
    controller: Controller
    qs_file: QuorumStateFile
    view: qa.LogView
    qs: qa.QuorumStateData | None
    health_problems: dict[str, str]  # why /health starts "degraded" (quarantine at open)
    corruption_seen: set[tuple[str, int]]  # (file, position) already reported
    directory_id: str  # this data dir's id in meta.properties (KIP-853)


def new_directory_id() -> str:
    """A random directory id as Kafka writes it (Uuid.randomUuid: 16 random
    bytes, url-safe base64 without padding), never one of Kafka's reserved
    ids nor one whose string starts with '-' (unreadable on a command line)."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-") and text not in _RESERVED_DIRECTORY_IDS:
            return text


def _meta_text(cluster_id: str, node_id: int, directory_id: str) -> bytes:
    # version=1 is Kafka's meta.properties version (KRaft); ours is FORMAT_KEY.
    return (f"version=1\ncluster.id={cluster_id}\nnode.id={node_id}\ndirectory.id={directory_id}\n"
            f"{FORMAT_KEY}={FORMAT_VERSION}\n").encode()


def check_format_version(data_dir: str, props: dict[str, str], log) -> bool:
    """Refuse a data dir whose records this build cannot read (StartupError
    naming its format version and the command that converts it). A dir of an
    older version that holds no data yet is simply stamped: returns True when
    meta.properties must be rewritten for that."""
    version = format_version_of(props)
    if version == FORMAT_VERSION:
        return False
    path = os.path.join(data_dir, META_FILE)
    if version in UPGRADABLE_VERSIONS:
        if not holds_data(os.path.join(data_dir, PARTITION_DIR)):
            log.info("format_version_stamped", data_dir=data_dir, format_version=FORMAT_VERSION,
                     old_format_version=version, reason="the dir holds no records yet")
            return True
        where = f"{path} has no {FORMAT_KEY}" if version == 1 else f"{path}: {FORMAT_KEY}={version}"
        raise StartupError(
            f"data dir {data_dir} is in metalog format version {version} ({where}); this build "
            f"reads format version {FORMAT_VERSION} (Kafka's v2 records, control records and metadata "
            f"records): refusing to start. Convert it, with this broker stopped: "
            f"metalog storage upgrade --data-dir {data_dir}")
    raise StartupError(
        f"data dir {data_dir} is in metalog format version {version!r} ({path}: {FORMAT_KEY}); this build "
        f"reads format version {FORMAT_VERSION} only: refusing to start (run the build that wrote it)")


def valid_directory_id(text: str) -> bool:
    """Kafka's Uuid string form: 22 characters of url-safe base64, 16 bytes."""
    if len(text) != 22 or text in _RESERVED_DIRECTORY_IDS:
        return False
    try:
        return len(base64.urlsafe_b64decode(text + "==")) == 16
    except (ValueError, binascii.Error):
        return False


def check_meta(data_dir: str, cluster_id: str, node_id: int, log) -> str:
    """Bind a data dir to one cluster and node: refuse a mismatch at boot.
    Returns the dir's directory id (KIP-853): written with the binding; a dir
    bound by an older build, without one, gets one now (logged)."""
    path = os.path.join(data_dir, META_FILE)
    if os.path.exists(path):
        props = read_props(path)
        if props.get("cluster.id") != cluster_id:
            raise StartupError(
                f"data dir {data_dir} belongs to cluster {props.get('cluster.id')!r} but the config says "
                f"{cluster_id!r}: refusing to start (point data_dir elsewhere or fix cluster_id)"
            )
        if props.get("node.id") != str(node_id):
            raise StartupError(
                f"data dir {data_dir} belongs to node {props.get('node.id')} but the config says node {node_id}"
            )
        stamp = check_format_version(data_dir, props, log)
        directory_id = props.get("directory.id")
        if directory_id is None:
            directory_id = new_directory_id()
            atomic_write(path, _meta_text(cluster_id, node_id, directory_id))
            log.info("directory_id_assigned", data_dir=data_dir, directory_id=directory_id,
                     reason=f"{META_FILE} was written by a build without directory ids")
        elif not valid_directory_id(directory_id):
            raise StartupError(
                f"{path}: directory.id {directory_id!r} is not a directory id (22 characters of url-safe "
                f"base64, as Kafka writes them): refusing to start. This id names this replica to the "
                f"quorum; restore the file from a backup, or treat the dir as a new replica (move the "
                f"data dir aside and let it re-replicate)")
        elif stamp:
            atomic_write(path, _meta_text(cluster_id, node_id, directory_id))
        return directory_id
    directory_id = new_directory_id()
    atomic_write(path, _meta_text(cluster_id, node_id, directory_id))
    log.info("data_dir_bound", data_dir=data_dir, cluster_id=cluster_id, node_id=node_id,
             directory_id=directory_id)
    return directory_id


def format_meta(data_dir: str, cluster_id: str, node_id: int, directory_id: str) -> str:
    """`metalog storage format`: bind a new data dir (meta.properties,
    durable). StartupError if it is bound already: formatting twice would
    give the replica a second identity."""
    path = os.path.join(data_dir, META_FILE)
    if os.path.exists(path):
        raise StartupError(f"{data_dir} is formatted already ({META_FILE} exists): nothing written")
    if not valid_directory_id(directory_id):
        raise StartupError(f"directory id {directory_id!r} is not one (22 characters of url-safe base64)")
    os.makedirs(data_dir, exist_ok=True)
    atomic_write(path, _meta_text(cluster_id, node_id, directory_id))
    return path


def format_data_dir(data_dir: str, cluster_id: str, node_id: int, directory_id: str,
                    controllers: list[tuple[int, str, int, str]] | None) -> tuple[str, str | None]:
    """KIP-853 format, shared by `metalog storage format` and the local
    launcher: bind the dir (format_meta) and, for the first voters of a
    dynamic cluster, write the bootstrap checkpoint holding `controllers`
    [(node id, host, port, directory id)] as the first voter set (None: a node
    that joins later). Returns (meta.properties path, checkpoint path or None)."""
    from metalog.storage import control_records as cr

    meta = format_meta(data_dir, cluster_id, node_id, directory_id)
    if controllers is None:
        return meta, None
    voters = cr.VotersRecord([cr.Voter(n, d, [cr.VoterEndpoint("CONTROLLER", h, p)])
                              for n, h, p, d in controllers])
    part_dir = os.path.join(data_dir, PARTITION_DIR)
    return meta, SnapshotStore(part_dir).write_bootstrap(voters, cluster_id)


def no_copy_message(report: CorruptionReport, data_dir: str) -> str:
    """What a sole voter says when its log is corrupt: no other copy exists."""
    return (f"corrupt data in {report.path} at byte {report.position} (offset {report.base_offset}): "
            f"{report.reason}; this is the only voter, so no other copy exists to re-replicate from. "
            f"To truncate the log at the corruption (records from offset {report.base_offset} on are "
            f"lost), run: metalog storage recover --data-dir {data_dir} --truncate-at-corruption")


def recover_local_state(cfg: BrokerConfig, part_dir: str, log: Any, metrics: BrokerMetrics) -> LocalState:
    """Open the log (crash recovery), clean up and load snapshots (KIP-630
    boot rules), rebuild the epoch history if needed, read the quorum
    state: everything the core is built from. One function per phase, in
    this order; each refuses with a StartupError that says what failed, in
    which file, and what to do."""
    voters = cfg.voter_endpoints()
    directory_id = _bind_data_dir(cfg, log)  # before writing anything there
    # Another copy can exist (more than one voter, or we are an observer):
    # corruption found at open is quarantined and re-replicated. A single
    # voter has no other copy: refuse to start and say what to do.
    seg_log = _open_log(cfg, part_dir, log, sole_voter=len(voters) == 1 and cfg.node_id in voters)
    health_problems, corruption_seen = _startup_damage(seg_log, log, metrics)
    snapshots = _clean_up_snapshots(part_dir, seg_log, log)
    controller, loaded = _load_snapshot(snapshots, seg_log, log, metrics)
    epochs = _epoch_history(part_dir, seg_log, loaded, log)
    qs_file, qs = _read_quorum_state(part_dir)
    base_voters = _base_voter_set(snapshots, seg_log, loaded, log)
    voter_history = _voter_history(cfg, seg_log, base_voters, log)
    view = qa.LogView(
        log_start_offset=seg_log.log_start_offset,
        log_end_offset=seg_log.log_end_offset,
        epochs=[(e[0], e[1]) for e in epochs.entries],
        snapshots=snapshots.list(),
        must_reach_offset=seg_log.quarantine.must_reach_offset if seg_log.quarantine else -1,
        voter_set=base_voters,
        voter_history=voter_history,
    )
    return LocalState(seg_log, snapshots, controller, qs_file, view, qs, health_problems, corruption_seen,
                      directory_id)


def _bind_data_dir(cfg: BrokerConfig, log: Any) -> str:
    """Phase 1: the data dir exists and is bound to this cluster and node (meta.properties)."""
    try:
        os.makedirs(cfg.data_dir, exist_ok=True)
        return check_meta(cfg.data_dir, cfg.cluster_id, cfg.node_id, log)
    except OSError as exc:
        raise StartupError(
            f"cannot use data dir {cfg.data_dir} ({exc.filename or cfg.data_dir}: {exc.strerror or exc}): "
            f"refusing to start. Check that data_dir names the right path and that this user may create "
            f"and write files there") from None


def _open_log(cfg: BrokerConfig, part_dir: str, log: Any, sole_voter: bool) -> SegmentedLog:
    """Phase 2: the log, with crash recovery (torn tail cut, segments verified
    from the recovery point); corruption is quarantined, or refused when no
    other copy exists."""
    try:
        os.makedirs(part_dir, exist_ok=True)
        # verify_appends=False: every AppendBatches is either the leader's own
        # freshly encoded batches or a fetch answer whose CRCs the core checked
        # on receipt (QuorumLog.append_fetched, the network boundary); append
        # still checks headers, lengths and offsets.
        return SegmentedLog.open(part_dir, segment_bytes_max=cfg.storage.segment_bytes_max,
                                 logger=log, on_corruption="raise" if sole_voter else "quarantine",
                                 verify_appends=False)
    except CorruptLogError as exc:
        raise StartupError(no_copy_message(exc.report, cfg.data_dir)) from None
    except (StorageError, OSError) as exc:
        raise StartupError(
            f"cannot open the metadata log in {part_dir}: {exc}: refusing to start. Check the disk "
            f"(free space, permissions, the kernel log). If its files cannot be read and other voters hold "
            f"the log, move the data dir aside and restart: the node re-replicates from the leader") from None


def _startup_damage(seg_log: SegmentedLog, log: Any,
                    metrics: BrokerMetrics) -> tuple[dict[str, str], set[tuple[str, int]]]:
    """Phase 3: what the log's open found damaged and quarantined: /health's
    reasons and the (file, position) already reported."""
    health_problems: dict[str, str] = {}
    corruption_seen: set[tuple[str, int]] = set()
    for report in seg_log.startup_reports:  # already logged by the log (corruption_detected)
        corruption_seen.add((report.path, report.position))
        metrics.corrupt_batches.labels(source="startup").inc()
    q = seg_log.quarantine
    if q is not None:
        health_problems["quarantine"] = (
            f"log cut to {seg_log.log_end_offset} after corruption "
            f"({', '.join(r.path for r in q.reports)}); not voting until the log reaches "
            f"{q.must_reach_offset} again")
        for r in q.reports:  # stays for this process's life, as run-time finds do
            health_problems[f"corruption:{r.path}"] = (
                f"corrupt data in {r.path} at byte {r.position} (offset {r.base_offset}, found at "
                f"start): {r.reason}; kept as .corrupt")
        log.warning("started_quarantined", must_reach_offset=q.must_reach_offset,
                    log_end_offset=seg_log.log_end_offset, reports=[r.as_log_fields() for r in q.reports])
    return health_problems, corruption_seen


def _clean_up_snapshots(part_dir: str, seg_log: SegmentedLog, log: Any) -> SnapshotStore:
    """Phase 4: KIP-630's boot rules on the snapshot files (partials and
    snapshots no longer needed go); if no snapshot covers the log start,
    the log is treated as empty and bootstrapped from the leader."""
    snapshots = SnapshotStore(part_dir)
    try:
        boot = snapshots.boot_cleanup(seg_log.log_start_offset)
        if boot is not None:
            log.info("snapshot_boot_cleanup", **{k: v for k, v in vars(boot).items() if v})
    except SnapshotInvariantError as exc:
        # KIP-630's boot invariant failed: no snapshot covers the log start.
        # Treat the log as empty and bootstrap from the leader.
        log.warning("log_reset_no_covering_snapshot", error=str(exc), log_start_offset=seg_log.log_start_offset)
        seg_log.truncate_fully(0)
        for sid in snapshots.list():
            snapshots.delete(sid)
    except OSError as exc:
        raise StartupError(
            f"cannot clean up the snapshots in {part_dir} ({exc.filename}: {exc.strerror or exc}): refusing "
            f"to start. Check the disk and the permissions of the files there") from None
    return snapshots


def _load_snapshot(snapshots: SnapshotStore, seg_log: SegmentedLog, log: Any,
                   metrics: BrokerMetrics) -> tuple[Controller, m.SnapshotId | None]:
    """Phase 5: the newest snapshot that loads becomes the controller's state
    (a damaged one is kept as .corrupt and the next older one tried); the log
    restarts at it if it is ahead of the log."""
    controller = Controller()
    t0_s = time.perf_counter()
    try:
        loaded = load_latest(snapshots)
    except OSError as exc:
        raise StartupError(
            f"cannot read the snapshots in {snapshots.directory} ({exc.filename}: {exc.strerror or exc}): "
            f"refusing to start. Check the disk and the permissions of the files there") from None
    if loaded is None:
        if seg_log.log_start_offset > 0:
            log.warning("log_reset_no_loadable_snapshot", log_start_offset=seg_log.log_start_offset)
            seg_log.truncate_fully(0)
        return controller, None
    state, snap_id = loaded
    controller.load(state)
    controller.snapshot_taken(snap_id.end_offset)
    metrics.snapshot_load_seconds.observe(time.perf_counter() - t0_s)
    log.info("snapshot_loaded", snapshot=[snap_id.end_offset, snap_id.epoch],
             seconds=round(time.perf_counter() - t0_s, 4))
    if seg_log.log_end_offset < snap_id.end_offset or seg_log.log_start_offset > snap_id.end_offset:
        # The snapshot is ahead of the log (installed, then crashed before
        # the log was reset) or the log starts past it: restart the log there.
        seg_log.truncate_fully(snap_id.end_offset)
    return controller, snap_id


def _epoch_history(part_dir: str, seg_log: SegmentedLog, loaded: m.SnapshotId | None, log: Any) -> EpochHistory:
    """Phase 6: the leader-epoch history, from its checkpoint, else rebuilt
    from the log's batch headers (derived data: a damaged file is kept as
    .corrupt), cut to the log."""
    checkpoint = os.path.join(part_dir, "leader-epoch-checkpoint")
    try:
        epochs = read_checkpoint(checkpoint)
    except EpochCheckpointError as exc:
        log.warning("epoch_checkpoint_unreadable", file=checkpoint, error=str(exc),
                    action="rebuilt from the log's batch headers; the damaged file is kept as .corrupt")
        try:
            os.replace(checkpoint, checkpoint + ".corrupt")
        except OSError as move_exc:
            raise StartupError(
                f"{checkpoint} is damaged ({exc}) and cannot be moved aside ({move_exc.strerror or move_exc}): "
                f"refusing to start. Move it aside yourself (mv {checkpoint} {checkpoint}.corrupt): the "
                f"broker rebuilds it from the log") from None
        epochs = EpochHistory()
    if not epochs.entries and seg_log.log_end_offset > seg_log.log_start_offset:
        epochs = EpochHistory(seg_log.batch_epochs())
    epochs.truncate_from_end(seg_log.log_end_offset)
    epochs.truncate_from_start(seg_log.log_start_offset)
    if loaded is not None and not epochs.entries:
        epochs.assign(loaded.epoch, loaded.end_offset)
    return epochs


def _read_quorum_state(part_dir: str) -> tuple[QuorumStateFile, qa.QuorumStateData | None]:
    """Phase 7: the epoch and the vote this voter cast (quorum-state)."""
    qs_file = QuorumStateFile(os.path.join(part_dir, "quorum-state"))
    try:
        qs_raw = qs_file.read()
    except QuorumStateError as exc:
        raise StartupError(
            f"{exc}. This file holds the epoch and the vote this voter cast; starting without it "
            f"could let it vote twice in one epoch, so the broker will not guess. If this broker has "
            f"been down for longer than an election takes (its epoch is over), move the file aside "
            f"(mv {qs_file.path} {qs_file.path}.corrupt): it then starts without a vote in "
            f"the epoch of its log's last batch and learns the current one from the leader") from None
    if qs_raw is None:
        return qs_file, None
    return qs_file, qa.QuorumStateData(
        leader_epoch=qs_raw["leader_epoch"], leader_id=qs_raw["leader_id"],
        voted_id=qs_raw["voted_id"], voters=tuple(qs_raw.get("voters", ())),
    )


def _base_voter_set(snapshots: SnapshotStore, seg_log: SegmentedLog, loaded: m.SnapshotId | None,
                    log: Any) -> VoterSet | None:
    """Phase 8 (KIP-853): the voter set below the log: the one of the snapshot
    the log starts at, else a formatted dir's bootstrap checkpoint; None:
    the config's static voters."""
    if loaded is not None:
        path = snapshots.path(loaded)
        try:
            rec = read_snapshot_voters(path)
        except CorruptSnapshotError as exc:
            raise StartupError(
                f"snapshot {path} loaded but its voter set is unreadable ({exc.reason}): refusing to start. "
                f"Move the file aside (mv {path} {path}.corrupt) and restart: the broker starts from an older "
                f"snapshot, or with an empty log that re-replicates from the leader (a sole voter has no "
                f"other copy: restore the file from a backup instead)") from None
        if rec is not None:
            return voter_set_of(rec)
    if seg_log.log_start_offset != 0:
        return None
    # A dir formatted with --standalone / --initial-controllers: the first
    # voter set, until the first leader has put it in the log.
    try:
        rec = snapshots.bootstrap_voters()
    except CorruptSnapshotError as exc:
        raise StartupError(
            f"bootstrap checkpoint {exc.path} is damaged ({exc.reason}): it holds the first voter set; "
            f"format the data dir again (metalog storage format) or restore the file") from None
    if rec is None:
        return None
    log.info("bootstrap_voters", voters={v.voter_id: v.directory_id for v in rec.voters})
    return voter_set_of(rec)


def _voter_history(cfg: BrokerConfig, seg_log: SegmentedLog, base_voters: VoterSet | None,
                   log: Any) -> list[tuple[int, VoterSet]]:
    """Phase 9 (KIP-853): every VotersRecord in the log, at its offset (the latest counts)."""
    try:
        voter_history = voter_sets_in(b"".join(seg_log.control_batches()))
    except CorruptBatchError as exc:
        where = exc.report.path if exc.report is not None else seg_log.directory
        raise StartupError(
            f"a control batch of the log is damaged ({where}, offset {exc.base_offset}): {exc}: refusing to "
            f"start. Control batches hold the voter set; in a cluster, move the data dir aside and restart to "
            f"re-replicate from the leader") from None
    if base_voters is None and cfg.dynamic_voters and not voter_history:
        log.warning("no_voter_set", data_dir=cfg.data_dir,
                    reason="dynamic_voters and no voter set in the data dir (formatted with "
                           "--no-initial-controllers, or wiped): an observer until the log gives one")
    return voter_history
