"""Issue 19 item 4: reads that cost what they return. One topic, one broker,
and paged listings over the controller state, and the indexes behind them
(partition counts per topic, config names per resource) kept right through
creates, config changes, deletes, copies and a rebuild from records."""

import time

import msgspec
import pytest

from metalog.broker.controller import views
from metalog.broker.controller.state import ControllerState
from metalog.broker.controller.state_copy import IncrementalCopy
from metalog.storage import metadata_records as r


def as_json(view):
    """A view as the admin API's client sees it: encoded, then decoded."""
    return msgspec.json.decode(views.encode(view))


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
    t = as_json(views.topic(s, "t001", partitions_limit=2))
    assert (t["topic_id"], t["partition_count"], t["configs"]) == (tid(1), 5, {"retention.ms": "1000"})
    assert t["next_config"] is None
    assert [p["partition"] for p in t["partitions"]] == [0, 1] and t["next_partition"] == 1
    rest = as_json(views.partitions_page(s, "t001", 1, 10))
    assert [p["partition"] for p in rest["partitions"]] == [2, 3, 4] and rest["next"] is None
    assert rest["partitions"][0] == {"topic": "t001", "topic_id": tid(1), "partition": 2, "replicas": [0, 1, 2],
                                     "isr": [0, 1, 2], "leader": 2, "leader_epoch": 0, "partition_epoch": 0}
    assert views.topic(s, "nope") is None


def test_one_broker_with_its_configs_and_brokers_paged_by_id():
    s = state_with(topics=0, partitions=0, brokers=5)
    assert s.apply(s.offset, r.Config(r.RESOURCE_BROKER, "3", "log.dirs", "/x"))
    assert s.apply(s.offset, r.Config(r.RESOURCE_BROKER, "", "default.x", "1"))  # cluster default
    b3 = views.broker(s, 3)
    assert b3["broker_id"] == 3 and b3["configs"] == {"log.dirs": "/x"} and b3["fenced"] is True
    assert b3["next_config"] is None  # registered fenced, as in Kafka
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


def test_a_page_ends_at_its_limit_and_the_last_page_says_so():
    """Page boundaries of every paged view: a full page carries the cursor of
    its last item, the page after it starts right after that item, and the
    last page (full or not) has next None."""
    s = state_with(topics=4, partitions=6)
    page = views.partitions_page(s, "t002", None, 3)
    assert [p.partition for p in page["partitions"]] == [0, 1, 2] and page["next"] == 2
    page = views.partitions_page(s, "t002", 2, 3)
    assert [p.partition for p in page["partitions"]] == [3, 4, 5] and page["next"] is None  # exactly full, last
    assert views.partitions_page(s, "t002", 5, 3)["partitions"] == []
    assert views.topics_page(s, None, 4)["next"] is None and views.topics_page(s, None, 3)["next"] == "t002"
    for i in range(5):
        assert s.apply(s.offset, r.Config(r.RESOURCE_TOPIC, "t001", f"k{i}", str(i)))
    assert views.configs_page(s, r.RESOURCE_TOPIC, "t001", None, 2) == ({"k0": "0", "k1": "1"}, "k1")
    assert views.configs_page(s, r.RESOURCE_TOPIC, "t001", "k1", 2) == ({"k2": "2", "k3": "3"}, "k3")
    assert views.configs_page(s, r.RESOURCE_TOPIC, "t001", "k3", 2) == ({"k4": "4"}, None)
    # A cursor that names nothing still pages from where it would sort.
    assert views.configs_page(s, r.RESOURCE_TOPIC, "t001", "k10", 2) == ({"k2": "2", "k3": "3"}, "k3")
    assert views.configs_page(s, r.RESOURCE_TOPIC, "nope", None, 2) == ({}, None)


def test_a_topic_answer_holds_at_most_a_page_of_configs():
    s = state_with(topics=1, partitions=1)
    for i in range(views.PAGE_LIMIT_MAX + 5):
        assert s.apply(s.offset, r.Config(r.RESOURCE_TOPIC, "t000", f"k{i:05d}", "v"))
    t = views.topic(s, "t000")
    assert len(t["configs"]) == views.PAGE_LIMIT_MAX and t["next_config"] == f"k{views.PAGE_LIMIT_MAX - 1:05d}"
    rest, after = views.configs_page(s, r.RESOURCE_TOPIC, "t000", t["next_config"])
    assert list(rest) == [f"k{i:05d}" for i in range(views.PAGE_LIMIT_MAX, views.PAGE_LIMIT_MAX + 5)]
    assert after is None


