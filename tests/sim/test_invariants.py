"""The invariant checkers catch what they claim to catch.

A scripted core (a puppet whose state and actions the test sets) stands in for
QuorumCore here: these tests exercise the checkers and the driver, not the core.
"""

from __future__ import annotations

import types

import pytest

from metalog.broker.quorum import api
from metalog.broker.quorum.voters import VoterSet, VoterSetHistory
from metalog.protocol import messages as m
from metalog.storage.batch import encode_batch
from metalog.sim.cluster import SimCluster, SimConfig
from metalog.sim.invariants import Refusal, Violation, check_final


class PuppetCore:
    def __init__(self, config, log_view, reader, quorum_state, env):
        self.config = config
        self.role = "unattached"
        self.epoch = quorum_state.leader_epoch if quorum_state else 0
        self.leader_id = -1
        self.high_watermark = 0
        self.log_end_offset = log_view.log_end_offset
        self.log_start_offset = log_view.log_start_offset
        self.flushed_end_offset = log_view.log_end_offset
        self.epochs = list(log_view.epochs)
        self.next_deadline_ms = None
        self.script: list[api.Action] = []
        self.events: list = []
        # What the checkers read of the voter set (KIP-853): the config's static voters.
        self.voter_set = VoterSet.static(config.voters)
        self.voters = self.voter_set.ids
        self.is_voter = config.node_id in self.voters
        self.log = types.SimpleNamespace(voters=VoterSetHistory(self.voter_set))

    def voter_set_at(self, end_offset):
        return self.voter_set

    def step(self, event):
        self.events.append(event)
        out, self.script = self.script, []
        for a in out:
            if isinstance(a, api.AppendBatches):
                self.log_end_offset = a.next_offset
        return out


def cluster() -> SimCluster:
    c = SimCluster(1, SimConfig(voters=(1, 2, 3), observers=()), core_factory=lambda: PuppetCore)
    c.start()
    return c


def append(c: SimCluster, node: int, base: int, epoch: int, n: int = 1, flush: bool = True) -> None:
    core = c.nodes[node].core
    core.script = [api.AppendBatches(encode_batch(base, epoch, [b"x%d" % i for i in range(n)], 0), base, base + n)]
    if flush:
        core.script.append(api.FlushLog())
    c.step(c.nodes[node], api.Tick(c.now_ms))
    c.advance(20)


def make_leader(c: SimCluster, node: int, epoch: int) -> None:
    core = c.nodes[node].core
    core.role, core.epoch, core.leader_id = "leader", epoch, node
    c.step(c.nodes[node], api.Tick(c.now_ms))


def test_two_leaders_in_one_epoch_is_a_violation():
    c = cluster()
    make_leader(c, 1, 3)
    with pytest.raises(Violation, match="two leaders in epoch 3: n1 and n2"):
        make_leader(c, 2, 3)


def test_epoch_going_down_is_a_violation():
    c = cluster()
    c.nodes[1].core.epoch = 5
    c.step(c.nodes[1], api.Tick(0))
    c.nodes[1].core.epoch = 4
    with pytest.raises(Violation, match="n1 epoch went down from 5 to 4"):
        c.step(c.nodes[1], api.Tick(0))


def test_high_watermark_going_down_is_a_violation():
    c = cluster()
    append(c, 2, 0, 1, n=3)
    c.nodes[2].core.high_watermark = 3
    c.step(c.nodes[2], api.Tick(c.now_ms))
    c.nodes[2].core.high_watermark = 2
    with pytest.raises(Violation, match="n2 high watermark went down from 3 to 2"):
        c.step(c.nodes[2], api.Tick(c.now_ms))


def test_leader_hw_over_data_only_it_holds_is_a_violation():
    c = cluster()
    make_leader(c, 1, 1)
    c.nodes[1].core.epochs = [(1, 0)]
    append(c, 1, 0, 1, n=2)
    append(c, 2, 0, 1, n=1)
    c.nodes[1].core.high_watermark = 1  # offset 0 is on n1 and n2: fine
    c.step(c.nodes[1], api.Tick(c.now_ms))
    c.nodes[1].core.high_watermark = 2  # offset 1 is on n1 only
    with pytest.raises(Violation, match=r"only voters \[1\] hold offset 1"):
        c.step(c.nodes[1], api.Tick(c.now_ms))


