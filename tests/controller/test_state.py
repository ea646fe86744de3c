"""Controller state machine: apply rules, fences (Kafka's explicit and old logs' implicit), rebuild from to_records."""

import pytest
from hypothesis import given, settings, strategies as st

from metalog.broker.controller.state import CommandError, Controller, ControllerState, LogGapError
from metalog.protocol.invariants import InvariantViolation
from metalog.storage import batch as b
from metalog.storage import control_records as cr
from metalog.storage import metadata_records as r

T = "00000000-0000-0000-0000-000000000001"
INC = "00000000-0000-0000-0001-000000000000"  # an incarnation id


class Log:
    """Commits command output as batches at contiguous offsets, like the quorum."""

    def __init__(self, controller: Controller):
        self.c = controller
        self.next_offset = 0
        self.data = bytearray()

    def commit(self, values, control=False):
        batch = b.encode_batch(self.next_offset, 1, values, 0, is_control=control)
        self.next_offset += len(values)
        self.data += batch
        self.c.apply_batches(batch)


def cluster(n_brokers=3):
    c = Controller()
    lg = Log(c)
    for i in range(n_brokers):
        lg.commit(c.register_broker(i, [("PLAINTEXT", "localhost", 9092 + i)]))
    return c, lg


def apply_all(state, recs):
    for rec in recs:
        state.apply(state.offset, rec)


def _fence_setup() -> ControllerState:
    s = ControllerState()
    apply_all(s, [r.RegisterBroker(i, f"00000000-0000-0000-0001-{i:012d}", 1, fenced=False) for i in range(3)])
    apply_all(s, [
        r.Topic("t", T),
        r.Partition(T, 0, (0, 1, 2), (0, 1, 2), 0, 5, 7),
        r.Partition(T, 1, (2, 0, 1), (2, 0, 1), 2, 3, 3),
        r.Partition(T, 2, (1, 2), (1, 2), 1, 0, 0),
        r.Partition(T, 3, (0, 1), (0,), 0, 2, 2),
    ])
    return s


def test_kafkas_fence_broker_only_marks_the_broker():
    s = _fence_setup()
    before = dict(s.partitions)
    assert s.apply(s.offset, r.FenceBroker(0, 1))
    assert s.brokers[0].fenced and s.partitions == before


def test_an_empty_isr_without_a_leader_is_kafkas_eligible_leader_replicas_state():
    """KIP-966: Kafka 4.x fences the last in-sync replica out of the ISR
    (PartitionRecord/PartitionChange with Isr [] and Leader -1)."""
    s = _fence_setup()
    assert s.apply(s.offset, r.PartitionChange(T, 3, isr=(), leader=-1))
    assert s.partitions[(T, 3)].isr == () and s.partitions[(T, 3)].leader == -1
    assert s.apply(s.offset, r.Partition(T, 4, (0,), (), -1)) and s.invalid_records == 0


def test_kafkas_broker_registration_change_fences_and_unfences_only_the_broker():
    s = _fence_setup()
    before = dict(s.partitions)
    assert s.apply(s.offset, r.BrokerRegistrationChange(0, 1, fenced=1))
    assert s.brokers[0].fenced and s.partitions == before
    assert s.apply(s.offset, r.BrokerRegistrationChange(0, 1, in_controlled_shutdown=1))  # not modelled: no change
    assert s.brokers[0].fenced
    assert s.apply(s.offset, r.BrokerRegistrationChange(0, 1, fenced=-1))
    assert not s.brokers[0].fenced and s.invalid_records == 0


def test_a_state_is_born_at_metadata_version_21_and_snapshots_write_it_first():
    s = _fence_setup()
    assert ControllerState().features == {"metadata.version": 21}
    assert s.apply(s.offset, r.FeatureLevel("a.feature", 2))
    assert list(s.to_records())[:2] == [r.FeatureLevel("metadata.version", 21), r.FeatureLevel("a.feature", 2)]
    assert s.apply(s.offset, r.FeatureLevel("metadata.version", 30))  # a Kafka log's bootstrap record
    assert s.features["metadata.version"] == 30


