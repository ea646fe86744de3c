"""A real Kafka listener whose requests a test answers in flat bodies.

``serve_flat(host, port, handler)`` starts what a broker port is -- a
``KafkaConnection`` listener (``serve_kafka``) served by a ``KafkaDispatch``
-- with ``handler(conn, header, body)`` standing in for the broker's request
router: it sees each request as the flat body the router would
(``metalog.protocol.messages``; a produce as its ``PrebuiltProduce``) and
answers whenever it likes with ``conn.send_response(header.correlation_id,
flat_response)``. The bytes on the wire are Kafka's, in both directions, and
the answers leave in request order as Kafka's do. A handler may return a
coroutine (run as a task); one that raises gets Kafka's UNKNOWN_SERVER_ERROR
answer.
"""

from __future__ import annotations

import asyncio
import inspect
from types import SimpleNamespace

from metalog.broker.net.kafka_conn import KAFKA_INFLIGHT_PER_CONN_MAX, serve_kafka
from metalog.broker.server.kafka.dispatch import KafkaDispatch
from metalog.broker.server.produce import PrebuiltProduce
from metalog.protocol.kafka.framing import DEFAULT_FRAME_BYTES_MAX
from metalog.storage.batch import decode_full_records
from tests.net.helpers import ListLogger


class _HandlerRouter:
    def __init__(self, handler, log):
        self._handler = handler
        self._log = log
        self._tasks: set = set()

    def on_request(self, conn, header, body):
        result = self._handler(conn, header, body)
        if inspect.isawaitable(result):
            task = asyncio.ensure_future(result)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)


class _Endpoints:
    """The voter set as the dispatch reads it: where each node's CONTROLLER listener is, asked per request."""

    def __init__(self, endpoints):
        self._endpoints = endpoints
        self.voters: list[int] = []

    @property
    def voter_set(self):
        listeners = {nid: [("CONTROLLER", host, port)] for nid, (host, port) in self._endpoints().items()}
        return SimpleNamespace(endpoints=listeners)


async def serve_flat(host, port, handler, *, max_frame_bytes=DEFAULT_FRAME_BYTES_MAX,
                     max_inflight_per_conn=KAFKA_INFLIGHT_PER_CONN_MAX, logger=None, tls=None, limits=None,
                     node_id=1, cluster_id="c", endpoints=dict):
    """`endpoints()`: node id -> (host, port), the brokers a Metadata answer names (asked per request)."""
    log = logger if logger is not None else ListLogger()
    dispatch = KafkaDispatch(_HandlerRouter(handler, log), node_id=node_id, cluster_id=cluster_id,
                             listener_name="CONTROLLER", static_endpoints={}, core=_Endpoints(endpoints), logger=log)
    return await serve_kafka(host, port, dispatch, dispatch.supported(), max_frame_bytes=max_frame_bytes,
                             max_inflight_per_conn=max_inflight_per_conn, logger=log, tls=tls, limits=limits)


def values_of(body) -> list[bytes]:
    """The record values of a produce as the router sees it (a batch built by our client)."""
    if isinstance(body, PrebuiltProduce):
        return [r.value for r in decode_full_records(bytes(body.batch))]
    return list(body.records)
