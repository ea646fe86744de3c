"""metalog.broker.controller.acl: one test per rule of the authorization gate."""

from __future__ import annotations

import dataclasses

import pytest

from metalog.broker.controller import acl as a
from metalog.broker.controller import views
from metalog.broker.controller.state import CommandError, Controller
from metalog.broker.net.principal import ANONYMOUS, Principal, node_principal
from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey
from metalog.protocol.errors import Errors
from metalog.storage import metadata_records as r

ALICE = Principal("User", "alice")
ADMIN = Principal("User", "admin")
N1, N2, N9 = node_principal(1), node_principal(2), node_principal(9)
CID = "c"
HOST = "10.0.0.5"


def view(*acls, enabled=True, super_users=("User:admin",)):
    return a.AuthzView(enabled=enabled, voters=frozenset({1, 2, 3}), super_users=frozenset(super_users),
                       acls=tuple(acls))


def acl(principal="User:alice", op=a.Operation.WRITE, perm=a.Permission.ALLOW, rtype=a.ResourceType.TOPIC,
        name=a.METADATA_TOPIC, pattern=a.PatternType.LITERAL, host="*"):
    return a.new_acl(principal, op, perm, rtype, name, pattern, host)


def fetch(replica_id):
    return m.FetchRequest(cluster_id=CID, replica_id=replica_id, max_wait_ms=0, current_leader_epoch=1,
                          fetch_offset=0, last_fetched_epoch=0)


PRODUCE = m.ProduceRequest(cluster_id=CID, records=[b"x"])
VOTE2 = m.VoteRequest(cluster_id=CID, candidate_epoch=5, candidate_id=2, last_offset_epoch=1, last_offset=9)
BEGIN2 = m.BeginQuorumEpochRequest(cluster_id=CID, leader_id=2, leader_epoch=5)
END2 = m.EndQuorumEpochRequest(cluster_id=CID, leader_id=2, leader_epoch=5, preferred_successors=[1, 3])
SNAP2 = m.FetchSnapshotRequest(cluster_id=CID, replica_id=2, current_leader_epoch=5,
                               snapshot_id=m.SnapshotId(10, 1), position=0)
OFLE2 = m.OffsetsForLeaderEpochRequest(cluster_id=CID, replica_id=2, current_leader_epoch=5, leader_epoch=4)
CHECK2 = m.ConsistencyCheckRequest(cluster_id=CID, leader_id=2, leader_epoch=5, start_offset=0, end_offset=9)
REPLICA_RPCS = [(ApiKey.VOTE, VOTE2), (ApiKey.BEGIN_QUORUM_EPOCH, BEGIN2), (ApiKey.END_QUORUM_EPOCH, END2),
                (ApiKey.FETCH, fetch(2)), (ApiKey.FETCH_SNAPSHOT, SNAP2), (ApiKey.OFFSET_FOR_LEADER_EPOCH, OFLE2),
                (ApiKey.CONSISTENCY_CHECK, CHECK2),
                (ApiKey.UPDATE_RAFT_VOTER, m.UpdateRaftVoterRequest(
                    cluster_id=CID, current_leader_epoch=1, voter_id=2, voter_directory_id="AAAAAAAAAAAAAAAAAAAAAw",
                    listeners=[m.RaftListener("CONTROLLER", "127.0.0.1", 9092)]))]
ADD4 = m.AddRaftVoterRequest(cluster_id=CID, voter_id=4, voter_directory_id="AAAAAAAAAAAAAAAAAAAABQ",
                             listeners=[m.RaftListener("CONTROLLER", "127.0.0.1", 9094)])
REMOVE3 = m.RemoveRaftVoterRequest(cluster_id=CID, voter_id=3, voter_directory_id="AAAAAAAAAAAAAAAAAAAABA")


def cmd(command):
    return m.ControllerCommandRequest(cluster_id=CID, command=command)


# ------------------------------------------------------------ replica identity


@pytest.mark.parametrize("api,body", REPLICA_RPCS)
def test_the_node_itself_may_send_replica_rpcs(api, body):
    assert a.authorize(N2, HOST, api, body, view()) is None


