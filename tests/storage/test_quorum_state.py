"""The quorum-state file: round trip, atomic replacement, clear errors."""

from __future__ import annotations

import json

import pytest

from storage.errors import QuorumStateError
from storage.quorum_state import QuorumStateFile


def test_missing_file_reads_as_none(tmp_path):
    assert QuorumStateFile(tmp_path / "quorum-state").read() is None


def test_write_then_read_round_trips_and_replaces(tmp_path):
    qs = QuorumStateFile(tmp_path / "quorum-state")
    qs.write(leader_epoch=3, leader_id=-1, voted_id=2, voters=(1, 2, 3))
    assert qs.read() == {"data_version": 2, "leader_epoch": 3, "leader_id": -1, "voted_id": 2,
                         "voters": [1, 2, 3]}
    qs.write(leader_epoch=4, leader_id=1, voted_id=-1, voters=[1, 2, 3])
    state = qs.read()
    assert (state["leader_epoch"], state["leader_id"], state["voted_id"]) == (4, 1, -1)
    assert json.loads((tmp_path / "quorum-state").read_text())["data_version"] == 2
    assert not (tmp_path / "quorum-state.tmp").exists()


@pytest.mark.parametrize("content, message", [
    ("{not json", "not JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"data_version": 7, "leader_epoch": 1, "leader_id": 1, "voted_id": 1, "voters": [1]}',
     "unsupported quorum-state data_version 7 (expected one of (1, 2))"),
    ('{"data_version": 1, "leader_epoch": "1", "leader_id": 1, "voted_id": 1, "voters": [1]}',
     "leader_epoch must be an integer, got '1'"),
    ('{"data_version": 1, "leader_epoch": 1, "leader_id": 1, "voted_id": 1, "voters": "1,2"}',
     "voters must be a list of integers"),
    ('{"data_version": 1, "leader_epoch": -2, "leader_id": 1, "voted_id": 1, "voters": [1]}',
     "negative leader_epoch -2"),
])
def test_malformed_file_is_a_clear_error_naming_the_path(tmp_path, content, message):
    path = tmp_path / "quorum-state"
    path.write_text(content)
    with pytest.raises(QuorumStateError) as info:
        QuorumStateFile(path).read()
    assert str(info.value).startswith(f"{path}: ")
    assert message in str(info.value)


def test_version_1_files_without_a_checksum_are_still_read(tmp_path):
    path = tmp_path / "quorum-state"
    path.write_text('{"data_version": 1, "leader_epoch": 3, "leader_id": 1, "voted_id": 2, "voters": [1, 2, 3]}')
    assert QuorumStateFile(path).read()["voted_id"] == 2


@pytest.mark.parametrize("field, old, new", [("voted_id", b'"voted_id": 2', b'"voted_id": 3'),
                                              ("leader_epoch", b'"leader_epoch": 4', b'"leader_epoch": 6')])
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
