"""Invariants that hold in production: an ``assert`` vanishes under
``python -O``, these do not.

    invariant(new_epoch >= old_epoch, "epoch would go back from %d to %d", old_epoch, new_epoch)

The message is formatted only when the check fails, so a hot path pays for
one truth test. Where a type checker must learn from the check (an
``isinstance`` narrowing), write it out instead:

    if not isinstance(st, LeaderState):
        raise InvariantViolation(f"serving a leader's read as {st.role}")

``InvariantViolation`` is an ``AssertionError``: code that treats a broken
invariant as a bug (the simulator's checker, the tests) keeps catching it.
It lives in the lowest layer so that every room can use the one helper.
"""

from __future__ import annotations


class InvariantViolation(AssertionError):
    """A condition the code relies on does not hold: a bug, never bad input
    (bad input gets its own error, with what the user should do)."""


def invariant(condition: object, message: str = "invariant violated", *args: object) -> None:
    if not condition:
        raise InvariantViolation(message % args if args else message)
