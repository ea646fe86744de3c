"""A role is tested alone: built against a small fake of its context (the
typing.Protocol of what it may use of its owner, metalog.broker.quorum.roles
.RoleContext and one per role module), with no QuorumCore, no log and no
outbox. The fakes hold only what the protocols name: a role reaching for
anything else fails here with an AttributeError."""

from __future__ import annotations

import random
from typing import Any

from metalog.broker.quorum.api import QuorumConfig
from metalog.broker.quorum.election import ElectionMemory, UnattachedState
from metalog.broker.quorum.follower import FollowerState
from metalog.broker.quorum.roles import Role, RoleState
from metalog.broker.quorum.voters import Electorate, VoterSet
from metalog.protocol import messages as m

CONFIG = QuorumConfig(node_id=1, voters=(1, 2, 3), cluster_id="alone")


class FakeLog:
    """The few answers of LocalLog the roles below ask for."""

    def __init__(self, log_end_offset: int, last_epoch: int) -> None:
        self.log_start_offset = 0
        self.log_end_offset = log_end_offset
        self.flushed_end_offset = log_end_offset
        self._position = (last_epoch, log_end_offset)

    def up_to_date(self, last_epoch: int, end_offset: int) -> bool:
        return (last_epoch, end_offset) >= self._position

    def last_epoch(self) -> int:
        return self._position[0]


class FakeContext:
    """RoleContext + ElectionContext + FollowerContext, by hand. Transitions
    are only recorded: the owner makes them, the role asks."""

    def __init__(self, log: FakeLog) -> None:
        self.config = CONFIG
        self.log = log
        self.electorate = Electorate(1, m.NO_DIRECTORY_ID, VoterSet.static((1, 2, 3)))
        self.random = random.Random(7)
        self.elections = ElectionMemory(CONFIG, self.random)
        self.shutting_down = False
        self.fatal_reason = None
        self.asked: list[tuple[Any, ...]] = []  # what the role asked of its owner, in order

    # RoleContext
    def send(self, destination: int, body: m.Body, kind: Any, position: int = 0) -> int:
        self.asked.append(("send", destination, type(body).__name__))
        return len(self.asked)

    def respond(self, token: Any, body: m.Body) -> None:
        self.asked.append(("respond", token, body))

    def current_leader(self) -> m.LeaderIdAndEpoch:
        raise AssertionError("not asked in these tests")

    def fail(self, reason: str) -> None:
        self.asked.append(("fail", reason))

    def become_follower(self, epoch: int, leader_id: int, now_ms: int) -> RoleState:
        raise AssertionError("not asked in these tests")

    def become_observer(self, now_ms: int) -> None:
        self.asked.append(("become_observer", now_ms))

    # ElectionContext
    def stand(self, now_ms: int) -> None:
        self.asked.append(("stand", now_ms))

    def become_voted(self, candidate_id: int, now_ms: int) -> None:
        self.asked.append(("become_voted", candidate_id, now_ms))

    def become_candidate(self, now_ms: int) -> None:
        self.asked.append(("become_candidate", now_ms))

    def become_leader(self, now_ms: int) -> None:
        self.asked.append(("become_leader", now_ms))

    # FollowerContext
    def emit(self, action: Any) -> None:
        self.asked.append(("emit", action))

    def transition(self, new: RoleState, now_ms: int) -> None:
        self.asked.append(("transition", new.role, now_ms))

    def become_leaderless_voter(self, now_ms: int) -> None:
        self.asked.append(("become_leaderless_voter", now_ms))


def vote(candidate_id: int, last_epoch: int, last_offset: int) -> m.VoteRequest:
    return m.VoteRequest(cluster_id="alone", candidate_epoch=4, candidate_id=candidate_id,
                         last_offset_epoch=last_epoch, last_offset=last_offset)


def test_an_unattached_voter_answers_a_vote_alone():
    """Our log ends at (epoch 3, offset 10). A stale candidate is refused and
    our election timer keeps the earlier deadline that was running; an up
    to date one is granted, and the role asks its owner to record the vote
    (persisted before the answer): it does not transition itself."""
    ctx = FakeContext(FakeLog(log_end_offset=10, last_epoch=3))
    role = UnattachedState(ctx, 4)
    assert role.role is Role.UNATTACHED and role.epoch == 4
    role.election_deadline_ms = 5_000
    assert role.grant_vote(vote(2, last_epoch=3, last_offset=9), running_deadline_ms=1_200, now_ms=1_000) is False
    assert role.election_deadline_ms == 1_200
    assert ctx.asked == []
    assert role.grant_vote(vote(3, last_epoch=3, last_offset=10), running_deadline_ms=1_200, now_ms=1_001) is True
    assert ctx.asked == [("become_voted", 3, 1_001)]


def test_a_follower_whose_leader_resets_the_connection_stands_soon_alone():
    """A Fetch to our leader that fails with a connection reset (its process
    died) pulls the fetch timeout in to a grace in [T/10, T/2] (T: the
    election timeout) and forgets the leader's last contact, so the others'
    pre-votes are granted; a plain timeout leaves the fetch timeout alone."""
    ctx = FakeContext(FakeLog(log_end_offset=0, last_epoch=-1))
    follower = FollowerState(ctx, 5, 2, -1)
    assert follower.role is Role.FOLLOWER
    follower.on_enter(1_000)
    assert follower.fetch_deadline_ms == 1_000 + CONFIG.fetch_timeout_ms
    follower.poll(1_000)
    assert ctx.asked == [("send", 2, "FetchRequest")]
    ctx.elections.note_leader_contact(5, 1_000)

    follower.fetch_failed(1, 2, "timed out", sent_epoch=5, now_ms=1_100)
    assert follower.fetch_deadline_ms == 1_000 + CONFIG.fetch_timeout_ms
    assert ctx.elections.heard_from_leader_recently(5, 1_100)

    follower.poll(1_150)  # retried after the back-off
    follower.fetch_failed(2, 2, "ConnectionResetError: reset by peer", sent_epoch=5, now_ms=1_200)
    t = CONFIG.election_timeout_ms
    assert 1_200 + t // 10 <= follower.fetch_deadline_ms <= 1_200 + t // 2
    assert not ctx.elections.heard_from_leader_recently(5, 1_200)
    assert [a[0] for a in ctx.asked] == ["send", "send"]  # nothing else was asked of the owner


def test_no_role_module_names_the_core():
    """The role modules reach their owner only through their context: none
    of them imports the core module or names QuorumCore in its code (the
    owner's own modules -- core, inbound -- do)."""
    import ast
    import pathlib

    quorum = pathlib.Path(__file__).resolve().parents[2] / "broker" / "quorum"
    for name in ("roles", "election", "follower", "leader", "leader_reads", "notify", "membership", "progress"):
        tree = ast.parse((quorum / f"{name}.py").read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        named = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        assert "metalog.broker.quorum.core" not in imported, name
        assert "QuorumCore" not in named, name
