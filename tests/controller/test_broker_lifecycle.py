"""Kafka brokers' registration, heartbeats and sessions at the controller
(metalog.broker.controller.brokers), driven through the CommandQueue as the
runtime drives it: the rules of Kafka's ClusterControlManager and
BrokerHeartbeatManager."""

import uuid

import pytest

from metalog.broker.controller import acl as authz
from metalog.broker.controller.brokers import SESSION_CHECK_INTERVAL_MS
from metalog.broker.controller.commands import CommandQueue, LeaderView
from metalog.broker.controller.state import Controller
from metalog.broker.net.principal import Principal
from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey
from metalog.protocol.errors import Errors
from metalog.storage import metadata_records as r
from tests.controller.test_state import Log

TIMEOUT_MS = 9000
INC_A, INC_B = str(uuid.UUID(int=0xA)), str(uuid.UUID(int=0xB))
DIR_A, DIR_B = str(uuid.UUID(int=0xA0A0)), str(uuid.UUID(int=0xB0B0))
MV = {r.METADATA_VERSION: [7, 27]}


class Conn:
    def __init__(self):
        self.answers = []

    def send_response(self, cid, resp):
        self.answers.append(resp)
        return True


class Quorum:
    """The queue, the controller and a log that commits every append at once."""

    def __init__(self):
        self.c = Controller()
        self.log = Log(self.c)
        self.fenced_by_session = []
        self.q = CommandQueue(session_timeout_ms=TIMEOUT_MS,
                              on_session_fenced=lambda bid, code: self.fenced_by_session.append((bid, code)))
        self.conn = Conn()
        self.now_ms = 1000
        self.appended = []  # (offset, record value) of every append the queue made

    def view(self):
        return LeaderView(True, 1, 3, self.log.next_offset, now_ms=self.now_ms)

    def pump(self):
        for _ in range(10):  # bounded: each round commits one append
            answers, append = self.q.pump(self.c, self.view())
            for token, resp in answers:
                token.conn.send_response(token.correlation_id, resp)
            if append is None:
                return
            token, records = append
            base = self.log.next_offset
            self.appended += [(base + i, v) for i, v in enumerate(records)]
            self.log.commit(records)
            token2, resp = self.q.done(token, m.ProduceResponse(base_offset=base, leader_epoch=3))
            token2.conn.send_response(0, resp)

    def run(self, command, **args):
        self.q.offer(self.conn, 0, m.ControllerCommandRequest(cluster_id="c", command=command, args=args))
        self.pump()
        return self.conn.answers.pop()

    def register(self, broker_id=100, incarnation=INC_A, log_dirs=(DIR_A,), features=MV):
        return self.run("broker_registration", broker_id=broker_id, incarnation_id=incarnation,
                        listeners=[["PLAINTEXT", "h", 9092, 0]], features=features, rack=None,
                        log_dirs=list(log_dirs))

    def heartbeat(self, broker_id=100, epoch=None, offset=None, want_fence=False, want_shut_down=False):
        epoch = self.c.state.brokers[broker_id].broker_epoch if epoch is None else epoch
        return self.run("broker_heartbeat", broker_id=broker_id, broker_epoch=epoch,
                        current_metadata_offset=self.log.next_offset if offset is None else offset,
                        want_fence=want_fence, want_shut_down=want_shut_down)


def test_register_fenced_with_the_record_offset_as_epoch_then_unfence_when_caught_up():
    qu = Quorum()
    qu.log.commit([r.encode_record(r.NoOp())] * 5)
    resp = qu.register()
    # metadata.version at offset 5 (a Kafka broker's loader needs one), the registration at 6.
    assert [r.decode_record(v) for _, v in qu.appended][:1] == [r.FeatureLevel(r.METADATA_VERSION, 21)]
    assert resp.error_code == 0 and resp.result == {"broker_epoch": 6}
    br = qu.c.state.brokers[100]
    assert br.fenced and br.broker_epoch == 6 and br.log_dirs == (DIR_A,) and br.incarnation_id == INC_A
    # Not caught up (offset 5 < 6): stays fenced.
    assert qu.heartbeat(offset=5).result == {"is_caught_up": False, "is_fenced": True, "should_shut_down": False}
    # Caught up but wanting fence: stays fenced.
    assert qu.heartbeat(want_fence=True).result["is_fenced"] is True
    end = qu.log.next_offset
    assert qu.heartbeat().result == {"is_caught_up": True, "is_fenced": False, "should_shut_down": False}
    assert not qu.c.state.brokers[100].fenced
    # What Kafka's controller writes from metadata.version 3.3: BrokerRegistrationChangeRecord.
    assert [r.decode_record(v) for off, v in qu.appended if off >= end] == [r.BrokerRegistrationChange(100, 6, -1, 0)]


