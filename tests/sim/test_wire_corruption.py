"""Fetched-batch corruption, replayed: a bit flips on the wire between the
leader and a follower (sim/network.py). The follower's core refuses the
damaged batch (FetchedBatchCorrupt), the driver executes that as the runtime
does (counted, no quarantine), the follower fetches the batch again and
converges; nothing damaged is appended or acknowledged and nothing
acknowledged is lost (sim/invariants.py, FetchedCorruptionChecker)."""

from __future__ import annotations

from metalog.broker.quorum import api
from metalog.protocol import messages as m
from metalog.sim.cluster import Message, SimCluster, SimConfig
from metalog.sim.invariants import check_final
from metalog.sim.network import NetworkConfig
from tests.sim.settle import wait_settled


def make(seed: int) -> SimCluster:
    c = SimCluster(seed, SimConfig(voters=(1, 2, 3), observers=(), flush_latency_ms=(0, 0),
                                   network=NetworkConfig(delay_ms=1, jitter_ms=0)))
    c.start()
    return c


def test_a_batch_corrupted_on_the_wire_is_refused_fetched_again_and_never_counted():
    c = make(31)
    leader = wait_settled(c)
    victim, third = [n for n in c.nodes.values() if n is not leader]
    # Only the victim can complete a majority now: the leader may commit the
    # new records only once the victim holds them, sound.
    c.network.isolate(third.node_id)
    flipped: list[Message] = []

    def corrupt_first_answer_with_records(msg: Message) -> str:
        if (not flipped and msg.kind == "response" and msg.dst == victim.node_id
                and isinstance(msg.body, m.FetchResponse) and msg.body.records):
            flipped.append(msg)
            return "corrupt"
        return "deliver"
    c.intercept = corrupt_first_answer_with_records
    fetch_offsets: list[int] = []  # what the victim asks the leader for, from its refusal on
    hw_while_unheld: list[int] = []  # the leader's HW while the victim does not hold the batch

    def watch(n) -> None:
        if n is not leader:
            return
        ev = n.last_event
        if (victim.fetched_corrupt_count and isinstance(ev, api.RequestReceived)
                and isinstance(ev.request, m.FetchRequest) and ev.request.replica_id == victim.node_id):
            fetch_offsets.append(ev.request.fetch_offset)
        if victim.disk.log_end_offset <= base:
            hw_while_unheld.append(leader.core.high_watermark)
    c.listeners.append(watch)

    base = leader.core.log_end_offset
    c.client_append(leader.node_id, [b"r0", b"r1", b"r2"])
    c.run_until_true(lambda: victim.fetched_corrupt_count == 1, 2000, "the victim refusing the damaged batch")

    # It took effect: one flip, seen and refused at the batch's offset; the
    # victim's log stops before it, its disk is not quarantined.
    wire = c.checker.wire
    assert wire.flip_count == 1 and len(flipped) == 1
    (refusal,) = wire.refusals
    assert (refusal.node_id, refusal.base_offset) == (victim.node_id, base)
    assert victim.disk.log_end_offset == base and victim.disk.must_reach_offset < 0
    assert any("fetched batch corrupt at" in line for line in c.trace_tail)

    c.run_until_true(lambda: leader.core.high_watermark == victim.core.high_watermark == base + 3, 3000,
                     "the victim fetching the batch again and the leader committing it")
    assert fetch_offsets and fetch_offsets[0] == base, "the next fetch asks for the refused batch again"
    assert refusal.refetched and wire.resolved_count == 1
    assert victim.fetched_corrupt_count == 1  # the second copy arrived sound
    assert hw_while_unheld and max(hw_while_unheld) <= base, "the refused batch was counted toward the HW"
    assert [victim.disk.record_at(base + i) for i in range(3)] == [(leader.core.epoch, b"r%d" % i) for i in range(3)]
    assert [c.acks[base + i].value for i in range(3)] == [b"r0", b"r1", b"r2"]
    c.network.heal()
    wait_settled(c)
    check_final(c)  # ConsistentCommittedData, acks committed, FetchedCorruptionConverges


def test_the_wire_flips_by_chance_from_a_stream_of_its_own():
    """With a chance per fetch answer, bits flip in a plain run and every
    invariant holds; the network's timing dice are not touched by it, so a
    seed whose answers are never flipped replays exactly."""
    quiet = make(5)
    quiet.run_until(3000)
    noisy = SimCluster(5, SimConfig(voters=(1, 2, 3), observers=(), flush_latency_ms=(0, 0),
                                    network=NetworkConfig(delay_ms=1, jitter_ms=0, fetch_flip_probability=0.3)))
    noisy.start()
    leader = wait_settled(noisy)
    for i in range(20):
        noisy.client_append(leader.node_id, [b"v%d" % i])
        noisy.advance(20)
    wait_settled(noisy)
    check_final(noisy)
    wire = noisy.checker.wire
    assert wire.flip_count > 0 and len(wire.refusals) > 0
    assert sum(n.fetched_corrupt_count for n in noisy.nodes.values()) == len(wire.refusals)
    never = SimCluster(5, SimConfig(voters=(1, 2, 3), observers=(), flush_latency_ms=(0, 0),
                                    network=NetworkConfig(delay_ms=1, jitter_ms=0, fetch_flip_probability=1e-12)))
    never.start()
    never.run_until(3000)
    assert never.trace_hash == quiet.trace_hash
