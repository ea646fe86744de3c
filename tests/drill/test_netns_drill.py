"""The drill on network namespaces: every fault verified to take effect, and a fault that does not bite fails it.

Runs as root (CI does): each broker in its own namespace on a private bridge,
faults as nftables DROP rules and a tc token bucket inside them.
"""

import argparse
import json
import os
import signal
import subprocess

import pytest

from metalog.tools.cluster.certs import describe
from metalog.tools.cluster.netns import NetnsHosts, cleanup_leftovers, run, unavailable
from metalog.tools.drill.drill import add_arguments, run_drill


def drill_args(tmp_path, *extra):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--dir", str(tmp_path / "run"), "--report", str(tmp_path / "report"), "--quiet",
                         "--snapshot-min-records", "1500", *extra])


def test_namespaces_can_be_made_here():
    """CI runs as root: a host where namespaces cannot be made fails here, naming why."""
    assert unavailable() is None


def mlg_names() -> str:
    return run(["ip", "netns", "list"]) + run(["ip", "-o", "link", "show"])


@pytest.mark.slow
def test_netns_drill_faults_bite_and_nothing_acknowledged_is_lost(tmp_path):
    args = drill_args(tmp_path, "--network", "netns", "--duration-s", "20",
                      "--schedule", "isolate_leader,cut_one_way,mtu_blackhole,loss_30,bandwidth_cap,split_majority")
    rc, report = run_drill(args)
    s = report["summary"]
    assert report["checker"]["ok"] and rc == 0, report["problems"]
    assert s["network"] == "netns"
    assert s["writes_acknowledged"] > 200 and s["writes_lost"] == 0 and s["writes_duplicated"] == 0
    kinds = s["faults_by_kind"]
    assert kinds.get("isolate_leader", 0) >= 1 and kinds.get("cut_one_way", 0) >= 1, kinds
    assert kinds.get("mtu_blackhole", 0) >= 1, kinds
    # every fault bit: packets dropped by the rules, and the effect each kind must have
    assert s["faults_verified"] == s["faults"], report["faults"]
    for f in report["faults"]:
        assert f["took_effect"], f
        if f["kind"] in ("isolate_leader", "cut_one_way", "split_majority", "loss_30", "mtu_blackhole"):
            assert f["net"]["dropped_packets"] > 0, f
    # An MTU black hole as a user sees it: a large record (one more writer's, while it is on)
    # is held until the heal -- its packets dropped, TCP retransmitting into the hole -- and
    # then acknowledged; the small writes went on (every fault's window has acks).
    with open(tmp_path / "run" / "history.jsonl") as fh:
        history = [json.loads(line) for line in fh]
    for f in (f for f in report["faults"] if f["kind"] == "mtu_blackhole"):
        ops = [h for h in history if h.get("process") == f"w{f['large_writer']['writer']}"]
        assert all(len(v) >= 4000 for h in ops for v in h["value"]["values"]), ops
        acked = [h for h in ops if h["type"] == "ok"]
        assert acked, ops
        # the hold (1.5 x --hold-s 2) ended before the heal; history times and t_s share the drill's start
        hold_end_s = f["t_s"] + 3.0 - 0.05
        assert acked[0]["time"] / 1e9 > hold_end_s, (acked[0]["time"] / 1e9, f)
    # an isolated leader is replaced within its own fault's window
    isolations = [f for f in report["failovers"] if f["kind"] == "isolate_leader"]
    assert isolations and all(f["leader_changed"] and f["failover_ms"] for f in isolations), isolations
    # brokers listened on their namespace's address, and their certificates carry it
    with open(tmp_path / "run" / "node-1" / "broker.yaml") as fh:
        assert "listen: 10.213.0.11:" in fh.read()
    assert "10.213.0.11" in describe(str(tmp_path / "run" / "certs" / "node-1.crt"))["san"]
    # the run's namespaces and links are gone
    assert f"mlg-{os.getpid():x}-" not in mlg_names() and f"mlg{os.getpid():x}" not in mlg_names()


