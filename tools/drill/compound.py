"""The drill's compound faults: a process fault while a network fault is in force (issue 35 item 3).

Each is one entry of the drill's schedule, on network namespaces only (the
fault proxy cannot cut a link the brokers dial around, ``netfaults``):

* ``partition_snapshot``: a follower is wiped (kill -9, data dir deleted,
  restarted) so that it must download the leader's snapshot; as soon as its
  download is on disk (the storage's ``<id>-fetch.checkpoint.part`` appears
  in its data dir: the follower's own evidence that a FetchSnapshot answer
  came and another is due) its link to the leader is cut both ways (DROP),
  held, and healed mid-download. The drill's settings make the snapshot span
  many FetchSnapshot answers (``BALLAST_*`` cluster configs, 2 KiB chunks);
* ``kill_under_partition``: the leader is isolated, then a follower of the
  majority side is killed -9 and restarted while the isolation holds: the
  majority must elect a leader once it is back, the old leader stays cut;
* ``pause_under_loss``: 30% loss on the link leader <-> a follower, then the
  leader is SIGSTOPped and resumed while the loss holds (it comes back to a
  newer epoch over the lossy link);
* ``wipe_under_cut``: the leader's packets to a follower are dropped (one
  way), then that follower is wiped while the cut holds: it rejoins with an
  empty log that the leader cannot reach, and after the heal must catch up.

With ``--dynamic`` (KIP-853) a wiped voter is a new disk, as for
``wipe_follower``: after the heal its old identity is removed from the voter
set and the new one added.

``inject`` runs one and fills the fault's record: what ``verify`` checks
(both halves: the network's drop counters and the process's exit, stop or
wipe) and what the report prints per kind.
"""

from __future__ import annotations

import asyncio
import glob
import os
import shutil
import signal
import time

from metalog.storage import metadata_records as r
from metalog.tools.cluster import membership
from metalog.storage.snapshot import PART_SUFFIX, SUFFIX, parse_snapshot_filename, verify_snapshot_file
from metalog.tools.drill.checker import Ack
from metalog.tools.drill.history import text

COMPOUND_FAULTS = ("partition_snapshot", "kill_under_partition", "pause_under_loss", "wipe_under_cut")
DESCRIPTIONS = {
    "partition_snapshot": "(namespaces only) wipe a follower; once its snapshot download is on disk, cut its link to "
                          "the leader both ways (DROP), hold, heal mid-download: it must install a whole snapshot",
    "kill_under_partition": "(namespaces only) isolate the leader, then kill -9 a follower of the majority and "
                            "restart it while the isolation holds",
    "pause_under_loss": "(namespaces only) 30% loss on the link leader <-> a follower, then SIGSTOP the leader and "
                        "SIGCONT it while the loss holds",
    "wipe_under_cut": "(namespaces only) drop what the leader sends to a follower, then wipe that follower "
                      "(kill -9, data dir deleted, restart) while the cut holds",
}
# The snapshot a partition_snapshot's follower downloads must take many FetchSnapshot answers:
# the drill's own records leave a state of ~1 KB, so the first such fault sets this many
# cluster-default configs of this size (a state of ~256 KB, about 128 answers of the drill's
# snapshot_chunk_bytes), written as acknowledged appends of the drill's history.
BALLAST_CONFIGS = 64
BALLAST_VALUE_BYTES = 4000
BALLAST_ATTEMPTS_MAX = 4 * BALLAST_CONFIGS
DOWNLOAD_POLL_S = 0.002  # a download of ~128 answers lasts a few hundred ms: look often
LOSS_PCT = 30
FETCH_PART = "-fetch" + PART_SUFFIX  # a download's partial (storage.snapshot.PartialSnapshot)


# ------------------------------------------------------------------ the follower's disk
def download_state(data_dir: str) -> dict:
    """What the follower's data dir holds: its download's partial (bytes), and its complete
    snapshots ([end offset, epoch, bytes]), each checked whole (every batch's CRC, its end
    offset) as a boot would: a damaged one is named in ``bad_checkpoints``."""
    parts = glob.glob(os.path.join(data_dir, "*", "*" + FETCH_PART)) + glob.glob(os.path.join(data_dir, "*" + FETCH_PART))
    part_bytes = 0
    for p in parts:
        try:
            part_bytes += os.path.getsize(p)
        except OSError:
            pass  # renamed or deleted between the listing and the stat
    checkpoints, bad = [], []
    for p in sorted(glob.glob(os.path.join(data_dir, "*", "*" + SUFFIX))):
        sid = parse_snapshot_filename(os.path.basename(p))
        if sid is None:
            continue
        try:
            size = os.path.getsize(p)
            verify_snapshot_file(p, sid)
        except FileNotFoundError:
            continue  # replaced by a newer snapshot meanwhile
        except Exception as exc:  # any damage: a half-written snapshot under a real name
            bad.append(f"{os.path.basename(p)}: {exc}")
        checkpoints.append([sid.end_offset, sid.epoch, size])
    return {"parts": [os.path.basename(p) for p in parts], "part_bytes": part_bytes,
            "checkpoints": checkpoints, "bad_checkpoints": bad}


