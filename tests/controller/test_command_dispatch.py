"""metalog.broker.controller.commands: the command table, build_command and the
one-at-a-time CommandQueue the runtime drives."""

from __future__ import annotations

import pytest

from metalog.broker.controller.state import CommandError, Controller
from metalog.broker.controller.commands import (BUILDERS, LIFECYCLE, Command, CommandQueue, CommandToken,
                                                LeaderView, build_command)
from metalog.protocol import messages as m
from metalog.protocol.errors import Errors
from metalog.storage import batch as b
from metalog.storage import metadata_records as r

LEADER = LeaderView(is_leader=True, leader_id=1, epoch=3, log_end_offset=0)


def req(command: str, **args) -> m.ControllerCommandRequest:
    return m.ControllerCommandRequest(cluster_id="c", command=command, args=args)


def commit(controller: Controller, records: list[bytes]) -> int:
    """Append records as one batch at the controller's applied offset and apply it."""
    base = controller.applied_offset
    data = b.encode_batch(base, 3, records, timestamp_ms=0)
    controller.apply_batches(data, end_offset=base + len(records))
    return controller.applied_offset


def test_every_command_but_the_readers_has_a_builder():
    assert set(BUILDERS) == set(Command) - {Command.LIST_ACLS, Command.DESCRIBE_CONFIGS} - LIFECYCLE
    assert Command("create_topic") is Command.CREATE_TOPIC


def test_build_command_dispatches_by_name_and_converts_arguments():
    c = Controller()
    recs = build_command(c, "register_broker", {"broker_id": "7", "endpoints": [["PLAINTEXT", "h", "9092"]]})
    rec = r.decode_record(recs[-1])  # after the log's first metadata.version (test below)
    assert isinstance(rec, r.RegisterBroker) and rec.broker_id == 7
    assert rec.endpoints == (r.Endpoint("PLAINTEXT", "h", 9092),)


def test_the_first_command_of_a_log_without_metadata_version_writes_it_first():
    """Kafka's log holds a metadata.version FeatureLevelRecord before any
    metadata record (its controller's bootstrap); a Kafka controller or broker
    replaying a log without one stops ("Unknown metadata version for
    FeaturesImage"). The first command writes it, once; a state that has one
    from its log or snapshot writes none."""
    c = Controller()
    first = build_command(c, "add_acl", {"principal": "User:a", "operation": "read", "resource_type": "topic",
                                         "resource_name": "t"})
    assert r.decode_record(first[0]) == r.FeatureLevel(r.METADATA_VERSION, r.METADATA_VERSION_LEVEL)
    assert isinstance(r.decode_record(first[1]), r.AccessControlEntry) and len(first) == 2
    commit(c, first)
    assert c.state.metadata_version_logged
    again = build_command(c, "register_broker", {"broker_id": 7})
    assert [type(r.decode_record(x)) for x in again] == [r.RegisterBroker]
    assert c.state.copy().metadata_version_logged
    loaded = Controller()
    commit(loaded, [r.encode_record(r.FeatureLevel(r.METADATA_VERSION, 25))])  # as a snapshot's first record
    assert [type(r.decode_record(x)) for x in build_command(loaded, "register_broker", {"broker_id": 7})] == [
        r.RegisterBroker]


@pytest.mark.parametrize("command, message", [
    ("drop_everything", "unknown controller command 'drop_everything'"),
    ("list_acls", "controller command 'list_acls' writes nothing"),
])
def test_build_command_refuses_what_it_cannot_build(command, message):
    with pytest.raises(CommandError, match=message):
        build_command(Controller(), command, {})


def test_queue_runs_one_command_at_a_time_and_answers_from_the_core_response():
    c = Controller()
    q = CommandQueue()
    assert q.offer("conn", 1, req("register_broker", broker_id=1)) is None
    assert q.offer("conn", 2, req("register_broker", broker_id=2)) is None
    answers, append = q.pump(c, LEADER)
    assert answers == [] and append is not None
    token, records = append
    assert isinstance(token, CommandToken) and token.correlation_id == 1 and len(records) == 2  # + metadata.version
    assert not q.runnable  # the second waits for the first
    again, none = q.pump(c, LEADER)
    assert again == [] and none is None
    end = commit(c, records)
    tok, resp = q.done(token, m.ProduceResponse(base_offset=0, leader_epoch=3))
    # the answer names the command's own record (offset 1), not the metadata.version before it
    assert tok is token and resp.error_code == Errors.NONE and resp.base_offset == 1
    assert q.runnable
    answers, (token2, records2) = q.pump(c, LeaderView(True, 1, 3, end))
    assert token2.correlation_id == 2 and len(records2) == 1
    _tok, resp2 = q.done(token2, m.ProduceResponse(base_offset=end, leader_epoch=3))
    assert resp2.base_offset == end  # nothing before the second command's record