@pytest.mark.parametrize("api,body", REPLICA_RPCS)
def test_a_user_certificate_never_acts_as_a_replica_not_even_a_super_user(api, body):
    """Refused with CLUSTER_AUTHORIZATION_FAILED whatever ACL or super_users say."""
    everything = acl(op=a.Operation.ALL, rtype=a.ResourceType.CLUSTER, name=a.CLUSTER_RESOURCE_NAME)
    for who in (ALICE, ADMIN):
        d = a.authorize(who, HOST, api, body, view(everything, super_users=("User:admin", "User:alice")))
        assert d is not None and d.error_code == Errors.CLUSTER_AUTHORIZATION_FAILED
        assert "a user certificate cannot act as a replica" in d.reason
        assert d.operation == "ReplicaAction"


@pytest.mark.parametrize("api,body", REPLICA_RPCS)
def test_a_node_cannot_claim_another_nodes_id(api, body):
    d = a.authorize(N1, HOST, api, body, view(super_users=("Node:1",)))
    assert d is not None and d.error_code == Errors.CLUSTER_AUTHORIZATION_FAILED
    assert d.reason == "as replica 2: the certificate is for node 1"
    assert d.message() == "not authorized: Node:1 may not ReplicaAction cluster kafka-cluster " \
                          "(as replica 2: the certificate is for node 1)"


def test_election_rpcs_need_a_voter_fetch_accepts_an_observer():
    """Node 9 (an observer's certificate) may Fetch/FetchSnapshot as 9 but not vote or lead."""
    v = view()
    assert a.authorize(N9, HOST, ApiKey.FETCH, fetch(9), v) is None
    snap9 = m.FetchSnapshotRequest(cluster_id=CID, replica_id=9, current_leader_epoch=5,
                                   snapshot_id=m.SnapshotId(10, 1), position=0)
    assert a.authorize(N9, HOST, ApiKey.FETCH_SNAPSHOT, snap9, v) is None
    vote9 = m.VoteRequest(cluster_id=CID, candidate_epoch=5, candidate_id=9, last_offset_epoch=1, last_offset=9)
    d = a.authorize(N9, HOST, ApiKey.VOTE, vote9, v)
    assert d.error_code == Errors.CLUSTER_AUTHORIZATION_FAILED and d.reason.endswith("not a voter of this cluster")
    # With the voter set in the log (KIP-853) our set may lag the candidate's:
    # node 9's own certificate may ask (the core judges it), another node's may not.
    dyn = dataclasses.replace(v, voters_in_log=True)
    assert a.authorize(N9, HOST, ApiKey.VOTE, vote9, dyn) is None
    assert a.authorize(N2, HOST, ApiKey.VOTE, vote9, dyn).error_code == Errors.CLUSTER_AUTHORIZATION_FAILED
    begin9 = m.BeginQuorumEpochRequest(cluster_id=CID, leader_id=9, leader_epoch=5)
    assert a.authorize(N9, HOST, ApiKey.BEGIN_QUORUM_EPOCH, begin9, v).error_code == 31
    check9 = m.ConsistencyCheckRequest(cluster_id=CID, leader_id=9, leader_epoch=5, start_offset=0, end_offset=9)
    assert a.authorize(N9, HOST, ApiKey.CONSISTENCY_CHECK, check9, v).error_code == 31


def test_end_quorum_epoch_successors_must_be_voters():
    body = m.EndQuorumEpochRequest(cluster_id=CID, leader_id=2, leader_epoch=5, preferred_successors=[1, 7])
    d = a.authorize(N2, HOST, ApiKey.END_QUORUM_EPOCH, body, view())
    assert d.error_code == 31 and "preferred successors [7] are not voters" in d.reason


def test_a_negative_replica_id_other_than_the_consumer_is_a_replica_claim():
    d = a.authorize(ADMIN, HOST, ApiKey.FETCH, fetch(-2), view())
    assert d.error_code == Errors.CLUSTER_AUTHORIZATION_FAILED


# ------------------------------------------------------------ ACLs


