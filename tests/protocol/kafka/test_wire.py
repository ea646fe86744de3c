"""Whole frames (headers + bodies) against kafka-python's protocol classes,
a second codec we did not write; the ApiVersions fallback; error answers."""

from __future__ import annotations

from kafka.protocol.metadata.api_versions import ApiVersionsResponse as KpApiVersionsResponse
from kafka.protocol.metadata.metadata import MetadataRequest as KpMetadataRequest
from kafka.protocol.metadata.metadata import MetadataResponse as KpMetadataResponse

from metalog.protocol.kafka import messages as m
from metalog.protocol.kafka import wire

SUPPORTED = {18: (0, 4), 3: (0, 13), 1: (4, 17), 0: (3, 10), 52: (0, 2)}


def test_request_frames_both_ways_with_kafka_python():
    for version in (1, 8, 9, 13):  # header v1 and v2, both sides of the flexible line
        theirs = KpMetadataRequest(version=version, topics=[KpMetadataRequest.MetadataRequestTopic(name="t1")],
                                   allow_auto_topic_creation=False)
        theirs.with_header(correlation_id=77, client_id="kafka-python")
        header, body = wire.decode_request(theirs.encode(header=True, framed=True)[4:], SUPPORTED)
        assert header == wire.RequestHeader(3, version, 77, "kafka-python")
        assert isinstance(body, m.MetadataRequest)
        assert [t.name for t in body.topics or []] == ["t1"]
        assert body.allow_auto_topic_creation is (version < 4)  # v0-3 cannot say false: the default

        ours = m.MetadataRequest(topics=None if version else [], allow_auto_topic_creation=True)
        decoded = KpMetadataRequest.decode(
            wire.encode_request(wire.RequestHeader(3, version, 78, None), ours), version=version, header=True, framed=True
        )
        assert decoded.header.correlation_id == 78 and decoded.header.client_id is None
        assert decoded.topics is None


def test_response_frames_decoded_by_kafka_python():
    body = m.MetadataResponse(
        brokers=[m.MetadataResponseMetadataResponseBroker(node_id=1, host="h", port=9092)],
        cluster_id="c", controller_id=1,
        topics=[m.MetadataResponseMetadataResponseTopic(name="__cluster_metadata", partitions=[
            m.MetadataResponseMetadataResponsePartition(partition_index=0, leader_id=1, replica_nodes=[1, 2, 3])
        ])],
    )
    for version in (2, 9, 12):  # cluster_id is v2+
        frame = wire.encode_response(wire.RequestHeader(3, version, 5, "x"), body)
        theirs = KpMetadataResponse.decode(frame, version=version, header=True, framed=True)
        assert theirs.header.correlation_id == 5
        assert [b.port for b in theirs.brokers] == [9092]
        assert theirs.topics[0].partitions[0].replica_nodes == [1, 2, 3]
        assert wire.decode_response(frame[4:], 3, version) == (5, body)


def test_api_versions_fallback_is_v0_with_unsupported_version_and_our_ranges():
    frame = wire.api_versions_fallback(wire.RequestHeader(18, 9, 31, "new-client"), SUPPORTED)
    # a client that asked v9 reads a v0 body in a v0 header (kafka-python, as librdkafka and Java do)
    theirs = KpApiVersionsResponse.decode(frame, version=3, header=True, framed=True)
    assert theirs.header.correlation_id == 31 and theirs.error_code == 35
    assert sorted((k.api_key, k.min_version, k.max_version) for k in theirs.api_keys) == sorted(
        (key, lo, hi) for key, (lo, hi) in SUPPORTED.items()
    )
    correlation_id, body = wire.decode_response(frame[4:], 18, 4)
    assert correlation_id == 31 and isinstance(body, m.ApiVersionsResponse) and body.error_code == 35


def test_api_versions_response_header_is_v0_even_when_flexible():
    body = m.ApiVersionsResponse(api_keys=[m.ApiVersionsResponseApiVersion(api_key=18, min_version=0, max_version=4)])
    frame = wire.encode_response(wire.RequestHeader(18, 3, 12, "c"), body)
    assert frame[8] != 0 or frame[9] == 0  # body starts right after the correlation id: error code 0 (int16)
    theirs = KpApiVersionsResponse.decode(frame, version=3, header=True, framed=True)
    assert theirs.header.correlation_id == 12 and [(k.api_key, k.max_version) for k in theirs.api_keys] == [(18, 4)]


def test_error_answer_sets_the_top_level_error_code_or_declines():
    answer = wire.error_answer(wire.RequestHeader(52, 2, 9, None), 42)  # Vote has a top-level ErrorCode
    assert answer is not None
    correlation_id, body = wire.decode_response(answer[4:], 52, 2)
    assert correlation_id == 9 and isinstance(body, m.VoteResponse) and body.error_code == 42
    assert wire.error_answer(wire.RequestHeader(0, 9, 9, None), 42) is None  # Produce: none; Kafka closes
    assert wire.error_answer(wire.RequestHeader(3, 12, 9, None), 42) is None  # Metadata: none
    assert wire.error_answer(wire.RequestHeader(1, 6, 9, None), 42) is None  # Fetch v6: ErrorCode is v7+
    answer = wire.error_answer(wire.RequestHeader(1, 7, 9, None), 42)
    assert answer is not None and wire.decode_response(answer[4:], 1, 7)[1].error_code == 42  # type: ignore[attr-defined]
    assert wire.error_answer(wire.RequestHeader(999, 0, 9, None), 42) is None  # unknown api


def test_records_are_zero_copy_slices_of_the_frame():
    batch = bytes(range(256)) * 4
    body = m.ProduceRequest(acks=-1, timeout_ms=1000, topic_data=[m.ProduceRequestTopicProduceData(
        name="t", partition_data=[m.ProduceRequestPartitionProduceData(index=0, records=batch)])])
    frame = bytearray(wire.encode_request(wire.RequestHeader(0, 9, 1, None), body)[4:])
    _, decoded = wire.decode_request(frame, SUPPORTED)
    assert isinstance(decoded, m.ProduceRequest)
    records = decoded.topic_data[0].partition_data[0].records
    assert isinstance(records, memoryview) and records == batch
    frame[bytes(frame).index(batch)] = 0xAB  # the frame's byte under the batch's first byte
    assert records[0] == 0xAB  # a view of the frame, not a copy


def test_unsupported_encodings_raise():
    import pytest

    from metalog.protocol.kafka.errors import UnsupportedVersionError

    with pytest.raises(UnsupportedVersionError, match="FetchRequest has versions 4-18, not 3"):
        m.FetchRequest().encode(3)
    with pytest.raises(UnsupportedVersionError, match="preferred_read_replica"):  # not ignorable: v11+
        m.FetchResponsePartitionData(preferred_read_replica=2).encode(10)
    m.FetchResponsePartitionData(log_start_offset=5).encode(4)  # ignorable: dropped silently, as Kafka does


def test_uuid_text_form_is_kafkas():
    raw = bytes(range(16))
    assert m.uuid_to_str(raw) == "AAECAwQFBgcICQoLDA0ODw"  # base64url, no padding (Kafka's Uuid.toString)
    assert m.uuid_from_str("AAECAwQFBgcICQoLDA0ODw") == raw
    assert m.uuid_to_str(m.ZERO_UUID) == "AAAAAAAAAAAAAAAAAAAAAA"