def test_fence_command_writes_explicit_partition_changes_equal_to_the_implicit_rule():
    """Controller.fence_broker writes FenceBroker + one PartitionChange per
    changed partition (only the changed fields); applied, they give the state
    an old log's FenceBrokerImplicit gives."""
    c = Controller(_fence_setup())
    values = c.fence_broker(0)
    recs = [r.decode_record(v) for v in values]
    assert recs == [r.FenceBroker(0, 1),
                    r.PartitionChange(T, 0, isr=(1, 2), leader=1),
                    r.PartitionChange(T, 1, isr=(2, 1)),
                    r.PartitionChange(T, 3, leader=-1)]
    explicit = c.state
    for rec in recs:
        assert explicit.apply(explicit.offset, rec)
    implicit = _fence_setup()
    assert implicit.apply(implicit.offset, r.FenceBrokerImplicit(0, 1))
    implicit.skip_to(explicit.offset)
    assert explicit == implicit


def test_implicit_fence_of_an_old_log_expands_to_every_partition():
    s = ControllerState()
    apply_all(s, [r.RegisterBroker(i, f"00000000-0000-0000-0001-{i:012d}", 1, fenced=False) for i in range(3)])
    apply_all(s, [
        r.Topic("t", T),
        r.Partition(T, 0, (0, 1, 2), (0, 1, 2), 0, 5, 7),   # leader 0 -> moves to 1
        r.Partition(T, 1, (2, 0, 1), (2, 0, 1), 2, 3, 3),   # follower 0 -> ISR shrinks only
        r.Partition(T, 2, (1, 2), (1, 2), 1, 0, 0),         # untouched
        r.Partition(T, 3, (0, 1), (0,), 0, 2, 2),           # last ISR member: ISR kept, offline
    ])
    s.apply(s.offset, r.FenceBrokerImplicit(0, 1))
    p = s.partitions
    assert (p[(T, 0)].isr, p[(T, 0)].leader, p[(T, 0)].leader_epoch, p[(T, 0)].partition_epoch) \
        == ((1, 2), 1, 6, 8)
    assert (p[(T, 1)].isr, p[(T, 1)].leader, p[(T, 1)].leader_epoch, p[(T, 1)].partition_epoch) \
        == ((2, 1), 2, 3, 4)
    assert p[(T, 2)] == r.Partition(T, 2, (1, 2), (1, 2), 1, 0, 0)
    assert (p[(T, 3)].isr, p[(T, 3)].leader, p[(T, 3)].leader_epoch, p[(T, 3)].partition_epoch) \
        == ((0,), -1, 3, 3)
    assert s.brokers[0].fenced and s.invalid_records == 0


def test_fence_elects_in_replica_order_skipping_fenced():
    s = ControllerState()
    apply_all(s, [r.RegisterBroker(i, INC, 1, fenced=False) for i in range(4)])
    apply_all(s, [r.Topic("t", T), r.Partition(T, 0, (0, 3, 1, 2), (2, 1, 0, 3), 0),
                  r.FenceBrokerImplicit(3, 1)])
    assert s.partitions[(T, 0)].isr == (2, 1, 0)
    s.apply(s.offset, r.FenceBrokerImplicit(0, 1))
    # replicas order 0,3,1,2: 0 and 3 fenced -> 1, although 2 comes first in the ISR
    assert s.partitions[(T, 0)].leader == 1


def test_fence_with_wrong_epoch_is_ignored_and_counted():
    s = ControllerState()
    apply_all(s, [r.RegisterBroker(0, INC, 4, fenced=False)])
    assert s.apply(1, r.FenceBroker(0, 3)) is False
    assert not s.brokers[0].fenced and s.invalid_records == 1
    assert "FenceBroker of unknown broker 0 epoch 3" in s.last_invalid
    assert s.offset == 2


@pytest.mark.parametrize("rec, why", [
    (r.Partition("00000000-0000-0000-0000-00000000dead", 0, (0,), (0,), 0), "unknown topic"),
    (r.Partition(T, 0, (0, 0), (0,), 0), "bad replica list"),
    (r.Partition(T, 0, (0, 1), (2,), 2), "not a subset"),
    (r.Partition(T, 0, (0, 1), (0,), 1), "leader 1 is not in the ISR"),
    (r.Partition(T, 0, (0,), (0, 0), 0), "bad ISR"),
    (r.Partition(T, 0, (0,), (), 0), "leader 0 is not in the ISR []"),
    (r.PartitionChange(T, 9, leader=0), "unknown partition"),
    (r.Topic("t", "other-id"), "already exists"),
    (r.Config(3, "t", "a", "b"), "unknown resource type 3"),
    (r.Config(2, "zz", "a", "b"), "unknown topic 'zz'"),
    (r.RemoveTopic("00000000-0000-0000-0000-00000000dead"), "unknown topic id"),
    (r.UnfenceBroker(7, 1), "unknown broker 7"),
    (r.BrokerRegistrationChange(0, 2, fenced=1), "BrokerRegistrationChange of broker 0 epoch 2"),
    (r.BrokerRegistrationChange(0, 1, fenced=2), "(fenced 2, in controlled shutdown 0)"),
    (r.FeatureLevel("metadata.version", 6), "metadata.version 6: Kafka's levels start at 7"),
    (r.FeatureLevel("metadata.version", 0), "metadata.version 0"),
    (r.RegisterBroker(0, INC, 0), "older than registered epoch 1"),
])
def test_invalid_records_are_ignored_deterministically(rec, why):
    s = ControllerState()
    apply_all(s, [r.RegisterBroker(0, INC, 1, fenced=False), r.Topic("t", T)])
    before = s.copy()
    assert s.apply(s.offset, rec) is False
    assert why in s.last_invalid
    assert s.invalid_records == 1
    before.offset = s.offset
    assert s == before


