"""Command builders: validation against the committed state, with clear errors."""

import pytest

from metalog.broker.controller.state import CommandError
from metalog.protocol.errors import Errors
from metalog.storage import metadata_records as r
from tests.controller.test_state import cluster


def decode(vals):
    return [r.decode_record(v) for v in vals]


def test_create_topic_assignment_round_robin():
    c, lg = cluster(3)
    recs = decode(c.create_topic("t", 4, 2, topic_id="00000000-0000-0000-0000-0000000000a1"))
    assert recs[0] == r.Topic("t", "00000000-0000-0000-0000-0000000000a1")
    assert [(p.partition_id, p.replicas, p.leader) for p in recs[1:]] == [
        (0, (0, 1), 0), (1, (1, 2), 1), (2, (2, 0), 2), (3, (0, 1), 0)]


@pytest.mark.parametrize("args, msg", [
    (("bad/name", 1, 1), "invalid topic name 'bad/name'"),
    ((".", 1, 1), "invalid topic name '.'"),
    (("t", 0, 1), "number of partitions must be at least 1, got 0"),
    (("t", 1, 0), "replication factor must be at least 1, got 0"),
    (("t", 1, 4), "replication factor 4 is larger than the 3 live broker(s) [0, 1, 2]"),
])
def test_create_topic_refusals(args, msg):
    c, _ = cluster(3)
    with pytest.raises(CommandError) as ei:
        c.create_topic(*args)
    assert msg in str(ei.value)


def test_create_existing_topic_and_fenced_brokers():
    c, lg = cluster(3)
    lg.commit(c.create_topic("t", 1, 1))
    with pytest.raises(CommandError, match="topic 't' already exists"):
        c.create_topic("t", 1, 1)
    lg.commit(c.fence_broker(2))
    with pytest.raises(CommandError, match="larger than the 2 live broker"):
        c.create_topic("u", 1, 3)
    with pytest.raises(CommandError, match="broker 2 is not registered and unfenced") as ei:
        c.create_topic("u", 1, 1, live_brokers=[2])
    assert ei.value.error_code == Errors.BROKER_NOT_AVAILABLE


def test_delete_unknown_topic():
    c, _ = cluster(1)
    with pytest.raises(CommandError, match="unknown topic 'x'") as ei:
        c.delete_topic("x")
    assert ei.value.error_code == Errors.UNKNOWN_TOPIC_OR_PARTITION


def test_fence_unfence_cycle_restores_leadership():
    c, lg = cluster(2)
    lg.commit(c.create_topic("t", 1, 2, topic_id="00000000-0000-0000-0000-0000000000a1"))
    lg.commit(c.fence_broker(0))
    lg.commit(c.fence_broker(1))
    p = c.state.partitions[("00000000-0000-0000-0000-0000000000a1", 0)]
    assert p.leader == -1 and p.isr == (1,)  # last in-sync replica is kept
    with pytest.raises(CommandError, match="broker 1 is already fenced"):
        c.fence_broker(1)
    lg.commit(c.unfence_broker(0))
    assert c.state.partitions[("00000000-0000-0000-0000-0000000000a1", 0)].leader == -1  # 0 is not in the ISR
    lg.commit(c.unfence_broker(1))
    p = c.state.partitions[("00000000-0000-0000-0000-0000000000a1", 0)]
    assert p.leader == 1 and c.state.invalid_records == 0
    with pytest.raises(CommandError, match="broker 1 is not fenced"):
        c.unfence_broker(1)


def test_unknown_broker_errors():
    c, _ = cluster(1)
    for fn in (c.fence_broker, c.unfence_broker, c.unregister_broker):
        with pytest.raises(CommandError, match="unknown broker 9"):
            fn(9)


def test_unregister_fences_first_and_reregister_bumps_epoch():
    c, lg = cluster(2)
    lg.commit(c.create_topic("t", 1, 2, topic_id="00000000-0000-0000-0000-0000000000a1"))
    recs = decode(c.unregister_broker(0))
    assert [type(x) for x in recs] == [r.FenceBroker, r.PartitionChange, r.UnregisterBroker]
    lg.commit(c.unregister_broker(0))
    assert 0 not in c.state.brokers and c.state.partitions[("00000000-0000-0000-0000-0000000000a1", 0)].leader == 1
    lg.commit(c.register_broker(1, [("PLAINTEXT", "h", 1)]))
    assert c.state.brokers[1].broker_epoch == 2


def test_register_and_config_refusals():
    c, _ = cluster(1)
    with pytest.raises(CommandError, match="port 70000 out of range"):
        c.register_broker(3, [("PLAINTEXT", "h", 70000)])
    with pytest.raises(CommandError, match="unknown config resource type 3"):
        c.set_config(3, "x", "a", "b")
    with pytest.raises(CommandError, match="unknown topic 'nope'"):
        c.set_config(2, "nope", "a", "b")
    with pytest.raises(CommandError, match="must be a broker id or ''"):
        c.set_config(4, "abc", "a", "b")
    with pytest.raises(CommandError, match="config name must not be empty"):
        c.set_config(4, "1", "", "b")


def test_config_delete():
    c, lg = cluster(1)
    lg.commit(c.set_config(4, "0", "a", "1"))
    assert c.state.configs == {(4, "0", "a"): "1"}
    lg.commit(c.set_config(4, "0", "a", None))
    assert c.state.configs == {}
