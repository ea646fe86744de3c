"""metalog.broker.server.produce.ProducePath: when group commit's batches reach the core.

A lone writer's Produce is appended once the read that carried it is done
(the connection's answer scope, ``answer_writes``), not a loop turn later
behind other connections' reads and due timers; a second one in the same
turn waits for the turn's end, as every write did before."""

from __future__ import annotations

import asyncio

import structlog

from metalog.broker.net.kafka_conn import answer_writes
from metalog.broker.quorum import api as qa
from metalog.broker.server.idempotence import ProducerGuard
from metalog.broker.server.metrics import BrokerMetrics
from metalog.broker.server.produce import ProducePath
from metalog.protocol import messages as m
from metalog.storage.group_commit import GroupCommit
from metalog.storage.producer_state import ProducerStateTable


def _path(steps: list[qa.Event]) -> ProducePath:
    return ProducePath(1, None, GroupCommit(0, 100), ProducerGuard(60000), BrokerMetrics(node_id=1),
                       structlog.get_logger(), step=steps.append, failed=lambda: False,
                       committed_producers=lambda: ProducerStateTable(60000))


def _waiters(event: qa.Event) -> list[tuple[object, int]]:
    assert isinstance(event, qa.ClientAppend)
    return [tuple(w) for w in event.waiters]


def _produce(value: bytes) -> m.ProduceRequest:
    return m.ProduceRequest(cluster_id="c", records=[value])


async def test_a_lone_writers_produce_is_appended_when_its_read_ends_with_the_frames_read_with_it():
    steps: list[qa.Event] = []
    path = _path(steps)
    with answer_writes:  # one connection's read of its buffered frames
        path.enqueue(("conn-1", 1), _produce(b"a"))
        path.enqueue(("conn-1", 2), _produce(b"b"))
        assert steps == []  # the read is not over: its frames join one batch
    assert len(steps) == 1 and _waiters(steps[0]) == [(("conn-1", 1), 1), (("conn-1", 2), 1)]


async def test_after_a_busy_batch_or_a_second_lone_writer_in_a_turn_the_append_waits_for_the_turns_end():
    steps: list[qa.Event] = []
    path = _path(steps)
    with answer_writes:
        path.enqueue(("conn-1", 1), _produce(b"a"))
    assert len(steps) == 1  # lone: appended at the end of its read
    with answer_writes:  # a second connection's read in the same loop turn
        path.enqueue(("conn-2", 1), _produce(b"b"))
    with answer_writes:
        path.enqueue(("conn-3", 1), _produce(b"c"))
    assert len(steps) == 1  # both wait for the end of the turn and go out together
    await asyncio.sleep(0)  # one loop turn (the end-of-turn callback), not a stand-in for a condition
    assert len(steps) == 2 and _waiters(steps[1]) == [(("conn-2", 1), 1), (("conn-3", 1), 1)]
    with answer_writes:  # the last batch held two requests: writers are not alone
        path.enqueue(("conn-1", 2), _produce(b"d"))
    assert len(steps) == 2
    await asyncio.sleep(0)
    assert len(steps) == 3 and _waiters(steps[2]) == [(("conn-1", 2), 1)]
    with answer_writes:  # a lone writer in a new turn: at the end of its read again
        path.enqueue(("conn-1", 3), _produce(b"e"))
    assert len(steps) == 4
