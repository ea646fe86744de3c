"""The runtime's authorization gate with a real broker (one voter, real files
and fsync, in this process) and plain objects standing in for connections
(the face a Kafka connection shows the request router, with flat bodies:
what the router sees is the same whichever listener the request came in on):
a refused request never reaches the core, is answered with Kafka's code and
a message, and is logged once per connection."""

from __future__ import annotations

import asyncio
import time

import pytest
import structlog
from structlog.testing import capture_logs

from metalog.broker.server.config import config_from_dict
from metalog.broker.net.principal import Principal, node_principal
from metalog.broker.server.runtime import Broker
from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey
from metalog.protocol.errors import Errors
from metalog.protocol.kafka.wire import RequestHeader
from metalog.tools.cluster.launcher import free_ports

CID = "gate-test"
ALICE = Principal("User", "alice")
ADMIN = Principal("User", "admin")


class FakeConn:
    """What the runtime uses of a connection: principal, peer, send_response."""

    def __init__(self, principal: Principal, peer: str = "10.1.2.3:5555"):
        self.principal = principal
        self.peer = peer
        self.responses: dict[int, m.Body] = {}
        self.arrived = asyncio.Event()

    def send_response(self, correlation_id: int, body: m.Body) -> bool:
        self.responses[correlation_id] = body
        self.arrived.set()
        return True

    def add_close_callback(self, cb) -> None:
        pass

    async def call(self, broker: Broker, api: ApiKey, body: m.Body, cid: int) -> m.Body:
        broker.inbound.on_request(self, RequestHeader(int(api), 0, cid, "test"), body)
        deadline = time.monotonic() + 5
        while cid not in self.responses:
            assert time.monotonic() < deadline, f"no answer to {api.name}"
            self.arrived.clear()
            await asyncio.wait_for(self.arrived.wait(), timeout=5)
        return self.responses.pop(cid)


async def _started_broker(tmp_path) -> Broker:
    port, = free_ports(1)
    cfg = config_from_dict({"node_id": 1, "cluster_id": CID, "data_dir": str(tmp_path / "d"),
                            "listen": f"127.0.0.1:{port}", "voters": f"1@127.0.0.1:{port}",
                            "super_users": ["User:admin"], "election_timeout_ms": 200,
                            "security_protocol": "PLAINTEXT"})
    broker = Broker(cfg, structlog.get_logger("test"))
    broker.authz_enabled = True  # what security_protocol SSL turns on; the connections here are stand-ins
    await broker.start()
    deadline = time.monotonic() + 10
    while not (str(broker.core.role) == "leader" and broker.core.high_watermark):
        assert time.monotonic() < deadline, "single voter did not become leader"
        await asyncio.sleep(0.02)
    return broker


def _fetch(replica_id: int, offset: int, epoch: int) -> m.FetchRequest:
    return m.FetchRequest(cluster_id=CID, replica_id=replica_id, max_wait_ms=0, current_leader_epoch=epoch,
                          fetch_offset=offset, last_fetched_epoch=epoch)


