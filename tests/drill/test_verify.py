"""The drill's verification that a fault took effect, and what it needs before a fault (no cluster).

A one-way cut to a follower is verified by that follower's high watermark standing
still while cut, read from the monitor's /quorum samples. In CI the cut once went to
a broker restarted 0.1 s earlier, still booting: no samples, "cannot tell", a failed
drill. So the drill first waits until the fault's targets follow the leader
(``must_follow``, ``lagging``), and counts only the answers that were asked for after
the cut began and came back before the heal began.
"""

from types import SimpleNamespace

from metalog.tools.drill.drill import FaultRecord, Sample
from metalog.tools.drill.verify import GRACE_S, lagging, must_follow, why_not_bitten

T0 = 1000.0


def cut(samples: list[Sample], heal_ts: float = T0 + 3.0) -> str | None:
    rec = FaultRecord("cut_one_way", 1, T0, ts_end=heal_ts + 0.3, leader_before=1, epoch_before=5,
                      detail={"to": 2, "net": {"dropped_packets": 20, "dropped_bytes": 2000}, "heal_ts": heal_ts})
    return why_not_bitten(SimpleNamespace(samples=samples), rec, T0 + 10)


def answer(sent_ts: float, ts: float, hw: int, node: int = 2, epoch: int = 5) -> Sample:
    return Sample(ts, node, 1, "follower", epoch, 1, hw=hw, sent_ts=sent_ts)


def test_a_follower_that_never_answered_while_cut_cannot_be_told():
    assert cut([]) == "only 0 /quorum answer(s) from node 2 while it was cut, cannot tell"


def test_a_frozen_high_watermark_is_the_cut_taking_effect():
    start = T0 + GRACE_S
    assert cut([answer(start + k * 0.1, start + k * 0.1 + 0.01, 500) for k in range(20)]) is None


def test_a_moving_high_watermark_is_a_cut_that_did_not_bite():
    start = T0 + GRACE_S
    why = cut([answer(start + k * 0.1, start + k * 0.1 + 0.01, 500 + k) for k in range(20)])
    assert why == "follower 2's high watermark moved 500 -> 519 while it was cut off"


def test_an_answer_asked_before_the_cut_or_arriving_after_the_heal_does_not_count():
    start = T0 + GRACE_S
    frozen = [answer(start + k * 0.1, start + k * 0.1 + 0.01, 500) for k in range(20)]
    # A slow answer (asked before the cut, back 0.7 s later on a loaded machine) shows the
    # HW before the cut; one back after the heal began shows the follower catching up.
    slow = answer(T0 - 0.1, T0 + 0.6, 480)
    after_heal = answer(T0 + 2.95, T0 + 3.05, 640)
    assert cut([slow] + frozen + [after_heal]) is None


def test_a_cut_off_follower_that_won_a_newer_epoch_was_cut_off():
    """Cut off from leader 1 (epoch 5), follower 2 stood and won epoch 6: its HW moves as a
    leader's. That is the cut biting; only its answers in epoch 5 must stand still."""
    start = T0 + GRACE_S
    in_5 = [answer(start + k * 0.1, start + k * 0.1 + 0.01, 500) for k in range(5)]
    in_6 = [answer(start + k * 0.1, start + k * 0.1 + 0.01, 500 + k, epoch=6) for k in range(5, 20)]
    assert cut(in_5 + in_6) is None


def test_the_targets_a_fault_needs_following_the_leader():
    assert must_follow("cut_one_way", [2, 3], 3) == [3, 2]  # the far end first, and a majority
    assert must_follow("loss_30", [2, 3], 2) == [2]
    for kind in ("isolate_leader", "split_majority", "pause_leader", "bandwidth_cap", "mtu_blackhole",
                 "partition_snapshot", "kill_under_partition", "pause_under_loss", "wipe_under_cut"):
        assert must_follow(kind, [2, 3], None) == [2, 3], kind
    for kind in ("kill_leader", "kill_follower", "term_restart", "wipe_follower"):
        assert must_follow(kind, [2, 3], None) == [], kind


def test_lagging_names_the_first_target_that_cannot_show_the_effect():
    views = {2: {"epoch": 5, "leader_id": 1, "high_watermark": 812}}
    quorum = views.get
    assert lagging(quorum, [2], 1, 5, 800) is None
    assert lagging(quorum, [2], 1, 5, 812) == "node 2's high watermark 812 has not passed the leader's 812"
    assert lagging(quorum, [2, 3], 1, 5, 800) == "node 3 does not answer /quorum"
    views[3] = {"epoch": 4, "leader_id": 3, "high_watermark": 700}  # restarted, still in its old epoch
    assert lagging(quorum, [2, 3], 1, 5, 800) == "node 3 follows leader 3 in epoch 4, not 1 in 5"