def _wait_download(data_dir: str, timeout_s: float) -> dict | None:
    """The data dir's state once a download's partial holds bytes; None on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = download_state(data_dir) if glob.glob(os.path.join(data_dir, "*", "*" + FETCH_PART)) else None
        if st is not None and st["part_bytes"] > 0:
            return st
        time.sleep(DOWNLOAD_POLL_S)
    return None


def _installs_after(cluster, node: int, ts: float) -> list[list[int]]:
    return [line.get("snapshot") for line in cluster.read_log_lines(node)
            if line.get("event") == "snapshot_installed" and float(line.get("ts", 0)) >= ts]


def _caught_up(cluster, node: int, timeout_s: float) -> float | None:
    """Seconds until `node`'s HW and log end reach the leader's HW as it was when we began; None on timeout."""
    start = time.monotonic()
    deadline = start + timeout_s
    target = None
    while time.monotonic() < deadline:
        if target is None:
            found = cluster.leader()
            target = (cluster.quorum(found[0]) or {}).get("high_watermark") if found else None
        q = cluster.quorum(node) or {}
        if target is not None and (q.get("high_watermark") or -1) >= target and (q.get("log_end_offset") or -1) >= target:
            return round(time.monotonic() - start, 2)
        time.sleep(0.1)
    return None


def _log_start_past(cluster, leader: int, offset: int, timeout_s: float) -> int | None:
    """The leader's log start once it is past `offset` (a snapshot holds it); None on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        start = (cluster.quorum(leader) or {}).get("log_start_offset")
        if start is not None and start > offset:
            return start
        time.sleep(0.1)
    return None


# ------------------------------------------------------------------ the ballast
async def ensure_ballast(drill) -> int:
    """Write the ballast configs once per drill; the offset of the last one. Each is an append
    of the drill's history (its value: the ConfigRecord's bytes, what a reader of the log
    sees), sent without the client's retries so that a value is never written twice; one of
    unknown outcome is recorded as such and the next attempt takes a new name."""
    if drill.ballast_end is not None:
        return drill.ballast_end
    client = drill._client(request_timeout_ms=5000, max_retries=0)
    done, last = 0, -1
    try:
        for attempt in range(BALLAST_ATTEMPTS_MAX):
            if done == BALLAST_CONFIGS:
                break
            name = f"drill.ballast.{attempt}"
            value = name.ljust(BALLAST_VALUE_BYTES, "#")
            raw = r.encode_record(r.Config(r.RESOURCE_BROKER, "", name, value))
            drill.history.attempted.add(raw)
            op = {"values": [text(raw)]}
            drill.hist.invoke("ballast", "append", op)
            try:
                base, epoch = await client.command("set_config", resource_type=r.RESOURCE_BROKER,
                                                   resource_name="", name=name, value=value)
            except Exception as exc:  # outcome unknown: never resent under this name
                drill.hist.complete("ballast", "append", "info", op, error=repr(exc))
                await asyncio.sleep(0.1)
                continue
            drill.hist.complete("ballast", "append", "ok", {**op, "offset": base, "epoch": epoch})
            drill.history.acks.append(Ack(raw, base, epoch, time.time(), -1))
            done, last = done + 1, max(last, base)
    finally:
        await client.close()
    drill.ballast_end = last
    return last


# ------------------------------------------------------------------ the faults
async def _wipe(drill, node: int) -> bool:
    c = drill.cluster
    await asyncio.to_thread(c.kill, node)
    drill.archive.scan(node, drill.incarnation[node])  # the last bytes before the wipe
    shutil.rmtree(c.data_dir(node), ignore_errors=True)
    wiped = not os.path.exists(c.data_dir(node))
    drill.archive.forget_live(node)
    drill.start_node(node)
    return wiped


