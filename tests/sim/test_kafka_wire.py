"""The simulator on Kafka's wire (sim/kafka_wire.py, issue 32).

Every message between simulated nodes goes through the brokers' own edge
and controller-listener handlers: flat body -> Kafka's request bytes -> the
receiver's flat body, and back. The mapping must be transparent: a seed run
on Kafka's wire makes exactly the same steps, trace line for line, as on
flat bodies, so that everything ten thousand flat seeds established holds
for the protocol the brokers speak. A field the wire cannot carry shows up
as a diverging trace: the first such finding was the leader hint in
OffsetsForLeaderEpoch answers (Kafka's answer has no field for it), which
the flat path delivered and the brokers never could; seeds 1 and 2 diverged
on it and are among those checked here.

``SIM_WIRE_SEEDS`` sets how many seeds (default 24, with membership changes,
snapshots, wire corruption and every fault kind among them).
"""

from __future__ import annotations

import os

import pytest

from metalog.sim.random_run import RandomRun


def _seeds() -> list[int]:
    return list(range(int(os.environ.get("SIM_WIRE_SEEDS", "24"))))


@pytest.mark.parametrize("seed", _seeds())
def test_a_seed_on_kafkas_wire_steps_exactly_as_on_flat_bodies(seed):
    flat = RandomRun(seed, 25000, 15000, snapshots=True).run()
    on_wire_run = RandomRun(seed, 25000, 15000, snapshots=True, kafka_wire=True)
    on_wire = on_wire_run.run()
    carried = on_wire_run.cluster.kafka
    assert carried is not None and carried.requests > 500, "the wire carried the run's requests"
    assert on_wire.trace_hash == flat.trace_hash, (
        f"SIM_SEED={seed}: the run diverged on Kafka's wire (replay with SIM_KAFKA_WIRE=1 and compare the traces)")
    assert (on_wire.events, on_wire.acked_records, on_wire.final_hw) == (flat.events, flat.acked_records,
                                                                          flat.final_hw)