# -- partition_snapshot: the download must be cut mid-way, and end in a whole snapshot
PART = "00000000000000003001-0000000001-fetch.checkpoint.part"


def snapshot_fault(**changes) -> str | None:
    detail = {"wiped": True, "download_seen": {"parts": [PART], "part_bytes": 2048},
              "at_cut": {"parts": [PART], "part_bytes": 55296, "checkpoints": [], "bad_checkpoints": []},
              "installs_before_heal": [],
              "before_heal": {"parts": [PART], "part_bytes": 55296, "checkpoints": [], "bad_checkpoints": []},
              "net": {"dropped_packets": 8, "dropped_bytes": 1145}, "heal_ts": T0 + 3.0, "caught_up_s": 1.5,
              "installs_after_heal": [[4503, 1]],
              "after": {"parts": [], "part_bytes": 0, "checkpoints": [[4503, 1, 262000]], "bad_checkpoints": []}}
    detail.update(changes)
    rec = FaultRecord("partition_snapshot", 2, T0, ts_end=T0 + 4.0, leader_before=1, epoch_before=5, detail=detail)
    return why_not_bitten(SimpleNamespace(samples=[]), rec, T0 + 10)


def test_a_snapshot_download_cut_mid_way_and_installed_after_the_heal_bit():
    assert snapshot_fault() is None


def test_a_download_that_finished_before_the_cut_was_not_cut():
    """The partial was already renamed to a real snapshot when the rules were in force."""
    why = snapshot_fault(at_cut={"parts": [], "part_bytes": 0, "checkpoints": [[3001, 1, 262000]],
                                 "bad_checkpoints": []})
    assert why.startswith("the download was not in progress when the cut was in force"), why


def test_a_half_written_snapshot_or_a_leftover_partial_fails_the_fault():
    half = {"parts": [PART], "part_bytes": 55296, "checkpoints": [[3001, 1, 55296]], "bad_checkpoints": []}
    assert snapshot_fault(before_heal=half).startswith("a snapshot appeared under a real name while the follower")
    left = {"parts": [PART], "part_bytes": 4096, "checkpoints": [[4503, 1, 262000]], "bad_checkpoints": []}
    assert snapshot_fault(after=left).startswith("after the catch-up the follower's dir holds a damaged snapshot")
    bad = {"parts": [], "part_bytes": 0, "checkpoints": [[4503, 1, 1000]], "bad_checkpoints": ["x: truncated"]}
    assert snapshot_fault(after=bad).startswith("after the catch-up the follower's dir holds a damaged snapshot")
    assert snapshot_fault(installs_after_heal=[]) == "the follower installed no snapshot after the heal"
    assert snapshot_fault(net={"dropped_packets": 0, "dropped_bytes": 0}).startswith("the network dropped nothing")


def test_a_compound_fault_needs_both_halves():
    """kill -9 under an isolation: the network half (drops, the isolated leader frozen) and
    the process half (SIGKILL, a majority leader in a newer epoch) are each required."""
    start = T0 + GRACE_S
    frozen = [answer(start + k * 0.1, start + k * 0.1 + 0.01, 500, node=1) for k in range(20)]
    newer = [answer(T0 + 5, T0 + 5.01, 600, node=2, epoch=6)]

    def fault(**changes) -> str | None:
        detail = {"killed": 2, "exit_code": -9, "majority_leader": [3, 6], "heal_ts": T0 + 3.0,
                  "net": {"dropped_packets": 100, "dropped_bytes": 9000}}
        detail.update(changes)
        rec = FaultRecord("kill_under_partition", 1, T0, ts_end=T0 + 3.1, leader_before=1, epoch_before=5,
                          detail=detail)
        return why_not_bitten(SimpleNamespace(samples=frozen + newer, history=SimpleNamespace(roles=[], acks=[])), rec, T0 + 10)

    assert fault() is None
    assert fault(exit_code=-15) == "follower 2 did not die by SIGKILL (exit code -15)"
    assert fault(net={"dropped_packets": 0}).startswith("the network dropped nothing")
    assert fault(majority_leader=None) == "the majority elected no leader while the old one was isolated"
