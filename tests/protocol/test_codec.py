"""The wire codec: round trips, framing under arbitrary chunking, and every kind of bad input."""

from __future__ import annotations

import struct

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metalog.broker.quorum.answers import api_versions_response
from metalog.protocol import codec
from metalog.protocol import messages as m
from metalog.protocol.apis import APIS, ApiKey
from metalog.protocol.codec import NEED_DATA, FrameDecoder
from metalog.protocol.errors import Errors

LEADER = m.LeaderIdAndEpoch(leader_id=2, leader_epoch=7)
SNAP = m.SnapshotId(end_offset=100, epoch=3)
REPLICAS = [m.ReplicaState(1, 50, 1000, 990, True), m.ReplicaState(2, 40)]

# One body of every type, with non-default values wherever a field has one.
SAMPLES: dict[type, m.Body] = {
    m.ApiVersionsRequest: m.ApiVersionsRequest(client_software_name="test"),
    m.ApiVersionsResponse: m.ApiVersionsResponse(
        api_keys=[m.ApiVersionRange(1, 0, 0)], supported_features=[m.SupportedFeature(m.KRAFT_VERSION_FEATURE, 0, 1)],
        finalized_features_epoch=7, finalized_features=[m.FinalizedFeature(m.KRAFT_VERSION_FEATURE, 1, 1)]),
    m.VoteRequest: m.VoteRequest(cluster_id="c1", candidate_epoch=4, candidate_id=2,
                                 last_offset_epoch=3, last_offset=99),
    m.VoteResponse: m.VoteResponse(error_code=0, leader_id=3, leader_epoch=4, vote_granted=True),
    m.BeginQuorumEpochRequest: m.BeginQuorumEpochRequest(cluster_id="c1", leader_id=1, leader_epoch=5),
    m.BeginQuorumEpochResponse: m.BeginQuorumEpochResponse(error_code=74, leader_id=1, leader_epoch=6),
    m.EndQuorumEpochRequest: m.EndQuorumEpochRequest(cluster_id="c1", leader_id=1, leader_epoch=5,
                                                     preferred_successors=[3, 2]),
    m.EndQuorumEpochResponse: m.EndQuorumEpochResponse(error_code=6, leader_id=2, leader_epoch=6),
    m.FetchRequest: m.FetchRequest(cluster_id="c1", replica_id=-1, max_wait_ms=500,
                                   current_leader_epoch=7, fetch_offset=12, last_fetched_epoch=6,
                                   log_start_offset=3, max_bytes=4096),
    m.FetchResponse: m.FetchResponse(error_code=0, high_watermark=20, log_start_offset=0,
                                     records=b"\x00\x01binary", diverging_epoch=m.EpochEndOffset(5, 10),
                                     current_leader=LEADER, snapshot_id=SNAP, error_message="x"),
    m.OffsetsForLeaderEpochRequest: m.OffsetsForLeaderEpochRequest(
        cluster_id="c1", replica_id=-1, current_leader_epoch=7, leader_epoch=5),
    m.OffsetsForLeaderEpochResponse: m.OffsetsForLeaderEpochResponse(
        leader_epoch=5, end_offset=42, current_leader=LEADER),
    m.FetchSnapshotRequest: m.FetchSnapshotRequest(cluster_id="c1", replica_id=2, current_leader_epoch=7,
                                                   snapshot_id=SNAP, position=1024, max_bytes=512),
    m.FetchSnapshotResponse: m.FetchSnapshotResponse(snapshot_id=SNAP, size=4096, position=1024,
                                                     unaligned_records=b"abc", current_leader=LEADER),
    m.DescribeQuorumRequest: m.DescribeQuorumRequest(),
    m.DescribeQuorumResponse: m.DescribeQuorumResponse(leader_id=1, leader_epoch=7, high_watermark=49,
                                                       voters=REPLICAS, observers=REPLICAS[1:],
                                                       nodes=[m.DescribeQuorumNode(1, [m.RaftListener(
                                                           "CONTROLLER", "10.0.0.1", 9091)])]),
    m.ProduceRequest: m.ProduceRequest(cluster_id="c1", records=[b"a", b"", b"\xff" * 300], timeout_ms=100),
    m.ProduceResponse: m.ProduceResponse(error_code=6, current_leader=LEADER, error_message="not leader"),
    m.InitProducerIdRequest: m.InitProducerIdRequest(cluster_id="c1", timeout_ms=1500),
    m.InitProducerIdResponse: m.InitProducerIdResponse(producer_id=1234, producer_epoch=0, current_leader=LEADER),
    m.ListOffsetsRequest: m.ListOffsetsRequest(cluster_id="c1", current_leader_epoch=7,
                                               timestamp_ms=m.LIST_OFFSETS_EARLIEST),
    m.ListOffsetsResponse: m.ListOffsetsResponse(offset=10, timestamp_ms=123, leader_epoch=6,
                                                 current_leader=LEADER),
    m.MetadataRequest: m.MetadataRequest(),
    m.MetadataResponse: m.MetadataResponse(cluster_id="c1", node_id=1, leader_id=2, leader_epoch=7,
                                           high_watermark=9, log_start_offset=0,
                                           voters=[m.NodeEndpoint(1, "127.0.0.1", 9001)],
                                           observers=[m.NodeEndpoint(4, "::1", 9004)]),
    m.ErrorResponse: m.ErrorResponse(error_code=42, error_message="bad"),
    m.ControllerCommandRequest: m.ControllerCommandRequest(
        cluster_id="c1", command="create_topic", args={"name": "t", "partitions": 3, "replication_factor": 2}),
    m.ControllerCommandResponse: m.ControllerCommandResponse(error_code=42, error_message="topic 't' already exists",
                                                             current_leader=LEADER),
    m.ConsistencyCheckRequest: m.ConsistencyCheckRequest(cluster_id="c1", leader_id=1, leader_epoch=3,
                                                         start_offset=40, end_offset=900, chunks=16),
    m.ConsistencyCheckResponse: m.ConsistencyCheckResponse(
        start_offset=40, end_offset=900, chunks=[m.ConsistencyChunk(40, 470, 0xDEADBEEF),
                                                 m.ConsistencyChunk(470, 900, 7)]),
    m.AddRaftVoterRequest: m.AddRaftVoterRequest(
        cluster_id="c1", voter_id=4, voter_directory_id="AAAAAAAAAAAAAAAAAAAABQ",
        listeners=[m.RaftListener("CONTROLLER", "10.0.0.4", 9093)], timeout_ms=10_000),
    m.AddRaftVoterResponse: m.AddRaftVoterResponse(error_code=126, error_message="node 4 is already a voter"),
    m.UpdateFeaturesRequest: m.UpdateFeaturesRequest(
        cluster_id="c", feature_updates=[m.FeatureUpdate(m.KRAFT_VERSION_FEATURE, 1)], timeout_ms=5000),
    m.UpdateFeaturesResponse: m.UpdateFeaturesResponse(
        error_code=95, error_message="voter 3's directory id is unknown",
        results=[m.UpdatableFeatureResult(m.KRAFT_VERSION_FEATURE, 95, "voter 3's directory id is unknown")]),
    m.RemoveRaftVoterRequest: m.RemoveRaftVoterRequest(cluster_id="c1", voter_id=3,
                                                       voter_directory_id="AAAAAAAAAAAAAAAAAAAABA"),
    m.RemoveRaftVoterResponse: m.RemoveRaftVoterResponse(error_code=127, error_message="not a voter"),
    m.UpdateRaftVoterRequest: m.UpdateRaftVoterRequest(
        cluster_id="c1", current_leader_epoch=3, voter_id=2, voter_directory_id="AAAAAAAAAAAAAAAAAAAAAw",
        listeners=[m.RaftListener("CONTROLLER", "10.0.0.2", 9093)]),
    m.UpdateRaftVoterResponse: m.UpdateRaftVoterResponse(current_leader=LEADER),
}


