"""Scenario tests: the seeds' stories replayed step by step on the real core.

Each test drives a SimCluster by hand (hold / drop / forge messages, move
time) and is named after what it proves. Flushes complete in the same
millisecond here so that the story is not blurred by group-commit timing.
"""

from __future__ import annotations

from metalog.broker.quorum import api
from metalog.protocol import messages as m
from metalog.protocol.errors import Errors
from metalog.sim.cluster import SimCluster, SimConfig
from metalog.sim.network import NetworkConfig
from tests.sim.settle import settled, wait_settled


def make(seed: int, voters=(1, 2, 3), observers=(), **quorum) -> SimCluster:
    c = SimCluster(seed, SimConfig(voters=voters, observers=observers, quorum=quorum, flush_latency_ms=(0, 0),
                                   network=NetworkConfig(delay_ms=1, jitter_ms=0)))
    c.start()
    return c


def test_blog_two_replica_walkthrough_hw_reaches_follower_one_fetch_round_later():
    c = make(2, voters=(1, 2))
    leader = wait_settled(c)
    follower = next(n for n in c.nodes.values() if n is not leader)
    end = leader.core.log_end_offset
    seen = []  # per fetch response the follower handles: (leader HW in it, had records, follower LEO, follower HW)

    def listen(n):
        ev = n.last_event
        if n is follower and isinstance(ev, api.ResponseReceived) and isinstance(ev.response, m.FetchResponse):
            seen.append((ev.response.high_watermark, bool(ev.response.records),
                         n.core.log_end_offset, n.core.high_watermark))
    c.listeners.append(listen)
    c.client_append(leader.node_id, [b"message-0"])
    c.run_until_true(lambda: follower.core.high_watermark == end + 1, 5000, "the follower's HW covering the record")
    first = next(i for i, s in enumerate(seen) if s[1])
    # Round 1: the record arrives with the leader's old HW; follower HW = min(LEO, leader HW).
    assert seen[first] == (end, True, end + 1, end)
    # Round 2: the next fetch told the leader our LEO; its answer carries the new HW.
    assert seen[first + 1] == (end + 1, False, end + 1, end + 1)
    assert leader.core.high_watermark == end + 1


def test_kip320_zombie_former_leader_is_fenced_and_cannot_count():
    c = make(5)
    old = wait_settled(c)
    old_epoch = old.core.epoch
    c.pause(old.node_id)  # the zombie: frozen with its stale view of the world
    c.run_until_true(lambda: c.current_leader() is not None and c.current_leader().core.epoch > old_epoch,
                     10000, "a new leader")
    new = c.current_leader()
    wait_settled(c)
    third = next(n for n in c.nodes.values() if n not in (old, new))
    c.network.isolate(third.node_id)  # now only the zombie could complete a majority
    c.client_append(new.node_id, [b"needs-a-second-voter"])
    c.advance(50)
    hw_before = new.core.high_watermark
    assert hw_before < new.core.log_end_offset
    # The zombie keeps fetching with its stale epoch and claims to hold everything.
    k = c.inject_request(new.node_id, m.FetchRequest(
        cluster_id=c.config.cluster_id, replica_id=old.node_id, max_wait_ms=0,
        current_leader_epoch=old_epoch, fetch_offset=new.core.log_end_offset,
        last_fetched_epoch=old_epoch))
    answer = c.injected[k]
    assert answer.error_code == Errors.FENCED_LEADER_EPOCH
    assert answer.current_leader == m.LeaderIdAndEpoch(new.node_id, new.core.epoch)
    assert answer.records == b""
    c.advance(50)
    assert new.core.high_watermark == hw_before, "a fenced fetch must not count toward the HW"
    # The zombie resumes; it rejoins only as a follower of the new epoch, and then counts.
    c.resume(old.node_id)
    c.run_until_true(lambda: new.core.high_watermark == new.core.log_end_offset, 10000, "commit with the rejoined voter")
    assert old.core.epoch == new.core.epoch and old.core.leader_id == new.node_id
    assert c.checker.leaders_by_epoch[old_epoch] == old.node_id


