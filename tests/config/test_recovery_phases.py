"""Boot recovery (broker/server/recovery.py) runs one phase after another;
each refuses with a StartupError that says what failed, in which file, and
what to do, instead of letting an OSError or a storage error escape with a
bare message. And bad settings handed to the broker's parts are ValueErrors
naming the setting, even under python -O (they used to be asserts)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import structlog

from metalog.broker.server.config import config_from_dict
from metalog.broker.server.gc_watch import GcWatch
from metalog.broker.server.metrics import BrokerMetrics
from metalog.broker.server.recovery import PARTITION_DIR, StartupError, recover_local_state
from metalog.broker.server.snapshot_policy import SnapshotPolicy
from metalog.broker.server.snapshot_work import SnapshotWork
from metalog.protocol.invariants import InvariantViolation
from metalog.storage import batch as b
from metalog.storage import metadata_records as r
from metalog.storage.segments import SegmentedLog


def _config(data_dir: str):
    return config_from_dict({"node_id": 1, "cluster_id": "phases", "data_dir": data_dir,
                             "listen": "127.0.0.1:9999", "voters": "1@127.0.0.1:9999,2@127.0.0.1:9998",
                             "security_protocol": "PLAINTEXT"})


def _recover(cfg):
    return recover_local_state(cfg, os.path.join(cfg.data_dir, PARTITION_DIR), structlog.get_logger("test"),
                               BrokerMetrics(1))


def test_a_data_dir_that_cannot_be_created_names_the_path_and_what_to_check(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the data dir's parent should be")
    cfg = _config(str(blocker / "data"))
    with pytest.raises(StartupError) as err:
        _recover(cfg)
    message = str(err.value)
    assert f"cannot use data dir {cfg.data_dir}" in message
    assert "refusing to start" in message and "may create and write files there" in message


def test_a_damaged_epoch_checkpoint_is_rebuilt_from_the_log_and_kept_for_the_operator(tmp_path):
    cfg = _config(str(tmp_path / "d"))
    _recover(cfg).seg_log.close()  # binds the dir
    part = os.path.join(cfg.data_dir, PARTITION_DIR)
    log = SegmentedLog.open(part)
    log.append(b.encode_batch(0, 3, [r.encode_record(r.NoOp())] * 2, 0))
    log.append(b.encode_batch(2, 5, [r.encode_record(r.NoOp())], 0))
    log.flush()
    log.close()
    checkpoint = os.path.join(part, "leader-epoch-checkpoint")
    with open(checkpoint, "w") as fh:
        fh.write("garbage\n")
    local = _recover(cfg)
    try:
        assert local.view.epochs == [(3, 0), (5, 2)]  # from the batches' headers
        assert os.path.exists(checkpoint + ".corrupt") and not os.path.exists(checkpoint)
    finally:
        local.seg_log.close()


def test_a_damaged_quorum_state_names_the_file_and_how_to_move_it_aside(tmp_path):
    cfg = _config(str(tmp_path / "d"))
    _recover(cfg).seg_log.close()
    qs = os.path.join(cfg.data_dir, PARTITION_DIR, "quorum-state")
    with open(qs, "w") as fh:
        fh.write("{not json")
    with pytest.raises(StartupError) as err:
        _recover(cfg)
    message = str(err.value)
    assert message.startswith(qs) and "vote twice" in message and f"mv {qs} {qs}.corrupt" in message


def test_bad_settings_of_the_snapshot_and_gc_parts_are_value_errors_naming_them():
    with pytest.raises(ValueError, match="snapshot_min_records must be > 0, got 0"):
        SnapshotPolicy(0)
    with pytest.raises(ValueError, match="snapshot_generation must be one of fork, thread, got 'spawn'"):
        SnapshotWork(object(), 1, lambda: 0, lambda ev: None, generation="spawn")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"snapshot_cpu_share must be in \(0, 1\], got 1.5"):
        SnapshotWork(object(), 1, lambda: 0, lambda ev: None, cpu_share=1.5)  # type: ignore[arg-type]
    watch = GcWatch(None, None)
    with pytest.raises(ValueError, match="gc_young_threshold must be > 0, got 0"):
        watch.install(young_threshold=0)


def test_tls_paths_of_a_plaintext_config_is_an_invariant_breach_not_a_none():
    with pytest.raises(InvariantViolation, match="without TLS files .security_protocol PLAINTEXT"):
        _config("/nonexistent").tls_paths()


def test_the_checks_hold_under_python_dash_O(tmp_path):
    """They were asserts, which -O strips: the same refusals with -O."""
    code = ("from metalog.broker.server.snapshot_policy import SnapshotPolicy\n"
            "from metalog.broker.server.metrics import RaftStats\n"
            "from metalog.protocol.invariants import InvariantViolation\n"
            "try:\n    SnapshotPolicy(0)\nexcept ValueError:\n    print('policy refused')\n"
            "s = RaftStats()\ns.on_append(True, 0, 5)\n"
            "try:\n    s.on_append(True, 5, 5)\nexcept InvariantViolation:\n    print('empty append refused')\n")
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["policy refused", "empty append refused"]
