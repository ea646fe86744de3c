"""Issue 19 item 4: reads that cost what they return. One topic, one broker,
and paged listings over the controller state, and the indexes behind them
(partition counts per topic, config names per resource) kept right through
creates, config changes, deletes, copies and a rebuild from records."""

import pytest

from broker import metadata_views as views
from broker.controller import ControllerState
from storage import metadata_records as r


def tid(i: int) -> str:
    return f"{i:08x}-0000-4000-8000-000000000000"


def state_with(topics: int, partitions: int, brokers: int = 3) -> ControllerState:
    s = ControllerState()
    for b in range(brokers):
        s.apply(s.offset, r.RegisterBroker(b, f"00000000-0000-0000-0001-{b:012d}", 1, (r.Endpoint("PLAINTEXT", "h", 9000 + b),)))
        s.offset += 1
    for i in range(topics):
        recs = [r.Topic(f"t{i:03d}", tid(i))] + [
            r.Partition(tid(i), p, (0, 1, 2), (0, 1, 2), p % 3) for p in range(partitions)]
        for rec in recs:
            assert s.apply(s.offset, rec)
            s.offset += 1
    return s


def test_topics_page_through_every_name_once_in_order():
    s = state_with(topics=25, partitions=2)
    seen, after = [], None
    for _ in range(10):
        page = views.topics_page(s, after, 10)
        seen += [t["name"] for t in page["topics"]]
        assert all(t["partitions"] == 2 for t in page["topics"])
        after = page["next"]
        if after is None:
            break
    assert seen == [f"t{i:03d}" for i in range(25)]
    assert views.topics_page(s, "t024", 10) == {"offset": s.offset, "topics": [], "next": None}


def test_one_topic_has_its_partitions_and_configs_and_pages_the_rest():
    s = state_with(topics=3, partitions=5)
    assert s.apply(s.offset, r.Config(r.RESOURCE_TOPIC, "t001", "retention.ms", "1000"))
    t = views.topic(s, "t001", partitions_limit=2)
    assert (t["topic_id"], t["partition_count"], t["configs"]) == (tid(1), 5, {"retention.ms": "1000"})
    assert [p["partition"] for p in t["partitions"]] == [0, 1] and t["next_partition"] == 1
    rest = views.partitions_page(s, "t001", 1, 10)
    assert [p["partition"] for p in rest["partitions"]] == [2, 3, 4] and rest["next"] is None
    assert rest["partitions"][0] == {"topic": "t001", "topic_id": tid(1), "partition": 2, "replicas": [0, 1, 2],
                                     "isr": [0, 1, 2], "leader": 2, "leader_epoch": 0, "partition_epoch": 0}
    assert views.topic(s, "nope") is None


def test_one_broker_with_its_configs_and_brokers_paged_by_id():
    s = state_with(topics=0, partitions=0, brokers=5)
    assert s.apply(s.offset, r.Config(r.RESOURCE_BROKER, "3", "log.dirs", "/x"))
    assert s.apply(s.offset, r.Config(r.RESOURCE_BROKER, "", "default.x", "1"))  # cluster default
    b3 = views.broker(s, 3)
    assert b3["broker_id"] == 3 and b3["configs"] == {"log.dirs": "/x"} and b3["fenced"] is True  # registered fenced, as in Kafka
    assert views.broker(s, 9) is None
    page = views.brokers_page(s, None, 2)
    assert [b["broker_id"] for b in page["brokers"]] == [0, 1] and page["next"] == 1
    page = views.brokers_page(s, 3, 2)
    assert [b["broker_id"] for b in page["brokers"]] == [4] and page["next"] is None
    assert views.resource_configs(s, r.RESOURCE_BROKER, "") == {"default.x": "1"}


def test_the_summary_counts_but_never_lists():
    s = state_with(topics=4, partitions=3)
    summary = views.summary(s)
    assert summary["counts"] == {"brokers": 3, "topics": 4, "partitions": 12, "configs": 0, "acls": 0}
    assert "partitions" not in summary and "topics" not in summary


def test_indexes_follow_deletes_config_removal_copies_and_a_rebuild():
    s = state_with(topics=3, partitions=4)
    assert s.apply(s.offset, r.Config(r.RESOURCE_TOPIC, "t002", "a", "1"))
    assert s.apply(s.offset, r.Config(r.RESOURCE_TOPIC, "t002", "b", "2"))
    assert s.apply(s.offset, r.Config(r.RESOURCE_TOPIC, "t002", "a", None))  # a delete
    assert views.resource_configs(s, r.RESOURCE_TOPIC, "t002") == {"b": "2"}
    copy = s.copy()
    assert s.apply(s.offset, r.RemoveTopic(tid(2)))
    assert views.topic(s, "t002") is None and (tid(2), 0) not in s.partitions
    assert not any(k[1] == "t002" for k in s.configs) and s.partition_counts.get(tid(2)) is None
    assert [t["name"] for t in views.topics_page(s, None, 10)["topics"]] == ["t000", "t001"]
    # The copy taken before is untouched, and a state rebuilt from records has the same indexes.
    assert views.topic(copy, "t002")["configs"] == {"b": "2"}
    rebuilt = ControllerState.from_records(s.to_records(), s.offset)
    assert rebuilt.partition_counts == s.partition_counts and rebuilt.config_names == s.config_names
    assert views.topics_page(rebuilt, None, 10) == views.topics_page(s, None, 10)
    # A topic created again under the same name is listed once, with its new id.
    assert s.apply(s.offset, r.Topic("t002", tid(9)))
    assert [t["topic_id"] for t in views.topics_page(s, "t001", 10)["topics"]] == [tid(9)]


@pytest.mark.parametrize("text, message", [("0", "between 1 and 1000"), ("1001", "between 1 and 1000"),
                                           ("ten", "must be an integer")])
def test_a_bad_limit_says_what_is_allowed(text, message):
    with pytest.raises(views.PageError, match=message):
        views.page_limit(text)
    assert views.page_limit(None) == views.PAGE_LIMIT_DEFAULT
