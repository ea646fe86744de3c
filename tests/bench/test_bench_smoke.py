"""`metalog bench --smoke`: every section runs end to end against real
processes and reports sane figures. It must work, not be fast -- no speed is
asserted here (speed is measured by the bench itself, see docs/bench.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from metalog.tools.bench import bench
from metalog.tools.bench import etcd as bench_etcd
from metalog.tools.cli import main as metalog_main


def main(argv: list[str]) -> int:
    """`metalog <argv>` run in this process."""
    return metalog_main(argv)

pytestmark = pytest.mark.timeout(240)


def run_bench(tmp_path, *extra: str) -> dict:
    out = tmp_path / "report.json"
    rc = main(["bench", "--smoke", "--dir", str(tmp_path / "clusters"), "--json", str(out), *extra])
    assert rc == 0
    return json.loads(out.read_text())


def test_smoke_all_sections(tmp_path, capsys):
    report = run_bench(tmp_path, "--only", "throughput,light,failover,catchup", "--duration-s", "1",
                       "--light-duration-s", "1", "--light-rounds", "2")
    # The one-client section takes its own rounds (--smoke's --rounds is 1).
    assert len(report["throughput"]["rounds"]) == 1 and len(report["light"]["rounds"]) == 2
    assert report["settings"]["light_rounds"] == 2
    thr = report["throughput"]["best"]
    assert thr["clients"] == 50 and thr["ops"] > 0 and thr["errors"] == 0
    assert thr["p50_ms"] <= thr["p99_ms"] <= thr["p99_9_ms"] <= thr["max_ms"]
    light = report["light"]["best"]
    assert light["clients"] == 1 and light["ops"] > 0
    fo = report["failover"]
    assert fo["kills"] == 2 and all(ms > 0 for ms in fo["all_ms"])
    cu = report["catchup"]
    assert cu["by_snapshot"]["snapshot_installed"] and not cu["by_log"]["snapshot_installed"]
    assert cu["by_snapshot"]["log_start_offset"] >= cu["by_snapshot"]["records"]  # the log really was cut
    assert cu["by_log"]["log_start_offset"] == 0
    for way in ("by_log", "by_snapshot"):
        # The observer applied everything up to the HW it caught up to.
        assert cu[way]["observer_applied_offset"] >= cu[way]["high_watermark"] - 1
    table = capsys.readouterr().out
    assert "metalog TLS throughput (50 cl)" in table and "catch-up of 2000 records" in table
    assert report["throughput"]["tls"] is True and "plaintext_best" not in report["throughput"]


def test_smoke_vs_etcd(tmp_path, capsys):
    report = run_bench(tmp_path, "--only", "throughput", "--vs", "etcd", "--duration-s", "1", "--rounds", "3")
    table = capsys.readouterr()
    if bench_etcd.etcd_binary() is None:
        assert report["etcd"] == {"available": False, "why": "no etcd binary on PATH"}
        assert "apt-get install -y etcd-server" in table.err
        assert "etcd comparison skipped" in table.out
        return
    etcd = report["throughput"]["etcd_best"]
    assert etcd["ops"] > 0 and etcd["errors"] == 0 and etcd["clients"] == 50
    assert "ratio metalog/etcd (TLS)" in table.out and "etcd TLS throughput (50 cl)" in table.out
    # the same run also shows metalog without TLS, for TLS's cost
    plain = report["throughput"]["plaintext_best"]
    assert plain["ops"] > 0 and plain["errors"] == 0 and "metalog plain throughput (50 cl)" in table.out
    # each round runs the systems in the reverse order of the round before
    order = [line.split(": ")[0].split(" ", 4)[-1] for line in table.err.splitlines()
             if line.startswith("[bench] throughput round")]
    assert order == ["metalog TLS", "metalog plaintext", "etcd", "etcd", "metalog plaintext", "metalog TLS",
                     "metalog TLS", "metalog plaintext", "etcd"]
    # and each round's metalog run is paired with that round's etcd run
    paired = report["throughput"]["paired"]
    assert paired["rounds"] == 3 and 0 <= paired["both_below"] <= paired["p50_below"] <= 3
    assert f"metalog's p50 below etcd's in {paired['p50_below']} of 3" in table.out


def test_paired_rounds_compare_each_round_with_its_own_etcd_run():
    def run(p50, p99, rate):
        return {"p50_ms": p50, "p99_ms": p99, "records_per_s": rate}

    metalog = [run(2.0, 6.0, 400), run(3.0, 7.0, 300), run(2.5, 9.0, 350)]
    etcd = [run(2.5, 8.0, 380), run(2.8, 8.0, 320), run(3.0, 8.0, 310)]
    paired = bench.paired_rounds(metalog, etcd)
    assert (paired["rounds"], paired["p50_below"], paired["p99_below"], paired["both_below"]) == (3, 2, 2, 1)
    assert paired["median_p50_ratio"] == 1.2  # of 1.25, 0.933, 1.2
    assert paired["median_p99_ratio"] == 1.143  # of 1.333, 1.143, 0.889
    assert paired["median_throughput_ratio"] == 1.053  # of 1.053, 0.9375, 1.129
    assert bench.paired_rounds([], etcd) == {"rounds": 0}
    # a round in which etcd committed nothing (no percentiles) is left out, not a crash
    silent = {"p50_ms": None, "p99_ms": None, "records_per_s": 0.0}
    assert bench.paired_rounds(metalog, [silent] + etcd[1:])["rounds"] == 2


def test_unknown_section_is_refused(capsys):
    assert main(["bench", "--only", "throughput,speed"]) == 2
    assert "unknown section(s) ['speed']" in capsys.readouterr().err


def test_percentiles_nearest_rank():
    vals = list(range(1, 1001))  # 1..1000
    assert bench.percentile(vals, 50) == 500
    assert bench.percentile(vals, 99) == 990
    assert bench.percentile(vals, 99.9) == 999
    assert bench.percentile(vals, 100) == 1000
    assert bench.percentile([], 50) is None
    assert bench_etcd.encode_put_request(b"k", b"v" * 200) == b"\x0a\x01k\x12\xc8\x01" + b"v" * 200


def _barrier_child(script: str, stderr) -> "subprocess.Popen":
    return subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=stderr)


def test_load_workers_start_together_after_the_slowest_is_ready(tmp_path):
    """The measured window is fixed only once every load worker is connected:
    a worker that is slow to start (imports, TLS on a loaded machine) once
    missed a fixed start time entirely and the smoke run measured 0 records.
    Here one worker says ready 1 s after the other; both get the same start
    time, later than the slow one's ready line."""
    report = tmp_path / "got"
    script = ("import sys, time\n"
              "time.sleep({delay})\n"
              "ready_at = time.monotonic()\n"
              "sys.stdout.buffer.write(b'ready\\n'); sys.stdout.buffer.flush()\n"
              "start_at = float(sys.stdin.buffer.readline())\n"
              "open({out!r}, 'w').write(f'{{ready_at}} {{start_at}}')\n")
    children = []
    for i, delay in enumerate((0.0, 1.0)):
        with open(tmp_path / f"load-{i}.stderr", "wb") as err:
            children.append(_barrier_child(script.format(delay=delay, out=f"{report}{i}"), err))
    bench._start_together(children, str(tmp_path))
    for child in children:
        assert child.wait(timeout=10) == 0
    (fast_ready, fast_start), (slow_ready, slow_start) = (
        map(float, open(f"{report}{i}").read().split()) for i in range(2))
    assert fast_start == slow_start
    assert fast_start > slow_ready >= fast_ready + 0.9


