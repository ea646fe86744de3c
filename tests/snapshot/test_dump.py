"""tools/cli/dump.py: readable JSON lines for snapshots and segments (kafka-dump-log's
batch lines, --deep-iteration, --print-data-log, --raw), clear errors on bad files."""

import base64
import io
import json
import os

from metalog.broker.controller.state import write_controller_snapshot
from metalog.protocol.messages import SnapshotId
from metalog.storage import batch as b
from metalog.storage import metadata_records as r
from metalog.storage.snapshot import SnapshotStore
from tests.controller.test_state import cluster
from metalog.tools.cli import dump


def run(path, **kw):
    out, err = io.StringIO(), io.StringIO()
    rc = dump.dump(path, out, err, **kw)
    return rc, [json.loads(line) for line in out.getvalue().splitlines()], err.getvalue()


def records(lines):
    return [line for line in lines if "batch" not in line and "snapshot" not in line]


def make_snapshot(tmp_path):
    c, lg = cluster(2)
    lg.commit(c.create_topic("t", 1, 2, topic_id="00000000-0000-0000-0000-0000000000a1"))
    store = SnapshotStore(str(tmp_path))
    return write_controller_snapshot(store, c.state.copy(), SnapshotId(c.applied_offset, 3), 0)


def test_dump_snapshot(tmp_path):
    res = make_snapshot(tmp_path)
    rc, lines, err = run(res.path)
    assert rc == 0 and err == ""
    recs = records(lines)
    assert recs[0]["type"] == "SnapshotHeader" and recs[0]["control"] and recs[0]["epoch"] == 3
    assert recs[1] == {"offset": 1, "epoch": 3, "type": "FeatureLevel", "version": 0,
                       "fields": {"name": "metadata.version", "feature_level": 21}}
    assert recs[2]["type"] == "RegisterBroker" and recs[2]["fields"]["broker_id"] == 0
    assert recs[5] == {"offset": 5, "epoch": 3, "type": "Partition", "version": 0,
                       "fields": {"topic_id": "00000000-0000-0000-0000-0000000000a1", "partition_id": 0, "replicas": [0, 1], "isr": [0, 1],
                                  "leader": 0, "leader_epoch": 0, "partition_epoch": 0}}
    assert recs[6]["type"] == "SnapshotFooter"
    assert lines[-1] == {"snapshot": {"end_offset": res.snapshot_id.end_offset, "epoch": 3, "records": 5,
                                      "bytes": res.size_bytes}}
    # Each batch line comes before its records, with its offsets, epoch and position.
    assert lines[0]["batch"]["base_offset"] == 0 and lines[0]["batch"]["is_control"]
    assert lines[0]["batch"]["position"] == 0 and lines[0]["batch"]["epoch"] == 3


def test_dump_shows_producer_state_written_either_way(tmp_path):
    """A snapshot's producers print as ProducerState records, whether this
    build wrote them (in NoOp records) or an older one (metalog's key 1000)."""
    from metalog.broker.controller.state import Controller
    from tests.storage.helpers import rewrite_snapshot_the_old_way

    c = Controller()
    c.apply_batches(b.encode_batch(0, 1, [b"a", b"b"], 0, producer_id=7, producer_epoch=0, base_sequence=0))
    shown = {}
    for way in ("new", "old"):
        store = SnapshotStore(str(tmp_path / way))
        res = write_controller_snapshot(store, c.state.copy(), SnapshotId(2, 1), 0)
        if way == "old":
            rewrite_snapshot_the_old_way(res.path)
        rc, lines, err = run(res.path)
        assert rc == 0 and err == "", way
        shown[way] = [(x["type"], x["fields"]) for x in records(lines) if x["type"] == "ProducerState"]
    assert shown["new"] == shown["old"] == [("ProducerState", {
        "producer_id": 7, "producer_epoch": 0, "last_timestamp_ms": 0, "batches": [[0, 1, 0, 1, 1]]})]


def test_dump_truncated_snapshot(tmp_path):
    res = make_snapshot(tmp_path)
    with open(res.path, "r+b") as f:
        f.truncate(res.size_bytes - 1)
    rc, lines, err = run(res.path)
    assert rc == 1
    assert records(lines)[0]["type"] == "SnapshotHeader"  # what was readable
    assert f"{res.path}: truncated:" in err and "byte(s) after the last whole batch" in err