def test_counting_unflushed_follower_data_is_caught_at_the_crash():
    c = cluster()
    make_leader(c, 1, 1)
    c.nodes[1].core.epochs = [(1, 0)]
    append(c, 1, 0, 1, n=2)
    append(c, 2, 0, 1, n=2, flush=False)
    # The puppet leader (wrongly) counts n2's unflushed copy; the checker looks
    # at durable data only, so the HW claim fails right away.
    c.nodes[1].core.high_watermark = 2
    with pytest.raises(Violation, match="hold offset 1 .* durably"):
        c.step(c.nodes[1], api.Tick(c.now_ms))


def test_truncation_below_the_high_watermark_is_a_violation():
    c = cluster()
    append(c, 2, 0, 1, n=4)
    c.nodes[2].core.high_watermark = 3
    c.step(c.nodes[2], api.Tick(c.now_ms))
    c.nodes[2].core.script = [api.TruncateLog(2)]
    with pytest.raises(Violation, match="n2 truncates its log to 2, below its high watermark 3"):
        c.step(c.nodes[2], api.Tick(c.now_ms))


def test_lost_acknowledged_append_is_a_violation():
    c = cluster()
    make_leader(c, 1, 1)
    append(c, 1, 0, 1, n=1)
    append(c, 2, 0, 1, n=1)
    leader = c.nodes[1]
    leader.core.high_watermark = 1
    token = ("client", 99)
    c.client_pending[token] = (1, [b"x0"])
    leader.open_tokens.add(token)
    leader.core.script = [api.Respond(token, m.ProduceResponse(base_offset=0, leader_epoch=1))]
    c.step(leader, api.Tick(c.now_ms))
    assert c.acks[0].value == b"x0"
    # n3 claims HW 1 while holding a different record at offset 0.
    append(c, 3, 0, 2, n=1)
    c.nodes[3].core.high_watermark = 1
    with pytest.raises(Violation, match="acknowledged record lost: offset 0"):
        c.step(c.nodes[3], api.Tick(c.now_ms))


def test_core_and_disk_disagreeing_on_the_log_end_is_a_violation():
    c = cluster()
    c.nodes[1].core.log_end_offset = 7
    with pytest.raises(Violation, match="core thinks its log ends at 7, the disk ends at 0"):
        c.step(c.nodes[1], api.Tick(0))


def test_answering_a_token_twice_is_a_violation():
    c = cluster()
    c.nodes[1].core.script = [api.SendRequest(2, 1, m.DescribeQuorumRequest(), 1000)]
    c.step(c.nodes[1], api.Tick(0))
    c.advance(30)
    got = c.nodes[2].core.events[-1]
    assert isinstance(got, api.RequestReceived)
    resp = m.DescribeQuorumResponse()
    c.nodes[2].core.script = [api.Respond(got.token, resp), api.Respond(got.token, resp)]
    with pytest.raises(Violation, match="unknown or already answered"):
        c.step(c.nodes[2], api.Tick(c.now_ms))


def test_request_to_a_dead_node_fails_and_silence_times_out():
    c = cluster()
    c.crash(2)
    c.nodes[1].core.script = [api.SendRequest(2, 1, m.DescribeQuorumRequest(), 1000)]
    c.step(c.nodes[1], api.Tick(0))
    c.advance(50)
    failed = c.nodes[1].core.events[-1]
    assert isinstance(failed, api.RequestFailed) and failed.reason == "connection refused"
    c.network.isolate(3)
    c.nodes[1].core.script = [api.SendRequest(3, 2, m.DescribeQuorumRequest(), 1000)]
    c.step(c.nodes[1], api.Tick(c.now_ms))
    c.advance(999)
    assert not isinstance(c.nodes[1].core.events[-1], api.RequestFailed) or c.nodes[1].core.events[-1].request_id != 2
    c.advance(1)
    last = c.nodes[1].core.events[-1]
    assert isinstance(last, api.RequestFailed) and last.request_id == 2 and last.reason == "timeout"


