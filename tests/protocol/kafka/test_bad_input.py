"""Bad bytes (issue 32 item 7): each a KafkaDecodeError (HeaderError when
there is no header to answer) with a message naming what is wrong and
where; never another exception. Then a fuzzer over random bodies and
mutations of the kept corpus of valid frames (corpus/, make_corpus.py)."""

from __future__ import annotations

import struct
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from metalog.protocol.kafka import messages as m
from metalog.protocol.kafka import wire
from metalog.protocol.kafka.errors import KafkaDecodeError

CORPUS = sorted((Path(__file__).parent / "corpus").glob("*.bin"))
SUPPORTED = {key: (cls.LOWEST_VERSION, cls.HIGHEST_VERSION) for key, cls in m.REQUESTS.items()}


def header(api_key: int, version: int, correlation_id: int = 7, client_id: bytes = b"c") -> bytes:
    out = struct.pack(">hhih", api_key, version, correlation_id, len(client_id)) + client_id
    flexible = version >= m.REQUESTS[api_key].FLEXIBLE_MIN_VERSION if api_key in m.REQUESTS else False
    return out + (b"\x00" if flexible else b"")


def body_error(frame: bytes) -> wire.RequestBodyError:
    with pytest.raises(wire.RequestBodyError) as caught:
        wire.decode_request(frame, SUPPORTED)
    assert isinstance(caught.value, KafkaDecodeError)
    return caught.value


def test_unknown_api_key_is_answerable():
    with pytest.raises(wire.UnsupportedApi) as caught:
        wire.decode_request(struct.pack(">hhih", 999, 0, 42, -1), SUPPORTED)
    assert caught.value.header == wire.RequestHeader(999, 0, 42, None)
    assert isinstance(caught.value, KafkaDecodeError)
    assert "api key 999" in str(caught.value)


def test_unknown_version_is_answerable():
    with pytest.raises(wire.UnsupportedVersion) as caught:
        wire.decode_request(header(1, 3), SUPPORTED)  # Fetch v3: Kafka 4 dropped it
    assert caught.value.header.api_version == 3 and caught.value.header.correlation_id == 7
    with pytest.raises(wire.UnsupportedVersion):  # a version we have but do not serve
        wire.decode_request(header(1, 16), {1: (4, 15)})


@pytest.mark.parametrize("frame", [b"", b"\x00\x01\x00", struct.pack(">hhi", 1, 12, 7)])
def test_a_header_too_short_is_a_header_error(frame):
    with pytest.raises(wire.HeaderError, match="request header takes at least 10 bytes"):
        wire.decode_request(frame, SUPPORTED)


def test_a_client_id_past_the_frame_is_a_header_error():
    with pytest.raises(wire.HeaderError, match="client id of 50 bytes runs past the frame"):
        wire.decode_request(struct.pack(">hhih", 1, 12, 7, 50) + b"abc", SUPPORTED)


def test_header_tagged_fields_past_the_frame_are_a_header_error():
    frame = struct.pack(">hhih", 1, 12, 7, -1) + b"\x01\x05\x7f"  # one tag: tag 5, 127 bytes
    with pytest.raises(wire.HeaderError, match="tagged field 5 of 127 bytes runs past the frame"):
        wire.decode_request(frame, SUPPORTED)


def test_a_truncated_compact_string():
    # DescribeCluster v1 (flexible): IncludeClusterAuthorizedOperations, EndpointType, tags;
    # CreateTopics v5: topics (compact array of 1), name says 20 bytes, 3 follow
    frame = header(19, 5) + b"\x02" + b"\x15" + b"abc"
    error = body_error(frame)
    assert "CreateTopicsRequestCreatableTopic.name" in str(error)
    assert "compact string of 20 bytes runs past the frame (3 left)" in str(error)


@pytest.mark.parametrize("varint", [b"\xff\xff\xff\xff\xff\x01", b"\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01"])
def test_a_varint_longer_than_five_bytes(varint):
    """Kafka's bodies hold only 32-bit varints: 5 bytes at most (10 would be a 64-bit one)."""
    error = body_error(header(19, 5) + varint)
    assert "CreateTopicsRequest.topics" in str(error) and "varint longer than 5 bytes" in str(error)


def test_a_five_byte_varint_over_32_bits():
    error = body_error(header(19, 5) + b"\xff\xff\xff\xff\x7f")
    assert "overflows 32 bits" in str(error)


def test_a_tagged_field_longer_than_the_frame():
    # FetchRequest v12: fixed part, then topics/forgotten/rack, then tags: tag 0 (ClusterId) of 100 bytes
    body = m.FetchRequest().encode(12)
    frame = header(1, 12) + body[:-1] + b"\x01\x00\x64" + b"xy"
    error = body_error(frame)
    assert "FetchRequest.(tagged fields)" in str(error) and "tagged field 0 of 100 bytes runs past the frame" in str(error)