def test_default_deny_with_kafka_error_codes():
    v = view()
    d = a.authorize(ALICE, HOST, ApiKey.PRODUCE, PRODUCE, v)
    assert d.error_code == Errors.TOPIC_AUTHORIZATION_FAILED
    assert d.message() == ("not authorized: User:alice may not Write topic __cluster_metadata "
                           "(TOPIC_AUTHORIZATION_FAILED)")
    assert a.authorize(ALICE, HOST, ApiKey.FETCH, fetch(-1), v).error_code == 29
    assert a.authorize(ALICE, HOST, ApiKey.DESCRIBE_QUORUM, m.DescribeQuorumRequest(), v).error_code == 31
    assert a.authorize(ALICE, HOST, ApiKey.CONTROLLER_COMMAND, cmd("create_topic"), v).error_code == 31


def test_api_versions_and_metadata_are_open_to_every_authenticated_peer():
    """A client must find the leader before it can be told what it may do; Metadata
    shows the log's figures only to who may Describe the topic or the cluster."""
    assert a.authorize(ALICE, HOST, ApiKey.API_VERSIONS, m.ApiVersionsRequest(), view()) is None
    assert a.authorize(ALICE, HOST, ApiKey.METADATA, m.MetadataRequest(), view()) is None
    assert not a.may_describe_log(ALICE, HOST, view())
    assert a.may_describe_log(ALICE, HOST, view(acl()))  # Write on the topic implies Describe
    assert a.may_describe_log(ALICE, HOST, view(acl(op=a.Operation.DESCRIBE, rtype=a.ResourceType.CLUSTER,
                                                    name=a.CLUSTER_RESOURCE_NAME)))
    assert a.may_describe_log(node_principal(1), HOST, view())
    assert a.may_describe_log(ALICE, HOST, view(enabled=False))


def test_each_api_needs_its_operation():
    write_topic, read_topic = acl(), acl(op=a.Operation.READ)
    cluster = dict(rtype=a.ResourceType.CLUSTER, name=a.CLUSTER_RESOURCE_NAME)
    cases = [
        (ApiKey.PRODUCE, PRODUCE, write_topic, read_topic),
        (ApiKey.FETCH, fetch(-1), read_topic, write_topic),
        (ApiKey.LIST_OFFSETS, m.ListOffsetsRequest(cluster_id=CID, current_leader_epoch=-1, timestamp_ms=-1),
         read_topic, write_topic),
        (ApiKey.OFFSET_FOR_LEADER_EPOCH, m.OffsetsForLeaderEpochRequest(
            cluster_id=CID, replica_id=-1, current_leader_epoch=-1, leader_epoch=1), read_topic, write_topic),
        (ApiKey.DESCRIBE_QUORUM, m.DescribeQuorumRequest(), acl(op=a.Operation.DESCRIBE, **cluster), read_topic),
        (ApiKey.CONTROLLER_COMMAND, cmd("register_broker"), acl(op=a.Operation.WRITE, **cluster),
         acl(op=a.Operation.ALTER, **cluster)),
        (ApiKey.CONTROLLER_COMMAND, cmd("add_acl"), acl(op=a.Operation.ALTER, **cluster),
         acl(op=a.Operation.WRITE, **cluster)),
        (ApiKey.CONTROLLER_COMMAND, cmd("remove_acl"), acl(op=a.Operation.ALTER, **cluster),
         acl(op=a.Operation.WRITE, **cluster)),
        (ApiKey.CONTROLLER_COMMAND, cmd("list_acls"), acl(op=a.Operation.DESCRIBE, **cluster), write_topic),
    ]
    for api, body, grants, does_not in cases:
        assert a.authorize(ALICE, HOST, api, body, view(grants)) is None, (api, body)
        assert a.authorize(ALICE, HOST, api, body, view(does_not)) is not None, (api, body)


def test_deny_wins_over_allow_and_all():
    v = view(acl(op=a.Operation.ALL), acl(perm=a.Permission.DENY))
    assert a.authorize(ALICE, HOST, ApiKey.PRODUCE, PRODUCE, v).error_code == 29
    assert a.authorize(ALICE, HOST, ApiKey.FETCH, fetch(-1), v) is None  # All still allows Read
    v = view(acl(), acl(op=a.Operation.ALL, perm=a.Permission.DENY))
    assert a.authorize(ALICE, HOST, ApiKey.PRODUCE, PRODUCE, v) is not None


