"""Kafka brokers' blocks of producer ids: AllocateProducerIds (api 67) as
Kafka's active controller answers it (ProducerIdControlManager).

A Kafka broker hands its idempotent and transactional producers ids from a
block its controller gave it, and asks for the next block when one runs out.
The controller answers from the log: every block is one ProducerIdsRecord
(metadata record type 15: BrokerId, BrokerEpoch, NextProducerId) committed
before the answer leaves, and the next block starts at the NextProducerId
of the last such record. Blocks are ``BLOCK_SIZE`` (Kafka's
ProducerIdsBlock.PRODUCER_ID_BLOCK_SIZE) ids from 0 up; the command queue
runs one command at a time against a state that holds the whole log, so no
two blocks can overlap, across leaders too (a new leader replays the
records, or the snapshot's one record, before it answers).

Kafka's rules: the asking broker must be registered with that broker epoch
(else STALE_BROKER_EPOCH). Blocks stay below 2**32 (``BLOCKS_END``): the
ids metalog's own leaders hand out are ``leader_epoch * 2**32 + n`` with
epochs from 1 (broker/server/idempotence.py), so the two never meet; past
it the answer is UNKNOWN_SERVER_ERROR, as Kafka answers an exhausted space.

``next_producer_id`` lives on the controller state (``ControllerState``),
is replayed from the records here (``replay``) and written to snapshots as
one record (``snapshot_record``, BrokerId and BrokerEpoch -1, as Kafka's
ProducerIdsImage writes it).
"""

from __future__ import annotations

import struct
from typing import Any, Mapping, Protocol

from metalog.protocol.errors import Errors
from metalog.storage import metadata_records as r

RECORD_TYPE = 15  # ProducerIdsRecord
RECORD_VERSION = 0
BLOCK_SIZE = 1000
BLOCKS_END = 1 << 32
_BODY = struct.Struct(">iqq")  # BrokerId, BrokerEpoch, NextProducerId; then the (empty) tagged fields


class BlockError(ValueError):
    """A refusal: the message and Kafka's error code."""

    def __init__(self, message: str, error_code: int):
        super().__init__(message)
        self.error_code = error_code


class _State(Protocol):
    next_producer_id: int

    @property
    def brokers(self) -> Mapping[int, Any]: ...  # broker id -> RegisterBroker (its broker_epoch)


def record(broker_id: int, broker_epoch: int, next_producer_id: int) -> r.UnknownRecord:
    """A ProducerIdsRecord v0 (a type the record codec keeps whole)."""
    return r.UnknownRecord(RECORD_TYPE, RECORD_VERSION, _BODY.pack(broker_id, broker_epoch, next_producer_id) + b"\0")


def decode(raw: bytes) -> tuple[int, int, int]:
    """(broker id, broker epoch, next producer id) of a v0 body; ValueError if it is not one."""
    if len(raw) < _BODY.size + 1:
        raise ValueError(f"ProducerIdsRecord of {len(raw)} bytes (v0 takes {_BODY.size + 1})")
    broker_id, epoch, next_id = _BODY.unpack_from(raw, 0)
    return broker_id, epoch, next_id


def replay(state: _State, rec: r.UnknownRecord) -> str | None:
    """Apply a ProducerIdsRecord to `state`; the reason it is invalid, or None.
    As Kafka's replay: the next producer id only moves forward."""
    try:
        _broker_id, _epoch, next_id = decode(rec.raw)
    except ValueError as exc:
        return str(exc)
    if next_id <= state.next_producer_id:
        return (f"ProducerIdsRecord next producer id {next_id} does not move past "
                f"{state.next_producer_id}")
    state.next_producer_id = next_id
    return None


def snapshot_record(state: _State) -> r.UnknownRecord | None:
    """The one record a snapshot carries (None before the first block)."""
    return record(-1, -1, state.next_producer_id) if state.next_producer_id > 0 else None


def allocate(state: _State, args: Mapping[str, Any]) -> tuple[list[bytes], dict[str, Any]]:
    """AllocateProducerIds: (records, {"producer_id_start", "producer_id_len"})
    or BlockError. `args`: broker_id, broker_epoch."""
    broker_id, epoch = int(args["broker_id"]), int(args["broker_epoch"])
    registered = state.brokers.get(broker_id)
    if registered is None or registered.broker_epoch != epoch:
        have = "not registered" if registered is None else f"registered with epoch {registered.broker_epoch}"
        raise BlockError(f"broker {broker_id} asked for producer ids with epoch {epoch}, but is {have}",
                         Errors.STALE_BROKER_EPOCH)
    start = state.next_producer_id
    if start + BLOCK_SIZE > BLOCKS_END:
        raise BlockError(f"producer ids for Kafka brokers are exhausted (blocks end at {BLOCKS_END}, where "
                         f"metalog's own producer ids begin)", Errors.UNKNOWN_SERVER_ERROR)
    return ([r.encode_record(record(broker_id, epoch, start + BLOCK_SIZE))],
            {"producer_id_start": start, "producer_id_len": BLOCK_SIZE})