def test_samples_cover_every_type():
    types = {t for req, resp, _, _ in APIS.values() for t in (req, resp)} | {m.ErrorResponse}
    assert types == set(SAMPLES)


def split_frame(data: bytes) -> bytes:
    """The payload of one whole encoded frame, checking its length prefix."""
    (n,) = struct.unpack_from(">i", data)
    assert n == len(data) - 4
    return data[4:]


@pytest.mark.parametrize("api_key", list(APIS), ids=lambda k: k.name)
@pytest.mark.parametrize("client_id", [None, "", "broker-1", "ünïcode"])
def test_request_round_trip(api_key, client_id):
    req_type = APIS[api_key][0]
    body = SAMPLES[req_type]
    frame = split_frame(codec.encode_request(api_key, 123456, client_id, body))
    header, decoded = codec.decode_request(frame)
    assert header == codec.RequestHeader(int(api_key), 0, 123456, client_id)
    assert type(decoded) is req_type
    assert decoded == body


@pytest.mark.parametrize("api_key", list(APIS), ids=lambda k: k.name)
def test_response_round_trip(api_key):
    resp_type = APIS[api_key][1]
    body = SAMPLES[resp_type]
    frame = split_frame(codec.encode_response(-5, body))
    assert codec.response_correlation_id(frame) == -5
    decoded = codec.decode_response(frame, resp_type)
    assert type(decoded) is resp_type and decoded == body


