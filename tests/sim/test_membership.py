"""KIP-853 voter changes in the simulator, step by step on the real core:
replace a wiped voter, remove the leader, grow the set. Every invariant
(one leader per epoch, no two disjoint majorities across a change, committed
data never lost, a wiped node never votes with its old identity) is checked
after every event by the SimCluster's checker; these tests add what each
story must end in."""

from __future__ import annotations

from metalog.protocol import messages as m
from metalog.protocol.errors import Errors
from metalog.sim.cluster import SimCluster, SimConfig, sim_endpoints
from metalog.sim.network import NetworkConfig
from tests.sim.settle import settled, wait_settled


def make(seed: int = 1) -> SimCluster:
    c = SimCluster(seed, SimConfig(voters=(1, 2, 3), observers=(4,), dynamic=True, flush_latency_ms=(0, 0),
                                   network=NetworkConfig(delay_ms=1, jitter_ms=0)))
    c.start()
    return c


def change(c: SimCluster, req: m.Body, within_ms: int = 5000) -> m.Body:
    """Send a voter change to the leader, retrying what it answers REQUEST_TIMED_OUT
    (not caught up yet, a change in progress); the final answer."""
    deadline = c.now_ms + within_ms
    while True:
        n = c.inject_request(c.current_leader().node_id, req)
        c.run_until_true(lambda: n in c.injected, 3000, "an answer to the voter change")
        resp = c.injected[n]
        if resp.error_code != Errors.REQUEST_TIMED_OUT or c.now_ms >= deadline:
            return resp
        c.advance(100)
        wait_settled(c)


def add(c: SimCluster, nid: int) -> m.AddRaftVoterRequest:
    return m.AddRaftVoterRequest(cluster_id=c.config.cluster_id, voter_id=nid,
                                 voter_directory_id=c.nodes[nid].disk.directory_id,
                                 listeners=[m.RaftListener(*e) for e in sim_endpoints(nid)])


def remove(c: SimCluster, nid: int, directory_id: str) -> m.RemoveRaftVoterRequest:
    return m.RemoveRaftVoterRequest(cluster_id=c.config.cluster_id, voter_id=nid, voter_directory_id=directory_id)


def test_the_first_leader_puts_the_bootstrap_set_in_the_log_and_observers_learn_it():
    c = make()
    lead = wait_settled(c)
    for n in c.nodes.values():
        assert n.core.voters == (1, 2, 3) and n.core.voter_set.kraft_version == 1
        assert not n.core.voter_set.unknown, f"n{n.node_id} learnt the set from the log"
    assert c.nodes[4].core.role == "observer" and lead.node_id in (1, 2, 3)


def test_replace_a_wiped_voter():
    c = make()
    wait_settled(c)
    victim = next(v for v in (1, 2, 3) if v != c.current_leader().node_id)
    old_dir = c.nodes[victim].disk.directory_id
    c.crash(victim, wipe="all")
    c.boot(victim)
    assert c.nodes[victim].disk.directory_id != old_dir
    assert c.nodes[victim].core.role == "observer" and not c.nodes[victim].core.is_voter
    wait_settled(c)
    assert c.nodes[victim].core.role == "observer", "caught up, still not the voter the set names"
    assert change(c, remove(c, victim, old_dir)).error_code == Errors.NONE
    wait_settled(c)
    assert change(c, add(c, victim)).error_code == Errors.NONE
    wait_settled(c)
    n = c.nodes[victim]
    assert n.core.is_voter and n.core.role == "follower"
    assert c.current_leader().core.voter_set.directory_id_of(victim) == n.disk.directory_id


def test_the_old_identity_of_a_wiped_voter_is_refused_while_still_in_the_set():
    """Before the old identity is removed: a Vote addressed to it is INVALID_VOTER_KEY."""
    c = make()
    wait_settled(c)
    victim = next(v for v in (1, 2, 3) if v != c.current_leader().node_id)
    old_dir = c.nodes[victim].disk.directory_id
    c.crash(victim, wipe="all")
    c.boot(victim)
    n = c.inject_request(victim, m.VoteRequest(
        cluster_id=c.config.cluster_id, candidate_epoch=c.current_leader().core.epoch + 1,
        candidate_id=c.current_leader().node_id, last_offset_epoch=99, last_offset=1 << 30,
        candidate_directory_id=c.current_leader().disk.directory_id, voter_id=victim, voter_directory_id=old_dir))
    assert c.injected[n].error_code == Errors.INVALID_VOTER_KEY and not c.injected[n].vote_granted


