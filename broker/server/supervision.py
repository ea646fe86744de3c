"""Fail-stop for what runs beside the loop's callbacks (issue 12).

An exception escaping a background task, or one asyncio reports nobody
retrieved, is a fatal error of the broker (``Broker.fail``: one structured
``fatal`` event, exit code 4), not a line on stderr. A peer going away under
a transport is the connection code's business, and one connection's error
closes that connection only.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Coroutine, Protocol

from metalog.broker.net.channel import NetError
from metalog.protocol.kafka.framing import ProtocolError


class Fail(Protocol):
    def __call__(self, cause: str, reason: str, exc: BaseException | None = None, **fields: Any) -> None: ...


class BackgroundTasks:
    """The broker's background tasks (awaiting peers' answers, stopping after a
    failure ...), bounded by the requests in flight; a task's exception is fatal."""

    def __init__(self, fail: Fail):
        self._fail = fail
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self.done)

    def done(self, task: asyncio.Task[Any]) -> None:
        """Every background task's end (also of tasks the broker keeps itself)."""
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            name = getattr(task.get_coro(), "__qualname__", task.get_name())
            self._fail("task_failed", f"background task {name} failed: {type(exc).__name__}: {exc}", exc=exc)

    async def drain(self, timeout_s: float) -> None:
        """Wait for the tasks running now to end, at most `timeout_s`."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)

    def cancel(self) -> None:
        """Cancel every task but the one calling (stop() itself runs as one after a failure)."""
        me = asyncio.current_task()
        for task in list(self._tasks):
            if task is not me:
                task.cancel()


def loop_exception_handler(log: Any, fail: Fail) -> Callable[[asyncio.AbstractEventLoop, dict[str, Any]], None]:
    """asyncio's handler for exceptions nobody retrieved."""

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        message = context.get("message", "")
        if isinstance(exc, (ConnectionError, NetError, ProtocolError, asyncio.CancelledError)):
            # A peer going away under a transport: the connection code owns it.
            log.warning("loop_connection_error", message=message, error=repr(exc))
            return
        if "protocol" in context or "transport" in context:
            # One connection's error (e.g. a malformed frame under TLS, which
            # uvloop reports here): that transport is closed; the broker goes on.
            log.error("connection_error", message=message, error=repr(exc),
                      error_type=type(exc).__name__ if exc else None)
            return
        fail("unhandled_exception", f"{message}: {exc!r}" if exc else message, exc=exc)

    return handle
