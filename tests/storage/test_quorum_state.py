"""The quorum-state file: Kafka's JSON, round trip, atomic replacement, clear
errors, our checksum, files of older builds migrated, files Kafka wrote read."""

from __future__ import annotations

import json

import pytest

from metalog.storage.errors import QuorumStateError
from metalog.storage.quorum_state import QuorumStateFile


def test_missing_file_reads_as_none(tmp_path):
    assert QuorumStateFile(tmp_path / "quorum-state").read() is None


def test_write_then_read_round_trips_and_replaces(tmp_path):
    qs = QuorumStateFile(tmp_path / "quorum-state")
    qs.write(leader_epoch=3, leader_id=-1, voted_id=2, voters=(1, 2, 3))
    assert qs.read() == {"data_version": 0, "leader_epoch": 3, "leader_id": -1, "voted_id": 2,
                         "voters": [1, 2, 3]}
    qs.write(leader_epoch=4, leader_id=1, voted_id=-1, voters=[1, 2, 3])
    state = qs.read()
    assert (state["leader_epoch"], state["leader_id"], state["voted_id"]) == (4, 1, -1)
    assert not (tmp_path / "quorum-state.tmp").exists()


def test_the_file_is_kafkas_json_in_kafkas_key_order(tmp_path):
    """FileQuorumStateStore's data_version 0 layout, plus our crc32c."""
    path = tmp_path / "quorum-state"
    QuorumStateFile(path).write(leader_epoch=2, leader_id=1, voted_id=-1, voters=(1, 2))
    state = json.loads(path.read_text())
    assert list(state) == ["clusterId", "leaderId", "leaderEpoch", "votedId", "appliedOffset", "currentVoters",
                           "data_version", "crc32c"]
    assert {k: v for k, v in state.items() if k != "crc32c"} == {
        "clusterId": "", "leaderId": 1, "leaderEpoch": 2, "votedId": -1, "appliedOffset": 0,
        "currentVoters": [{"voterId": 1}, {"voterId": 2}], "data_version": 0}


@pytest.mark.parametrize("content", [
    '{"clusterId": "", "leaderId": 1, "leaderEpoch": 2, "votedId": -1, "appliedOffset": 0, '
    '"currentVoters": [{"voterId": 1}, {"voterId": 3}], "data_version": 0}',
    '{"leaderId": 1, "leaderEpoch": 2, "votedId": -1, "votedDirectoryId": "J8aAPcfLQt2bqs1JT_rMgQ", '
    '"data_version": 1}',
])
def test_a_file_kafka_wrote_is_read(tmp_path, content):
    path = tmp_path / "quorum-state"
    path.write_text(content)
    state = QuorumStateFile(path).read()
    assert (state["leader_epoch"], state["leader_id"], state["voted_id"]) == (2, 1, -1)
    assert state["voters"] == ([1, 3] if '"data_version": 0' in content else [])
    assert path.read_text() == content  # read, never rewritten


@pytest.mark.parametrize("legacy", [
    '{"data_version": 1, "leader_epoch": 3, "leader_id": 1, "voted_id": 2, "voters": [1, 2, 3]}',
    '{"crc32c": 3429460853, "data_version": 2, "leader_epoch": 3, "leader_id": 1, "voted_id": 2, '
    '"voters": [1, 2, 3]}',
])
def test_a_snake_case_file_of_an_older_build_is_read_once_and_rewritten_as_kafkas(tmp_path, legacy):
    path = tmp_path / "quorum-state"
    path.write_text(legacy)
    state = QuorumStateFile(path).read()
    assert (state["leader_epoch"], state["leader_id"], state["voted_id"], state["voters"]) == (3, 1, 2, [1, 2, 3])
    rewritten = json.loads(path.read_text())
    assert rewritten["leaderEpoch"] == 3 and rewritten["votedId"] == 2 and rewritten["data_version"] == 0
    assert QuorumStateFile(path).read() == state