def test_paused_node_sees_its_backlog_only_after_resume():
    c = cluster()
    c.pause(2)
    c.nodes[1].core.script = [api.SendRequest(2, 1, m.DescribeQuorumRequest(), 60000)]
    c.step(c.nodes[1], api.Tick(0))
    c.advance(5000)
    assert not any(isinstance(e, api.RequestReceived) for e in c.nodes[2].core.events)
    c.resume(2)
    assert any(isinstance(e, api.RequestReceived) for e in c.nodes[2].core.events)


def test_final_check_reports_a_node_that_has_not_caught_up():
    c = cluster()
    make_leader(c, 1, 1)
    c.nodes[1].core.epochs = [(1, 0)]
    for node in (1, 2, 3):
        append(c, node, 0, 1, n=2)
    for node in (1, 2):
        c.nodes[node].core.high_watermark = 2
        c.step(c.nodes[node], api.Tick(c.now_ms))
    with pytest.raises(Violation, match="n3 has not caught up: HW 0, leader HW 2"):
        check_final(c)


# -------------------------------------------------- fetched-batch corruption


def fetch(c: SimCluster, node: int, offset: int) -> None:
    """The puppet at `node` sends a Fetch claiming everything below `offset`."""
    c.nodes[node].core.script = [api.SendRequest(1, 500 + offset, m.FetchRequest(
        cluster_id="sim-cluster", replica_id=node, max_wait_ms=0, current_leader_epoch=1,
        fetch_offset=offset, last_fetched_epoch=1), 1000)]
    c.step(c.nodes[node], api.Tick(c.now_ms))


def test_appending_a_damaged_batch_is_a_violation():
    c = cluster()
    bad = bytearray(encode_batch(0, 1, [b"x0", b"x1"], 0))
    bad[-1] ^= 0x04  # in the CRC-covered records
    c.nodes[2].core.script = [api.AppendBatches(bytes(bad), 0, 2)]
    with pytest.raises(Violation, match="n2 appended a damaged batch at 0..2"):
        c.step(c.nodes[2], api.Tick(c.now_ms))


def test_refusing_a_batch_the_wire_never_damaged_is_a_violation():
    c = cluster()
    c.nodes[2].core.script = [api.FetchedBatchCorrupt(0, 1, "CRC mismatch")]
    with pytest.raises(Violation, match="n2 refused a fetched batch at 0 .* that the wire never damaged"):
        c.step(c.nodes[2], api.Tick(c.now_ms))


def test_a_fetch_past_a_refused_batch_or_past_the_log_end_is_a_violation():
    c = cluster()
    append(c, 2, 0, 1, n=2)
    body = m.FetchResponse(high_watermark=0, records=encode_batch(2, 1, [b"x2", b"x3"], 0))
    _, flip = c.network.flip(body)
    c.checker.wire.on_flip(2, flip)  # as the driver reports a flip on its way to n2
    c.nodes[2].core.script = [api.FetchedBatchCorrupt(2, 1, "CRC mismatch")]
    c.step(c.nodes[2], api.Tick(c.now_ms))
    assert c.nodes[2].fetched_corrupt_count == 1 and c.checker.wire.pending[2][0].base_offset == 2
    fetch(c, 2, 2)  # asking for it again: fine
    assert c.checker.wire.pending[2][0].refetched
    # A Fetch claiming the refused batch it does not hold.
    with pytest.raises(Violation, match="n2 fetches at 4, acknowledging records past its log end 2"):
        fetch(c, 2, 4)
    c2 = cluster()
    append(c2, 2, 0, 1, n=4)
    c2.checker.wire.pending[2] = [Refusal(2, 2, 0)]  # refused at 2, and still unresolved though the log is past it
    with pytest.raises(Violation, match="n2 fetches at 4, acknowledging the batch at 2 it refused"):
        fetch(c2, 2, 4)


def test_a_sound_copy_of_a_refused_batch_resolves_it():
    c = cluster()
    append(c, 2, 0, 1, n=2)
    c.checker.wire.pending[2] = [Refusal(2, 2, 0)]
    append(c, 2, 2, 1, n=2)
    assert c.checker.wire.pending[2] == [] and c.checker.wire.resolved_count == 1
    fetch(c, 2, 4)  # now it may acknowledge past it