def test_queue_waits_until_every_record_in_the_log_is_applied():
    q = CommandQueue()
    q.offer("conn", 1, req("register_broker", broker_id=1))
    answers, append = q.pump(Controller(), LeaderView(True, 1, 3, log_end_offset=5))
    assert answers == [] and append is None and q.runnable


def test_bad_commands_are_answered_and_the_queue_goes_on():
    c = Controller()
    q = CommandQueue()
    q.offer("conn", 1, req("nope"))
    q.offer("conn", 2, req("create_topic", name="t"))  # missing arguments
    q.offer("conn", 3, req("delete_topic", name="missing"))
    q.offer("conn", 4, req("list_acls"))
    q.offer("conn", 5, req("list_acls", limit=5000))
    answers, append = q.pump(c, LEADER)
    assert append is None
    by_id = {t.correlation_id: resp for t, resp in answers}
    assert by_id[5].error_code == Errors.INVALID_REQUEST
    assert by_id[5].error_message == "limit must be an integer between 1 and 1000, got 5000"
    assert by_id[1].error_code == Errors.INVALID_REQUEST
    assert by_id[1].error_message == "unknown controller command 'nope'"
    assert by_id[2].error_code == Errors.INVALID_REQUEST
    assert by_id[2].error_message.startswith("bad arguments for 'create_topic': KeyError")
    assert by_id[3].error_code == Errors.UNKNOWN_TOPIC_OR_PARTITION
    assert by_id[4].error_code == Errors.NONE and by_id[4].result == {"acls": [], "next": None} and by_id[4].leader_epoch == 3


def test_a_command_that_writes_nothing_is_answered_at_once():
    c = Controller()
    q = CommandQueue()
    acl = dict(principal="User:a", operation="Read", resource_type="Topic", resource_name="t")
    q.offer("conn", 1, req("add_acl", **acl))
    _answers, (token, records) = q.pump(c, LEADER)
    end = commit(c, records)
    q.done(token, m.ProduceResponse(base_offset=0, leader_epoch=3))
    q.offer("conn", 2, req("add_acl", **acl))  # exists already: no record
    answers, append = q.pump(c, LeaderView(True, 1, 3, end))
    assert append is None and answers[0][1].error_code == Errors.NONE and answers[0][1].base_offset == end


def test_a_follower_redirects_every_queued_command_to_the_leader():
    q = CommandQueue()
    q.offer("conn", 1, req("register_broker", broker_id=1))
    q.offer("conn", 2, req("list_acls"))
    answers, append = q.pump(Controller(), LeaderView(is_leader=False, leader_id=2, epoch=4, log_end_offset=0))
    assert append is None and [t.correlation_id for t, _ in answers] == [1, 2]
    assert all(resp.error_code == Errors.NOT_LEADER_OR_FOLLOWER for _, resp in answers)
    assert all(resp.current_leader == m.LeaderIdAndEpoch(2, 4) for _, resp in answers)
    assert not q.runnable


def test_a_full_queue_refuses_with_request_timed_out():
    q = CommandQueue(max_queued=1)
    assert q.offer("conn", 1, req("list_acls")) is None
    refusal = q.offer("conn", 2, req("list_acls"))
    assert refusal.error_code == Errors.REQUEST_TIMED_OUT and refusal.error_message == "controller command queue is full"


def test_fail_all_answers_the_in_flight_command_and_the_queued_ones():
    q = CommandQueue()
    q.offer("conn", 1, req("register_broker", broker_id=1))
    q.offer("conn", 2, req("register_broker", broker_id=2))
    q.pump(Controller(), LEADER)
    answers = q.fail_all(Errors.KAFKA_STORAGE_ERROR, "disk gone")
    assert [(t.correlation_id, resp.error_code, resp.error_message) for t, resp in answers] == [
        (1, Errors.KAFKA_STORAGE_ERROR, "disk gone"), (2, Errors.KAFKA_STORAGE_ERROR, "disk gone")]
    assert q.in_flight is None and not q.runnable