@pytest.mark.parametrize("content, message", [
    ("{not json", "not JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"data_version": 7, "leaderEpoch": 1, "leaderId": 1, "votedId": 1}',
     "unsupported quorum-state data_version 7 (expected one of (0, 1))"),
    ('{"data_version": 7, "leader_epoch": 1, "leader_id": 1, "voted_id": 1, "voters": [1]}',
     "unsupported quorum-state data_version 7 (expected one of (1, 2))"),
    ('{"leaderId": "1", "leaderEpoch": 1, "votedId": 1, "votedDirectoryId": "", "data_version": 1}',
     "leaderId must be an integer, got '1'"),
    ('{"clusterId": "", "leaderId": 1, "leaderEpoch": 1, "votedId": 1, "appliedOffset": 0, '
     '"currentVoters": [1, 2], "data_version": 0}', "currentVoters must be a list of"),
    ('{"leaderId": 1, "leaderEpoch": -2, "votedId": 1, "votedDirectoryId": "", "data_version": 1}',
     "negative leaderEpoch -2"),
    ('{"leaderId": 1, "leaderEpoch": 2, "votedId": 1, "votedDirectoryId": "", "data_version": 1, "crc33c": 5}',
     "keys ['crc33c'] differ from Kafka's data_version 1 and there is no crc32c"),
    ('{"data_version": 1, "leader_epoch": "1", "leader_id": 1, "voted_id": 1, "voters": [1]}',
     "leader_epoch must be an integer, got '1'"),
])
def test_malformed_file_is_a_clear_error_naming_the_path(tmp_path, content, message):
    path = tmp_path / "quorum-state"
    path.write_text(content)
    with pytest.raises(QuorumStateError) as info:
        QuorumStateFile(path).read()
    assert str(info.value).startswith(f"{path}: ")
    assert message in str(info.value)
    assert path.read_text() == content  # nothing rewritten


@pytest.mark.parametrize("field, old, new", [("votedId", b'"votedId": 2', b'"votedId": 3'),
                                              ("leaderEpoch", b'"leaderEpoch": 4', b'"leaderEpoch": 6')])
def test_a_bit_flip_that_still_parses_is_refused(tmp_path, field, old, new):
    """A flipped bit in a digit would forge a vote or an epoch: the user sees
    QuorumStateError naming the file, both CRCs and what to do."""
    path = tmp_path / "quorum-state"
    QuorumStateFile(path).write(leader_epoch=4, leader_id=-1, voted_id=2, voters=(1, 2, 3))
    raw = path.read_bytes()
    assert bin(old[-1] ^ new[-1]).count("1") == 1  # one bit
    path.write_bytes(raw.replace(old, new))
    with pytest.raises(QuorumStateError, match=rf"^{path}: quorum-state checksum mismatch \(stored 0x[0-9a-f]{{8}}, "
                                               r"computed 0x[0-9a-f]{8}\): the file is damaged .* refusing to start"):
        QuorumStateFile(path).read()


def test_decode_checks_bytes_read_elsewhere_and_touches_no_file(tmp_path):
    """decode(): the content of a file read by someone else (the Spark job's
    executors), checked as read() checks it; a snake_case file is translated,
    not rewritten; the path only names the file in errors."""
    path = tmp_path / "quorum-state"
    QuorumStateFile(path).write(leader_epoch=4, leader_id=1, voted_id=2, voters=(1, 2, 3))
    raw = path.read_bytes()
    named = QuorumStateFile("hdfs://nn/data/n1/__cluster_metadata-0/quorum-state")
    assert named.decode(raw) == named.decode(raw.decode()) == QuorumStateFile(path).read()
    with pytest.raises(QuorumStateError, match=r"^hdfs://nn/data/n1/__cluster_metadata-0/quorum-state: "
                                               "quorum-state checksum mismatch"):
        named.decode(raw.replace(b'"votedId": 2', b'"votedId": 3'))
    legacy = '{"data_version": 1, "leader_epoch": 3, "leader_id": 1, "voted_id": 2, "voters": [1, 2, 3]}'
    missing = QuorumStateFile(tmp_path / "absent")
    assert missing.decode(legacy) == {"data_version": 0, "leader_epoch": 3, "leader_id": 1, "voted_id": 2,
                                      "voters": [1, 2, 3]}
    assert not (tmp_path / "absent").exists()
