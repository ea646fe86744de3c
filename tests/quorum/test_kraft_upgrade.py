"""kraft.version 0 -> 1 online (UpdateFeatures, api 57; Kafka's
`kafka-features upgrade --feature kraft.version=1`), in the core.

A cluster of static voters (kraft version 0, the config's ids) upgrades
while it runs: the leader, once it has committed a record of its epoch and
knows every voter's directory id from its fetches, appends
KRaftVersionRecord(1) + the VotersRecord of those voters (endpoints from the
config) and answers once that commits; then voter changes work. Every
refusal and the error the client sees."""

from __future__ import annotations

from metalog.broker.quorum import api as a
from metalog.broker.quorum.answers import api_versions_response
from metalog.broker.quorum.voters import VoterSet, voter_sets_in
from metalog.protocol import messages as m
from metalog.protocol.errors import Errors
from metalog.storage import control_records as cr
from metalog.storage.batch import decode_records, iter_batches
from tests.quorum.harness import CLUSTER, Node, fetch, make_leader, one_response, responses

D = {1: "AAAAAAAAAAAAAAAAAAAAAg", 2: "AAAAAAAAAAAAAAAAAAAAAw", 3: "AAAAAAAAAAAAAAAAAAAABA",
     4: "AAAAAAAAAAAAAAAAAAAABQ"}
VEP = tuple((i, "CONTROLLER", "127.0.0.1", 9090 + i) for i in (1, 2, 3))


def upgrade(level: int = 1, **kw) -> m.UpdateFeaturesRequest:
    return m.UpdateFeaturesRequest(cluster_id=CLUSTER, feature_updates=[m.FeatureUpdate(m.KRAFT_VERSION_FEATURE, level)],
                                   **kw)


def static_leader(fetched=(2,), **kw) -> tuple[Node, int]:
    """Node 1 leading static voters {1, 2, 3}, its epoch committed; the
    voters in `fetched` fetched with their directory ids."""
    kw.setdefault("voter_endpoints", VEP)
    n = Node(1, directory_id=D[1], **kw)
    now = make_leader(n)
    catch_up(n, now, fetched)
    assert n.core.voter_set.kraft_version == 0 and n.core.high_watermark == n.core.log_end_offset
    return n, now


def catch_up(n: Node, now: int, ids) -> list:
    """The leader's log is flushed, then each of `ids` fetches to its end."""
    acts = n.step(a.FlushCompleted(now, n.core.log_end_offset))
    for i in ids:
        acts += fetch(n, now, i, n.core.log_end_offset, n.core.epoch, directory_id=D[i], token=("f", i))
    return acts


def ask(n: Node, now: int, req: m.Body, token="u") -> list:
    return n.step(a.RequestReceived(now, token, req))


def refused(n: Node, now: int, req: m.Body) -> tuple[int, str]:
    end = n.core.log_end_offset
    resp = one_response(ask(n, now, req), "u")
    assert n.core.log_end_offset == end, "a refused upgrade appends nothing"
    assert all(r.error_code == resp.error_code for r in resp.results)
    return resp.error_code, resp.error_message


def control_records(n: Node, start: int) -> list:
    data = n.log.read(start, n.core.log_end_offset, 1 << 20)
    out = []
    for pos, h in iter_batches(data):
        if h.is_control:
            out += [cr.decode_control(bytes(v)) for v in decode_records(data[pos:pos + h.size], h)]
    return out


def test_upgrade_writes_kraft_version_and_the_static_voters_then_answers_at_commit():
    n, now = static_leader(fetched=(2, 3))
    end = n.core.log_end_offset
    acts = ask(n, now + 1, upgrade())
    assert responses(acts, "u") == [], "answered only once committed"
    expected = VoterSet(dict(D.items() - {(4, D[4])}), kraft_version=1,
                        endpoints={i: (("CONTROLLER", "127.0.0.1", 9090 + i),) for i in (1, 2, 3)})
    assert n.core.voter_set == expected and n.core.voter_set.endpoints == expected.endpoints, \
        "the set counts from the moment it is appended"
    recs = control_records(n, end)
    assert isinstance(recs[0], cr.KRaftVersionRecord) and recs[0].kraft_version == 1
    assert isinstance(recs[1], cr.VotersRecord)
    assert voter_sets_in(n.log.read(end, n.core.log_end_offset, 1 << 20)) == [(end + 1, expected)]
    # Committed not yet: ApiVersions still says 0; a second upgrade must wait.
    ver = one_response(ask(n, now + 1, m.ApiVersionsRequest(), "av"), "av")
    assert [(f.name, f.max_version_level) for f in ver.finalized_features] == [("kraft.version", 0)]
    code, msg = refused(n, now + 2, upgrade())
    assert code == Errors.REQUEST_TIMED_OUT and msg == (
        f"the upgrade to kraft.version 1 at offset {end + 1} is not committed yet; retry")
    acts = catch_up(n, now + 3, [2])
    resp = one_response(acts, "u")
    assert resp.error_code == Errors.NONE and resp.results == [m.UpdatableFeatureResult("kraft.version", 0, None)]
    ver = one_response(ask(n, now + 4, m.ApiVersionsRequest(), "av"), "av")
    assert ver == api_versions_response(1, end + 1)
    # Now a dynamic cluster: level 1 again is a no-op, a downgrade is refused.
    end = n.core.log_end_offset
    assert one_response(ask(n, now + 5, upgrade()), "u").error_code == Errors.NONE
    assert n.core.log_end_offset == end
    code, msg = refused(n, now + 6, upgrade(0))
    assert code == Errors.INVALID_UPDATE_VERSION and msg == "kraft.version cannot be downgraded from 1 to 0"