def test_kafka7786_fast_epoch_bumps_with_inflight_offsets_for_leader_epoch_do_not_stall_fetching():
    # The held OffsetsForLeaderEpoch must still be outstanding when it is released
    # after two elections: fetch timeout 8 s gives it the 2 s request timeout
    # (fetch-loop requests time out at fetch timeout / 4).
    c = make(7, fetch_timeout_ms=8000)
    lead = wait_settled(c)
    others = [n for n in c.nodes.values() if n is not lead]
    victim, helper = others
    # Only `lead` may win elections (two bumps, same leader, as in the ticket's steps 2 and 6).
    hold_epoch_check = {"on": True}

    def intercept(msg):
        if isinstance(msg.body, m.VoteRequest) and msg.src != lead.node_id:
            return "drop"
        if (hold_epoch_check["on"] and msg.src == victim.node_id
                and isinstance(msg.body, m.OffsetsForLeaderEpochRequest)):
            hold_epoch_check["on"] = False  # hold exactly one: the request of the first bump
            return "hold"
        return "deliver"
    c.intercept = intercept
    epochs = []
    for _ in range(2):
        e = lead.core.epoch
        c.crash(lead.node_id, silent=True)  # restarted at once: nobody notices the crash itself
        c.boot(lead.node_id)  # a restarted leader resigns and stands again (KAFKA-10527)
        c.run_until_true(lambda: lead.alive and lead.core.role == "leader" and lead.core.epoch > e, 10000,
                         "the same node leading a new epoch")
        epochs.append(lead.core.epoch)
        if len(epochs) == 1:
            c.run_until_true(lambda: bool(c.held), 5000, "the victim's OffsetsForLeaderEpoch in flight")
    stale = c.held[0]
    assert stale.body.current_leader_epoch == epochs[0] < epochs[1]
    c.run_until_true(lambda: victim.core.epoch == epochs[1], 5000, "the victim seeing the second bump")
    # Step 10: the old request reaches the leader now and is answered FENCED_LEADER_EPOCH.
    answers = []
    c.listeners.append(lambda n: n is victim and isinstance(n.last_event, api.ResponseReceived)
                       and answers.append(n.last_event.response))
    c.release(stale)
    c.run_until_true(lambda: any(getattr(a, "error_code", 0) == Errors.FENCED_LEADER_EPOCH for a in answers),
                     1000, "the stale answer delivered")
    t_stale = c.now_ms
    c.client_append(lead.node_id, [b"after-the-race"])
    c.run_until_true(lambda: victim.core.high_watermark == lead.core.log_end_offset, 1000,
                     "the victim fetching and committing without another epoch change")
    assert c.now_ms - t_stale < 1000
    assert lead.core.epoch == epochs[1] and victim.core.epoch == epochs[1]
    assert helper.core.epoch == epochs[1]


def kip501_in_sync_at_15s(flag: bool) -> tuple[bool, bool]:
    c = make(1, replica_lag_time_max_ms=10000, follower_fetch_pending_reads_insync_enable=flag,
             fetch_timeout_ms=60000, request_timeout_ms=60000)
    lead = wait_settled(c)
    follower = next(n for n in c.nodes.values() if n is not lead)
    c.client_append(lead.node_id, [b"950"])
    wait_settled(c)
    t0 = c.now_ms
    # From now on the leader's reads take 25 s (KIP-501's ty).
    c.step(lead, api.StallReads(t0, t0 + 25000))
    c.client_append(lead.node_id, [b"1002..1100"])  # the leader's LEO moves past the follower's
    c.run_until(t0 + 15000)  # past tx + replica.lag.time.max.ms
    during = lead.core.is_in_sync(follower.node_id, c.now_ms)
    c.run_until(t0 + 26000)
    after = lead.core.is_in_sync(follower.node_id, c.now_ms)
    return during, after


def test_kip501_pending_fetch_keeps_follower_in_sync_only_with_flag_on():
    assert kip501_in_sync_at_15s(True) == (True, True)
    during_off, _ = kip501_in_sync_at_15s(False)
    assert during_off is False