def test_write_read_alter_imply_describe_but_not_each_other():
    cluster = dict(rtype=a.ResourceType.CLUSTER, name=a.CLUSTER_RESOURCE_NAME)
    for op in (a.Operation.READ, a.Operation.WRITE, a.Operation.ALTER, a.Operation.ALL):
        assert a.authorize(ALICE, HOST, ApiKey.DESCRIBE_QUORUM, m.DescribeQuorumRequest(),
                           view(acl(op=op, **cluster))) is None
    assert a.authorize(ALICE, HOST, ApiKey.DESCRIBE_QUORUM, m.DescribeQuorumRequest(),
                       view(acl(op=a.Operation.CLUSTER_ACTION, **cluster))) is not None
    # and a Deny of Describe is not a Deny of Write
    assert a.authorize(ALICE, HOST, ApiKey.PRODUCE, PRODUCE,
                       view(acl(), acl(op=a.Operation.DESCRIBE, perm=a.Permission.DENY))) is None


def test_prefixed_literal_and_wildcard_names():
    assert a.authorize(ALICE, HOST, ApiKey.PRODUCE, PRODUCE,
                       view(acl(name="__cluster", pattern=a.PatternType.PREFIXED))) is None
    assert a.authorize(ALICE, HOST, ApiKey.PRODUCE, PRODUCE, view(acl(name="__cluster"))) is not None
    assert a.authorize(ALICE, HOST, ApiKey.PRODUCE, PRODUCE,
                       view(acl(name="__x", pattern=a.PatternType.PREFIXED))) is not None
    assert a.authorize(ALICE, HOST, ApiKey.PRODUCE, PRODUCE, view(acl(name="*"))) is None


def test_principal_and_host_matching():
    assert a.authorize(ALICE, HOST, ApiKey.PRODUCE, PRODUCE, view(acl(principal="User:bob"))) is not None
    assert a.authorize(ALICE, HOST, ApiKey.PRODUCE, PRODUCE, view(acl(principal="User:*"))) is None
    # User:* is about users: it grants nothing to a node certificate
    assert a.authorize(N1, HOST, ApiKey.PRODUCE, PRODUCE, view(acl(principal="User:*"))) is not None
    assert a.authorize(N1, HOST, ApiKey.PRODUCE, PRODUCE, view(acl(principal="Node:1"))) is None
    assert a.authorize(ALICE, HOST, ApiKey.PRODUCE, PRODUCE, view(acl(host=HOST))) is None
    assert a.authorize(ALICE, "10.0.0.6", ApiKey.PRODUCE, PRODUCE, view(acl(host=HOST))) is not None


def test_super_users_bypass_acls_even_a_deny():
    v = view(acl(principal="User:admin", op=a.Operation.ALL, perm=a.Permission.DENY))
    for api, body in [(ApiKey.PRODUCE, PRODUCE), (ApiKey.CONTROLLER_COMMAND, cmd("add_acl")),
                      (ApiKey.DESCRIBE_QUORUM, m.DescribeQuorumRequest())]:
        assert a.authorize(ADMIN, HOST, api, body, v) is None


def test_nodes_may_describe_but_nothing_else_without_an_acl():
    v = view()
    assert a.authorize(N1, HOST, ApiKey.METADATA, m.MetadataRequest(), v) is None
    assert a.authorize(N1, HOST, ApiKey.DESCRIBE_QUORUM, m.DescribeQuorumRequest(), v) is None
    assert a.authorize(N1, HOST, ApiKey.PRODUCE, PRODUCE, v).error_code == 29
    assert a.authorize(N1, HOST, ApiKey.FETCH, fetch(-1), v).error_code == 29
    assert a.authorize(N1, HOST, ApiKey.CONTROLLER_COMMAND, cmd("fence_broker"), v).error_code == 31


def test_authorization_off_allows_everything_including_anonymous_replicas():
    v = view(enabled=False)
    for api, body in REPLICA_RPCS + [(ApiKey.PRODUCE, PRODUCE), (ApiKey.CONTROLLER_COMMAND, cmd("add_acl"))]:
        assert a.authorize(ANONYMOUS, HOST, api, body, v) is None


