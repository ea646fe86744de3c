"""`metalog storage format` (KIP-853 bootstrap) end to end on real files, a
real process: meta.properties with a new directory id, the bootstrap
checkpoint with the first voter set, and the broker's boot reading it; bad
input is one line on stderr, a non-zero exit and nothing written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from metalog.broker.server.config import load_config
from metalog.broker.server.recovery import recover_local_state
from metalog.broker.server.metrics import BrokerMetrics
from metalog.storage.snapshot import BOOTSTRAP_SNAPSHOT_ID, SnapshotStore, snapshot_filename

REPO = Path(__file__).resolve().parents[2]
PART = "__cluster_metadata-0"
DIR_A, DIR_B = "AAAAAAAAAAAAAAAAAAAAAg", "AAAAAAAAAAAAAAAAAAAAAw"


def metalog(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "metalog.tools.cli", "storage", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def config(tmp_path, node_id: int = 1, dynamic: bool = True) -> Path:
    path = tmp_path / f"n{node_id}.yaml"
    path.write_text(f"node_id: {node_id}\ncluster_id: c1\ndata_dir: {tmp_path / f'data{node_id}'}\n"
                    f"listen: 127.0.0.1:{9090 + node_id}\nvoters: 1@127.0.0.1:9091,2@127.0.0.1:9092\n"
                    f"dynamic_voters: {'true' if dynamic else 'false'}\n"
                    f"security:\n  security_protocol: PLAINTEXT\n")
    return path


def meta(data_dir: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in (data_dir / "meta.properties").read_text().splitlines())


def test_standalone_writes_meta_and_a_bootstrap_checkpoint_naming_this_node(tmp_path):
    proc = metalog("format", "--config", str(config(tmp_path)), "--standalone")
    assert proc.returncode == 0, proc.stderr
    data = tmp_path / "data1"
    props = meta(data)
    assert props["cluster.id"] == "c1" and props["node.id"] == "1" and len(props["directory.id"]) == 22
    assert (data / PART / snapshot_filename(BOOTSTRAP_SNAPSHOT_ID)).name == "00000000000000000000-0000000000.checkpoint"
    store = SnapshotStore(data / PART)
    voters = store.bootstrap_voters()
    assert [(v.voter_id, v.directory_id, v.endpoints[0].host, v.endpoints[0].port) for v in voters.voters] == [
        (1, props["directory.id"], "127.0.0.1", 9091)]
    assert store.list() == [], "the bootstrap checkpoint is no snapshot of the log"


def test_the_broker_boots_with_the_bootstrap_set(tmp_path):
    cfg_path = config(tmp_path)
    assert metalog("format", "--config", str(cfg_path), "--initial-controllers",
                   f"1@127.0.0.1:9091:{DIR_A},2@127.0.0.1:9092:{DIR_B}").returncode == 0
    assert meta(tmp_path / "data1")["directory.id"] == DIR_A, "this node's entry gives its directory id"
    cfg = load_config(str(cfg_path))
    import structlog
    st = recover_local_state(cfg, os.path.join(cfg.data_dir, PART), structlog.get_logger(), BrokerMetrics(1))
    assert st.view.voter_set.directory_ids == {1: DIR_A, 2: DIR_B} and st.view.voter_set.kraft_version == 1
    assert st.directory_id == DIR_A and cfg.quorum.voters_are_bootstrap
    st.seg_log.close()


def test_no_initial_controllers_binds_the_dir_only(tmp_path):
    proc = metalog("format", "--config", str(config(tmp_path, node_id=3)), "--no-initial-controllers")
    assert proc.returncode == 0, proc.stderr
    assert len(meta(tmp_path / "data3")["directory.id"]) == 22
    assert not (tmp_path / "data3" / PART).exists() or SnapshotStore(tmp_path / "data3" / PART).bootstrap_voters() is None


def test_bad_input_is_one_line_and_writes_nothing(tmp_path):
    """Each: exit code non-zero, one line on stderr naming the problem, no meta.properties."""
    cases = [
        (config(tmp_path), ["--initial-controllers", "1@127.0.0.1:9091"],
         "--initial-controllers: expected id@host:port:directory-id, got '1@127.0.0.1:9091'"),
        (config(tmp_path), ["--initial-controllers", f"1@h:9091:{DIR_A},2@h:9092:{DIR_A}"],
         "listed twice"),
        (config(tmp_path, dynamic=False), ["--standalone"], "dynamic_voters: false"),
    ]
    for cfg_path, args, expected in cases:
        proc = metalog("format", "--config", str(cfg_path), *args)
        assert proc.returncode == 2, (args, proc)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0], proc.stderr
        assert not (tmp_path / "data1" / "meta.properties").exists()


def test_formatting_twice_is_refused(tmp_path):
    cfg_path = config(tmp_path)
    assert metalog("format", "--config", str(cfg_path), "--standalone").returncode == 0
    before = meta(tmp_path / "data1")
    proc = metalog("format", "--config", str(cfg_path), "--standalone")
    assert proc.returncode == 1 and "is formatted already (meta.properties exists): nothing written" in proc.stderr
    assert meta(tmp_path / "data1") == before
