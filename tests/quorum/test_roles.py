"""The core's structure (issue 14): role objects, the transition table and the
one transition function, the shared answers, and the purity of broker/quorum."""

from __future__ import annotations

import ast
import pathlib

import pytest

from metalog.broker.quorum import api as a
from metalog.broker.quorum.answers import api_versions_response, check_cluster_id, metadata_response
from metalog.broker.quorum.election import CandidateState
from metalog.broker.quorum.follower import FollowerState
from metalog.broker.quorum.leader import LeaderState
from metalog.broker.quorum.roles import ALLOWED_TRANSITIONS, Role
from metalog.protocol import messages as m
from metalog.protocol.errors import Errors
from metalog.protocol.invariants import InvariantViolation
from tests.quorum.harness import CLUSTER, Node, make_leader, of, sent, stand

QUORUM_DIR = pathlib.Path(__file__).resolve().parents[2] / "broker" / "quorum"


def test_every_role_has_a_row_in_the_transition_table():
    assert set(ALLOWED_TRANSITIONS) == set(Role)
    for allowed in ALLOWED_TRANSITIONS.values():
        assert allowed <= set(Role)
    # Nobody becomes leader but a candidate; an observer never becomes a voter's role.
    assert [r for r, nxt in ALLOWED_TRANSITIONS.items() if Role.LEADER in nxt] == [Role.CANDIDATE]
    assert ALLOWED_TRANSITIONS[Role.OBSERVER] == {Role.OBSERVER}
    # KIP-996: nobody stands (epoch + 1) without a majority of pre-votes first.
    assert [r for r, nxt in ALLOWED_TRANSITIONS.items() if Role.CANDIDATE in nxt] == [Role.PROSPECTIVE]


def test_the_transition_table_in_the_docs_is_the_one_the_core_asserts():
    doc = (QUORUM_DIR.parents[1] / "docs" / "quorum-core.md").read_text()
    rows = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0] in {r.value for r in Role}:
            rows[Role(cells[0])] = {Role(x.split()[0]) for x in cells[1].split(",")}
    assert rows == {r: set(nxt) for r, nxt in ALLOWED_TRANSITIONS.items()}


def test_a_transition_outside_the_table_is_refused_before_anything_is_persisted():
    """A follower cannot jump to leader: transition() raises InvariantViolation
    naming both roles, emits no PersistQuorumState and keeps the old role."""
    n = Node(1)
    n.step(a.Tick(0))
    follower = FollowerState(n.core, 3, 2, -1)
    n.core.transition(follower, 0)  # unattached -> follower: allowed
    n.core.outbox.take()
    with pytest.raises(InvariantViolation, match="no transition from follower to leader"):
        n.core.transition(LeaderState(n.core, 3, -1, [1], 0), 0)
    assert n.core.state is follower
    assert not of(n.core.outbox.take(), a.PersistQuorumState)


def test_each_role_change_persists_its_election_before_any_request_or_answer():
    """Candidate then leader: each step's PersistQuorumState (new epoch and
    vote, then the leader) comes before the step's VoteRequests / LeaderChange."""
    n = Node(1)
    n.step(a.Tick(0))
    now = n.core.next_deadline_ms
    acts = n.step(a.Tick(now))
    assert n.core.role == Role.PROSPECTIVE and not of(acts, a.PersistQuorumState)  # a memory transition
    acts = stand(n, now, acts)
    assert n.core.role == Role.CANDIDATE and isinstance(n.core.state, CandidateState)
    first_persist = next(i for i, x in enumerate(acts) if isinstance(x, a.PersistQuorumState))
    first_send = next(i for i, x in enumerate(acts) if isinstance(x, a.SendRequest))
    assert first_persist < first_send
    assert acts[first_persist].state == a.QuorumStateData(1, -1, 1, (1, 2, 3))
    vote = sent(acts, m.VoteRequest)[0]
    acts = n.step(a.ResponseReceived(now, vote.request_id, vote.destination,
                                     m.VoteResponse(leader_id=-1, leader_epoch=1, vote_granted=True)))
    assert n.core.role == Role.LEADER
    kinds = [type(x) for x in acts]
    assert kinds.index(a.PersistQuorumState) < kinds.index(a.AppendBatches)
    assert of(acts, a.PersistQuorumState)[0].state == a.QuorumStateData(1, 1, 1, (1, 2, 3))