async def _replace_identity(drill, rec, node: int) -> None:
    """In a KIP-853 quorum a wiped voter is a new disk: it came back as an observer under a
    new directory id; its old identity leaves the voter set and the new one joins (as
    wipe_follower does), after the network fault is healed."""
    if not drill.cluster.dynamic:
        return
    rec.detail["removed_dir"] = await drill._membership(rec, "remove old identity", membership.remove_voter, node)
    rec.detail["added_dir"] = await drill._membership(rec, "add new identity", membership.add_voter, node)


def _cut_both_ways(net, a: int, b: int) -> None:
    net.block(a, b)
    net.block(b, a)


async def partition_snapshot(drill, rec, leader: int, followers: list[int], voters: list[int]) -> None:
    c, d = drill.cluster, rec.detail
    ballast_end = await ensure_ballast(drill)
    # The wiped follower must download a snapshot that holds the ballast: the leader's log starts past it.
    d["leader_log_start"] = await asyncio.to_thread(_log_start_past, c, leader, ballast_end,
                                                    drill.settle_timeout_s * 2)
    d["voters_caught_up_before"] = await asyncio.to_thread(drill._voters_caught_up, voters, drill.settle_timeout_s)
    rec.node = node = drill.rng.choice(followers)
    d["wiped"] = await _wipe(drill, node)
    data_dir = c.data_dir(node)
    seen = await asyncio.to_thread(_wait_download, data_dir, drill.settle_timeout_s)
    d["download_seen"] = seen
    if seen is None:
        return  # verify says so: the download never showed
    before = drill.net.counters()
    _cut_both_ways(drill.net, node, leader)
    d["cut_ts"], d["cut_from"] = time.time(), leader
    # After the rules are in force: a partial still there means the download was cut mid-way.
    d["at_cut"] = download_state(data_dir)
    d["installs_before_heal"] = _installs_after(c, node, rec.ts_start)
    # Whom the follower was downloading from (the admin port is outside the cut): the leader
    # may have changed while it booted, and a cut from an old leader interrupts nothing.
    d["follower_leader"] = (c.quorum(node) or {}).get("leader_id")
    await asyncio.sleep(drill.hold_s * 1.5)
    d["before_heal"] = download_state(data_dir)
    d["installs_while_cut"] = _installs_after(c, node, d["cut_ts"])
    d["net"] = {k: v - before.get(k, 0) for k, v in drill.net.counters().items()}
    d["heal_ts"] = time.time()
    drill.net.heal()
    d["caught_up_s"] = await asyncio.to_thread(_caught_up, c, node, drill.settle_timeout_s * 2)
    d["installs_after_heal"] = _installs_after(c, node, d["heal_ts"])
    d["after"] = download_state(data_dir)
    await _replace_identity(drill, rec, node)


async def kill_under_partition(drill, rec, leader: int, followers: list[int]) -> None:
    c, d = drill.cluster, rec.detail
    rec.node = leader
    before = drill.net.counters()
    drill.net.isolate(leader)
    await asyncio.sleep(drill.hold_s / 2)
    d["killed"] = victim = drill.rng.choice(followers)
    await asyncio.to_thread(c.kill, victim)
    d["exit_code"] = c.procs[victim].returncode
    await asyncio.sleep(drill.hold_s / 2)
    drill.start_node(victim)
    # The isolation holds until the majority -- the restarted follower and the other -- has a
    # leader again (or the settle timeout passes: verify then finds no newer epoch).
    d["majority_leader"] = await asyncio.to_thread(_majority_leader, c, leader, rec.epoch_before,
                                                   drill.settle_timeout_s)
    d["net"] = {k: v - before.get(k, 0) for k, v in drill.net.counters().items()}
    d["heal_ts"] = time.time()
    drill.net.heal()


def _majority_leader(cluster, isolated: int, epoch_before: int, timeout_s: float) -> list[int] | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = cluster.leader()
        if found and found[0] != isolated and found[1] > epoch_before:
            return [found[0], found[1]]
        time.sleep(0.1)
    return None


