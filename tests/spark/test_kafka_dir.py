"""A metadata dir in Kafka's exact layout (tests/formats/kafka_dir.py: batches
by kafka-python, control records by kio, metadata records from Kafka's
schemas, record types we do not model among them) rebuilt and audited by the
Spark job: the state equals the one the controller replays, the snapshot
Kafka wrote compares equal entity by entity, and the unmodelled types are
listed with their counts in the report and on stdout."""

from __future__ import annotations

import os

from metalog.broker.controller.state import Controller
from tests.formats.kafka_dir import PART, SNAPSHOT_END, write_kafka_dir
from tests.spark.test_job import run_job, spark, state_of_checkpoint  # noqa: F401  (fixture)


def test_spark_rebuilds_and_audits_a_kafka_dir_listing_unmodelled_types(spark, tmp_path, capsys):
    d = str(tmp_path / "kafka")
    info = write_kafka_dir(d)
    out = tmp_path / "out"
    code, rep = run_job(spark, "snapshot", d, "--out", str(out), "--report", str(out / "r.json"))
    assert code == 0, rep
    assert rep["replay"]["unmodelled_records"] == {"ProducerIds": 2}
    assert rep["replay"]["invalid_records"] == 0 and rep["replay"]["data_records"] == 0
    [cmp] = rep["comparisons"]
    assert cmp["end_offset"] == SNAPSHOT_END and cmp["equal"], cmp
    assert cmp["unmodelled_records"] == {"ProducerIds": 1}
    stdout = capsys.readouterr().out
    assert "record types not modelled (counted, not applied): ProducerIds x2" in stdout
    assert "not compared, not modelled: ProducerIds x1" in stdout
    # The rebuilt checkpoint is the state our controller replays from the same segment.
    c = Controller()
    with open(os.path.join(d, PART, "00000000000000000000.log"), "rb") as fh:
        c.apply_batches(fh.read())
    assert c.applied_offset == info["log_end_offset"]
    assert c.state.unknown_records == {"ProducerIds": 2}  # BrokerRegistrationChange is modelled
    built = state_of_checkpoint(rep["snapshot"]["path"])
    assert built == c.state
    assert [(p.isr, p.leader) for _, p in sorted(built.partitions.items())] == [((1,), 1), ((2,), -1)]
    assert sorted((bid, br.fenced) for bid, br in built.brokers.items()) == [(1, False), (2, True)]