def test_every_api_has_a_rule():
    """Every api key gets a decision (a new api without a rule raises, never passes by default)."""
    from metalog.protocol.apis import APIS
    bodies = dict(REPLICA_RPCS)
    bodies.update({
        ApiKey.PRODUCE: PRODUCE, ApiKey.FETCH: fetch(-1), ApiKey.METADATA: m.MetadataRequest(),
        ApiKey.LIST_OFFSETS: m.ListOffsetsRequest(cluster_id=CID, current_leader_epoch=-1, timestamp_ms=-1),
        ApiKey.API_VERSIONS: m.ApiVersionsRequest(), ApiKey.DESCRIBE_QUORUM: m.DescribeQuorumRequest(),
        ApiKey.CONTROLLER_COMMAND: cmd("create_topic"), ApiKey.INIT_PRODUCER_ID: m.InitProducerIdRequest(cluster_id=CID),
        ApiKey.ADD_RAFT_VOTER: ADD4, ApiKey.REMOVE_RAFT_VOTER: REMOVE3, ApiKey.UPDATE_FEATURES: UPGRADE,
    })
    assert set(bodies) == set(APIS)
    for api, body in bodies.items():
        d = a.authorize(ALICE, HOST, api, body, view())
        assert (d is None) == (api in (ApiKey.API_VERSIONS, ApiKey.METADATA)), api


# ------------------------------------------------------------ ACL records and commands


def test_malformed_acl_records_are_refused_by_name():
    with pytest.raises(ValueError, match="bad ACL: principal must look like User:<name> or Node:<id>"):
        acl(principal="alice")
    with pytest.raises(ValueError, match="the cluster resource is named 'kafka-cluster'"):
        acl(rtype=a.ResourceType.CLUSTER, name="prod")
    with pytest.raises(ValueError, match=r"unknown Operation 'Wrtie'; one of: All, Read, Write"):
        a.parse_enum(a.Operation, "Wrtie")


def test_controller_acl_commands_round_trip_through_the_log():
    c = Controller()
    args = {"principal": "User:alice", "operation": "Write", "permission": "Allow",
            "resource_type": "topic", "resource_name": a.METADATA_TOPIC, "pattern_type": "literal"}
    recs = c.add_acl(args)
    assert len(recs) == 1
    c.state.apply(0, r.decode_record(recs[0]))
    assert c.add_acl(args) == []  # the same ACL again: nothing to write
    (listed,) = views.acls_page(c.state, None, 10)["acls"]
    assert {k: listed[k] for k in ("principal", "operation", "permission", "resource_type", "resource_name",
                                   "pattern_type", "host")} == {
        "principal": "User:alice", "operation": "Write", "permission": "Allow", "resource_type": "Topic",
        "resource_name": "__cluster_metadata", "pattern_type": "LITERAL", "host": "*"}
    # the state (and so a snapshot) rebuilds the ACL
    from metalog.broker.controller.state import ControllerState
    again = ControllerState.from_records(c.state.to_records(), c.state.offset)
    assert again == c.state and len(again.acls) == 1
    (rm,) = c.remove_acl(args)
    c.state.apply(1, r.decode_record(rm))
    assert views.acls_page(c.state, None, 10)["acls"] == []
    with pytest.raises(CommandError, match="no such ACL: User:alice has Allow permission for operation Write "
                                           "from host \\* on Topic:LITERAL:__cluster_metadata"):
        c.remove_acl(args)
    with pytest.raises(CommandError, match="unknown Operation 'Fly'"):
        c.add_acl({**args, "operation": "Fly"})


def test_a_duplicate_or_malformed_acl_record_is_invalid_not_fatal():
    from metalog.broker.controller.state import ControllerState
    st = ControllerState()
    good = acl()
    assert st.apply(0, good)
    assert not st.apply(1, good)
    assert not st.apply(2, r.AccessControlEntry("z", 2, "t", 3, "User:a", "*", 99, 3))
    assert not st.apply(3, r.RemoveAccessControlEntry("nope"))
    assert st.invalid_records == 3 and list(st.acls) == [good.id]


