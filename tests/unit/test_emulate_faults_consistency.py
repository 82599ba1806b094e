"""harness.run.consistency: "identical state across live replicas" and "a consistent quorum history",
checked over hand-written event streams (the recorder's event shapes)."""

from __future__ import annotations

from harness.run.consistency import GENESIS, check_quorum_history, check_replicas, step_digest


def start(rid, inc=0):
    return {"event": "start", "replica_id": rid, "incarnation": inc, "t": 0.0}


def quorum(rid, qid, step, parts, behind=(), inc=0):
    return {"event": "quorum", "replica_id": rid, "incarnation": inc, "quorum_id": qid, "step": step,
            "participants": list(parts), "behind": list(behind)}


def commit(rid, qid, step, inc=0):
    return {"event": "commit", "replica_id": rid, "incarnation": inc, "quorum_id": qid, "step": step}


def heal(rid, to, inc=0):
    return {"event": "heal", "replica_id": rid, "incarnation": inc, "to_step": to}


def kill(rid, inc=0):
    return {"event": "kill", "replica_id": rid, "incarnation": inc}


def decided(qid, parts, t, lighthouse=0):
    return {"event": "lighthouse_quorum", "quorum_id": qid, "participants": list(parts), "t": t,
            "lighthouse": lighthouse}


def round_(qid, step, parts, behind=(), inc=None):
    """Every participant enters the quorum at `step` and commits step + 1."""
    inc = inc or {}
    return ([quorum(r, qid, step if r not in behind else 0, parts, behind, inc.get(r, 0)) for r in parts]
            + [heal(r, step, inc.get(r, 0)) for r in behind]
            + [commit(r, qid, step + 1, inc.get(r, 0)) for r in parts])


AB, ABC = ("a", "b"), ("a", "b", "c")


def test_a_clean_run_is_consistent_and_the_digest_is_the_chain():
    ev = [start(r) for r in ABC] + round_(1, 0, ABC) + round_(1, 1, ABC)
    r = check_replicas(ev)
    assert r.consistent and r.final_step == 2 and r.live_replicas == list(ABC)
    assert r.final_digest == step_digest(step_digest(GENESIS, 1, 1, ABC), 2, 1, ABC)


def test_a_killed_replica_rejoins_by_healing_and_ends_identical():
    ev = [start(r) for r in ABC] + round_(1, 0, ABC) + [kill("c")] + round_(2, 1, AB)
    ev += [start("c", 1)] + round_(3, 2, ABC, behind=("c",), inc={"c": 1})
    r = check_replicas(ev)
    assert r.consistent and r.final_step == 3 and r.live_replicas == list(ABC), r.violations
    # c contributed zeros in the step it healed: the contributors are a and b
    d2 = step_digest(step_digest(GENESIS, 1, 1, ABC), 2, 2, AB)
    assert r.final_digest == step_digest(d2, 3, 3, AB)


def test_a_replica_killed_in_the_last_quorum_is_not_live():
    ev = [start(r) for r in ABC] + round_(1, 0, ABC)[:3] + [kill("c")] + [commit("a", 1, 1), commit("b", 1, 1)]
    r = check_replicas(ev)
    assert r.consistent and r.live_replicas == ["a", "b"]


def test_a_split_brain_step_is_caught():
    """Two groups train the same step under different quorums, then rejoin with nobody behind."""
    ev = [start(r) for r in ABC] + round_(1, 0, ABC) + round_(2, 1, ("a",)) + round_(3, 1, ("b", "c"))
    ev += round_(4, 2, ABC)
    r = check_replicas(ev)
    assert not r.consistent
    assert any("step 2 diverged" in v for v in r.violations)
    assert any("final state" in v for v in r.violations)  # the divergence lasts to the end


def test_a_gap_in_the_commits_or_a_foreign_quorum_is_caught():
    ev = [start(r) for r in AB] + round_(1, 0, AB) + [quorum("a", 1, 1, AB), commit("a", 1, 3)]
    assert any("committed step 3 from its state at step 1" in v for v in check_replicas(ev).violations)
    ev = [start("a"), quorum("a", 1, 0, AB), commit("a", 2, 1)]
    assert any("did not enter" in v for v in check_replicas(ev).violations)
    ev = [start("a"), quorum("a", 1, 0, AB, behind=("a",)), heal("a", 5)]
    assert any("healed to step 5" in v for v in check_replicas(ev).violations)


def test_a_live_replica_that_never_finished_is_caught():
    ev = [start(r) for r in AB] + round_(1, 0, AB) + [quorum("a", 1, 1, AB), quorum("b", 1, 1, AB), commit("a", 1, 2)]
    r = check_replicas(ev)
    assert not r.consistent and any(v.startswith("b.0 was live in the last quorum 1") for v in r.violations)


def test_quorum_history_across_a_lighthouse_restart():
    ev = [decided(1, ABC, 0.0), decided(1, ABC, 1.0), decided(2, AB, 2.0, lighthouse=1), quorum("a", 2, 2, AB)]
    q = check_quorum_history(ev)
    assert q.consistent and q.num_quorums == 2 and q.num_lighthouses == 2


def test_quorum_history_violations():
    back = check_quorum_history([decided(3, ABC, 0.0), decided(2, ABC, 1.0, lighthouse=1)])
    assert not back.consistent and "went back from 3 to 2" in back.violations[0]
    split = check_quorum_history([decided(2, ABC, 0.0), decided(2, AB, 1.0, lighthouse=1)])
    assert "split brain" in split.violations[0]
    foreign = check_quorum_history([decided(1, ABC, 0.0), quorum("a", 1, 0, AB), quorum("a", 4, 0, AB)])
    assert len(foreign.violations) == 2 and "no such quorum" in foreign.violations[1]
    regress = check_quorum_history([decided(1, AB, 0.0), decided(2, ABC, 1.0), quorum("a", 2, 0, ABC),
                                    quorum("a", 1, 1, AB)])
    assert regress.violations == ["a.0 went back from quorum 2 to 1"]