@pytest.mark.slow
def test_a_partition_healed_during_a_snapshot_download(tmp_path):
    """A wiped follower downloads the leader's snapshot in 2 KiB FetchSnapshot answers; its
    link to the leader is cut mid-download and healed: it must install a whole snapshot
    (never the half it had), leave no partial, and catch up; nothing acknowledged is lost."""
    rc, report = run_drill(drill_args(tmp_path, "--network", "netns", "--faults", "1",
                                      "--schedule", "partition_snapshot"))
    s = report["summary"]
    assert report["checker"]["ok"] and rc == 0, report["problems"]
    assert s["writes_lost"] == 0 and s["writes_duplicated"] == 0 and s["writes_acknowledged"] > 200
    (f,) = report["faults"]
    assert f["took_effect"] and f["net"]["dropped_packets"] > 0, f
    # cut mid-way: more than one answer on disk, and the whole snapshot is many answers long
    assert f["at_cut"]["part_bytes"] > 2048 and not f["at_cut"]["checkpoints"], f
    # nothing came while cut but what was already in the follower's socket (an answer or two)
    assert f["before_heal"]["part_bytes"] <= f["at_cut"]["part_bytes"] + 2 * 2048, f
    # a snapshot installed after the heal; by the check the follower may have taken its own since
    installed = f["installs_after_heal"][0]
    sizes = [size for _end, _epoch, size in f["after"]["checkpoints"]]
    assert installed[0] > 0 and f["caught_up_s"] is not None and sizes, f
    assert min(sizes) > f["at_cut"]["part_bytes"] and min(sizes) > 20 * 2048, f
    assert f["after"]["parts"] == [] and f["after"]["bad_checkpoints"] == [], f
    # the follower's own log says it gave up no corrupt snapshot and installed after the heal
    node_log = tmp_path / "run" / f"node-{f['node']}" / "broker.log"
    events = [json.loads(line).get("event") for line in node_log.read_text().splitlines() if line.startswith("{")]
    assert "snapshot_download_rejected" not in events and "snapshot_installed" in events
    row = s["fault_kinds"]["partition_snapshot"]
    assert row["lost"] == 0 and row["duplicated"] == 0 and row["acknowledged"] > 0, row


@pytest.mark.slow
def test_kill_pause_and_wipe_under_network_faults(tmp_path):
    """kill -9 of a majority follower while the leader is isolated, SIGSTOP of the leader
    under 30% loss, a wipe under a one-way cut: each bit both ways, nothing lost."""
    rc, report = run_drill(drill_args(tmp_path, "--network", "netns", "--faults", "3",
                                      "--schedule", "kill_under_partition,pause_under_loss,wipe_under_cut"))
    s = report["summary"]
    assert report["checker"]["ok"] and rc == 0, report["problems"]
    assert s["writes_lost"] == 0 and s["writes_duplicated"] == 0
    by_kind = {f["kind"]: f for f in report["faults"]}
    assert sorted(by_kind) == ["kill_under_partition", "pause_under_loss", "wipe_under_cut"], by_kind
    for f in by_kind.values():
        assert f["took_effect"] and f["net"]["dropped_packets"] > 0, f
    kill = by_kind["kill_under_partition"]
    assert kill["exit_code"] == -signal.SIGKILL and kill["killed"] != kill["node"], kill
    assert kill["majority_leader"][0] != kill["node"] and kill["majority_leader"][1] > kill["epoch_before"], kill
    pause = by_kind["pause_under_loss"]
    assert pause["stopped"] and pause["net"]["matched_packets"] > pause["net"]["dropped_packets"], pause
    assert by_kind["wipe_under_cut"]["wiped"] and by_kind["wipe_under_cut"]["wiped_caught_up"]
    # the leader faults replaced the leader, and the drill prints their figures per kind
    changed = {f["kind"]: f for f in report["failovers"]}
    assert changed["kill_under_partition"]["leader_changed"] and changed["pause_under_loss"]["leader_changed"]
    for kind in by_kind:
        assert s["fault_kinds"][kind]["faults"] == 1 and s["fault_kinds"][kind]["lost"] == 0, s["fault_kinds"]


@pytest.mark.slow
def test_a_fault_that_does_not_bite_fails_the_drill(tmp_path):
    """The user-space proxy's isolation is a no-op since leaders advertise their real
    address (KIP-853): followers dial around the proxy. The drill must say so and fail."""
    rc, report = run_drill(drill_args(tmp_path, "--network", "proxy", "--duration-s", "8",
                                      "--schedule", "isolate_leader"))
    assert rc == 1
    assert len(report["problems"]) == 1, report["problems"]
    line = report["problems"][0]
    assert line.startswith("fault did not take effect: isolate_leader of node "), line
    assert "on the proxy: the cut-off leader's high watermark moved" in line, line
    assert report["faults"][0]["took_effect"] is False
    assert report["checker"]["ok"]  # nothing lost: the fault just did not happen


def test_a_crashed_runs_namespaces_are_cleaned_at_the_next_start():
    """Hosts of a run whose process is gone (and a broker still running inside one)
    are removed when the next run creates its hosts; a live run's hosts are left alone."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    leftover = NetnsHosts([1, 2], run_id=f"{dead.pid:x}").create()
    inside = subprocess.Popen(leftover.exec_prefix(1) + ["sleep", "300"])
    live = None
    try:
        names = mlg_names()
        assert leftover.ns(1) in names and leftover.bridge in names
        live = NetnsHosts([1], run_id=f"{os.getpid():x}").create()  # the next start
        assert inside.wait(timeout=10) == -signal.SIGKILL
        names = mlg_names()
        assert f"mlg-{dead.pid:x}-" not in names and f"mlg{dead.pid:x}" not in names, names
        assert live.ns(1) in names and live.client_ns in names and live.bridge in names
        assert not {live.ns(1), live.client_ns, live.bridge} & set(cleanup_leftovers())  # never a leftover
        assert live.ns(1) in mlg_names()
    finally:
        if inside.poll() is None:
            inside.kill()
        if live:
            live.remove()
        leftover.remove()
    assert f"mlg{os.getpid():x}" not in mlg_names()