@pytest.mark.parametrize(
    "resp_type", [m.ProduceResponse, m.FetchResponse, m.DescribeQuorumResponse, m.ApiVersionsResponse,
                  m.OffsetsForLeaderEpochResponse, m.VoteResponse, m.ListOffsetsResponse],
)
def test_error_response_falls_back_when_expected_type_fails(resp_type):
    err = m.ErrorResponse(error_code=Errors.INVALID_REQUEST, error_message="undecodable body")
    decoded = codec.decode_response(split_frame(codec.encode_response(1, err)), resp_type)
    assert decoded == err


def test_error_response_decoding_as_metadata_still_shows_the_error_code():
    # The documented caveat: [code, message] is also a valid MetadataResponse prefix.
    err = m.ErrorResponse(error_code=Errors.UNSUPPORTED_VERSION, error_message="x")
    decoded = codec.decode_response(split_frame(codec.encode_response(1, err)), m.MetadataResponse)
    assert decoded.error_code == Errors.UNSUPPORTED_VERSION


def test_response_that_decodes_as_nothing_is_a_response_decode_error():
    frame = struct.pack(">i", 9) + msgspec.msgpack.encode(["not", "a", "response"])
    with pytest.raises(codec.ResponseDecodeError, match="neither as FetchResponse nor as ErrorResponse"):
        codec.decode_response(frame, m.FetchResponse)
    with pytest.raises(codec.ResponseDecodeError, match="no correlation id"):
        codec.response_correlation_id(b"\x00\x01")


# --------------------------------------------------------------------------
# Bad requests: each gives the documented error, carrying the header when readable.


def header_bytes(api_key: int, version: int = 0, corr: int = 77, client_id: bytes | None = b"cli") -> bytes:
    if client_id is None:
        return struct.pack(">hhih", api_key, version, corr, -1)
    return struct.pack(">hhih", api_key, version, corr, len(client_id)) + client_id


def test_unknown_api_key_answers_unsupported_version():
    with pytest.raises(codec.UnknownApiKey) as ei:
        codec.decode_request(header_bytes(999) + b"\x90")
    assert ei.value.header.correlation_id == 77 and ei.value.header.api_key == 999
    resp = ei.value.error_response()
    assert resp.error_code == Errors.UNSUPPORTED_VERSION
    assert resp.error_message == "unknown api key 999"


def test_unknown_version_answers_unsupported_version():
    with pytest.raises(codec.UnsupportedVersion) as ei:
        codec.decode_request(header_bytes(ApiKey.FETCH, version=3) + b"\x90")
    assert ei.value.header.api_version == 3
    assert ei.value.error_response().error_code == Errors.UNSUPPORTED_VERSION
    assert "api key 1 version 3 is not supported (supported 0..0)" in str(ei.value)


@pytest.mark.parametrize(
    "payload, detail",
    [
        (b"", "Input data was truncated"),
        (b"\xc1", "invalid opcode"),
        (msgspec.msgpack.encode(["c1", "not-a-list"]), "Expected `array`, got `str` - at `$[1]`"),
        (msgspec.msgpack.encode(["c1"]), "Expected `array` of at least length 2"),
        (msgspec.msgpack.encode({"cluster_id": "c1"}), "Expected `array`"),
    ],
)
def test_undecodable_body_answers_invalid_request(payload, detail):
    with pytest.raises(codec.BodyDecodeError) as ei:
        codec.decode_request(header_bytes(ApiKey.PRODUCE) + payload)
    assert ei.value.header == codec.RequestHeader(0, 0, 77, "cli")
    resp = ei.value.error_response()
    assert resp.error_code == Errors.INVALID_REQUEST
    assert resp.error_message.startswith("undecodable PRODUCE request body: ")
    assert detail.lower() in resp.error_message.lower()


