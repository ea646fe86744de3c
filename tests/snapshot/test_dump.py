"""tools/dump.py: readable lines for snapshots and segments, clear errors on bad files."""

import io
import os

from broker.controller import write_controller_snapshot
from protocol.messages import SnapshotId
from storage import batch as b
from storage import metadata_records as r
from storage.snapshot import SnapshotStore
from tests.controller.test_state import cluster
from tools import dump


def run(path, **kw):
    out, err = io.StringIO(), io.StringIO()
    rc = dump.dump(path, out, err, **kw)
    return rc, out.getvalue().splitlines(), err.getvalue()


def make_snapshot(tmp_path):
    c, lg = cluster(2)
    lg.commit(c.create_topic("t", 1, 2, topic_id="T"))
    store = SnapshotStore(str(tmp_path))
    return write_controller_snapshot(store, c.state.copy(), SnapshotId(c.applied_offset, 3), 0)


def test_dump_snapshot(tmp_path):
    res = make_snapshot(tmp_path)
    rc, lines, err = run(res.path)
    assert rc == 0 and err == ""
    assert lines[0].startswith("offset=0 epoch=3 control SnapshotHeader")
    assert lines[1].startswith('offset=1 epoch=3 RegisterBroker {"broker_id": 0')
    assert lines[4] == ('offset=4 epoch=3 Partition {"topic_id": "T", "partition_id": 0, '
                        '"replicas": [0, 1], "isr": [0, 1], "leader": 0, "leader_epoch": 0, '
                        '"partition_epoch": 0}')
    assert lines[5].startswith("offset=5 epoch=3 control SnapshotFooter")
    assert lines[6] == f"# snapshot end_offset={res.snapshot_id.end_offset} epoch=3 records=4 bytes={res.size_bytes}"


def test_dump_truncated_snapshot(tmp_path):
    res = make_snapshot(tmp_path)
    with open(res.path, "r+b") as f:
        f.truncate(res.size_bytes - 1)
    rc, lines, err = run(res.path)
    assert rc == 1
    assert lines[0].startswith("offset=0 epoch=3 control SnapshotHeader")  # what was readable
    assert f"{res.path}: truncated:" in err and "byte(s) after the last whole batch" in err


def test_dump_segment_with_bad_crc_and_undecodable_record(tmp_path):
    path = os.path.join(tmp_path, "00000000000000000000.log")
    good = b.encode_batch(0, 1, [r.encode_record(r.NoOp()), b"\x00\x63\x00\x00"], 0)
    bad = bytearray(b.encode_batch(2, 1, [r.encode_record(r.FenceBroker(1, 1))], 0))
    bad[-1] ^= 1
    open(path, "wb").write(good + bytes(bad))
    rc, lines, err = run(path)
    assert rc == 1
    assert lines == ["offset=0 epoch=1 NoOp {}",
                     "offset=1 epoch=1 UNDECODABLE (unknown metadata record api key 99)"]
    assert f"{path}: corrupt batch at byte {len(good)}: CRC mismatch" in err


def test_dump_missing_and_wrong_kind(tmp_path):
    rc, _, err = run(str(tmp_path / "nope.checkpoint"))
    assert rc == 1 and "nope.checkpoint: no such file" in err
    other = tmp_path / "x.txt"
    other.write_text("hi")
    rc, _, err = run(str(other))
    assert rc == 1 and "not a .checkpoint or .log file" in err


def test_main_entry(tmp_path, capsys):
    res = make_snapshot(tmp_path)
    assert dump.main([res.path, "--max-records", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and out[-1].startswith("# snapshot")
