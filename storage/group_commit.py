"""Group commit of client writes: when queued records become one append.

Sans-IO policy the runtime drives (no asyncio, no clock): the runtime owns
the timers and the fsyncs and tells the policy what happened; the
policy keeps the queue and says what to do next.

Adaptive by default (``linger_ms`` = 0): while the disk is idle a write is
appended at the end of the event-loop turn it arrived in (everything read in
that turn joins it); while an fdatasync runs, writes wait and go out as one
batch when it completes, and one fdatasync covers every append before it.
A writer alone (the last batch held one request) is not kept for the rest
of the turn: its write is appended once the read that carried it is done
(the frames read with it join it), at most once a turn. The rest of a turn
is other connections' reads and due timers, a peer's Fetch among them: one
client's commit waited behind them (docs/bench.md).
``linger_ms`` > 0 replaces that with a fixed window. ``batch_records_max``
records end a batch at once. Flushes never overlap: a flush asked for while
one runs is remembered and run right after it.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from metalog.protocol.invariants import InvariantViolation, invariant

# Whatever the driver hands in with a write to recognise it when it is taken
# (the runtime's connection and correlation id); the policy never looks
# inside. A driver names it (GroupCommit[Token]); one that does not gets Any,
# as before the class was generic (PEP 696 default, seen by the type checker
# only: typing.TypeVar takes no default before Python 3.13).
if TYPE_CHECKING:
    from typing_extensions import TypeVar as _TypeVarWithDefault

    TokenT = _TypeVarWithDefault("TokenT", default=Any)
else:
    TokenT = TypeVar("TokenT")


class Arm(enum.Enum):
    """What `offer` asks the driver to do."""

    APPEND_NOW = "append_now"  # call take() and append right away
    END_OF_READ = "end_of_read"  # call take() once the read that carried it is done; then turn_ended() next turn
    END_OF_TURN = "end_of_turn"  # call take() at the end of this event-loop turn
    LINGER = "linger"  # call take() after linger_ms
    WAIT = "wait"  # nothing: a timer is armed already, or the running flush's completion takes it


class GroupCommit(Generic[TokenT]):
    def __init__(self, linger_ms: float, batch_records_max: int):
        invariant(linger_ms >= 0 and batch_records_max > 0, "linger_ms %r, batch_records_max %r",
                  linger_ms, batch_records_max)
        self.linger_ms = linger_ms
        self.batch_records_max = batch_records_max
        self._pending: list[tuple[TokenT, list[bytes]]] = []
        self.pending_records = 0
        self._armed = False  # the driver holds a linger timer or end-of-turn callback for take()
        self._lone = True  # the last batch held one request (nobody else writes): the next needs no turn's wait
        self._read_given = False  # END_OF_READ was given this turn (turn_ended() clears it)
        self.flush_running = False
        self._flush_wanted = False

    # -- client writes -----------------------------------------------------
    def offer(self, token: TokenT, records: list[bytes]) -> Arm:
        """Queue one request's records (bounded by the connections' in-flight
        limits and by batch_records_max, which empties the queue)."""
        if not records:
            raise InvariantViolation("an empty write is refused before it is queued")
        self._pending.append((token, records))
        self.pending_records += len(records)
        if self.pending_records >= self.batch_records_max:
            return Arm.APPEND_NOW
        if self._armed:
            return Arm.WAIT
        if self.linger_ms > 0:
            self._armed = True
            return Arm.LINGER
        if self.flush_running:
            return Arm.WAIT  # the disk is busy: flush_completed() releases the batch
        self._armed = True
        if self._lone and not self._read_given:
            self._read_given = True
            return Arm.END_OF_READ
        return Arm.END_OF_TURN

    def turn_ended(self) -> None:
        """The event-loop turn that was given END_OF_READ is over: the next
        lone writer may have one too."""
        self._read_given = False

    def take(self) -> tuple[list[tuple[TokenT, int]], list[bytes]] | None:
        """Everything queued as one batch: (waiters as (token, record count),
        records), or None if nothing is queued. Disarms: the driver cancels
        its timer if one is still pending."""
        self._armed = False
        if not self._pending:
            return None
        pending, self._pending = self._pending, []
        self.pending_records = 0
        self._lone = len(pending) == 1
        waiters = [(token, len(recs)) for token, recs in pending]
        records = [r for _token, recs in pending for r in recs]
        return waiters, records

    def drop_all(self) -> list[TokenT]:
        """Forget every queued write (the disk failed); their tokens, to answer."""
        tokens = [token for token, _recs in self._pending]
        self._pending = []
        self.pending_records = 0
        self._armed = False
        return tokens

    # -- flushes -------------------------------------------------------------
    def request_flush(self) -> bool:
        """The core asked for a flush. True: start one now; False: one runs,
        it runs again when it completes."""
        if self.flush_running:
            self._flush_wanted = True
            return False
        self.flush_running = True
        return True

    def flush_starting(self) -> None:
        """A flush begins: it covers every append made before this point."""
        invariant(self.flush_running, "flush_starting without a flush granted by want_flush")
        self._flush_wanted = False

    def flush_completed(self) -> bool:
        """The flush is durable (and fed to the core). True: the writes that
        waited for it should be appended now, as one batch."""
        return bool(self._pending) and not self._armed

    def flush_again(self) -> bool:
        """After flush_completed's batch (if any) was appended: True to flush
        again (appends came in meanwhile), else the flusher stops."""
        if self._flush_wanted:
            return True
        self.flush_running = False
        return False

    def flush_stopped(self) -> None:
        """The flusher ended without completing (failure, shutdown)."""
        self.flush_running = False