@pytest.mark.asyncio
async def test_refused_requests_never_reach_the_core_and_acls_take_effect_once_committed(tmp_path):
    broker = await _started_broker(tmp_path)
    try:
        core = broker.core
        epoch, hw, leo = core.epoch, core.high_watermark, core.log_end_offset
        alice = FakeConn(ALICE)
        with capture_logs() as logs:
            # A user certificate claiming to be replica 2 (twice: logged once).
            for cid in (1, 2):
                resp = await alice.call(broker, ApiKey.FETCH, _fetch(2, leo, epoch), cid)
                assert resp.error_code == Errors.CLUSTER_AUTHORIZATION_FAILED
                assert resp.error_message == ("not authorized: User:alice may not ReplicaAction cluster "
                                              "kafka-cluster (as replica 2: a user certificate cannot act "
                                              "as a replica)")
            vote = m.VoteRequest(cluster_id=CID, candidate_epoch=epoch + 5, candidate_id=1,
                                 last_offset_epoch=epoch, last_offset=leo + 100)
            assert (await alice.call(broker, ApiKey.VOTE, vote, 3)).error_code == 31
            # Node 2's certificate (not a voter here) may not start an election either.
            n2 = FakeConn(node_principal(2))
            vote2 = m.VoteRequest(cluster_id=CID, candidate_epoch=epoch + 5, candidate_id=2,
                                  last_offset_epoch=epoch, last_offset=leo + 100)
            assert (await n2.call(broker, ApiKey.VOTE, vote2, 1)).error_code == 31
            begin = m.BeginQuorumEpochRequest(cluster_id=CID, leader_id=2, leader_epoch=epoch + 5)
            assert (await n2.call(broker, ApiKey.BEGIN_QUORUM_EPOCH, begin, 2)).error_code == 31
            produce = m.ProduceRequest(cluster_id=CID, records=[b"x"])
            resp = await alice.call(broker, ApiKey.PRODUCE, produce, 4)
            assert resp.error_code == Errors.TOPIC_AUTHORIZATION_FAILED
            assert resp.error_message == ("not authorized: User:alice may not Write topic __cluster_metadata "
                                          "(TOPIC_AUTHORIZATION_FAILED)")
        # No effect on the core: epoch, HW, LEO, no observer "2" was recorded.
        assert (core.epoch, core.high_watermark, core.log_end_offset) == (epoch, hw, leo)
        assert str(core.role) == "leader"
        assert [r.replica_id for r in core.describe_quorum(0).observers] == []
        failed = [e for e in logs if e["event"] == "authorization_failed"]
        assert len([e for e in failed if e["api"] == "FETCH"]) == 1  # once per connection
        f = next(e for e in failed if e["api"] == "FETCH")
        assert (f["peer"], f["principal"], f["operation"], f["resource"], f["error"]) == (
            "10.1.2.3:5555", "User:alice", "ReplicaAction", "Cluster:kafka-cluster", "CLUSTER_AUTHORIZATION_FAILED")
        assert {e["api"] for e in failed} == {"FETCH", "VOTE", "BEGIN_QUORUM_EPOCH", "PRODUCE"}

        # alice may not grant herself anything
        grant = m.ControllerCommandRequest(cluster_id=CID, command="add_acl", args={
            "principal": "User:alice", "operation": "Write", "resource_type": "topic",
            "resource_name": "__cluster_metadata"})
        assert (await alice.call(broker, ApiKey.CONTROLLER_COMMAND, grant, 5)).error_code == 31
        # the admin (a super user) may; once committed, alice's produce is accepted
        admin = FakeConn(ADMIN)
        resp = await admin.call(broker, ApiKey.CONTROLLER_COMMAND, grant, 1)
        assert resp.error_code == 0, resp
        listed = await admin.call(broker, ApiKey.CONTROLLER_COMMAND,
                                  m.ControllerCommandRequest(cluster_id=CID, command="list_acls"), 2)
        assert [(x["principal"], x["operation"], x["resource_name"]) for x in listed.result["acls"]] == [
            ("User:alice", "Write", "__cluster_metadata")] and listed.result["next"] is None
        resp = await alice.call(broker, ApiKey.PRODUCE, produce, 6)
        assert resp.error_code == 0 and resp.base_offset >= leo
        # Metadata: routing for everyone, the log's figures only with Describe (Write implies it)
        bob = FakeConn(Principal("User", "bob"))
        meta = await bob.call(broker, ApiKey.METADATA, m.MetadataRequest(), 1)
        assert (meta.leader_id, meta.high_watermark, meta.log_start_offset) == (1, -1, -1)
        meta = await alice.call(broker, ApiKey.METADATA, m.MetadataRequest(), 8)
        assert meta.leader_id == 1 and meta.high_watermark > 0
        # Write does not grant Read
        assert (await alice.call(broker, ApiKey.FETCH, _fetch(-1, 0, -1), 7)).error_code == 29
        # Revoking takes effect on alice's existing connection (decisions are cached per connection).
        revoke = m.ControllerCommandRequest(cluster_id=CID, command="remove_acl", args=grant.args)
        assert (await admin.call(broker, ApiKey.CONTROLLER_COMMAND, revoke, 3)).error_code == 0
        assert (await alice.call(broker, ApiKey.PRODUCE, produce, 9)).error_code == 29
    finally:
        await broker.stop()


@pytest.mark.asyncio
async def test_a_replicas_fetch_decision_is_kept_per_claimed_id(tmp_path):
    """The gate keeps a connection's replica Fetch decisions (its steady
    stream costs a lookup), but per claimed id: node 2's certificate is let
    through as replica 2 every time, and refused as replica 3 on the same
    connection, before and after its allowed Fetches."""
    broker = await _started_broker(tmp_path)
    try:
        core = broker.core
        epoch, leo = core.epoch, core.log_end_offset
        n2 = FakeConn(node_principal(2))
        as_3 = (await n2.call(broker, ApiKey.FETCH, _fetch(3, leo, epoch), 1))
        assert as_3.error_code == Errors.CLUSTER_AUTHORIZATION_FAILED
        assert "as replica 3: the certificate is for node 2" in as_3.error_message
        for cid in (2, 3):
            assert (await n2.call(broker, ApiKey.FETCH, _fetch(2, leo, epoch), cid)).error_code == Errors.NONE
        as_3 = (await n2.call(broker, ApiKey.FETCH, _fetch(3, leo, epoch), 4))
        assert as_3.error_code == Errors.CLUSTER_AUTHORIZATION_FAILED
        assert [r.replica_id for r in core.describe_quorum(0).observers] == [2]  # only the allowed claims reached the core
    finally:
        await broker.stop()
