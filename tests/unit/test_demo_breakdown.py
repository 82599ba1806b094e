"""`ftrun demo`'s rejoin breakdown: the stages follow the slowest rank to `ready`, then the leader's
quorum, heal and first commit, and add up to rejoin_s."""

from __future__ import annotations

import pytest

from ftrun.launch.demo import REJOIN_STAGES, consistency, rejoin_breakdown


def ready(rank: int, t: float, **startup) -> dict:
    return {"event": "ready", "rank": rank, "t": t, "startup": startup}


EVENTS = [
    ready(0, 10.30, forked=10.05, init=10.06, joined=10.12),
    ready(1, 10.33, forked=10.07, init=10.09, joined=10.12),
    {"event": "quorum", "t": 10.40}, {"event": "catchup", "t": 10.44}, {"event": "heal", "t": 10.45},
    {"event": "commit", "t": 10.60}, {"event": "commit", "t": 10.80},
]


def test_stages_follow_the_slowest_rank_and_add_up_to_the_first_commit():
    b = rejoin_breakdown(10.0, EVENTS)
    assert list(b) == list(REJOIN_STAGES)
    expected = {"fork_s": 0.07, "start_s": 0.02, "join_replica_s": 0.03, "build_s": 0.21, "quorum_wait_s": 0.07,
                "catchup_s": 0.05, "first_step_s": 0.15}
    assert b == pytest.approx(expected)
    assert sum(b.values()) == pytest.approx(10.60 - 10.0)


def test_spawned_ranks_have_no_fork_stage_and_missing_events_give_none():
    spawned = [ready(0, 11.0, forked=None, init=10.8, joined=10.9), {"event": "quorum", "t": 11.2}]
    b = rejoin_breakdown(10.0, spawned)
    assert b["fork_s"] is None and b["start_s"] == pytest.approx(0.8)  # from the restart
    assert b["quorum_wait_s"] == pytest.approx(0.2) and b["catchup_s"] is None and b["first_step_s"] is None
    assert rejoin_breakdown(10.0, []) == dict.fromkeys(REJOIN_STAGES)


def step(replica: str, incarnation: int, rank: int, n: int, h: str | None) -> dict:
    return {"event": "step", "replica_id": replica, "incarnation": incarnation, "rank": rank, "step": n,
            **({"param_hash": h} if h else {})}


@pytest.mark.parametrize("log, expected", [
    ([], {"replicas_consistent": True, "rejoined_steps_compared": 0}),
    ([step("r0", 0, 0, 5, "a"), step("r1", 1, 0, 5, "a"), step("r0", 0, 1, 5, "b"), step("r1", 1, 1, 5, "b")],
     {"replicas_consistent": True, "rejoined_steps_compared": 2}),
    ([step("r0", 0, 0, 5, "a"), step("r1", 1, 0, 5, "x")],  # the rejoined replica's rank 0 differs
     {"replicas_consistent": False, "rejoined_steps_compared": 1}),
    ([step("r0", 0, 0, 5, "a"), step("r2", 0, 0, 5, "a"), step("r1", 0, 0, 5, "a"),  # before the kill: not counted
      step("r1", 1, 0, 6, "c"), step("r0", 0, 0, 6, None)],  # no hash (not committed): not compared
     {"replicas_consistent": True, "rejoined_steps_compared": 0}),
])
def test_consistency_compares_each_ranks_hash_across_replicas(log, expected):
    assert consistency(log, "r1") == expected