def test_sorted_names_and_acl_ids_follow_creates_and_deletes_once_built():
    s = state_with(topics=3, partitions=1)
    assert [t["name"] for t in views.topics_page(s, None, 10)["topics"]] == ["t000", "t001", "t002"]
    assert s.apply(s.offset, r.Topic("a-first", tid(7)))
    assert s.apply(s.offset, r.RemoveTopic(tid(1)))
    assert [t["name"] for t in views.topics_page(s, None, 10)["topics"]] == ["a-first", "t000", "t002"]
    assert s.sorted_topic_names() == sorted(s.topic_ids)
    acl = dict(principal="User:a", host="*", operation=2, permission_type=3, resource_type=4,
               resource_name="kafka-cluster", pattern_type=3)
    ids = [f"00000000-0000-4000-8000-00000000000{i}" for i in (3, 1, 2)]
    assert s.apply(s.offset, r.AccessControlEntry(id=ids[0], **acl))
    assert [a["id"] for a in views.acls_page(s, None, 10)["acls"]] == [ids[0]]  # the sorted list is built
    assert s.apply(s.offset, r.AccessControlEntry(id=ids[1], **acl))
    assert s.apply(s.offset, r.AccessControlEntry(id=ids[2], **acl))
    assert s.apply(s.offset, r.RemoveAccessControlEntry(ids[0]))
    page = views.acls_page(s, None, 1)
    assert [a["id"] for a in page["acls"]] == [ids[1]] and page["next"] == ids[1]
    assert [a["id"] for a in views.acls_page(s, ids[1], 10)["acls"]] == [ids[2]]


def test_partition_ids_with_a_gap_cost_what_exists_not_the_highest_id():
    """A committed Partition record may carry any id. A topic with ids
    {0, 1, 2**31 - 1} pages, copies, snapshots and is removed touching its
    three partitions, not two billion ids (which would never finish)."""
    s = state_with(topics=2, partitions=2)
    far = 2**31 - 1
    t0 = time.perf_counter()
    assert s.apply(s.offset, r.Partition(tid(1), far, (0, 1), (0, 1), 0))
    assert s.apply(s.offset, r.Partition(tid(1), 5, (0,), (0,), 0))  # fills in below the highest
    assert s.apply(s.offset, r.Partition(tid(1), 5, (1,), (1,), 1))  # a replacement: no new id
    assert list(s.partition_ids(tid(1))) == [0, 1, 5, far] and list(s.partition_ids(tid(0))) == [0, 1]
    t = as_json(views.topic(s, "t001", partitions_limit=3))
    assert t["partition_count"] == 4 and [p["partition"] for p in t["partitions"]] == [0, 1, 5]
    assert t["partitions"][2]["leader"] == 1 and t["next_partition"] == 5
    last = views.partitions_page(s, "t001", 5, 3)
    assert [p.partition for p in last["partitions"]] == [far] and last["next"] is None
    assert views.topics_page(s, None, 10)["topics"][1]["partitions"] == 4
    # A copy, an incremental copy and a rebuild from the records agree, and are independent.
    copy = s.copy()
    inc = IncrementalCopy(s, slice_entries=1)
    while not inc.step():
        pass
    inc_copy = inc.finish()
    rebuilt = ControllerState.from_records(s.to_records(), s.offset)
    for other in (copy, inc_copy, rebuilt):
        assert other == s and list(other.partition_ids(tid(1))) == [0, 1, 5, far]
    assert s.apply(s.offset, r.RemoveTopic(tid(1)))
    assert list(s.partition_ids(tid(1))) == [] and not any(k[0] == tid(1) for k in s.partitions)
    assert list(copy.partition_ids(tid(1))) == [0, 1, 5, far]
    # The same topic id again starts dense.
    assert s.apply(s.offset, r.Topic("t001", tid(1)))
    assert s.apply(s.offset, r.Partition(tid(1), 0, (0,), (0,), 0))
    assert s.partition_ids(tid(1)) == range(1) and tid(1) not in s.sparse_partition_ids
    assert time.perf_counter() - t0 < 5, "walked the id range instead of the ids"


def test_list_acls_over_the_binary_port_answers_a_page_and_says_what_is_wrong():
    """ControllerCommand list_acls pages like /metadata/acls (the client reads
    every page); a bad `after` or `limit` is refused with the reason."""
    from metalog.broker.controller.state import CommandError, Controller
    from metalog.broker.controller.commands import list_acls_page

    c = Controller(state_with(topics=0, partitions=0))
    acl = dict(principal="User:a", host="*", operation=2, permission_type=3, resource_type=4,
               resource_name="kafka-cluster", pattern_type=3)
    ids = [f"00000000-0000-4000-8000-00000000000{i}" for i in range(3)]
    for i in ids:
        assert c.state.apply(c.state.offset, r.AccessControlEntry(id=i, **acl))
    page = list_acls_page(c, {"limit": 2})
    assert [a["id"] for a in page["acls"]] == ids[:2] and page["next"] == ids[1]
    page = list_acls_page(c, {"after": ids[1]})
    assert [a["id"] for a in page["acls"]] == ids[2:] and page["next"] is None
    with pytest.raises(CommandError, match=r"limit must be an integer between 1 and 1000, got 0"):
        list_acls_page(c, {"limit": 0})
    with pytest.raises(CommandError, match=r"after must be an ACL id \(text\), got 5"):
        list_acls_page(c, {"after": 5})
