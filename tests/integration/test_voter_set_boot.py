"""KIP-853 items 1-2 through a real broker process: the directory id in
meta.properties is the one the broker runs with, and at boot the latest
VotersRecord in the log decides who votes, whatever the static config says."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from metalog.storage import control_records as cr
from metalog.storage.batch import encode_batch
from metalog.storage.segments import SegmentedLog
from tests.integration.test_cluster import FAST

pytestmark = pytest.mark.slow

PART = "__cluster_metadata-0"
OTHER_DIR = "AAAAAAAAAAAAAAAAAAAAAg"


def meta(data_dir: str) -> dict[str, str]:
    with open(os.path.join(data_dir, "meta.properties")) as f:
        return dict(line.split("=", 1) for line in f.read().splitlines() if "=" in line)


async def test_a_voters_record_in_the_log_decides_who_votes_at_boot(make_cluster):
    """A sole voter leads; with a VotersRecord appended to its log that names
    only node 2, the restarted broker is an observer with voters [2] (it
    neither stands nor leads), and /quorum says kraft version 1. Its
    directory id stays the one in meta.properties."""
    cluster = make_cluster(voters=1, dynamic=False, **FAST)  # static: the test writes the first VotersRecord
    leader, epoch = await asyncio.to_thread(cluster.wait_for_leader, 20)
    q = cluster.quorum(leader)
    assert q["voters"] == [1] and q["kraft_version"] == 0
    directory_id = meta(cluster.data_dir(1))["directory.id"]
    assert q["directory_id"] == directory_id and len(directory_id) == 22
    cluster.kill(1)
    log = SegmentedLog.open(os.path.join(cluster.data_dir(1), PART))
    end = log.log_end_offset
    voters = cr.VotersRecord([cr.Voter(2, OTHER_DIR, [cr.VoterEndpoint("CONTROLLER", "127.0.0.1", 1)])])
    log.append(encode_batch(end, epoch, [cr.encode_control(voters)], 0, is_control=True))
    log.flush()
    log.close()
    cluster.start_node(1)

    def observed():
        q = cluster.quorum(1)
        return q if q and q["log_end_offset"] == end + 1 else None

    q = await asyncio.to_thread(cluster.wait_for, observed, 20, "the restarted broker's /quorum")
    assert (q["role"], q["voters"], q["kraft_version"]) == ("observer", [2], 1), q
    assert q["directory_id"] == directory_id and q["epoch"] == epoch, "an observer never stands"


def _append_voters(data_dir: str, voters: cr.VotersRecord) -> int:
    """Append one VotersRecord batch at the log end, in the last epoch; the end."""
    log = SegmentedLog.open(os.path.join(data_dir, PART))
    try:
        end = log.log_end_offset
        epoch = log.batch_epochs()[-1][0]
        log.append(encode_batch(end, epoch, [cr.encode_control(voters)], 0, is_control=True))
        log.flush()
        return end
    finally:
        log.close()


async def test_a_wiped_voter_comes_back_as_an_observer_not_with_its_old_identity(make_cluster):
    """Three voters whose logs hold the same VotersRecord naming each by its
    directory id (kraft version 1). Node 3's data dir is wiped: it boots with a
    new directory id, learns the voter set from the leader's log and is an
    observer; the leader shows it as an observer under its new directory id
    and voter 3 (its old directory) as not fetching; it never leads or votes."""
    cluster = make_cluster(voters=3, dynamic=False, **FAST)  # static: the test writes the VotersRecord
    leader, _ = await asyncio.to_thread(cluster.wait_for_leader, 20)

    def caught_up():
        q = cluster.quorum(leader)
        reps = (q or {}).get("replicas", {}).get("voters", [])
        return len(reps) == 3 and all(r["log_end_offset"] == q["log_end_offset"] for r in reps) and q
    await asyncio.to_thread(cluster.wait_for, caught_up, 20, "every voter at the leader's log end")
    dirs = {n: meta(cluster.data_dir(n))["directory.id"] for n in (1, 2, 3)}
    for n in (1, 2, 3):  # freeze all first: a graceful stop one by one would elect anew
        cluster.signal(n, signal.SIGSTOP)
    for n in (1, 2, 3):
        cluster.kill(n)
    voters = cr.VotersRecord([cr.Voter(n, dirs[n], [cr.VoterEndpoint("CONTROLLER", h, p)])
                              for n, (h, p) in sorted(cluster.voter_addrs.items())])
    ends = {n: _append_voters(cluster.data_dir(n), voters) for n in (1, 2, 3)}
    assert len(set(ends.values())) == 1, f"the stopped logs differ in length: {ends}"
    import shutil
    shutil.rmtree(cluster.data_dir(3))  # node 3's disk is replaced
    cluster.start()

    def settled():
        led = cluster.leader()
        if led is None:
            return None
        q = cluster.quorum(led[0])
        obs = (q or {}).get("replicas", {}).get("observers", [])
        return (led[0], q) if q and q["kraft_version"] == 1 and [o["replica_id"] for o in obs] == [3] else None
    led, q = await asyncio.to_thread(cluster.wait_for, settled, 30, "a leader seeing node 3 as an observer")
    new_dir = meta(cluster.data_dir(3))["directory.id"]
    assert new_dir != dirs[3] and led in (1, 2)
    (obs,) = q["replicas"]["observers"]
    assert obs["directory_id"] == new_dir
    voter3 = next(r for r in q["replicas"]["voters"] if r["replica_id"] == 3)
    assert voter3["directory_id"] == dirs[3] and voter3["last_fetch_timestamp_ms"] == -1
    q3 = await asyncio.to_thread(cluster.wait_for, lambda: (cluster.quorum(3) or {}).get("kraft_version") == 1
                                 and cluster.quorum(3), 20, "node 3 to learn the voter set")
    assert (q3["role"], q3["voters"], q3["directory_id"]) == ("observer", [1, 2, 3], new_dir)
    assert q3["voted_id"] == -1
