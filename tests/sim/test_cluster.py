"""Driver (SimCluster) bookkeeping that the randomized runs rely on."""

from __future__ import annotations

from metalog.sim.cluster import SimCluster, SimConfig
from metalog.sim.network import NetworkConfig


def test_a_node_resumed_after_a_pause_keeps_being_ticked():
    """A tick that falls due while a node is paused is dropped; on resume the
    driver must arm the core's next deadline again. (It used to remember the
    dropped tick, so a leader paused once never ticked again: its parked
    fetches were never answered and every follower timed out, for ever.)"""
    c = SimCluster(1, SimConfig(voters=(1, 2, 3), observers=(), network=NetworkConfig(delay_ms=1, jitter_ms=0)))
    c.start()
    c.run_until_true(lambda: c.current_leader() is not None, 10000, "a leader")
    leader = c.current_leader()
    c.advance(1000)  # followers caught up, their empty fetches parked at the leader
    due = leader.core.next_deadline_ms
    assert due is not None and due - c.now_ms <= 500  # a parked fetch's max wait
    c.pause(leader.node_id)
    c.run_until(due + 10)  # the tick due now is dropped: the node is paused
    c.resume(leader.node_id)
    epoch = leader.core.epoch
    ticks = []
    c.listeners.append(lambda n: ticks.append(c.now_ms) if n is leader and type(n.last_event).__name__ == "Tick" else None)
    c.advance(3000)
    assert ticks, "the resumed leader was never ticked again"
    # Its parked fetches are answered, so nobody timed out and stood for election.
    assert leader.core.role == "leader" and leader.core.epoch == epoch
