"""A KRaft metadata dir in Kafka's exact layout, written without our encoders.

There is no Kafka install here, so this builds what a one-node Kafka KRaft
controller leaves on disk: ``meta.properties`` as Kafka writes it (a
timestamp comment, ``version=1``, no metalog key), ``__cluster_metadata-0/``
with ``00000000000000000000.log`` (and its ``.index``/``.timeindex``),
``leader-epoch-checkpoint``, Kafka's ``quorum-state`` JSON and a
``<offset>-<epoch>.checkpoint`` snapshot. Batches come from kafka-python's
record-batch builder (the control bit, which kafka-python leaves to brokers,
set by a subclass; base offset and leader epoch, outside the CRC, patched in
as Kafka's log does on append), control record values from kio's entities
(generated from Kafka's schemas), and metadata record values from
tests/formats/schemas' interpreter of Kafka's own JSON schemas; nothing here
calls storage/. It includes record types we do not model (ProducerIdsRecord,
BrokerRegistrationChangeRecord), as a real Kafka log does.
"""

from __future__ import annotations

import io
import os
import struct
import uuid

from kafka.record.default_records import DefaultRecordBatchBuilder
from kio.schema.leader_change_message.v0.data import LeaderChangeMessage, Voter
from kio.schema.snapshot_footer_record.v0.data import SnapshotFooterRecord
from kio.schema.snapshot_header_record.v0.data import SnapshotHeaderRecord
from kio.serial import entity_writer

from tests.formats.schemas import kafka_schema as ks

PART = "__cluster_metadata-0"
CLUSTER_ID = "MkU3OEVBNTcwNTJENDM2Qg"  # the example id of Kafka's quickstart
DIRECTORY_ID = "J8aAPcfLQt2bqs1JT_rMgQ"
TS = 1_732_000_000_000
TOPIC_ID = uuid.UUID("7a4e2c1b-9d3f-4e5a-8b6c-0d1e2f3a4b5c")
INCARNATIONS = {1: uuid.UUID("11111111-2222-4333-8444-555555555555"),
                2: uuid.UUID("66666666-7777-4888-9999-aaaaaaaaaaaa")}
SNAPSHOT_END = 9  # the snapshot holds the state of offsets < 9
# Control record keys: version i16, type i16 (LeaderChange 2, SnapshotHeader 3, SnapshotFooter 4).
_KEY = struct.Struct(">hh")


class _ControlBatchBuilder(DefaultRecordBatchBuilder):
    """kafka-python's builder, with the control attribute bit set."""

    def _get_attributes(self, include_compression_type=True):
        return super()._get_attributes(include_compression_type) | self.CONTROL_MASK


def _kio(entity) -> bytes:
    buf = io.BytesIO()
    entity_writer(type(entity))(buf, entity)
    return buf.getvalue()


def kafka_batch(base_offset: int, epoch: int, records: list[tuple[bytes | None, bytes]],
                control: bool = False) -> bytes:
    cls = _ControlBatchBuilder if control else DefaultRecordBatchBuilder
    builder = cls(2, 0, False, -1, -1, -1, 1 << 20)
    for i, (key, value) in enumerate(records):
        assert builder.append(i, TS + base_offset, key, value, []) is not None
    raw = bytearray(builder.build())
    struct.pack_into(">q", raw, 0, base_offset)  # baseOffset and partitionLeaderEpoch are
    struct.pack_into(">i", raw, 12, epoch)  # outside the CRC (it starts at attributes)
    return bytes(raw)


def rec(schema: str, version: int = 0, **fields) -> bytes:
    return ks.write(ks.load(schema), fields, version)


def _register(broker_id: int) -> bytes:
    return rec("RegisterBrokerRecord", 3, BrokerId=broker_id, IncarnationId=INCARNATIONS[broker_id].bytes,
               BrokerEpoch=broker_id + 1,
               EndPoints=[{"Name": "PLAINTEXT", "Host": "localhost", "Port": 9092 + broker_id,
                           "SecurityProtocol": 0}],
               Features=[{"Name": "metadata.version", "MinSupportedVersion": 1, "MaxSupportedVersion": 21}],
               Rack=None, Fenced=True, LogDirs=[uuid.UUID(int=broker_id).bytes])