def test_resigning_keeps_the_persisted_election_and_says_we_led():
    """Leader -> resigned (graceful stop) writes nothing: the state on disk
    still names us as the epoch's leader (KAFKA-10527 on restart)."""
    n = Node(1)
    now = make_leader(n)
    acts = n.step(a.Shutdown(now))
    assert n.core.role == Role.RESIGNED
    assert not of(acts, a.PersistQuorumState)
    assert n.core.election_state(n.core.state) == a.QuorumStateData(1, 1, 1, (1, 2, 3))
    assert len(sent(acts, m.EndQuorumEpochRequest)) == 2


def test_cluster_id_check_names_both_ids_in_the_answer_type_the_request_expects():
    cl = m.LeaderIdAndEpoch(2, 5)
    assert check_cluster_id("ours", m.MetadataRequest(), cl) is None  # no cluster id carried
    assert check_cluster_id("ours", m.ProduceRequest(cluster_id="ours", records=[b"x"]), cl) is None
    got = check_cluster_id("ours", m.ProduceRequest(cluster_id="theirs", records=[b"x"]), cl)
    assert got == m.ProduceResponse(error_code=Errors.INCONSISTENT_CLUSTER_ID, current_leader=cl,
                                    error_message="cluster id 'theirs' does not match ours 'ours'")
    cmd = check_cluster_id("ours", m.ControllerCommandRequest(cluster_id="x", command="list_acls"), cl)
    assert type(cmd) is m.ControllerCommandResponse and cmd.error_code == Errors.INCONSISTENT_CLUSTER_ID
    chk = check_cluster_id("ours", m.ConsistencyCheckRequest(cluster_id="x", leader_id=1, leader_epoch=1,
                                                             start_offset=0, end_offset=1), cl)
    assert type(chk) is m.ConsistencyCheckResponse and chk.error_code == Errors.INCONSISTENT_CLUSTER_ID


def test_the_core_answers_api_versions_and_metadata_through_the_shared_builders():
    n = Node(1)
    acts = n.step(a.RequestReceived(0, "v", m.ApiVersionsRequest()))
    assert of(acts, a.Respond)[0].response == api_versions_response(0, -1)  # static voters: kraft.version 0
    assert api_versions_response().api_keys == []  # the listener lists the versions it serves
    acts = n.step(a.RequestReceived(0, "md", m.MetadataRequest()))
    assert of(acts, a.Respond)[0].response == metadata_response(
        cluster_id=CLUSTER, node_id=1, leader_id=-1, leader_epoch=0, high_watermark=-1,
        log_start_offset=0, voters=[1, 2, 3], observers=[])
    md = n.core.metadata({1: ("h1", 9091), 2: ("h2", 9092)})
    assert md.voters == [m.NodeEndpoint(1, "h1", 9091), m.NodeEndpoint(2, "h2", 9092), m.NodeEndpoint(3, "", 0)]


FORBIDDEN_MODULES = {"asyncio", "socket", "time", "os", "threading", "selectors", "uvloop", "datetime"}


def test_the_quorum_package_stays_pure():
    """No module in broker/quorum imports IO, clock or event-loop modules, and
    `random` is imported only by env.py, for the type of Environment.random."""
    offenders = []
    for path in sorted(QUORUM_DIR.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [al.name.split(".")[0] for al in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module.split(".")[0]]
            for name in names:
                if name in FORBIDDEN_MODULES or (name == "random" and path.name != "env.py"):
                    offenders.append(f"{path.name}:{node.lineno} imports {name}")
    assert offenders == []


def test_no_role_is_checked_by_comparing_strings_or_the_role_field():
    """Roles dispatch through their own methods: no `role ==` / `_role ==` chains."""
    hits = []
    for path in sorted(QUORUM_DIR.glob("*.py")):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if "role ==" in code or "role !=" in code or "role in (" in code:
                hits.append(f"{path.name}:{i}: {line.strip()}")
    assert hits == []


def test_the_core_refuses_a_config_that_breaks_its_cross_field_rule():
    """QuorumCore calls QuorumConfig.validate(): a fetch max wait not below the
    fetch timeout (a parked fetch would outlive the follower's patience) is a
    ValueError naming the key, before the core exists."""
    with pytest.raises(ValueError, match=r"fetch_max_wait_ms: must be below fetch_timeout_ms \(2000\), got 2000"):
        Node(1, fetch_max_wait_ms=2000, fetch_timeout_ms=2000)