def test_a_worker_dying_before_it_is_ready_is_reported_with_its_stderr(tmp_path):
    """The bench fails with the worker's own error instead of measuring nothing."""
    with open(tmp_path / "load-0.stderr", "wb") as err:
        child = _barrier_child("import sys; sys.stderr.write('no route to the cluster'); sys.exit(3)", err)
    with pytest.raises(RuntimeError, match=r"load worker 0 failed before it was ready \(3\): no route to the cluster"):
        bench._start_together([child], str(tmp_path))


def test_smoke_profile_commit(tmp_path, capsys):
    """--only profile: three TLS brokers started with the commit trace on
    write their marks when stopped, and every write of the one client is
    followed through them; the table names each stage."""
    report = run_bench(tmp_path, "--only", "profile", "--light-duration-s", "1")
    prof = report["commit_profile"]
    assert prof["load"]["ops"] > 0 and prof["load"]["errors"] == 0
    assert prof["followed"] > 0, prof
    stages = {row["stage"]: row for row in prof["stages"]}
    total = stages["total (client send -> answer)"]
    assert 0 < total["p50_us"] <= total["p99_us"]
    # The parts of a commit's critical path come before its end.
    assert stages["follower appended -> fsync done"]["p50_us"] < total["p50_us"]
    # The codec's cost per request, timed inside the brokers (issue 32 item 8).
    codec = {(r["node"], r["op"], r["api"]): r for r in prof["codec"]["rows"]}
    for key in [("leader", "decode request", "Produce"), ("leader", "decode request", "Fetch"),
                ("follower", "decode answer", "Fetch"), ("follower", "encode request", "Fetch")]:
        assert codec[key]["count"] > 0 and 0 < codec[key]["p50_us"] <= codec[key]["p99_us"], key
    assert 0 < prof["codec"]["per_commit_p50_us"] < total["p50_us"]
    out = capsys.readouterr().out
    assert "commit profile:" in out and "next Fetch written -> leader read it" in out
    assert "the codec on one commit's path" in out


def test_light_rounds_below_one_is_refused(tmp_path, capsys):
    rc = main(["bench", "--only", "light", "--light-rounds", "0", "--dir", str(tmp_path / "clusters")])
    assert rc == 2
    assert "--light-rounds must be at least 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "clusters").exists()  # refused before any cluster was made
