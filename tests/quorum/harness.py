"""Tiny single-node harness for the quorum core's unit tests.

``MemLog`` is an in-memory LogReader (a dict of encoded batches) that applies
the core's log actions; ``Node`` wraps a core and its log so that a test can
feed events one at a time and inspect the returned actions. No network: tests
play the peers by hand.
"""

from __future__ import annotations

import random
from typing import Any

from metalog.broker.quorum import api as a
from metalog.broker.quorum.core import QuorumCore
from metalog.broker.quorum.env import Environment
from metalog.protocol import messages as m
from metalog.storage.batch import encode_batch

CLUSTER = "test-cluster"


class MemLog:
    def __init__(self) -> None:
        self.batches: dict[int, tuple[bytes, int]] = {}  # base offset -> (data, next offset)
        self.snapshots: dict[m.SnapshotId, bytes] = {}
        self.start = 0

    def read(self, start_offset: int, end_offset: int, max_bytes: int) -> bytes:
        out = b""
        for base in sorted(self.batches):
            data, nxt = self.batches[base]
            if nxt <= start_offset or base < self.start:
                continue
            if nxt > end_offset:
                break
            if out and len(out) + len(data) > max_bytes:
                break
            out += data
        return out

    def snapshot_size(self, snapshot_id: m.SnapshotId) -> int | None:
        data = self.snapshots.get(snapshot_id)
        return None if data is None else len(data)

    def read_snapshot(self, snapshot_id: m.SnapshotId, position: int, max_bytes: int) -> bytes:
        return self.snapshots[snapshot_id][position:position + max_bytes]

    def append(self, data: bytes, base: int, nxt: int) -> None:
        self.batches[base] = (data, nxt)

    def apply(self, action: Any) -> None:
        if isinstance(action, a.AppendBatches):
            self.append(action.data, action.base_offset, action.next_offset)
        elif isinstance(action, a.TruncateLog):
            self.batches = {b: v for b, v in self.batches.items() if b < action.end_offset}
        elif isinstance(action, a.AdvanceLogStart):
            self.start = action.log_start_offset


class ManualClock:
    """The tests play the driver: they stamp events by hand, never from here."""

    def now_ms(self) -> int:
        raise AssertionError("the core must take time from its events, not from the clock")

    def wall_clock_ms(self) -> int:
        raise AssertionError("the core must take time from its events, not from the clock")


def config(node_id: int, voters=(1, 2, 3), **kw) -> a.QuorumConfig:
    return a.QuorumConfig(node_id=node_id, voters=tuple(voters), cluster_id=CLUSTER, **kw)


class Node:
    def __init__(self, node_id: int, voters=(1, 2, 3), log: MemLog | None = None,
                 view: a.LogView | None = None, state: a.QuorumStateData | None = None,
                 seed: int = 0, **kw):
        self.log = log or MemLog()
        self.core = QuorumCore(config(node_id, voters, **kw), view or a.LogView(), self.log,
                               state, Environment(ManualClock(), random.Random(seed)))

    def step(self, event) -> list:
        actions = self.core.step(event)
        for act in actions:
            self.log.apply(act)
        return actions


def of(actions, cls) -> list:
    return [x for x in actions if isinstance(x, cls)]


def sent(actions, body_cls=None) -> list[a.SendRequest]:
    return [x for x in actions if isinstance(x, a.SendRequest)
            and (body_cls is None or isinstance(x.request, body_cls))]


def responses(actions, token=None) -> list:
    return [x.response for x in actions if isinstance(x, a.Respond) and (token is None or x.token == token)]


def one_response(actions, token):
    rs = responses(actions, token)
    assert len(rs) == 1, f"expected one answer to {token!r}, got {rs!r}"
    return rs[0]


def grant_pre_votes(node: Node, now: int, acts: list) -> list:
    """`node` is prospective and `acts` hold its pre-votes: every voter grants
    (answers naming no leader, in the node's epoch) until it stands. Returns
    the actions of the step that made it a candidate."""
    assert node.core.role == "prospective", node.core.role
    pre = [s for s in sent(acts, m.VoteRequest) if s.request.pre_vote]
    assert pre, "a prospective sends pre-votes"
    for s in pre:
        out = node.step(a.ResponseReceived(now, s.request_id, s.destination, m.VoteResponse(
            leader_id=-1, leader_epoch=node.core.epoch, vote_granted=True)))
        if node.core.role != "prospective":
            return out
    raise AssertionError(f"still {node.core.role} after every pre-vote was granted")


def stand(node: Node, now: int, acts: list | None = None) -> list:
    """Let `node`'s timer run out at `now` (or use `acts`, the actions of the
    step that made it prospective) and win the pre-vote: the candidate's
    actions (its VoteRequests)."""
    if acts is None:
        acts = node.step(a.Tick(now))
    return grant_pre_votes(node, now, acts)


def make_leader(node: Node, now: int = 0) -> int:
    """Drive `node` through an election it wins; returns the time reached."""
    node.step(a.Tick(now))
    deadline = node.core.next_deadline_ms
    now = max(now, deadline)
    acts = stand(node, now)
    votes = sent(acts, m.VoteRequest)
    assert node.core.role == "candidate", node.core.role
    for s in votes:
        node.step(a.ResponseReceived(now, s.request_id, s.destination, m.VoteResponse(
            leader_id=-1, leader_epoch=node.core.epoch, vote_granted=True)))
        if node.core.role == "leader":
            break
    assert node.core.role == "leader"
    node.step(a.FlushCompleted(now, node.core.log_end_offset))
    return now


def fetch(node: Node, now: int, replica_id: int, offset: int, last_epoch: int, *,
          epoch: int | None = None, max_wait_ms: int = 0, token: Any = "f",
          directory_id: str = m.NO_DIRECTORY_ID) -> list:
    req = m.FetchRequest(
        cluster_id=CLUSTER, replica_id=replica_id, max_wait_ms=max_wait_ms,
        current_leader_epoch=node.core.epoch if epoch is None else epoch,
        fetch_offset=offset, last_fetched_epoch=last_epoch, replica_directory_id=directory_id,
    )
    return node.step(a.RequestReceived(now, token, req))


def append(node: Node, now: int, n: int, token: Any = "p") -> list:
    return node.step(a.ClientAppend(now, [a.AppendWaiter(token, n)], [b"r%d" % i for i in range(n)]))


def batch(base: int, epoch: int, n: int, ts: int = 0) -> bytes:
    return encode_batch(base, epoch, [b"x%d" % i for i in range(n)], ts)
