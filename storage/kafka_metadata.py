"""Kafka's metadata record framing (ApiMessageAndVersion), the start of issue 17 item 3.

Kafka's MetadataRecordSerde frames every metadata record value as::

    frame version uvarint (=1) | api key uvarint | version uvarint | body

with the body in Kafka's message encoding of that record's schema
(metadata/*.json in Kafka: flexible versions get compact fields and a
tagged-field section, non-flexible ones fixed-width fields only). This module
has the framing and the bodies of the first record types; the log does not
write them yet (storage.metadata_records still frames values as
``api_key i16 | version i16 | msgpack``). Left to do: every other type we
share with Kafka, switching the controller's writer and every reader, and
converting version-2 data dirs in ``metalog storage upgrade``.
"""

from __future__ import annotations

import struct

from storage import kafka_flexible as kf
from storage import metadata_records as mr

FRAME_VERSION = 1
_I32_I64 = struct.Struct(">iq")


class KafkaMetadataError(ValueError):
    """Bytes that are not a framed Kafka metadata record we can read."""


def encode_frame(api_key: int, version: int, body: bytes) -> bytes:
    w = kf.Writer()
    w.uvarint(FRAME_VERSION)
    w.uvarint(api_key)
    w.uvarint(version)
    return w.bytes() + body


def decode_frame(value: bytes) -> tuple[int, int, bytes]:
    """(api key, version, body); KafkaMetadataError on a bad frame."""
    r = kf.Reader(bytes(value))
    try:
        frame = r.uvarint()
        if frame != FRAME_VERSION:
            raise KafkaMetadataError(f"frame version {frame} (expected {FRAME_VERSION})")
        api_key, version = r.uvarint(), r.uvarint()
    except kf.FlexibleDecodeError as exc:
        raise KafkaMetadataError(f"bad ApiMessageAndVersion frame: {exc}") from None
    return api_key, version, r.data[r.pos:]


def _broker_epoch_body(rec: mr.FenceBroker | mr.UnfenceBroker) -> bytes:
    # FenceBrokerRecord / UnfenceBrokerRecord v0, not flexible: Id int32, Epoch int64.
    return _I32_I64.pack(rec.id, rec.epoch)


_ENCODERS = {
    mr.FenceBroker: (mr.FENCE_BROKER, _broker_epoch_body),
    mr.UnfenceBroker: (mr.UNFENCE_BROKER, _broker_epoch_body),
    mr.NoOp: (mr.NO_OP, lambda rec: b"\x00"),  # NoOpRecord v0, flexible: no fields, no tagged fields
}


def encode_kafka_record(rec: mr.MetadataRecord) -> bytes:
    """Kafka's bytes of `rec` (version 0), for the types this module knows."""
    entry = _ENCODERS.get(type(rec))
    if entry is None:
        raise TypeError(f"{type(rec).__name__} has no Kafka encoding here yet")
    api_key, body = entry
    return encode_frame(api_key, 0, body(rec))


def decode_kafka_record(value: bytes) -> mr.MetadataRecord:
    api_key, version, body = decode_frame(value)
    if version != 0:
        raise KafkaMetadataError(f"unsupported version {version} of api key {api_key}")
    if api_key in (mr.FENCE_BROKER, mr.UNFENCE_BROKER):
        if len(body) != _I32_I64.size:
            raise KafkaMetadataError(f"{mr.record_type_name(api_key)} body of {len(body)} bytes "
                                     f"(expected {_I32_I64.size})")
        broker_id, epoch = _I32_I64.unpack(body)
        return (mr.FenceBroker if api_key == mr.FENCE_BROKER else mr.UnfenceBroker)(broker_id, epoch)
    if api_key == mr.NO_OP:
        r = kf.Reader(body)
        try:
            r.skip_tagged_fields()
            r.end()
        except kf.FlexibleDecodeError as exc:
            raise KafkaMetadataError(f"bad NoOpRecord body: {exc}") from None
        return mr.NoOp()
    raise KafkaMetadataError(f"api key {api_key} has no Kafka decoding here yet")