def test_dump_segment_with_bad_crc_produced_values_and_modes(tmp_path):
    path = os.path.join(tmp_path, "00000000000000000000.log")
    good = b.encode_batch(0, 1, [r.encode_record(r.NoOp()), "héllo".encode(), b"\xff\x00bin"], 0)
    bad = bytearray(b.encode_batch(3, 1, [r.encode_record(r.FenceBroker(1, 1))], 0))
    bad[-1] ^= 1
    open(path, "wb").write(good + bytes(bad))
    rc, lines, err = run(path)
    assert rc == 1
    assert lines[1:] == [{"offset": 0, "epoch": 1, "type": "NoOp", "version": 0, "fields": {}},
                         {"offset": 1, "epoch": 1, "type": "data", "value": "héllo", "encoding": "utf-8"},
                         {"offset": 2, "epoch": 1, "type": "data",
                          "value": base64.b64encode(b"\xff\x00bin").decode(), "encoding": "base64"}]
    batch = lines[0]["batch"]
    assert (batch["base_offset"], batch["last_offset"], batch["count"], batch["epoch"]) == (0, 2, 3, 1)
    assert f"{path}: corrupt batch at byte {len(good)}: CRC mismatch" in err
    # kafka-dump-log's modes: batches only; records without content; raw bytes.
    _, lines, _ = run(path, deep=False, data=False)
    assert [list(line) for line in lines] == [["batch"]]
    _, lines, _ = run(path, deep=True, data=False)
    assert lines[1:] == [{"offset": o, "epoch": 1, "size": n} for o, n in ((0, len(r.encode_record(r.NoOp()))), (1, 6), (2, 5))]
    _, lines, _ = run(path, raw=True)
    assert base64.b64decode(lines[2]["value"]) == "héllo".encode()


def test_dump_missing_and_wrong_kind(tmp_path):
    rc, _, err = run(str(tmp_path / "nope.checkpoint"))
    assert rc == 1 and "nope.checkpoint: no such file" in err
    other = tmp_path / "x.txt"
    other.write_text("hi")
    rc, _, err = run(str(other))
    assert rc == 1 and "not a .checkpoint or .log file" in err


def test_main_entry(tmp_path, capsys):
    res = make_snapshot(tmp_path)
    assert dump.main([res.path, "--print-data-log", "--max-records", "2"]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(records(out)) == 2 and "snapshot" in out[-1]
    assert dump.main([res.path]) == 0  # without options: batch lines and the snapshot summary only
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {next(iter(line)) for line in out} == {"batch", "snapshot"}


def test_dump_shows_producer_fields_of_idempotent_batches(tmp_path):
    """kafka-dump-log prints producerId, producerEpoch and baseSequence per batch;
    ours too (-1 for a batch of no idempotent producer)."""
    path = os.path.join(tmp_path, "00000000000000000000.log")
    data = (b.encode_batch(0, 1, [b"a", b"b"], 0, producer_id=(5 << 32) + 1, producer_epoch=0, base_sequence=7)
            + b.encode_batch(2, 1, [b"c"], 0))
    open(path, "wb").write(data)
    rc, lines, _err = run(path, deep=False)
    assert rc == 0
    assert [(x["batch"]["producer_id"], x["batch"]["producer_epoch"], x["batch"]["base_sequence"])
            for x in lines if "batch" in x] == [((5 << 32) + 1, 0, 7), (-1, -1, -1)]


def test_dump_of_a_kafka_dir_names_unmodelled_types(tmp_path):
    """`metalog dump --print-data-log` on a segment and a snapshot in Kafka's
    layout (written by kafka-python, kio and Kafka's schemas): every record is
    decoded, a type we do not model is printed by Kafka's name with
    "unmodelled": true, and a last line counts them; exit 0."""
    import subprocess
    import sys

    from tests.formats.kafka_dir import PART, write_kafka_dir
    from metalog.tools.cluster.launcher import REPO_ROOT

    info = write_kafka_dir(str(tmp_path))
    part = tmp_path / PART
    for name, want in (("00000000000000000000.log", {"ProducerIds": 2}),
                       (info["snapshot"], {"ProducerIds": 1})):
        proc = subprocess.run([sys.executable, "-m", "metalog.tools.cli", "dump", "--print-data-log", str(part / name)],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        lines = [json.loads(x) for x in proc.stdout.splitlines()]
        recs = [x for x in lines if "offset" in x and "type" in x]
        assert not [x for x in recs if "error" in x]
        unmodelled = [x for x in recs if x.get("unmodelled")]
        assert {x["type"] for x in unmodelled} == set(want)
        assert all(x["fields"]["raw"] for x in unmodelled)
        assert lines[-1 if name.endswith(".log") else -2] == {"unmodelled_records": want}
    log_types = [x["type"] for x in map(json.loads, subprocess.run(
        [sys.executable, "-m", "metalog.tools.cli", "dump", "--print-data-log", str(part / "00000000000000000000.log")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60).stdout.splitlines()) if "type" in x]
    assert log_types == ["LeaderChange", "FeatureLevel", "RegisterBroker", "RegisterBroker", "UnfenceBroker",
                         "UnfenceBroker", "ProducerIds", "Topic", "Partition", "Partition", "Config",
                         "PartitionChange", "BrokerRegistrationChange", "ProducerIds", "NoOp",
                         "FenceBroker", "PartitionChange", "PartitionChange"]