async def pause_under_loss(drill, rec, leader: int, other: int) -> None:
    c, d = drill.cluster, rec.detail
    rec.node = leader
    d["link"], d["loss_pct"] = [leader, other], LOSS_PCT
    before = drill.net.counters()
    drill.net.loss(leader, other, LOSS_PCT)
    await asyncio.sleep(drill.hold_s / 2)  # the loss bites on live traffic first
    c.signal(leader, signal.SIGSTOP)
    d["stopped"] = await asyncio.to_thread(drill._seen_stopped, leader)
    await asyncio.sleep(drill.hold_s * 1.5)
    c.signal(leader, signal.SIGCONT)
    await asyncio.sleep(drill.hold_s / 2)  # the resumed leader meets the newer epoch over the lossy link
    d["net"] = {k: v - before.get(k, 0) for k, v in drill.net.counters().items()}
    d["heal_ts"] = time.time()
    drill.net.heal()


async def wipe_under_cut(drill, rec, leader: int, other: int, voters: list[int]) -> None:
    c, d = drill.cluster, rec.detail
    # Inside the drill's fault model for a static quorum (see wipe_follower): wipe only a caught-up voter set.
    d["voters_caught_up_before"] = await asyncio.to_thread(drill._voters_caught_up, voters, drill.settle_timeout_s)
    rec.node = other
    d["to"] = other
    before = drill.net.counters()
    drill.net.block(leader, other)
    await asyncio.sleep(drill.hold_s / 2)
    d["wiped"] = await _wipe(drill, other)
    await asyncio.sleep(drill.hold_s)
    d["net"] = {k: v - before.get(k, 0) for k, v in drill.net.counters().items()}
    d["heal_ts"] = time.time()
    drill.net.heal()
    await _replace_identity(drill, rec, other)
    d["wiped_caught_up"] = await asyncio.to_thread(drill._voters_caught_up, voters, drill.settle_timeout_s)


async def inject(drill, kind: str, rec, leader: int, followers: list[int], voters: list[int],
                 other: int | None) -> None:
    if kind == "partition_snapshot":
        await partition_snapshot(drill, rec, leader, followers, voters)
    elif kind == "kill_under_partition":
        await kill_under_partition(drill, rec, leader, followers)
    elif kind == "pause_under_loss":
        await pause_under_loss(drill, rec, leader, other)
    elif kind == "wipe_under_cut":
        await wipe_under_cut(drill, rec, leader, other, voters)
    else:
        raise ValueError(f"not a compound fault: {kind}")


# ------------------------------------------------------------------ did it bite?
def why_not_bitten(rec) -> str | None:
    """The process half and the snapshot half of a compound fault (the network half and a
    newer epoch are verify's common checks)."""
    k, d = rec.kind, rec.detail
    if k == "kill_under_partition":
        if d.get("exit_code") != -9:
            return f"follower {d.get('killed')} did not die by SIGKILL (exit code {d.get('exit_code')})"
        if d.get("majority_leader") is None:
            return "the majority elected no leader while the old one was isolated"
    elif k == "pause_under_loss":
        if not d.get("stopped"):
            return "the leader was never seen stopped (state T)"
    elif k == "wipe_under_cut":
        if not d.get("wiped"):
            return "the data dir was not deleted"
        if not d.get("wiped_caught_up"):
            return "the wiped follower did not catch up after the heal"
    elif k == "partition_snapshot":
        return _snapshot_not_bitten(d)
    return None


def _snapshot_not_bitten(d: dict) -> str | None:
    if not d.get("wiped"):
        return "the data dir was not deleted"
    if d.get("download_seen") is None:
        return "no snapshot download appeared on the follower's disk"
    at_cut = d.get("at_cut") or {}
    if not at_cut.get("parts") or at_cut.get("checkpoints") or d.get("installs_before_heal"):
        return f"the download was not in progress when the cut was in force (at the cut: {at_cut}, " \
               f"installed: {d.get('installs_before_heal')})"
    if d.get("follower_leader") not in (None, d.get("cut_from")):
        return f"the follower followed leader {d.get('follower_leader')}, not the cut-off {d.get('cut_from')}"
    if d.get("installs_while_cut"):
        return f"the download completed while the follower was cut off: {d.get('installs_while_cut')}"
    while_cut = d.get("before_heal") or {}
    if while_cut.get("checkpoints"):
        return f"a snapshot appeared under a real name while the follower was cut off: {while_cut}"
    if not d.get("installs_after_heal"):
        return "the follower installed no snapshot after the heal"
    if d.get("caught_up_s") is None:
        return "the follower did not catch up to the high watermark after the heal"
    after = d.get("after") or {}
    if after.get("bad_checkpoints") or after.get("parts"):
        return f"after the catch-up the follower's dir holds a damaged snapshot or a partial: {after}"
    return None