def test_partition_change_rules():
    s = ControllerState()
    apply_all(s, [r.Topic("t", T), r.Partition(T, 0, (0, 1, 2), (0, 1, 2), 0)])
    s.apply(s.offset, r.PartitionChange(T, 0, isr=(0, 1)))
    p = s.partitions[(T, 0)]
    assert (p.isr, p.leader, p.leader_epoch, p.partition_epoch) == ((0, 1), 0, 0, 1)
    s.apply(s.offset, r.PartitionChange(T, 0, leader=1))
    p = s.partitions[(T, 0)]
    assert (p.leader, p.leader_epoch, p.partition_epoch) == (1, 1, 2)
    s.apply(s.offset, r.PartitionChange(T, 0, leader=-1))
    assert s.partitions[(T, 0)].leader == -1 and s.partitions[(T, 0)].leader_epoch == 2


def test_remove_topic_drops_partitions_and_configs():
    c, lg = cluster()
    lg.commit(c.create_topic("t", 4, 2, topic_id=T))
    lg.commit(c.set_config(2, "t", "retention.ms", "5"))
    lg.commit(c.set_config(4, "", "log.dirs", "/x"))
    lg.commit(c.delete_topic("t"))
    s = c.state
    assert not s.topics and not s.partitions and not s.topic_ids
    assert s.configs == {(4, "", "log.dirs"): "/x"}
    # the name is free again
    lg.commit(c.create_topic("t", 1, 1))
    assert s.topic_by_name("t").topic_id != T


def test_records_strictly_in_offset_order():
    s = ControllerState()
    s.apply(5, r.NoOp())
    with pytest.raises(InvariantViolation, match="offset order: got 3, next is 6"):
        s.apply(3, r.NoOp())


def test_apply_batches_control_batches_undecodable_and_rereads():
    c = Controller()
    lg = Log(c)
    lg.commit([cr.encode_control(cr.LeaderChange(1, [1, 2, 3]))], control=True)
    lg.commit(c.register_broker(1) + [b"\x00\x63\x00\x00garbage"])
    assert c.applied_offset == 3 and c.records_since_snapshot == 2
    assert c.state.invalid_records == 1
    assert c.state.last_invalid == "offset 2: not a metadata record: frame version 0 (only 1 exists)"
    # A Kafka type we keep whole is valid and counted by name (ProducerIds: it moves the next block, too).
    lg.commit([bytes.fromhex("01 0f 00 00000001 0000000000000000 00000000000003e8 00")])
    assert c.applied_offset == 4 and c.state.invalid_records == 1 and c.state.next_producer_id == 1000
    assert c.state.unknown_records == {"ProducerIds": 1}
    # Re-reading from the start applies nothing twice.
    assert c.apply_batches(bytes(lg.data)) == 0
    assert c.applied_offset == 4 and c.state.unknown_records == {"ProducerIds": 1}


def test_apply_batches_stops_at_high_watermark_inside_a_batch():
    c = Controller()
    vals = [r.encode_record(r.RegisterBroker(i, INC, 1, fenced=False)) for i in range(4)]
    data = b.encode_batch(0, 1, vals, 0)
    assert c.apply_batches(data, end_offset=2) == 2
    assert sorted(c.state.brokers) == [0, 1] and c.applied_offset == 2
    assert c.apply_batches(data) == 2
    assert sorted(c.state.brokers) == [0, 1, 2, 3] and c.applied_offset == 4


