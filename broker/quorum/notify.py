"""BeginQuorumEpoch (a new leader) and EndQuorumEpoch (a resigned one) sent to
every other voter and re-sent until each acknowledges: a voter learns the
new leader, or that the old one left, from these."""

from __future__ import annotations

from collections.abc import Callable

from metalog.broker.quorum.outbox import RETRY_BACKOFF_MS, RequestKind
from metalog.protocol import messages as m


class Notifier:
    __slots__ = ("kind", "unacked", "inflight", "retry_at_ms")

    def __init__(self, kind: RequestKind, voters: tuple[int, ...], now_ms: int):
        self.kind = kind
        self.unacked = set(voters)  # not acknowledged yet
        self.inflight: dict[int, int] = {}  # voter -> request id
        self.retry_at_ms = {v: now_ms for v in voters}

    def send_due(self, now_ms: int, body: Callable[[int], m.Body],
                 send: Callable[[int, m.Body, RequestKind], int]) -> None:
        for v in sorted(self.unacked):
            if v in self.inflight or now_ms < self.retry_at_ms.get(v, 0):
                continue
            self.inflight[v] = send(v, body(v), self.kind)

    def deadlines(self, now_ms: int) -> list[int]:
        # Retries already due were sent by the last step; only future ones count.
        out = []
        for v in self.unacked:
            at_ms = self.retry_at_ms.get(v, 0)
            if v not in self.inflight and at_ms > now_ms:
                out.append(at_ms)
        return out

    def failed(self, voter: int, request_id: int, now_ms: int) -> None:
        if self.inflight.get(voter) == request_id:
            del self.inflight[voter]
            self.retry_at_ms[voter] = now_ms + RETRY_BACKOFF_MS

    def answered(self, voter: int, request_id: int) -> None:
        if self.inflight.get(voter) == request_id:
            del self.inflight[voter]

    def judged(self, voter: int, ok: bool, now_ms: int) -> None:
        """An answer sent in our epoch: acknowledged, or to be re-sent."""
        if ok:
            self.unacked.discard(voter)
        else:
            self.retry_at_ms[voter] = now_ms + RETRY_BACKOFF_MS


class NotifyingRole:
    """Mixin for the roles that notify (leader, resigned): the answers to
    their notifications go to their Notifier."""

    __slots__ = ()
    notifier: Notifier

    def notification_failed(self, voter: int, request_id: int, now_ms: int) -> None:
        self.notifier.failed(voter, request_id, now_ms)

    def notification_answered(self, voter: int, request_id: int) -> None:
        self.notifier.answered(voter, request_id)

    def notification_judged(self, voter: int, ok: bool, now_ms: int) -> None:
        self.notifier.judged(voter, ok, now_ms)