def test_acls_survive_a_controller_snapshot(tmp_path):
    """write_controller_snapshot / load_snapshot (what a restart and an
    InstallSnapshot use) carry the ACLs."""
    from metalog.broker.controller.state import ControllerState, load_snapshot, write_controller_snapshot
    from metalog.storage.snapshot import SnapshotStore

    st = ControllerState()
    st.apply(0, acl())
    st.apply(1, acl(principal="User:bob", op=a.Operation.READ, perm=a.Permission.DENY, host="10.0.0.1"))
    st.apply(2, r.RemoveAccessControlEntry(next(iter(st.acls))))
    st.apply(3, acl(principal="User:carol", rtype=a.ResourceType.CLUSTER, name=a.CLUSTER_RESOURCE_NAME,
                    op=a.Operation.ALTER))
    store = SnapshotStore(str(tmp_path))
    sid = m.SnapshotId(4, 1)
    write_controller_snapshot(store, st, sid, 0, "c")
    loaded = load_snapshot(store, sid)
    assert loaded == st and len(loaded.acls) == 2
    assert sorted(x.principal for x in loaded.acls.values()) == ["User:bob", "User:carol"]


UPGRADE = m.UpdateFeaturesRequest(cluster_id=CID, feature_updates=[m.FeatureUpdate(m.KRAFT_VERSION_FEATURE, 1)])


@pytest.mark.parametrize("api,body", [(ApiKey.ADD_RAFT_VOTER, ADD4), (ApiKey.REMOVE_RAFT_VOTER, REMOVE3),
                                      (ApiKey.UPDATE_FEATURES, UPGRADE)])
def test_voter_changes_need_alter_on_the_cluster(api, body):
    """KIP-853, as Kafka: AddRaftVoter / RemoveRaftVoter and UpdateFeatures
    (the kraft.version upgrade) need Alter on the cluster;
    Write or Describe is not enough (CLUSTER_AUTHORIZATION_FAILED), nor is a node certificate."""
    cluster = dict(rtype=a.ResourceType.CLUSTER, name=a.CLUSTER_RESOURCE_NAME)
    for not_enough in (acl(op=a.Operation.WRITE, **cluster), acl(op=a.Operation.DESCRIBE, **cluster)):
        d = a.authorize(ALICE, HOST, api, body, view(not_enough))
        assert d is not None and d.error_code == Errors.CLUSTER_AUTHORIZATION_FAILED and d.operation == "Alter"
    assert a.authorize(N2, HOST, api, body, view()).error_code == Errors.CLUSTER_AUTHORIZATION_FAILED
    assert a.authorize(ALICE, HOST, api, body, view(acl(op=a.Operation.ALTER, **cluster))) is None


def test_a_node_may_add_or_remove_only_its_own_node_id():
    """KIP-1186 auto-join: node 4's certificate may AddRaftVoter node 4 and
    RemoveRaftVoter node 4 (its stale, wiped identity) without an ACL; node 2's
    may not touch node 4 or 3 (CLUSTER_AUTHORIZATION_FAILED)."""
    n4, n3 = node_principal(4), node_principal(3)
    assert a.authorize(n4, HOST, ApiKey.ADD_RAFT_VOTER, ADD4, view()) is None
    assert a.authorize(n3, HOST, ApiKey.REMOVE_RAFT_VOTER, REMOVE3, view()) is None
    assert a.authorize(n3, HOST, ApiKey.ADD_RAFT_VOTER, ADD4, view()).error_code == Errors.CLUSTER_AUTHORIZATION_FAILED
    assert a.authorize(n4, HOST, ApiKey.REMOVE_RAFT_VOTER, REMOVE3, view()).error_code == \
        Errors.CLUSTER_AUTHORIZATION_FAILED


def test_init_producer_id_needs_what_produce_needs():
    """InitProducerId (api 22) is allowed exactly when Produce is: Write on the
    log; without it the user sees TOPIC_AUTHORIZATION_FAILED (29)."""
    init = m.InitProducerIdRequest(cluster_id=CID)
    denied = a.authorize(ALICE, HOST, ApiKey.INIT_PRODUCER_ID, init, view())
    assert denied is not None and denied.error_code == 29
    v = view(acl(principal="User:alice", op=a.Operation.WRITE))
    assert a.authorize(ALICE, HOST, ApiKey.INIT_PRODUCER_ID, init, v) is None
    assert a.authorize(ALICE, HOST, ApiKey.PRODUCE, PRODUCE, v) is None
    v = view(acl(principal="User:alice", op=a.Operation.READ))
    assert a.authorize(ALICE, HOST, ApiKey.INIT_PRODUCER_ID, init, v).error_code == 29