def test_a_tagged_field_whose_value_overruns_its_size():
    # ClusterId tag of size 2 whose compact string says 5 bytes: read within the tag's 2 bytes only
    body = m.FetchRequest().encode(12)
    frame = header(1, 12) + body[:-1] + b"\x01\x00\x02\x06a" + b"bcdefgh"
    error = body_error(frame)
    assert "FetchRequest.cluster_id" in str(error) and "runs past the frame" in str(error)


def test_an_array_length_past_the_frame():
    # Metadata v1: topics (int32 count) = 1000, three bytes follow
    error = body_error(header(3, 1) + struct.pack(">i", 1000) + b"abc")
    assert "MetadataRequest.topics" in str(error)
    assert "array of 1000 elements runs past the frame (3 bytes left)" in str(error)


def test_negative_lengths_where_null_is_not_allowed():
    # Produce v3: transactional id (nullable: -1 fine), acks, timeout, topics: -1 (not nullable)
    error = body_error(header(0, 3) + struct.pack(">hhii", -1, 1, 1000, -1))
    assert "ProduceRequest.topic_data" in str(error) and "null (length -1) in a non-nullable array" in str(error)
    # one topic whose name (not nullable) has length -2
    error = body_error(header(0, 3) + struct.pack(">hhiih", -1, 1, 1000, 1, -2))
    assert "ProduceRequestTopicProduceData.name" in str(error) and "non-nullable string" in str(error)


def test_bytes_left_after_the_body():
    """decode_request ignores them, as Kafka's parser does (librdkafka sends
    some after a Metadata v13 request); a body's own decode refuses them."""
    _, body = wire.decode_request(header(18, 0) + b"\x00", SUPPORTED)
    assert body == m.ApiVersionsRequest()
    with pytest.raises(KafkaDecodeError, match="ApiVersionsRequest v0: 1 bytes left after the body"):
        m.ApiVersionsRequest.decode(b"\x00", 0)


def test_bad_utf8_in_a_string():
    error = body_error(header(19, 5) + b"\x02\x03\xff\xfe")
    assert "CreateTopicsRequestCreatableTopic.name" in str(error) and "utf-8" in str(error)


# --- the fuzzer ------------------------------------------------------------------------


def decode_or_documented_error(frame: bytes) -> None:
    try:
        wire.decode_request(frame, SUPPORTED)
    except KafkaDecodeError:
        pass


def test_the_corpus_is_kept_and_decodes():
    requests = [p for p in CORPUS if "Request-" in p.name]
    responses = [p for p in CORPUS if "Response-" in p.name]
    assert len(requests) >= 50 and len(responses) >= 50
    for path in requests:
        header_read, body = wire.decode_request(path.read_bytes(), SUPPORTED)
        assert wire.encode_request(header_read, body)[4:] == path.read_bytes(), path.name
    for path in responses:
        name, version = path.stem.rsplit("-v", 1)
        cls = next(c for c in m.RESPONSES.values() if c.__name__ == name)
        _, body = wire.decode_response(path.read_bytes(), cls.API_KEY, int(version))
        assert type(body) is cls


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(api=st.sampled_from(sorted(SUPPORTED)), version=st.integers(0, 20), body=st.binary(max_size=200))
def test_fuzz_random_bodies_behind_a_valid_header(api, version, body):
    decode_or_documented_error(header(api, version) + body)


@settings(max_examples=200, deadline=None)
@given(frame=st.binary(max_size=64))
def test_fuzz_random_frames(frame):
    decode_or_documented_error(frame)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_mutations_of_the_corpus(data):
    path = data.draw(st.sampled_from(CORPUS))
    frame = bytearray(path.read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "set", "cut", "insert", "delete"]))
        at = data.draw(st.integers(0, max(len(frame) - 1, 0)))
        if kind == "flip" and frame:
            frame[at] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "set" and frame:
            frame[at] = data.draw(st.sampled_from([0x00, 0x7F, 0x80, 0xFF]))
        elif kind == "cut":
            del frame[at:]
        elif kind == "insert":
            frame[at:at] = data.draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete" and frame:
            del frame[at]
    if "Request-" in path.name:
        decode_or_documented_error(bytes(frame))
    else:
        name, version = path.stem.rsplit("-v", 1)
        cls = next(c for c in m.RESPONSES.values() if c.__name__ == name)
        try:
            wire.decode_response(bytes(frame), cls.API_KEY, int(version))
        except KafkaDecodeError:
            pass