@pytest.mark.parametrize(
    "frame, message",
    [
        (b"", "request of 0 bytes is shorter than the 10-byte fixed header"),
        (b"\x00\x01\x00", "request of 3 bytes is shorter"),
        (struct.pack(">hhih", 1, 0, 5, 10) + b"abc", "client_id length 10 runs past the end of a 13-byte request"),
        (struct.pack(">hhih", 1, 0, 5, -2), "negative client_id length -2"),
        (struct.pack(">hhih", 1, 0, 5, 2) + b"\xff\xfe", "client_id is not valid utf-8"),
    ],
)
def test_unreadable_header_is_header_decode_error(frame, message):
    with pytest.raises(codec.HeaderDecodeError, match=message):
        codec.decode_request(frame)


# --------------------------------------------------------------------------
# Framing


def sample_frames() -> list[bytes]:
    out = []
    for i, (key, (req_type, resp_type, _, _)) in enumerate(APIS.items()):
        out.append(codec.encode_request(key, i, f"c{i}", SAMPLES[req_type]))
        out.append(codec.encode_response(i, SAMPLES[resp_type]))
    out.append(struct.pack(">i", 0))  # an empty frame is legal framing
    return out


STREAM_FRAMES = sample_frames()
STREAM = b"".join(STREAM_FRAMES)
EXPECTED_PAYLOADS = [f[4:] for f in STREAM_FRAMES]


def drain(dec: FrameDecoder) -> list[bytes]:
    out = []
    while (f := dec.next_frame()) is not NEED_DATA:
        out.append(bytes(f))
    return out


def test_frame_decoder_byte_by_byte():
    dec = FrameDecoder(1 << 20)
    got = []
    for i in range(len(STREAM)):
        dec.feed(STREAM[i:i + 1])
        got += drain(dec)
    assert got == EXPECTED_PAYLOADS
    assert dec.buffered_bytes == 0


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=40))
def test_frame_decoder_any_chunking(cuts):
    bounds = [0, *sorted(cuts), len(STREAM)]
    dec = FrameDecoder(1 << 20)
    got = []
    for a, b in zip(bounds, bounds[1:]):
        dec.feed(STREAM[a:b])
        got += drain(dec)
    assert got == EXPECTED_PAYLOADS


def test_frame_decoder_compacts_a_long_stream():
    # Many frames through one decoder: the buffer must not keep consumed bytes.
    frame = codec.encode_response(1, m.FetchResponse(records=b"x" * 1000))
    dec = FrameDecoder(1 << 20)
    for _ in range(500):
        dec.feed(frame + frame[:500])  # always leave a partial frame behind
        dec.feed(frame[500:])
        assert len(drain(dec)) == 2
    assert len(dec._buf) < 2 * len(frame) + (64 << 10)


def test_truncated_frame_is_need_data():
    dec = FrameDecoder(1 << 20)
    dec.feed(STREAM_FRAMES[0][:-1])
    assert dec.next_frame() is NEED_DATA
    dec.feed(STREAM_FRAMES[0][-1:])
    assert bytes(dec.next_frame()) == EXPECTED_PAYLOADS[0]


def test_oversized_length_rejected_before_the_body_arrives():
    dec = FrameDecoder(frame_bytes_max=1000)
    dec.feed(struct.pack(">i", 1001))  # only the length: no body was sent or buffered
    with pytest.raises(codec.FrameTooLarge, match="frame of 1001 bytes, above max_frame_bytes=1000"):
        dec.next_frame()
    # The decoder stays broken: the connection must be closed.
    with pytest.raises(codec.FrameTooLarge):
        dec.feed(b"more")


def test_huge_length_does_not_allocate():
    dec = FrameDecoder(frame_bytes_max=1 << 20)
    dec.feed(b"\x7f\xff\xff\xff")
    with pytest.raises(codec.FrameTooLarge):
        dec.next_frame()
    assert dec.buffered_bytes == 4


def test_negative_length_is_malformed():
    dec = FrameDecoder(1 << 20)
    dec.feed(b"\xff\xff\xff\xfe")
    with pytest.raises(codec.MalformedFrame, match="negative frame length -2"):
        dec.next_frame()


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_garbage_gives_only_documented_outcomes(garbage):
    """Random bytes through decoder and request decoding: frames or documented errors, nothing else."""
    dec = FrameDecoder(frame_bytes_max=256)
    dec.feed(garbage)
    while True:
        try:
            frame = dec.next_frame()
        except codec.FrameError:
            return
        if frame is NEED_DATA:
            return
        try:
            header, body = codec.decode_request(frame)
        except codec.RequestError as exc:
            assert exc.error_response().error_code in (Errors.UNSUPPORTED_VERSION, Errors.INVALID_REQUEST)
        except codec.HeaderDecodeError:
            pass
        else:
            assert isinstance(body, APIS[header.api_key][0])