def test_same_incarnation_amends_new_incarnation_gets_a_new_epoch():
    qu = Quorum()
    epoch = qu.register().result["broker_epoch"]
    qu.heartbeat()
    assert qu.register().result == {"broker_epoch": epoch}  # amended: same epoch, still unfenced
    assert not qu.c.state.brokers[100].fenced
    # Another incarnation while the session is live: refused.
    assert qu.register(incarnation=INC_B).error_code == Errors.DUPLICATE_BROKER_REGISTRATION
    qu.now_ms += TIMEOUT_MS + 1  # the old incarnation's session expired (and it got fenced)
    qu.pump()
    assert qu.fenced_by_session == [(100, 0)] and qu.c.state.brokers[100].fenced
    resp = qu.register(incarnation=INC_B)
    assert resp.error_code == 0 and resp.result["broker_epoch"] > epoch
    assert qu.c.state.brokers[100].fenced and qu.c.state.brokers[100].incarnation_id == INC_B
    assert qu.heartbeat(epoch=epoch).error_code == Errors.STALE_BROKER_EPOCH
    assert qu.heartbeat(broker_id=7, epoch=1).error_code == Errors.BROKER_ID_NOT_REGISTERED


@pytest.mark.parametrize("kwargs, code", [
    ({"features": {r.METADATA_VERSION: [7, 20]}}, Errors.UNSUPPORTED_VERSION),  # finalized 21
    ({"features": {}}, Errors.UNSUPPORTED_VERSION),  # no range: 3.0-IV1 only
    ({"log_dirs": ()}, Errors.INVALID_REGISTRATION),
    ({"log_dirs": (DIR_A, DIR_A)}, Errors.INVALID_REGISTRATION),
    ({"log_dirs": ("00000000-0000-0000-0000-000000000001",)}, Errors.INVALID_REGISTRATION),
    ({"incarnation": "not-a-uuid"}, Errors.INVALID_REQUEST),
])
def test_registration_refusals(kwargs, code):
    qu = Quorum()
    resp = qu.register(**kwargs)
    assert resp.error_code == code, resp
    assert 100 not in qu.c.state.brokers


def test_a_directory_of_another_broker_is_refused():
    qu = Quorum()
    assert qu.register(broker_id=100).error_code == 0
    assert qu.register(broker_id=101, incarnation=INC_B).error_code == Errors.INVALID_REGISTRATION
    assert qu.register(broker_id=101, incarnation=INC_B, log_dirs=(DIR_B,)).error_code == 0


def test_shutdown_fences_and_says_shut_down():
    qu = Quorum()
    qu.register()
    qu.heartbeat()
    resp = qu.heartbeat(want_shut_down=True)
    assert resp.result == {"is_caught_up": True, "is_fenced": True, "should_shut_down": True}
    assert qu.c.state.brokers[100].fenced


def test_session_expiry_moves_leadership_and_spares_cli_brokers():
    qu = Quorum()
    qu.log.commit(qu.c.register_broker(0, [("PLAINTEXT", "h", 1)]))  # our CLI's: no session
    qu.register()
    qu.heartbeat()
    qu.log.commit(qu.c.create_topic("t", 2, 2, live_brokers=[100, 0]))
    assert qu.c.state.partitions[(qu.c.state.topic_ids["t"], 1)].leader == 100
    qu.now_ms += TIMEOUT_MS - 1
    qu.pump()
    assert not qu.c.state.brokers[100].fenced  # within its session
    qu.now_ms += SESSION_CHECK_INTERVAL_MS  # the next check
    qu.pump()
    part = qu.c.state.partitions[(qu.c.state.topic_ids["t"], 1)]
    assert qu.c.state.brokers[100].fenced and part.leader == 0 and part.isr == (0,)
    assert not qu.c.state.brokers[0].fenced
    qu.now_ms += 10 * TIMEOUT_MS
    qu.pump()
    assert not qu.c.state.brokers[0].fenced and qu.fenced_by_session == [(100, 0)]


def test_a_new_leader_starts_full_sessions():
    qu = Quorum()
    qu.register()
    qu.heartbeat()
    qu.now_ms += TIMEOUT_MS - 1
    qu.q = CommandQueue(session_timeout_ms=TIMEOUT_MS)  # another node became leader: no contact known
    qu.pump()
    qu.now_ms += TIMEOUT_MS - 1
    qu.pump()
    assert not qu.c.state.brokers[100].fenced
    qu.now_ms += SESSION_CHECK_INTERVAL_MS
    qu.pump()
    assert qu.c.state.brokers[100].fenced


class View:
    enabled = True
    super_users = frozenset()
    acls = ()
    voters = frozenset({1, 2, 3})
    voters_in_log = True


@pytest.mark.parametrize("principal, broker_id, allowed", [
    ("Node:100", 100, True),
    ("Node:100", 101, False),
    ("User:alice", 100, False),
])
def test_a_node_certificate_registers_only_its_own_id(principal, broker_id, allowed):
    for command in ("broker_registration", "broker_heartbeat"):
        body = m.ControllerCommandRequest(cluster_id="c", command=command, args={"broker_id": broker_id})
        denial = authz.authorize(Principal.parse(principal), "h", ApiKey.CONTROLLER_COMMAND, body, View())
        assert (denial is None) == allowed, denial
        if denial is not None:
            assert denial.error_code == Errors.CLUSTER_AUTHORIZATION_FAILED