def test_apply_batches_refuses_a_gap():
    c = Controller()
    with pytest.raises(LogGapError, match="expected offset 0, got a batch starting at 5"):
        c.apply_batches(b.encode_batch(5, 1, [r.encode_record(r.NoOp())], 0))


def test_to_json_shape():
    c, lg = cluster(2)
    lg.commit(c.create_topic("orders", 2, 2, topic_id=T))
    lg.commit(c.set_config(2, "orders", "cleanup.policy", "compact"))
    j = c.state.to_json()
    assert j["offset"] == lg.next_offset
    assert [br["broker_id"] for br in j["brokers"]] == [0, 1]
    assert j["brokers"][0]["endpoints"] == [{"name": "PLAINTEXT", "host": "localhost", "port": 9092}]
    assert j["topics"] == [{"name": "orders", "topic_id": T, "partitions": 2}]
    assert j["partitions"][1] == {"topic": "orders", "topic_id": T, "partition": 1,
                                  "replicas": [1, 0], "isr": [1, 0], "leader": 1,
                                  "leader_epoch": 0, "partition_epoch": 0}
    assert j["configs"] == [{"resource_type": 2, "resource_name": "orders",
                             "name": "cleanup.policy", "value": "compact"}]


# -------------------------------------------------------------- rebuild property

commands = st.lists(st.tuples(
    st.sampled_from(["register", "fence", "unfence", "unregister", "create", "delete",
                     "config", "isr", "raw_partition_change", "feature"]),
    st.integers(0, 5), st.integers(0, 3), st.integers(1, 3)), max_size=40)


def run(c, lg, cmds):
    for verb, a, b_, n in cmds:
        try:
            if verb == "register":
                vals = c.register_broker(a, [("PLAINTEXT", "h", 9000 + a)], rack=f"r{b_}")
            elif verb == "fence":
                vals = c.fence_broker(a)
            elif verb == "unfence":
                vals = c.unfence_broker(a)
            elif verb == "unregister":
                vals = c.unregister_broker(a)
            elif verb == "create":
                vals = c.create_topic(f"t{b_}", n, min(n, 2))
            elif verb == "delete":
                vals = c.delete_topic(f"t{b_}")
            elif verb == "config":
                vals = c.set_config(2 if a % 2 else 4, f"t{b_}" if a % 2 else "",
                                    f"k{n}", None if a == 5 else f"v{a}")
            elif verb == "isr":
                keys = sorted(c.state.partitions)
                if not keys:
                    continue
                p = c.state.partitions[keys[a % len(keys)]]
                vals = [r.encode_record(r.PartitionChange(p.topic_id, p.partition_id,
                                                          isr=p.replicas, leader=p.replicas[0]))]
            elif verb == "raw_partition_change":
                # Unvalidated: may be invalid, the state machine must ignore it.
                keys = sorted(c.state.partitions)
                tid, pid = keys[a % len(keys)] if keys else ("00000000-0000-0000-0000-00000000dead", 0)
                vals = [r.encode_record(r.PartitionChange(tid, pid, isr=(a,), leader=b_))]
            else:
                vals = [r.encode_record(r.FeatureLevel(f"f{b_}", a))]
        except CommandError:
            continue
        lg.commit(vals)


@settings(max_examples=60, deadline=None)
@given(commands)
def test_to_records_rebuilds_the_state_exactly(cmds):
    c = Controller()
    lg = Log(c)
    run(c, lg, cmds)
    s = c.state
    rebuilt = ControllerState.from_records(s.to_records(), s.offset)
    assert rebuilt.invalid_records == 0
    assert rebuilt == s
    assert rebuilt.to_json() == s.to_json()
    # Replaying the same log on a fresh controller gives the same state (determinism).
    other = Controller()
    other.apply_batches(bytes(lg.data))
    assert other.state == s and other.state.invalid_records == s.invalid_records
    # Round trip through the encoding too.
    again = ControllerState.from_records(
        (r.decode_record(r.encode_record(x)) for x in s.to_records()), s.offset)
    assert again == s


def test_offset_order_is_checked_under_python_O_too():
    """A production invariant, not an assert: python -O keeps it."""
    import subprocess
    import sys

    code = ("from metalog.broker.controller.state import ControllerState\n"
            "from metalog.storage import metadata_records as r\n"
            "s = ControllerState(); s.apply(5, r.NoOp()); s.apply(3, r.NoOp())\n")
    proc = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "metalog.protocol.invariants.InvariantViolation: records must be applied in offset order: got 3, next is 6")