def test_remove_the_leader_then_the_others_elect_one_of_their_own():
    c = make()
    wait_settled(c)
    assert change(c, add(c, 4)).error_code == Errors.NONE  # four voters, so three stay
    lead = wait_settled(c)
    epoch = lead.core.epoch
    assert change(c, remove(c, lead.node_id, lead.disk.directory_id)).error_code == Errors.NONE
    assert lead.core.role == "observer", "it stepped down once the change committed"
    new = wait_settled(c)
    assert new is not lead and new.core.epoch > epoch and new.core.voters == tuple(
        v for v in (1, 2, 3, 4) if v != lead.node_id)
    c.client_append(new.node_id, [b"after"])
    wait_settled(c)
    assert lead.core.high_watermark == new.core.high_watermark, "the old leader replicates as an observer"


def test_a_static_cluster_refuses_voter_changes():
    c = SimCluster(1, SimConfig(voters=(1, 2, 3), observers=(4,), flush_latency_ms=(0, 0),
                                network=NetworkConfig(delay_ms=1, jitter_ms=0)))
    c.start()
    wait_settled(c)
    resp = change(c, add(c, 4))
    assert resp.error_code == Errors.UNSUPPORTED_VERSION and "kraft.version 0" in resp.error_message


def upgrade(c: SimCluster) -> m.UpdateFeaturesRequest:
    return m.UpdateFeaturesRequest(cluster_id=c.config.cluster_id,
                                   feature_updates=[m.FeatureUpdate(m.KRAFT_VERSION_FEATURE, 1)])


def test_a_static_cluster_upgrades_online_then_changes_voters_and_survives_a_leader_crash():
    """kraft.version 0 -> 1 while running (UpdateFeatures): every node learns
    the set from the log with each voter's directory id; then node 4 is
    added, the leader crashes, the others elect a leader of the new set that
    holds every acknowledged write (the checker verifies each event)."""
    c = SimCluster(3, SimConfig(voters=(1, 2, 3), observers=(4,), dynamic=True, static_start=True,
                                flush_latency_ms=(0, 0), network=NetworkConfig(delay_ms=1, jitter_ms=0)))
    c.start()
    lead = wait_settled(c)
    assert lead.core.voter_set.kraft_version == 0
    c.client_append(lead.node_id, [b"before"])
    wait_settled(c)
    assert change(c, add(c, 4)).error_code == Errors.UNSUPPORTED_VERSION
    assert change(c, upgrade(c)).error_code == Errors.NONE
    wait_settled(c)
    for n in c.nodes.values():
        vs = n.core.voter_set
        assert vs.kraft_version == 1 and vs.ids == (1, 2, 3), f"n{n.node_id}: {vs}"
        assert all(vs.directory_id_of(v) == c.nodes[v].disk.directory_id for v in (1, 2, 3))
        assert vs.endpoints[2] == sim_endpoints(2)
    assert change(c, add(c, 4)).error_code == Errors.NONE
    lead = wait_settled(c)
    assert c.nodes[4].core.is_voter and c.nodes[4].core.role == "follower"
    c.client_append(lead.node_id, [b"after"])
    wait_settled(c)
    c.crash(lead.node_id)
    new = wait_settled(c)
    assert new is not lead and new.core.voters == (1, 2, 3, 4)
    c.boot(lead.node_id)
    wait_settled(c)
    assert lead.core.role == "follower" and lead.core.high_watermark == new.core.high_watermark


def test_auto_join_an_observer_joins_and_a_wiped_voter_replaces_its_old_identity():
    """KIP-1186 with auto-join on for every node: observer 4 becomes a voter
    by itself; voter 2's disk is replaced (new directory id): it removes its
    stale identity, then adds itself back -- no operator request at all, and
    the checker's invariants hold at every event."""
    c = SimCluster(5, SimConfig(voters=(1, 2, 3), observers=(4,), dynamic=True, flush_latency_ms=(0, 0),
                                network=NetworkConfig(delay_ms=1, jitter_ms=0),
                                quorum={"auto_join_enable": True}))
    c.start()
    c.run_until_true(lambda: settled(c) and c.current_leader().core.voters == (1, 2, 3, 4), 20000,
                     "node 4 joined by itself")
    lead = wait_settled(c)
    assert c.nodes[4].core.is_voter and c.nodes[4].core.role == "follower"
    victim = next(v for v in (1, 2, 3) if v != lead.node_id)
    old_dir = c.nodes[victim].disk.directory_id
    c.crash(victim, wipe="all")
    c.boot(victim)
    new_dir = c.nodes[victim].disk.directory_id
    assert new_dir != old_dir and not c.nodes[victim].core.is_voter

    def rejoined() -> bool:
        lead = c.current_leader()
        return (settled(c) and lead.core.voter_set.directory_id_of(victim) == new_dir
                and lead.core.voters == (1, 2, 3, 4))

    c.run_until_true(rejoined, 30000, f"node {victim} replaced its old identity")
    assert c.nodes[victim].core.is_voter and c.nodes[victim].core.role == "follower"
