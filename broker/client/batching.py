"""Concurrent produce calls of one client share requests, as Kafka's producers batch.

A Kafka producer (librdkafka, the Java client) never sends one request per
record: records wait in a per-partition batch while the connection has its
maximum of requests in flight, and leave together when a slot frees
(``linger.ms=0``: the first record of an idle producer leaves at once). The
leader's cost is mostly per request (decode, gate, step, answer), so one
application with many concurrent writers gets the throughput of batches
without adding latency when it is idle.

``ProduceBatcher`` does that for ``MetalogClient.produce``: calls queue here;
while fewer than ``inflight_max`` requests are out, the queued calls leave as
one request (whole calls, in arrival order, up to ``max_request_bytes``).
Each call's records stay consecutive in its request, so a call's answer is
its own first offset (the request's base offset plus the records of the
calls before it). A request that fails fails each of its calls with the
same error, and each of them "may or may not be stored", as a failed
request of its own was before. Calls larger than one request bypass this
(``MetalogClient.produce`` splits them and sends the parts in order).

Bounds: at most ``inflight_max`` requests out; the queue holds the calls
that are awaiting (each caller awaits its own), so it is bounded by the
application's concurrency, as Kafka's by ``buffer.memory``.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Awaitable, Callable

from metalog.broker.client.request_size import REQUEST_OVERHEAD_BYTES, records_cost_bytes

# Sends one request's records and answers (base offset, leader epoch) of its first record.
SendRecords = Callable[[list[bytes]], Awaitable[tuple[int, int]]]

# Requests a client has out at once by default: Kafka's idempotent producer
# allows 5 per connection; ours are spread over producers of their own (each
# with one request out), and 8 keeps a 1000-writer application's batches
# near 100 records while a lone writer's request always leaves at once.
PRODUCE_INFLIGHT_MAX = 8


class _Call:
    __slots__ = ("records", "cost_bytes", "answer")

    def __init__(self, records: list[bytes], answer: asyncio.Future[tuple[int, int]]):
        self.records = records
        self.cost_bytes = records_cost_bytes(records)
        self.answer = answer


class ProduceBatcher:
    """See the module docstring."""

    def __init__(self, send: SendRecords, max_request_bytes: int, inflight_max: int = PRODUCE_INFLIGHT_MAX):
        if inflight_max <= 0:
            raise ValueError(f"inflight_max must be > 0, got {inflight_max}")
        self._send = send
        self._budget_bytes = max_request_bytes - REQUEST_OVERHEAD_BYTES
        self._inflight_max = inflight_max
        self._queue: collections.deque[_Call] = collections.deque()
        self._inflight = 0
        self._tasks: set[asyncio.Task[None]] = set()  # strong references while requests are out
        self.requests_sent = 0  # requests that carried the calls (calls/requests: the batching)

    def fits(self, records: list[bytes]) -> bool:
        """Whether `records` fit in one request (else the caller splits them)."""
        return records_cost_bytes(records) <= self._budget_bytes

    async def produce(self, records: list[bytes]) -> tuple[int, int]:
        """Queue one call (records that fit in one request); (base offset, epoch) of its first record."""
        if not self._queue and self._inflight < self._inflight_max:
            # Alone with a slot free: the call is its request, sent from here rather than from a
            # task (whose start and whose answer cost a loop turn each on a lone writer's commit).
            # Calls arriving meanwhile queue and leave as slots free, as behind any request.
            self._inflight += 1
            self.requests_sent += 1
            try:
                return await self._send(records)
            finally:
                self._inflight -= 1
                self._start()
        answer: asyncio.Future[tuple[int, int]] = asyncio.get_running_loop().create_future()
        self._queue.append(_Call(records, answer))
        self._start()
        return await answer

    def _start(self) -> None:
        while self._queue and self._inflight < self._inflight_max:
            calls = self._take()
            if not calls:
                return
            self._inflight += 1
            self.requests_sent += 1
            task = asyncio.get_running_loop().create_task(self._request(calls))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _take(self) -> list[_Call]:
        """The queued calls of the next request: whole calls, in order, within the budget."""
        calls: list[_Call] = []
        size_bytes = 0
        queue = self._queue
        while queue:
            call = queue[0]
            if call.answer.done():  # its caller was cancelled while it waited: nothing of it is sent
                queue.popleft()
                continue
            if calls and size_bytes + call.cost_bytes > self._budget_bytes:
                break
            queue.popleft()
            calls.append(call)
            size_bytes += call.cost_bytes
        return calls

    async def _request(self, calls: list[_Call]) -> None:
        try:
            records = calls[0].records if len(calls) == 1 else [r for call in calls for r in call.records]
            base_offset, epoch = await self._send(records)
        except BaseException as exc:  # noqa: BLE001 - each caller gets the request's failure, cancellation too
            for call in calls:
                if call.answer.done():
                    continue
                if isinstance(exc, asyncio.CancelledError):
                    call.answer.cancel()
                else:
                    call.answer.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
        else:
            offset = base_offset
            for call in calls:
                if not call.answer.done():
                    call.answer.set_result((offset, epoch))
                offset += len(call.records)
        finally:
            self._inflight -= 1
            self._start()