def test_unclean_tail_truncated_to_exactly_the_leaders_epoch_end_offset():
    c = make(3)
    old = wait_settled(c)
    c.client_append(old.node_id, [b"committed-1", b"committed-2"])
    wait_settled(c)
    committed_end = old.core.high_watermark
    c.network.isolate(old.node_id)
    c.client_append(old.node_id, [b"unclean-1", b"unclean-2", b"unclean-3"])  # never replicated
    c.advance(20)
    assert old.core.log_end_offset == committed_end + 3
    c.run_until_true(lambda: c.current_leader() not in (None, old), 10000, "a new leader")
    new = c.current_leader()
    c.client_append(new.node_id, [b"new-epoch-1"])
    c.run_until_true(lambda: new.core.high_watermark == new.core.log_end_offset, 5000, "the new leader committing")
    new_epoch_start = dict((e, s) for e, s in new.core.epochs.entries)[new.core.epoch]
    assert new_epoch_start == committed_end  # the old epoch ended where the commit ended
    n_before = len(c.truncations)
    c.network.heal(old.node_id)
    c.run_until_true(lambda: settled(c) and old.core.epoch == new.core.epoch, 10000, "the old leader rejoining")
    cuts = [end for (_, node, end) in c.truncations[n_before:] if node == old.node_id]
    assert cuts and cuts[0] == committed_end, f"truncated to {cuts}, expected exactly {committed_end}"
    for o in range(new.core.high_watermark):
        assert old.disk.any_record_at(o) == new.disk.any_record_at(o)
    refused = [r for t, r in c.client_results if isinstance(r, m.ProduceResponse) and r.error_code != 0]
    assert refused, "the unclean append's client got an error, never an acknowledgement"
    assert all(a.value not in (b"unclean-1", b"unclean-2", b"unclean-3") for a in c.acks.values())


def test_a_quarantined_voter_abstains_so_a_stale_voter_cannot_win_without_committed_records():
    """Issue 12: L and A hold records the lagging B lacks (committed by L + A).
    A bit flip cuts A's log below B's end while A is down. Had A voted as
    before, B would win with A's vote and lose acknowledged records. A is
    quarantined: it refuses B, B cannot win while L is down, and once L is back
    L leads, A re-replicates past its old end and leaves quarantine, and every
    acknowledged record is still there."""
    c = make(31)
    lead = wait_settled(c)
    a_node, b_node = [n for n in c.nodes.values() if n is not lead]
    b_end = b_node.core.log_end_offset
    c.network.isolate(b_node.node_id)
    for i in range(5):
        c.client_append(lead.node_id, [b"acked-%d" % i])
        c.advance(20)
    c.run_until_true(lambda: len(c.acks) == 5 and a_node.core.high_watermark >= max(c.acks) + 1, 3000,
                     "five records committed by L and A")
    c.crash(a_node.node_id)
    cut = next(i for i, b in enumerate(a_node.disk.batches) if b.next_offset > b_end - 1)
    new_end, must_reach = a_node.disk.quarantine(cut)
    c.checker.on_quarantine(a_node)
    assert new_end < b_end <= must_reach
    c.boot(a_node.node_id)
    assert a_node.core.quarantined
    refused = []

    def listen(n):
        ev = n.last_event
        if n is a_node and isinstance(ev, api.RequestReceived) and isinstance(ev.request, m.VoteRequest):
            refused.append(ev.request.candidate_id)
    c.listeners.append(listen)
    c.network.heal(b_node.node_id)
    c.crash(lead.node_id)
    c.advance(8000)
    assert c.current_leader() is None, "B must not win: A abstains and L is down"
    assert b_node.node_id in refused, "B stood and asked A (the driver fails the run had A granted it)"
    c.boot(lead.node_id)
    new_lead = wait_settled(c, 15000)
    assert new_lead is lead
    c.client_append(lead.node_id, [b"after"])  # the new epoch's records take A past its old end
    c.run_until_true(lambda: a_node.disk.must_reach_offset < 0, 5000, "A leaving quarantine")
    assert not a_node.core.quarantined
    for off, ack in c.acks.items():
        for n in c.nodes.values():
            if n.core.high_watermark > off:
                assert n.disk.record_at(off) == (ack.epoch, ack.value)


