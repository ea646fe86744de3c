"""`metalog bench --vs kafka --smoke`: a real 3-controller Apache Kafka
quorum (plus its broker) and a real 3-voter metalog quorum, both mutual TLS,
driven by librdkafka's AdminClient for seconds each. It must work, not be
fast: the table has every row with both sides' figures and the ratio, both
sides did writes without errors in every phase, a new node caught up on each
side (3,000 ACLs), and every figure is positive and within a sane range (no speed is asserted; docs/bench.md has one run's
figures). Fails, never skips, without Kafka's jars (`bash run.sh setup`)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from metalog.tools import kafka
from metalog.tools.bench import vs_kafka, vs_kafka_catchup
from metalog.tools.cli import main as metalog_main

# Two JVM start-ups (and a new node each), two clusters, 12 short phases: about 3 minutes on a loaded 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def report_and_table(tmp_path_factory) -> tuple[dict, str]:
    try:
        kafka.classpath()
        kafka.java()
    except kafka.KafkaMissing as exc:
        pytest.fail(str(exc))
    d = tmp_path_factory.mktemp("vs_kafka")
    out = d / "report.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # the table; progress goes to stderr
        rc = metalog_main(["bench", "--vs", "kafka", "--smoke", "--dir", str(d / "clusters"), "--json", str(out)])
    assert rc == 0
    return json.loads(out.read_text()), printed.getvalue()


def test_the_table_has_every_measure_for_both_sides(report_and_table):
    report, table = report_and_table
    assert report["kafka_version"] == kafka.kafka_version()
    rows = {row["key"]: row for row in report["figures"]}
    assert list(rows) == [key for key, _, _ in vs_kafka.ROWS]
    lines = table.splitlines()
    assert lines[1].split() == ["measure", "metalog", "kafka", "metalog/kafka", "better"]
    for (key, label, _), line in zip(vs_kafka.ROWS, lines[2:]):
        row = rows[key]
        assert line.startswith(label)
        metalog, kafka_figure, ratio, better = line[len(label):].split()
        assert float(metalog) == row["metalog"] and float(kafka_figure) == row["kafka"]
        assert float(ratio) == pytest.approx(row["metalog"] / row["kafka"], rel=0.02, abs=0.01)
        assert better in ("metalog", "kafka", "-")
    assert "load average before" in lines[2 + len(vs_kafka.ROWS)]
    assert lines[-1].startswith("JSON report: ")


def test_both_sides_wrote_in_every_phase_and_the_figures_are_sane(report_and_table):
    report, _ = report_and_table
    for side in ("metalog", "kafka"):
        (only_round,) = report["rounds_detail"][side]
        phases = {(p["op"], p["clients"]): p for p in only_round["phases"]}
        assert set(phases) == {(op, c) for op in vs_kafka.OPS for c in vs_kafka.CLIENT_COUNTS}
        for (op, clients), p in phases.items():
            assert p["ops"] > 0, (side, op, clients, p)
            # A few refusals at 100 clients under load are tolerated; most writes succeed.
            assert p["errors"] <= p["ops"] // 10, (side, op, clients, p)
            assert 0 < p["p50_ms"] <= p["p99_ms"] <= p["max_ms"] < 30_000
        # The three quorum nodes (Kafka's broker is listed apart) between 10 MiB and 4 GiB each.
        assert len(only_round["rss_mb"]) == 3
        assert all(10 < mb < 4096 for mb in only_round["rss_mb"].values())
        assert 0 < only_round["startup_s"] < 180
        failover = only_round["failover"]
        assert failover["next_write_ms"] is not None and 0 < failover["next_write_ms"] < 90_000
        assert failover["leader_killed"] in (1, 2, 3)
    assert list(report["rounds_detail"]["kafka"][0]["rss_mb_other"]) == ["broker-100"]
    assert all(row["metalog"] > 0 and row["kafka"] > 0 for row in report["figures"])


def test_a_new_node_caught_up_on_both_sides_on_the_same_records(report_and_table):
    """The catch-up ran the 1M-record code on SMOKE_RECORDS ACLs: each new
    node reached the leader's high watermark of its spawn, and both leaders'
    snapshot + log hold every ACL written as one AccessControlEntryRecord,
    of the same size on both sides (the doc's figure is per record)."""
    report, _ = report_and_table
    assert report["catchup_records"] == vs_kafka_catchup.SMOKE_RECORDS
    per_record = {}
    for side in ("metalog", "kafka"):
        c = report["rounds_detail"][side][0]["catchup"]
        assert c["acls_written"] == vs_kafka_catchup.SMOKE_RECORDS
        assert c["target_offset"] > vs_kafka_catchup.SMOKE_RECORDS, (side, c)
        assert 0 < c["seconds"] < vs_kafka_catchup.CATCHUP_DEADLINE_S
        assert c["records_per_s"] == pytest.approx(c["target_offset"] / c["seconds"], rel=0.01)
        held = c["leader_log"]["records"].get("AccessControlEntry", 0)
        # The write phases' and the failover's ACLs are in the log too.
        assert held >= vs_kafka_catchup.SMOKE_RECORDS, (side, c["leader_log"])
        per_record[side] = c["leader_log"]["value_bytes"]["AccessControlEntry"] / held
        assert isinstance(c["snapshot_installed"], bool)
    assert report["rounds_detail"]["metalog"][0]["catchup"]["applied_seconds"] is not None
    assert per_record["metalog"] == pytest.approx(per_record["kafka"], rel=0.10), per_record