def test_after_the_upgrade_a_voter_can_be_added():
    n, now = static_leader(fetched=(2, 3))
    ask(n, now, upgrade())
    catch_up(n, now + 1, [2, 3])
    assert n.core.finalized_kraft_version()[0] == 1
    fetch(n, now + 2, 4, n.core.log_end_offset, n.core.epoch, directory_id=D[4], token="f4")
    ask(n, now + 3, m.AddRaftVoterRequest(cluster_id=CLUSTER, voter_id=4, voter_directory_id=D[4],
                                          listeners=[m.RaftListener("CONTROLLER", "127.0.0.1", 9094)]), "add")
    assert n.core.voters == (1, 2, 3, 4)
    acts = catch_up(n, now + 4, [2, 3])
    assert one_response(acts, "add").error_code == Errors.NONE


def test_a_voter_whose_directory_id_the_leader_does_not_know_blocks_the_upgrade():
    """The user sees INVALID_UPDATE_VERSION naming the voter; nothing is written."""
    n, now = static_leader(fetched=(2,))
    code, msg = refused(n, now, upgrade())
    assert code == Errors.INVALID_UPDATE_VERSION
    assert msg.startswith("the directory id of voter(s) [3] is not known to the leader")
    catch_up(n, now + 1, [3])
    assert responses(ask(n, now + 2, upgrade()), "u") == [] and n.core.voter_set.kraft_version == 1


def test_upgrade_refusals_each_with_their_error():
    n, now = static_leader(fetched=(2, 3))
    code, msg = refused(n, now, upgrade(2))
    assert code == Errors.INVALID_UPDATE_VERSION and msg == "kraft.version 2 is not supported (this build supports 0..1)"
    code, msg = refused(n, now, m.UpdateFeaturesRequest(cluster_id=CLUSTER, feature_updates=[
        m.FeatureUpdate("metadata.version", 21)]))
    assert code == Errors.INVALID_UPDATE_VERSION and msg == "unknown feature 'metadata.version': the quorum has only kraft.version"
    code, msg = refused(n, now, m.UpdateFeaturesRequest(cluster_id=CLUSTER))
    assert code == Errors.INVALID_REQUEST and msg == "no feature to update"
    # Validate only: the answer says it would work, nothing is written.
    end = n.core.log_end_offset
    assert one_response(ask(n, now, upgrade(validate_only=True)), "u").error_code == Errors.NONE
    assert n.core.log_end_offset == end and n.core.voter_set.kraft_version == 0
    # Level 0 on a level-0 cluster: nothing to do.
    assert one_response(ask(n, now, upgrade(0)), "u").error_code == Errors.NONE and n.core.log_end_offset == end
    # No endpoint configured for the voters (a driver that gave none).
    bare, t = static_leader(fetched=(2, 3), voter_endpoints=())
    code, msg = refused(bare, t, upgrade())
    assert code == Errors.INVALID_UPDATE_VERSION and msg == "no endpoint is configured for voter(s) [1, 2, 3]"
    # Not the leader.
    f = Node(2, directory_id=D[2], voter_endpoints=VEP)
    f.step(a.Tick(0))
    code, msg = refused(f, 1, upgrade())
    assert code == Errors.NOT_LEADER_OR_FOLLOWER and msg.startswith("node 2 is not the leader")


def test_upgrade_waits_for_the_leaders_epoch_to_commit():
    n = Node(1, directory_id=D[1], voter_endpoints=VEP)
    now = make_leader(n)
    code, msg = refused(n, now, upgrade())
    assert code == Errors.REQUEST_TIMED_OUT and msg.endswith("has not committed a record of its epoch 1 yet; retry")


def test_upgrade_not_committed_in_time_answers_request_timed_out_and_the_leader_moves_on():
    n, now = static_leader(fetched=(2, 3))
    ask(n, now, upgrade(timeout_ms=500))
    acts = n.step(a.Tick(now + 501))
    resp = one_response(acts, "u")
    assert resp.error_code == Errors.REQUEST_TIMED_OUT
    # The batch stays and commits like any record; the retry sees it done.
    catch_up(n, now + 502, [2])
    assert one_response(ask(n, now + 503, upgrade()), "u").error_code == Errors.NONE


def test_a_follower_replicating_the_upgrade_becomes_a_dynamic_voter():
    n, now = static_leader(fetched=(2, 3))
    ask(n, now, upgrade())
    f = Node(2, directory_id=D[2], voter_endpoints=VEP)
    f.step(a.Tick(0))
    acts = f.step(a.RequestReceived(1, "b", m.BeginQuorumEpochRequest(
        cluster_id=CLUSTER, leader_id=1, leader_epoch=n.core.epoch, voter_id=2, voter_directory_id=D[2])))
    req = [x for x in acts if isinstance(x, a.SendRequest) and isinstance(x.request, m.FetchRequest)][-1]
    f.step(a.ResponseReceived(2, req.request_id, 1, m.FetchResponse(
        high_watermark=0, records=n.log.read(0, n.core.log_end_offset, 1 << 20))))
    assert f.core.voter_set == n.core.voter_set and f.core.voter_set.kraft_version == 1
    assert f.core.is_voter and f.core.role == "follower"