def test_a_follower_rejoining_after_a_partition_bumps_no_epoch_and_keeps_the_leader():
    """KIP-996 (issue 15 item 6): a follower cut off for many election
    timeouts keeps asking for pre-votes nobody can answer, never stands in a
    new epoch, and on healing follows the same leader in the same epoch.
    Before pre-vote it bumped the epoch every election timeout and, once
    healed, deposed the healthy leader."""
    c = make(15)
    lead = wait_settled(c)
    epoch = lead.core.epoch
    victim = next(n for n in c.nodes.values() if n is not lead)
    roles_seen = set()
    c.listeners.append(lambda n: n is victim and roles_seen.add(str(n.core.role)))
    c.network.isolate(victim.node_id)
    cfg = c.quorum_config(victim.node_id)
    for i in range(10):  # writes keep committing on the majority meanwhile
        c.client_append(lead.node_id, [b"during-%d" % i])
        c.advance(cfg.election_timeout_ms)
    assert "prospective" in roles_seen and "candidate" not in roles_seen
    assert victim.core.epoch == epoch
    c.network.heal(victim.node_id)
    c.run_until_true(lambda: victim.core.high_watermark == lead.core.log_end_offset
                     and str(victim.core.role) == "follower", 5000, "the victim following and caught up")
    c.advance(3 * cfg.fetch_timeout_ms)
    assert c.current_leader() is lead and "candidate" not in roles_seen
    assert {n.core.epoch for n in c.nodes.values()} == {epoch}


def test_a_snapshot_download_cut_by_a_partition_leaves_no_partial_once_a_newer_one_is_installed():
    """The drill's partition_snapshot (issue 35): a wiped observer downloads the leader's
    snapshot a chunk at a time; its link is cut mid-download; meanwhile the leader takes a
    newer snapshot and moves its log start past the first; after the heal the observer
    downloads and installs the newer one. The first download's partial must be gone then:
    one download on disk at most (broker/server/snapshot_work.py abandons every other
    partial when a download begins; the runtime kept it until the next append or boot)."""
    c = make(35, voters=(1, 2, 3), observers=(4,), snapshot_chunk_bytes=64, max_replication_lag_ms=100)
    lead = wait_settled(c)

    def write_and_snapshot(tag: bytes) -> None:
        for i in range(30):
            c.client_append(lead.node_id, [tag + b"-%02d-" % i + b"x" * 40])
            c.advance(5)
        voters = [c.nodes[v] for v in (1, 2, 3)]
        c.run_until_true(lambda: all(v.core.high_watermark == lead.core.log_end_offset for v in voters), 5000,
                         "the voters caught up")
        for n in voters:
                c.maybe_snapshot(n, min_records=1)
        c.run_until_true(lambda: lead.disk.log_start_offset == max(s.end_offset for s in lead.disk.snapshots),
                         5000, "the leader's log start at its newest snapshot")

    write_and_snapshot(b"a")
    c.crash(4, wipe="all")
    c.boot(4)
    obs = c.nodes[4]
    c.run_until_true(lambda: any(len(p) > 64 for p in obs.disk.partial_snapshots.values()), 5000,
                     "the observer's download past its first chunk")
    first = set(obs.disk.partial_snapshots)
    c.network.isolate(4)
    c.advance(10)
    assert set(obs.disk.partial_snapshots) == first and not obs.disk.snapshots  # cut mid-download
    write_and_snapshot(b"b")
    newer = max(lead.disk.snapshots)
    assert newer > max(first)
    c.network.heal(4)
    c.run_until_true(lambda: newer in obs.disk.snapshots, 10000, "the observer's install of the newer snapshot")
    assert obs.disk.partial_snapshots == {}, f"partials left after the install: {list(obs.disk.partial_snapshots)}"
    wait_settled(c)