def log_values() -> list[list[bytes]]:
    """The metadata record values of the log, batch by batch (offsets 1..)."""
    t = TOPIC_ID.bytes
    return [
        [rec("FeatureLevelRecord", Name="metadata.version", FeatureLevel=21), _register(1), _register(2)],
        [rec("UnfenceBrokerRecord", Id=1, Epoch=2), rec("UnfenceBrokerRecord", Id=2, Epoch=3),
         rec("ProducerIdsRecord", BrokerId=1, BrokerEpoch=2, NextProducerId=1000)],
        [rec("TopicRecord", Name="orders", TopicId=t),
         rec("PartitionRecord", 1, PartitionId=0, TopicId=t, Replicas=[1, 2], Isr=[1, 2], Leader=1,
             LeaderEpoch=0, PartitionEpoch=0, Directories=[uuid.UUID(int=1).bytes, uuid.UUID(int=2).bytes])],
        # -- the snapshot ends here (offset 9) --
        [rec("PartitionRecord", 1, PartitionId=1, TopicId=t, Replicas=[2, 1], Isr=[2, 1], Leader=2,
             LeaderEpoch=0, PartitionEpoch=0, Directories=[uuid.UUID(int=2).bytes, uuid.UUID(int=1).bytes]),
         rec("ConfigRecord", ResourceType=2, ResourceName="orders", Name="retention.ms", Value="86400000")],
        [rec("PartitionChangeRecord", PartitionId=1, TopicId=t, Isr=[2], Leader=2),
         rec("BrokerRegistrationChangeRecord", 2, BrokerId=1, BrokerEpoch=2, InControlledShutdown=1),
         rec("ProducerIdsRecord", BrokerId=1, BrokerEpoch=2, NextProducerId=2000),
         rec("NoOpRecord")],
        # Broker 2 fenced, as Kafka's controller writes it: the fence, then a
        # PartitionChange per partition it leaves (ISR shrink, leader moved or gone).
        [rec("FenceBrokerRecord", Id=2, Epoch=3),
         rec("PartitionChangeRecord", PartitionId=0, TopicId=t, Isr=[1]),
         rec("PartitionChangeRecord", PartitionId=1, TopicId=t, Leader=-1)],
    ]


def snapshot_values() -> list[bytes]:
    """The state at SNAPSHOT_END as Kafka's snapshot holds it (producer ids too)."""
    t = TOPIC_ID.bytes
    return [rec("FeatureLevelRecord", Name="metadata.version", FeatureLevel=21),
            rec("RegisterBrokerRecord", 3, BrokerId=1, IncarnationId=INCARNATIONS[1].bytes, BrokerEpoch=2,
                EndPoints=[{"Name": "PLAINTEXT", "Host": "localhost", "Port": 9093, "SecurityProtocol": 0}],
                Rack=None, Fenced=False, LogDirs=[uuid.UUID(int=1).bytes]),
            rec("RegisterBrokerRecord", 3, BrokerId=2, IncarnationId=INCARNATIONS[2].bytes, BrokerEpoch=3,
                EndPoints=[{"Name": "PLAINTEXT", "Host": "localhost", "Port": 9094, "SecurityProtocol": 0}],
                Rack=None, Fenced=False, LogDirs=[uuid.UUID(int=2).bytes]),
            rec("TopicRecord", Name="orders", TopicId=t),
            rec("PartitionRecord", 1, PartitionId=0, TopicId=t, Replicas=[1, 2], Isr=[1, 2], Leader=1,
                LeaderEpoch=0, PartitionEpoch=0, Directories=[uuid.UUID(int=1).bytes, uuid.UUID(int=2).bytes]),
            rec("ProducerIdsRecord", BrokerId=1, BrokerEpoch=2, NextProducerId=1000)]


def write_kafka_dir(data_dir: str) -> dict:
    """Write the dir; returns what it holds (offsets, counts) for the tests."""
    part = os.path.join(data_dir, PART)
    os.makedirs(part)
    with open(os.path.join(data_dir, "meta.properties"), "w") as fh:
        fh.write("#\n#Tue Nov 19 10:00:00 UTC 2024\n"
                 f"node.id=1\ndirectory.id={DIRECTORY_ID}\nversion=1\ncluster.id={CLUSTER_ID}\n")
    leader_change = _kio(LeaderChangeMessage(version=0, leader_id=1, voters=(Voter(voter_id=1),),
                                             granting_voters=(Voter(voter_id=1),)))
    seg = bytearray(kafka_batch(0, 1, [(_KEY.pack(0, 2), leader_change)], control=True))
    offset = 1
    for values in log_values():
        seg += kafka_batch(offset, 1, [(None, v) for v in values])
        offset += len(values)
    with open(os.path.join(part, "00000000000000000000.log"), "wb") as fh:
        fh.write(seg)
    # Empty, as after an unclean stop (Kafka rebuilds them). A clean close
    # leaves the active .timeindex one entry: LogSegment.close appends the
    # largest timestamp (TimeIndex.maybeAppend), which this fixture does not.
    for suffix in (".index", ".timeindex"):
        open(os.path.join(part, "00000000000000000000" + suffix), "wb").close()
    with open(os.path.join(part, "leader-epoch-checkpoint"), "w") as fh:
        fh.write("0\n1\n1 0\n")
    with open(os.path.join(part, "quorum-state"), "w") as fh:
        fh.write('{"clusterId":"","leaderId":1,"leaderEpoch":1,"votedId":-1,"appliedOffset":0,'
                 '"currentVoters":[{"voterId":1}],"data_version":0}')
    snap_values = snapshot_values()
    header = _kio(SnapshotHeaderRecord(version=0, last_contained_log_timestamp=TS + 8))
    footer = _kio(SnapshotFooterRecord(version=0))
    snap = (kafka_batch(0, 1, [(_KEY.pack(0, 3), header)], control=True)
            + kafka_batch(1, 1, [(None, v) for v in snap_values])
            + kafka_batch(1 + len(snap_values), 1, [(_KEY.pack(0, 4), footer)], control=True))
    name = f"{SNAPSHOT_END:020d}-{1:010d}.checkpoint"
    with open(os.path.join(part, name), "wb") as fh:
        fh.write(snap)
    return {"log_end_offset": offset, "snapshot": name, "snapshot_records": len(snap_values)}
