"""Kafka brokers' blocks of producer ids (AllocateProducerIds, api 67) at the
controller (metalog.broker.controller.producer_blocks), through the
CommandQueue as the runtime drives it: Kafka's ProducerIdControlManager
rules, the records replayed by another replica, and a snapshot."""

import uuid

from metalog.broker.controller import acl as authz
from metalog.broker.controller import producer_blocks as pb
from metalog.broker.controller.state import Controller, ControllerState
from metalog.broker.net.principal import Principal
from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey
from metalog.protocol.errors import Errors
from metalog.storage import metadata_records as r
from tests.controller.test_broker_lifecycle import Quorum, View
from tests.controller.test_state import Log


def test_blocks_follow_each_other_and_each_is_one_committed_record():
    q = Quorum()
    epoch = q.register().result["broker_epoch"]
    other = q.register(broker_id=101, incarnation=str(uuid.UUID(int=0xC)),
                       log_dirs=(str(uuid.UUID(int=0xC0C0)),)).result["broker_epoch"]
    blocks = [q.run("allocate_producer_ids", broker_id=100, broker_epoch=epoch),
              q.run("allocate_producer_ids", broker_id=101, broker_epoch=other),
              q.run("allocate_producer_ids", broker_id=100, broker_epoch=epoch)]
    assert [(b.error_code, b.result) for b in blocks] == [
        (0, {"producer_id_start": start, "producer_id_len": 1000}) for start in (0, 1000, 2000)]
    written = [r.decode_record(v) for _, v in q.appended]
    ids = [pb.decode(rec.raw) for rec in written if type(rec) is r.UnknownRecord and rec.api_key == 15]
    assert ids == [(100, epoch, 1000), (101, other, 2000), (100, epoch, 3000)]
    assert q.c.state.next_producer_id == 3000

    # Another replica replaying the log, and a state rebuilt from a snapshot's records, agree.
    replica = Controller()
    Log(replica).commit([v for _, v in q.appended])
    assert replica.state.next_producer_id == 3000 and replica.state == q.c.state
    rebuilt = ControllerState.from_records(q.c.state.to_records(), q.c.state.offset)
    assert rebuilt.next_producer_id == 3000 and rebuilt == q.c.state


def test_a_stale_or_unknown_broker_epoch_gets_no_block():
    q = Quorum()
    epoch = q.register().result["broker_epoch"]
    stale = q.run("allocate_producer_ids", broker_id=100, broker_epoch=epoch - 1)
    unknown = q.run("allocate_producer_ids", broker_id=7, broker_epoch=epoch)
    assert (stale.error_code, unknown.error_code) == (Errors.STALE_BROKER_EPOCH, Errors.STALE_BROKER_EPOCH)
    assert "not registered" in unknown.error_message
    assert q.c.state.next_producer_id == 0


def test_blocks_end_where_metalogs_own_producer_ids_begin():
    q = Quorum()
    epoch = q.register().result["broker_epoch"]
    q.c.state.next_producer_id = pb.BLOCKS_END - pb.BLOCK_SIZE
    last = q.run("allocate_producer_ids", broker_id=100, broker_epoch=epoch)
    assert last.result == {"producer_id_start": pb.BLOCKS_END - pb.BLOCK_SIZE, "producer_id_len": pb.BLOCK_SIZE}
    past = q.run("allocate_producer_ids", broker_id=100, broker_epoch=epoch)
    assert past.error_code == Errors.UNKNOWN_SERVER_ERROR and "exhausted" in past.error_message


def test_a_record_that_does_not_move_forward_is_invalid():
    s = ControllerState()
    assert s.apply(0, pb.record(100, 5, 1000))
    assert not s.apply(1, pb.record(100, 5, 1000))
    assert s.next_producer_id == 1000 and s.invalid_records == 1


def test_only_the_broker_itself_or_cluster_action_may_ask():
    view = View()
    body = m.ControllerCommandRequest(cluster_id="c", command="allocate_producer_ids",
                                      args={"broker_id": 100, "broker_epoch": 3})
    assert authz.authorize(Principal("Node", "100"), "h", ApiKey.CONTROLLER_COMMAND, body, view) is None
    assert authz.authorize(Principal("Node", "101"), "h", ApiKey.CONTROLLER_COMMAND, body, view) is not None
    assert authz.authorize(Principal("User", "alice"), "h", ApiKey.CONTROLLER_COMMAND, body, view) is not None
