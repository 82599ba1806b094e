"""Table tests of the pure quorum decision: one case per rule and per reason string."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ftrun.config import LighthouseConfig, Timeouts
from ftrun.quorum.decide import LighthouseState, Member, QuorumRequest, apply, decide, expect_previous, finish

CFG = LighthouseConfig(min_replicas=2, timeouts=Timeouts(heartbeat_timeout_s=5.0, join_timeout_s=1.0))


def members(*ids, heard=100.0, connected=True):
    return {i: Member(i, heard, connected) for i in ids}


def reqs(spec, at=100.0):
    """spec: {replica_id: step} or {replica_id: (step, commit_failed[, own_failures])}."""
    out = {}
    for rid, v in spec.items():
        step, failed, own = (*v, 0)[:3] if isinstance(v, tuple) else (v, False, 0)
        out[rid] = QuorumRequest(rid, step, at, failed, own_failures=own)
    return out


# (name, now, state, requests, ready, reason fragment, participants, quorum_id, behind)
CASES = [
    ("below min_replicas", 100.0, LighthouseState(members=members("a", "b")), reqs({"a": 3}),
     False, "waiting: 1 of min_replicas=2 asked", (), None, ()),
    ("no majority", 100.0, LighthouseState(members=members("a", "b", "c", "d")), reqs({"a": 3, "b": 3}),
     False, "waiting: no majority (2 of 4 live replicas asked)", (), None, ()),
    ("all live asked, first quorum", 100.0, LighthouseState(members=members("a", "b", "c")),
     reqs({"a": 0, "b": 0, "c": 0}), True, "all 3 live replicas asked", ("a", "b", "c"), 1, ()),
    ("fast path keeps quorum id", 100.0,
     LighthouseState(quorum_id=4, prev_participants=("a", "b"), members=members("a", "b", "c")),
     reqs({"a": 7, "b": 7}), True, "fast path: every member of quorum 4 asked again", ("a", "b"), 4, ()),
    ("fast path includes a joiner that asked", 100.0,
     LighthouseState(quorum_id=4, prev_participants=("a", "b"), members=members("a", "b", "c")),
     reqs({"a": 7, "b": 7, "c": 0}), True, "fast path", ("a", "b", "c"), 5, ("c",)),
    ("waiting for a live member", 100.5,
     LighthouseState(quorum_id=4, prev_participants=("a", "b", "c"), members=members("a", "b", "c")),
     reqs({"a": 7, "b": 7}), False, "waiting for c until join timeout", (), None, ()),
    ("join timeout forms without the straggler", 101.0,
     LighthouseState(quorum_id=4, prev_participants=("a", "b", "c"), members=members("a", "b", "c", heard=100.5)),
     reqs({"a": 7, "b": 7}), True, "join timeout: 2 of 3 live replicas asked within 1.0s", ("a", "b"), 5, ()),
    ("dead member is not waited for", 100.0,
     LighthouseState(quorum_id=4, prev_participants=("a", "b", "c"),
                     members={**members("a", "b"), **members("c", connected=False)}),
     reqs({"a": 7, "b": 7}), True, "all 2 live replicas asked", ("a", "b"), 5, ()),
    ("heartbeat timeout drops a hung member and its request", 106.0,
     LighthouseState(quorum_id=4, prev_participants=("a", "b", "c"),
                     members={**members("a", "b", heard=105.0), **members("c", heard=100.0)}),
     reqs({"a": 7, "b": 7, "c": 7}), True, "all 2 live replicas asked", ("a", "b"), 5, ()),
    ("behind replicas are marked", 100.0, LighthouseState(members=members("a", "b", "c")),
     reqs({"a": 9, "b": 9, "c": 2}), True, "all 3", ("a", "b", "c"), 1, ("c",)),
    ("commit failure bumps quorum id", 100.0,
     LighthouseState(quorum_id=4, prev_participants=("a", "b"), members=members("a", "b")),
     reqs({"a": 7, "b": (7, True)}), True, "commit failed on b", ("a", "b"), 5, ()),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_decide(case):
    _, now, state, requests, ready, reason, participants, quorum_id, behind = case
    d = decide(now, state, requests, CFG)
    assert d.ready is ready
    assert reason in d.reason
    assert d.replica_ids == participants
    assert d.behind == behind
    if ready:
        assert d.quorum_id == quorum_id
        assert d.max_step == max(requests[p].step for p in participants)


def test_a_joiner_waiting_mid_step_does_not_start_the_join_timeout():
    # r9 rejoined and asked 10 s ago, mid-step; the previous quorum's members are arriving now. Without
    # the rule, the join timeout (1 s) would have expired long ago and the first arrivals would split off.
    state = LighthouseState(quorum_id=4, prev_participants=("a", "b", "c"),
                            members=members("a", "b", "c", "r9", heard=110.0))
    requests = {**reqs({"a": 7, "b": 7}, at=110.0), **reqs({"r9": 0}, at=100.0)}
    d = decide(110.2, state, requests, CFG)
    assert not d.ready and d.retry_at == pytest.approx(111.0) and "waiting for c" in d.reason
    d = decide(110.3, state, {**requests, **reqs({"c": 7}, at=110.3)}, CFG)
    assert d.ready and d.replica_ids == ("a", "b", "c", "r9") and d.behind == ("r9",)


def test_a_restarted_lighthouse_waits_for_the_last_quorum_instead_of_forming_with_the_first_caller():
    # Restarted at t=100 from persisted state {quorum 4: a, b, c, d}; a reconnects and asks first. Without
    # the expected members a would be "all live replicas" and train alone, and with a join timeout shorter
    # than a step b, c, d would form a second quorum for the same step: split brain.
    state = expect_previous(LighthouseState(quorum_id=4, prev_participants=("a", "b", "c", "d")), now=100.0)
    state = LighthouseState(quorum_id=4, prev_participants=state.prev_participants,
                            members={**state.members, "a": Member("a", 100.1)})
    cfg = LighthouseConfig(min_replicas=1, timeouts=CFG.timeouts)
    d = decide(100.2, state, reqs({"a": 7}, at=100.1), cfg)
    assert not d.ready and "no majority (1 of 4" in d.reason
    back = {**state.members, **members("b", "c", heard=100.3)}
    state3 = LighthouseState(quorum_id=4, prev_participants=state.prev_participants, members=back)
    requests = reqs({"a": 7, "b": 7, "c": 7}, at=100.3)
    d = decide(100.4, state3, requests, cfg)
    assert not d.ready and "waiting for d" in d.reason  # d is expected back until its heartbeat timeout
    heartbeats = {**back, **members("a", "b", "c", heard=105.9)}  # a, b, c keep heartbeating; d never returns
    state4 = LighthouseState(quorum_id=4, prev_participants=state.prev_participants, members=heartbeats)
    d = decide(106.0, state4, requests, cfg)  # past d's heartbeat_timeout_s (5 s) after the restart
    assert d.ready and d.replica_ids == ("a", "b", "c") and d.quorum_id == 5


def test_waiting_decision_says_when_to_look_again():
    state = LighthouseState(quorum_id=1, prev_participants=("a", "b", "c"), members=members("a", "b", "c"))
    d = decide(100.2, state, reqs({"a": 1, "b": 1}, at=100.0), CFG)
    assert not d.ready and d.retry_at == pytest.approx(101.0)


def test_apply_records_quorum_and_membership_change_is_monotonic():
    state = LighthouseState(members=members("a", "b", "c"))
    ids = []
    for live in (("a", "b", "c"), ("a", "b"), ("a", "b"), ("a", "b", "c")):
        state = LighthouseState(state.quorum_id, state.prev_participants, members(*live))
        d = decide(100.0, state, reqs({r: 1 for r in live}), CFG)
        state = apply(state, d)
        ids.append(state.quorum_id)
    assert ids == [1, 2, 2, 3]


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="min_replicas"):
        LighthouseConfig(min_replicas=0)
    with pytest.raises(ValueError, match="join_timeout_s"):
        Timeouts(join_timeout_s=-1)
    with pytest.raises(ValueError, match="heartbeat_interval_s"):
        Timeouts(heartbeat_interval_s=3.0, heartbeat_timeout_s=2.0)


# -- rules 7 (left out) and 8 (no regress) ------------------------------------------------------------
ONE = LighthouseConfig(min_replicas=1, timeouts=CFG.timeouts)
# (name, config, state, requests, ready, reason fragment, participants, behind, left_out, refused)
SAFETY_CASES = [
    ("a stale replica alone is refused, not trained (the fork)", ONE,
     LighthouseState(quorum_id=9, prev_participants=("a", "b"), members=members("c"), max_step=40),
     reqs({"c": 11}), False, "refused: the requesters' highest step is 11, but step 40", (), (), (), ("c",)),
    ("stale requesters wait while a silent live member may hold the step", ONE,
     LighthouseState(quorum_id=9, prev_participants=("a",), members=members("a", "b", "c"), max_step=40),
     reqs({"b": 11, "c": 11}, at=90.0), False, "waiting for a, which may hold it", (), (), (), ()),
    ("a replica at the step heals the stale one", ONE,
     LighthouseState(quorum_id=9, prev_participants=("a", "b"), members=members("a", "c"), max_step=40),
     reqs({"a": 40, "c": 11}), True, "all 2 live", ("a", "c"), ("c",), (), ()),
    ("a replica that keeps failing by its own fault sits out", ONE,
     LighthouseState(quorum_id=3, prev_participants=("a", "b"), members=members("a", "b"), max_step=5),
     reqs({"a": (5, True), "b": (5, True, 2)}), True, "left out b", ("a",), (), ("b",), ()),
    ("one own failure is retried with everyone", ONE,
     LighthouseState(quorum_id=3, prev_participants=("a", "b"), members=members("a", "b"), max_step=5),
     reqs({"a": (5, True), "b": (5, True, 1)}), True, "fast path", ("a", "b"), (), (), ()),
    ("nobody sits out below min_replicas", CFG,
     LighthouseState(quorum_id=3, prev_participants=("a", "b"), members=members("a", "b"), max_step=5),
     reqs({"a": (5, True), "b": (5, True, 3)}), True, "fast path", ("a", "b"), (), (), ()),
    ("nobody sits out when the rest cannot heal from anyone", ONE,
     LighthouseState(quorum_id=3, prev_participants=("a", "b"), members=members("a", "b"), max_step=5),
     reqs({"a": 3, "b": (5, True, 3)}), True, "fast path", ("a", "b"), ("a",), (), ()),
]


# Rule 6a, the 3 x 2 fork: r0 alone formed quorum 1 at step 0 and committed; r1 and r2 ask at step 0 while r0
# (live) is slow to ask again. At the join timeout they must not form a quorum of their own at step 0.
FORK = LighthouseState(quorum_id=1, prev_participants=("r0",), members=members("r0", "r1", "r2"), max_step=0)


def test_a_quorum_without_a_silent_member_of_the_last_one_at_its_step_waits_for_it():
    join, heartbeat = ONE.timeouts.join_timeout_s, ONE.timeouts.heartbeat_timeout_s
    after_join = 100.0 + join + 0.1
    d = decide(after_join, FORK, reqs({"r1": 0, "r2": 0}, at=100.0), ONE)
    assert not d.ready and "waiting for r0 of quorum 1" in d.reason and d.retry_at == 100.0 + heartbeat
    d = decide(after_join, FORK, {**reqs({"r1": 0, "r2": 0}, at=100.0), **reqs({"r0": 1}, at=100.5)}, ONE)
    assert d.ready and d.replica_ids == ("r0", "r1", "r2") and d.behind == ("r1", "r2")  # they heal from r0
    # once r0's heartbeat times out it no longer counts
    later = replace(FORK, members={**FORK.members, **members("r1", "r2", heard=100.0 + heartbeat)})
    assert decide(100.0 + heartbeat + 0.5, later, reqs({"r1": 0, "r2": 0}, at=100.0), ONE).ready


def test_rule_6a_leaves_the_usual_join_timeout_alone():
    after_join = 100.0 + ONE.timeouts.join_timeout_s + 0.1
    prev_asks = LighthouseState(quorum_id=1, prev_participants=("r0", "r1"), members=members("r0", "r1", "r2"), max_step=5)
    assert decide(after_join, prev_asks, reqs({"r0": 5, "r2": 5}, at=100.0), ONE).ready  # r0 of the quorum asked at 5
    assert decide(after_join, FORK, reqs({"r1": 1, "r2": 0}, at=100.0), ONE).ready  # r1 holds a step above it


@pytest.mark.parametrize("case", SAFETY_CASES, ids=[c[0] for c in SAFETY_CASES])
def test_decide_safety_rules(case):
    _, cfg, state, requests, ready, reason, participants, behind, left_out, refused = case
    d = decide(100.0 if ready or refused else 100.2, state, requests, cfg)
    assert (d.ready, d.replica_ids, d.behind, d.left_out, d.refused) == (ready, participants, behind, left_out, refused)
    assert reason in d.reason
    if ready:
        assert d.min_replicas == cfg.min_replicas and d.max_step >= state.max_step


# Rule 0: (name, state, requests, finished, ready, reason fragment)
FINISHED_CASES = [
    ("a stale replica asking after the job finished is told so",
     LighthouseState(quorum_id=9, prev_participants=("a", "b"), members=members("c"), max_step=39, finished_step=40),
     reqs({"c": 11}), ("c",), False, "job_finished: the job finished at step 40; c asked for an earlier step"),
    ("a fresh restart below the finished step is told so too (no rewind of a finished job)",
     LighthouseState(quorum_id=9, members=members("a", "b"), max_step=39, finished_step=40),
     {r: QuorumRequest(r, 20, 100.0, fresh=True) for r in ("a", "b")}, ("a", "b"), False, "job_finished"),
    ("rule 0 comes before liveness: a dead requester is told too",
     LighthouseState(members=members("c", connected=False), finished_step=5), reqs({"c": 4}), ("c",), False,
     "job_finished"),
    ("a request at the finished step (the job extended) goes on",
     LighthouseState(quorum_id=9, members=members("a", "b"), max_step=39, finished_step=40),
     reqs({"a": 40, "b": 40}), (), True, "all 2 live"),
    ("no finished step: the rules as before",
     LighthouseState(members=members("a", "b")), reqs({"a": 3, "b": 3}), (), True, "all 2 live"),
]


@pytest.mark.parametrize("case", FINISHED_CASES, ids=[c[0] for c in FINISHED_CASES])
def test_decide_job_finished_rule(case):
    _, state, requests, finished, ready, reason = case
    d = decide(100.0, state, requests, ONE)
    assert (d.finished, d.ready) == (finished, ready) and reason in d.reason
    if ready:
        assert apply(state, d).finished_step == state.finished_step


def test_finish_keeps_the_highest_finished_step():
    state = finish(LighthouseState(max_step=9), 10)
    assert (state.finished_step, state.max_step) == (10, 9)
    assert finish(state, 7).finished_step == 10 and finish(state, 12).finished_step == 12


def test_apply_keeps_the_highest_step_handed_out():
    state = LighthouseState(members=members("a", "b"))
    d = decide(100.0, state, reqs({"a": 7, "b": 7}), CFG)
    state = apply(state, d)
    assert state.max_step == 7
    assert expect_previous(state, 200.0).max_step == 7
    d = decide(100.0, state, reqs({"a": 7, "b": 9}), CFG)
    assert apply(state, d).max_step == 9 and d.behind == ("a",)


def test_a_full_restart_rewinds_only_when_every_holder_of_the_step_is_fresh():
    """Every replica restarted from the latest checkpoint (step 20) after the job had reached 25: a
    deliberate rewind, and the floor follows it down. A replica that kept its in-memory state is not."""
    state = LighthouseState(quorum_id=9, prev_participants=("a", "b"), members=members("a", "b"), max_step=25)
    fresh = {rid: QuorumRequest(rid, 20, 100.0, fresh=True) for rid in ("a", "b")}
    d = decide(100.0, state, fresh, ONE)
    assert d.ready and d.rewind and "rewinding the job from step 25 to 20" in d.reason
    assert apply(state, d).max_step == 20
    stale = {**fresh, "b": QuorumRequest("b", 20, 100.0)}
    d = decide(100.0, state, stale, ONE)
    assert not d.ready and d.refused == ("a", "b")
    behind_stale = {**fresh, "b": QuorumRequest("b", 11, 100.0)}  # the stale one heals from the restart
    d = decide(100.0, state, behind_stale, ONE)
    assert d.ready and d.rewind and d.behind == ("b",)


def test_left_out_replica_stays_out_of_the_ring_until_it_asks_again():
    cfg = LighthouseConfig(min_replicas=1, leave_out_after=1, timeouts=CFG.timeouts)
    state = LighthouseState(quorum_id=3, prev_participants=("a", "b"), members=members("a", "b"), max_step=5)
    d = decide(100.0, state, reqs({"a": (5, True), "b": (5, True, 1)}), cfg)
    assert d.ready and d.replica_ids == ("a",) and d.left_out == ("b",) and d.quorum_id == 4
    with pytest.raises(ValueError, match="leave_out_after"):
        LighthouseConfig(leave_out_after=0)


# -- invariants over random states (hypothesis) ------------------------------------------------------
from hypothesis import given, settings, strategies as st  # noqa: E402

IDS5 = ("a", "b", "c", "d", "e")
req_st = st.builds(lambda step, failed, own, fresh, at: (step, failed, own, fresh, at),
                   st.integers(0, 12), st.booleans(), st.integers(0, 3), st.booleans(), st.floats(95.0, 100.0))


@settings(deadline=None)
@given(st.dictionaries(st.sampled_from(IDS5), st.tuples(st.floats(90.0, 100.0), st.booleans()), min_size=1),
       st.dictionaries(st.sampled_from(IDS5), req_st), st.lists(st.sampled_from(IDS5), unique=True, max_size=5),
       st.integers(0, 12), st.integers(0, 9), st.integers(1, 3))
def test_decide_invariants(heard, asks, prev, floor, quorum_id, min_replicas):
    state = LighthouseState(quorum_id=quorum_id, prev_participants=tuple(sorted(prev)), max_step=floor,
                            members={rid: Member(rid, t, connected) for rid, (t, connected) in heard.items()})
    requests = {rid: QuorumRequest(rid, step, at, failed, own_failures=own, fresh=fresh)
                for rid, (step, failed, own, fresh, at) in asks.items()}
    cfg = LighthouseConfig(min_replicas=min_replicas, timeouts=CFG.timeouts)
    d = decide(100.0, state, requests, cfg)
    assert d.reason
    assert set(d.refused) <= set(requests) and not (d.refused and d.ready)
    if not d.ready:
        return
    ids = set(d.replica_ids)
    assert ids <= set(requests) and len(ids) >= min_replicas and not ids & set(d.left_out)
    assert d.quorum_id >= state.quorum_id and d.min_replicas == min_replicas
    assert d.max_step == max(requests[r].step for r in ids)
    assert set(d.behind) == {r for r in ids if requests[r].step < d.max_step}
    if d.max_step < floor:  # a regress only as a full restart, by fresh replicas holding the step
        assert d.rewind and all(requests[r].fresh for r in ids if requests[r].step == d.max_step)
        assert apply(state, d).max_step == d.max_step
    else:
        assert not d.rewind and apply(state, d).max_step == max(floor, d.max_step)
