"""meta.properties binds a data dir to a cluster, a node and (KIP-853) a
directory id: a random id written durably when the dir is first bound, kept
across restarts, given at boot to a dir bound by an older build (logged),
new for a wiped dir; a malformed one refuses the start."""

from __future__ import annotations

import pytest

from metalog.broker.server.recovery import META_FILE, StartupError, check_meta, new_directory_id, valid_directory_id
from metalog.storage.format_upgrade import FORMAT_VERSION


class Events:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def info(self, event: str, **fields) -> None:
        self.events.append((event, fields))


def props(path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


def test_binding_writes_a_directory_id_that_survives_restarts(tmp_path):
    log = Events()
    did = check_meta(str(tmp_path), "c1", 3, log)
    assert valid_directory_id(did) and len(did) == 22
    assert props(tmp_path / META_FILE) == {"version": "1", "cluster.id": "c1", "node.id": "3", "directory.id": did,
                                          "metalog.format.version": str(FORMAT_VERSION)}
    assert log.events == [("data_dir_bound", {"data_dir": str(tmp_path), "cluster_id": "c1", "node_id": 3,
                                              "directory_id": did})]
    assert check_meta(str(tmp_path), "c1", 3, Events()) == did  # a restart keeps it


def test_a_wiped_dir_gets_a_new_directory_id(tmp_path):
    first = check_meta(str(tmp_path), "c1", 3, Events())
    (tmp_path / META_FILE).unlink()  # the disk is replaced
    assert check_meta(str(tmp_path), "c1", 3, Events()) != first


def test_a_dir_bound_by_an_older_build_gets_one_at_boot_and_says_so(tmp_path):
    (tmp_path / META_FILE).write_text("version=1\ncluster.id=c1\nnode.id=2\n")
    log = Events()
    did = check_meta(str(tmp_path), "c1", 2, log)
    assert props(tmp_path / META_FILE)["directory.id"] == did
    # It holds no records, so it is stamped with the current format version too.
    assert [e for e, _ in log.events] == ["format_version_stamped", "directory_id_assigned"]
    assert log.events[1][1]["directory_id"] == did
    assert props(tmp_path / META_FILE)["metalog.format.version"] == str(FORMAT_VERSION) == "3"
    assert check_meta(str(tmp_path), "c1", 2, Events()) == did


@pytest.mark.parametrize("bad", ["", "not-an-id", "AAAAAAAAAAAAAAAAAAAAAA", "A" * 21 + "!"])
def test_a_malformed_directory_id_refuses_the_start(tmp_path, bad):
    """The user sees: '<path>: directory.id '<bad>' is not a directory id ... refusing to start'."""
    (tmp_path / META_FILE).write_text(f"version=1\ncluster.id=c1\nnode.id=2\ndirectory.id={bad}\n")
    with pytest.raises(StartupError, match=r"directory.id .* is not a directory id .*refusing to start"):
        check_meta(str(tmp_path), "c1", 2, Events())
    assert props(tmp_path / META_FILE)["directory.id"] == bad  # nothing rewritten


def test_new_directory_ids_are_valid_and_distinct():
    ids = {new_directory_id() for _ in range(200)}
    assert len(ids) == 200 and all(valid_directory_id(i) and not i.startswith("-") for i in ids)
