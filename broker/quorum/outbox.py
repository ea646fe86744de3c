"""Outbound machinery of the core: the step's action list, request ids, the
requests awaiting an answer, and how long each kind of request may take."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from metalog.broker.quorum.api import Action, QuorumConfig, Respond, SendRequest
from metalog.protocol import messages as m


class RequestKind(enum.Enum):
    FETCH = "fetch"
    EPOCH_CHECK = "epoch_check"  # OffsetsForLeaderEpoch before fetching (KIP-320)
    FETCH_SNAPSHOT = "fetch_snapshot"
    VOTE = "vote"
    PRE_VOTE = "pre_vote"  # KIP-996: Vote with pre_vote=true, nothing bumped or persisted
    PROBE = "probe"  # a quarantined voter's VoteRequest that nobody grants
    BEGIN = "begin"  # BeginQuorumEpoch
    END = "end"  # EndQuorumEpoch
    MEMBERSHIP = "membership"  # our own entry: UpdateRaftVoter (KIP-853), auto-join (KIP-1186)


# Pause before re-sending a failed Fetch / BeginQuorumEpoch / EndQuorumEpoch.
RETRY_BACKOFF_MS = 50

# The follower's fetch loop (one request in flight at a time).
FETCH_LOOP = frozenset({RequestKind.FETCH, RequestKind.EPOCH_CHECK, RequestKind.FETCH_SNAPSHOT})
# A leader's or resigned leader's notifications, re-sent until acknowledged.
NOTIFICATIONS = frozenset({RequestKind.BEGIN, RequestKind.END})


@dataclass(slots=True)
class Outstanding:
    kind: RequestKind
    epoch: int  # our epoch when the request was sent (KAFKA-7786)
    destination: int
    position: int = 0  # FETCH_SNAPSHOT: the requested position


def request_timeout_ms(cfg: QuorumConfig, kind: RequestKind) -> int:
    """The fetch loop's requests give up well before the fetch timeout, so a
    single lost request or answer is retried instead of costing an election:
    with request timeout = fetch timeout (2 s each by default) one lost
    message made the follower stand (sim: endless elections at 2 % loss).
    A Fetch may be parked for fetch_max_wait_ms, hence its allowance."""
    if kind is RequestKind.FETCH:
        return min(cfg.request_timeout_ms, cfg.fetch_max_wait_ms + cfg.fetch_timeout_ms // 4)
    if kind in (RequestKind.EPOCH_CHECK, RequestKind.FETCH_SNAPSHOT):
        return min(cfg.request_timeout_ms, cfg.fetch_timeout_ms // 4)
    if kind in (RequestKind.VOTE, RequestKind.PRE_VOTE):
        # An unanswered (pre-)vote is asked again (the round's `retry_failed`)
        # well before the election timer ends the round: one lost message
        # cost a whole election timeout and put silent failovers over 3 s
        # (sim seed 20251).
        return min(cfg.request_timeout_ms, cfg.election_timeout_ms // 4)
    if kind in NOTIFICATIONS:
        # A voter learns the new leader only from BeginQuorumEpoch: a lost one
        # must be re-sent before the voter's election timer (>= the election
        # timeout) makes it stand and depose the leader (sim seed 6059).
        return min(cfg.request_timeout_ms, cfg.election_timeout_ms // 2)
    return cfg.request_timeout_ms


class Outbox:
    """What the current step returns, in order, and the requests in flight."""

    __slots__ = ("actions", "outstanding", "_next_request_id", "_timeout_ms")

    def __init__(self, cfg: QuorumConfig, first_request_id: int):
        self.actions: list[Action] = []
        self.outstanding: dict[int, Outstanding] = {}
        self._next_request_id = first_request_id
        self._timeout_ms = {k: request_timeout_ms(cfg, k) for k in RequestKind}

    def take(self) -> list[Action]:
        out, self.actions = self.actions, []
        return out

    def send(self, destination: int, body: m.Body, kind: RequestKind, epoch: int, position: int = 0) -> int:
        rid = self._next_request_id
        self._next_request_id += 1
        self.outstanding[rid] = Outstanding(kind, epoch, destination, position)
        self.actions.append(SendRequest(destination, rid, body, self._timeout_ms[kind]))
        return rid

    def settle(self, request_id: int) -> Outstanding | None:
        """The request's answer or failure arrived: forget it (None if unknown)."""
        return self.outstanding.pop(request_id, None)

    def respond(self, token: Any, body: m.Body) -> None:
        self.actions.append(Respond(token, body))