def test_produce_request_producer_fields_round_trip_and_default_to_none():
    """Idempotent produce (KIP-98) carries producer id, epoch and base sequence;
    a request encoded without them (an older client) decodes as not idempotent (-1)."""
    req = m.ProduceRequest(cluster_id="c1", records=[b"x"], producer_id=17, producer_epoch=0, base_sequence=42)
    frame = codec.encode_request(ApiKey.PRODUCE, 5, "cli", req)
    _hdr, body = codec.decode_request(split_frame(frame))
    assert (body.producer_id, body.producer_epoch, body.base_sequence) == (17, 0, 42)

    class OldProduceRequest(m.Body):  # the request as it was before the producer fields
        cluster_id: str
        records: list[bytes]
        timeout_ms: int = 5000

    old = msgspec.msgpack.decode(msgspec.msgpack.encode(OldProduceRequest(cluster_id="c1", records=[b"x"])),
                                 type=m.ProduceRequest)
    assert (old.producer_id, old.producer_epoch, old.base_sequence) == (-1, -1, -1)


def test_api_versions_advertises_init_producer_id():
    from metalog.broker.quorum.answers import api_versions_response

    keys = {v.api_key: (v.min_version, v.max_version) for v in api_versions_response().api_keys}
    assert keys[22] == (0, 0)


# --------------------------------------------------------------------------
# Vote v2: pre_vote (KIP-996)

PRE_VOTE = m.VoteRequest(cluster_id="c1", candidate_epoch=5, candidate_id=2, last_offset_epoch=4,
                         last_offset=99, pre_vote=True)


def test_a_pre_vote_travels_as_vote_version_2_and_a_real_vote_stays_version_0():
    header, body = codec.decode_request(split_frame(codec.encode_request(ApiKey.VOTE, 1, "n2", PRE_VOTE)))
    assert (header.api_version, body) == (2, PRE_VOTE)
    real = SAMPLES[m.VoteRequest]
    header, body = codec.decode_request(split_frame(codec.encode_request(ApiKey.VOTE, 2, "n2", real)))
    assert (header.api_version, body.pre_vote) == (0, False)
    advertised = {r.api_key: (r.min_version, r.max_version) for r in api_versions_response().api_keys}
    assert advertised[ApiKey.VOTE] == (0, 2)


def test_pre_vote_under_an_older_vote_version_is_an_invalid_request():
    """A body claiming pre_vote under version 0 or 1 cannot be what the
    sender meant: INVALID_REQUEST, never read as a real vote."""
    frame = split_frame(codec.encode_request(ApiKey.VOTE, 9, "n2", PRE_VOTE, api_version=0))
    with pytest.raises(codec.BodyDecodeError) as ei:
        codec.decode_request(frame)
    assert ei.value.error_response().error_code == Errors.INVALID_REQUEST
    assert str(ei.value) == "pre_vote needs Vote version 2, the request says version 0"


def test_a_peer_that_knows_only_vote_v0_answers_a_pre_vote_unsupported_version(monkeypatch):
    """What a build from before KIP-996 does with our pre-vote: it reads the
    header's version 2 and refuses (UNSUPPORTED_VERSION) -- it would
    otherwise drop the extra field and take it for a real vote."""
    dec, _, _ = codec._REQUEST_TYPES[int(ApiKey.VOTE)]
    monkeypatch.setitem(codec._REQUEST_TYPES, int(ApiKey.VOTE), (dec, 0, 0))
    with pytest.raises(codec.UnsupportedVersion) as ei:
        codec.decode_request(split_frame(codec.encode_request(ApiKey.VOTE, 3, "n2", PRE_VOTE)))
    assert ei.value.error_response().error_code == Errors.UNSUPPORTED_VERSION
    # Why the version matters: the old body type reads the new bytes without complaint.

    class OldVoteRequest(m.Body):
        cluster_id: str
        candidate_epoch: int
        candidate_id: int
        last_offset_epoch: int
        last_offset: int

    old = msgspec.msgpack.decode(codec.encode_body(PRE_VOTE), type=OldVoteRequest)
    assert (old.candidate_epoch, old.candidate_id) == (5, 2)
