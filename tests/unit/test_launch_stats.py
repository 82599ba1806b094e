"""Pure parts of `ftrun launch`: run statistics, identical-state check, theory, losses, audit figures, preload."""

from __future__ import annotations

import pytest

from ftrun.data.audit import Attempt, Commit, audit
from ftrun.data.loader_state import GENESIS, next_lineage
from ftrun.launch.faults import KillPlan
from ftrun.launch.report import audit_figures, batches_per_step
from ftrun.launch.stats import RunStats, loss_at, loss_curve
from ftrun.launch.theory import realized_interval, theoretical_efficiency
from ftrun.launch.zygote import top_level_imports


def commit(rid, step, t, inc=0):
    return {"event": "commit", "replica_id": rid, "incarnation": inc, "step": step + 1, "t": t, "rank": 0}


def stepped(rid, step, *, h="a", loss=1.0, inc=0, rank=0, healed=False):
    return {"event": "step", "replica_id": rid, "incarnation": inc, "rank": rank, "step": step, "committed": True,
            "loss": loss, "param_hash": h, "healed": healed, "t": 0.0}


def test_efficiency_counts_replica_steps_from_the_first_full_step():
    s = RunStats(3)
    s.add(commit("r0", 0, 0.0))  # start-up: r1, r2 not there yet (left out of the window)
    for step in (1, 2, 3):
        for rid in ("r0", "r1", "r2"):
            if not (step == 2 and rid == "r2"):
                s.add(commit(rid, step, float(step)))
    assert s.steady_step == 1 and s.max_step == 4
    assert s.efficiency() == (8, 9)


def test_a_failed_commit_of_the_next_step_is_not_a_step_reached():
    s = RunStats(2)
    for step in (0, 1, 2):
        s.add(commit("r0", step, float(step)))
        s.add(commit("r1", step, float(step)))
    s.add({"event": "abort", "replica_id": "r0", "incarnation": 0, "rank": 0, "step": 3, "t": 3.0})
    assert s.max_step == 3 and s.rows[3].aborts == 1
    assert s.efficiency() == (6, 6)


def test_identical_state_compares_each_step_and_rank_against_the_first_hash():
    s = RunStats(2)
    s.add(stepped("r0", 0, h="x"))
    s.add(stepped("r1", 0, h="x"))
    s.add(stepped("r0", 0, h="y", rank=1))  # another rank's shard: its own comparison
    s.add(stepped("r1", 0, h="y", rank=1))
    assert s.replicas_identical and s.identity_checks == 2
    s.add(stepped("r0", 1, h="p"))
    s.add(stepped("r1", 1, h="q"))
    assert not s.replicas_identical
    d = s.divergences[0]
    assert (d.step, d.rank, d.first[0], d.other[0]) == (1, 0, "r0", "r1")


def test_downtime_runs_from_the_kill_to_the_first_commit_of_a_later_incarnation():
    s = RunStats(2)
    s.add(commit("r1", 0, 1.0))
    s.add({"event": "kill", "replica_id": "r1", "incarnation": 0, "t": 2.0, "why": "injected"})
    s.add(commit("r1", 1, 2.5, inc=0))  # a late line of the killed incarnation does not end it
    s.add({"event": "ready", "replica_id": "r1", "incarnation": 1, "t": 3.0, "rank": 0})
    s.add(commit("r1", 5, 4.5, inc=1))
    (d,) = s.downtimes
    assert (d.ready_after_s, d.commit_after_s) == (1.0, 2.5)
    assert s.num_kills == 1 and s.num_crashes == 0


def test_a_kill_during_recovery_ends_the_earlier_downtime():
    s = RunStats(2)
    s.add({"event": "kill", "replica_id": "r1", "incarnation": 0, "t": 1.0, "why": "injected"})
    s.add({"event": "kill", "replica_id": "r1", "incarnation": 1, "t": 1.5, "why": "rank exited with [1]"})
    s.add(commit("r1", 3, 3.0, inc=2))
    assert [d.commit_after_s for d in s.downtimes] == [0.5, 1.5]
    assert (s.num_kills, s.num_crashes) == (1, 1)


def test_losses_skip_healed_steps_and_average_per_step():
    s = RunStats(2)
    s.add(stepped("r0", 0, loss=2.0))
    s.add(stepped("r1", 0, loss=4.0))
    s.add(stepped("r0", 1, loss=1.0))
    s.add(stepped("r1", 1, loss=None, healed=True))
    assert loss_curve(s.rows) == [(2, 3.0), (3, 1.0)]
    assert loss_curve(s.rows, {0: 2, 1: 2}) == [(2, 3.0), (4, 1.0)]


def test_loss_at_averages_a_window_of_batches():
    curve = [(1, 5.0), (2, 4.0), (3, 3.0), (4, 2.0)]
    assert loss_at(curve, 4, 2) == pytest.approx(2.5)
    assert loss_at(curve, 3.5, 2) == pytest.approx(3.5)
    assert loss_at(curve, 10, 2) is None


@pytest.mark.parametrize("r,t,d,expected", [(3, 30.0, 3.0, 29 / 30), (4, 10.0, 0.0, 1.0), (2, 1.0, 5.0, 0.0)])
def test_theoretical_efficiency(r, t, d, expected):
    assert theoretical_efficiency(num_replicas=r, kill_interval_s=t, downtime_s=d) == pytest.approx(expected)


def test_theory_rejects_bad_inputs_and_interval_needs_kills():
    with pytest.raises(ValueError):
        theoretical_efficiency(num_replicas=0, kill_interval_s=1.0, downtime_s=1.0)
    with pytest.raises(ValueError):
        theoretical_efficiency(num_replicas=3, kill_interval_s=0.0, downtime_s=1.0)
    assert realized_interval(num_kills=0, window_s=10.0) is None
    assert realized_interval(num_kills=4, window_s=10.0) == 2.5


def _chain(batches_by_step):
    """Attempt and commit records of two replicas training the given batch ids step by step."""
    records, parent = [], GENESIS
    for step, ((p0, b0), (p1, b1)) in enumerate(batches_by_step):
        records += [Attempt("r0", step, parent, p0, b0), Attempt("r1", step, parent, p1, b1)]
        lineage = next_lineage(parent, step, [("r0", p0), ("r1", p1)])
        records.append(Commit("r0", step, parent, lineage, ("r0", "r1"), (p0, p1)))
        parent = lineage
    return records


def test_audit_figures_count_duplicates_and_gaps():
    clean = audit(_chain([((0, 10), (0, 20)), ((1, 11), (1, 21))]))
    f = audit_figures(clean)
    assert (f["duplicate_batches"], f["skipped_batches"], f["audit_problems"], f["batches_trained"]) == (0, 0, 0, 4)
    assert batches_per_step(clean) == {0: 2, 1: 2}
    dup = audit(_chain([((0, 10), (0, 20)), ((1, 10), (2, 21))]))  # batch 10 twice, r1 skipped position 1
    f = audit_figures(dup)
    assert (f["duplicate_batches"], f["skipped_batches"]) == (1, 1)
    assert audit_figures(None)["duplicate_batches"] is None


def test_kill_plan_keeps_min_up_healthy_replicas():
    plan = KillPlan(every_s=1.0, min_up=2, seed=0)
    plan.start(0.0)
    # r2 and r3 are restarting (up, not healthy): only they may be killed, or nothing
    victim = plan.due(1.0, 10, ["r0", "r1", "r2", "r3"], ["r0", "r1"])
    assert victim in ("r2", "r3")
    assert plan.due(2.0, 10, ["r0", "r1"], ["r0", "r1"]) is None  # deferred, not dropped
    assert plan.due(2.1, 10, ["r0", "r1", "r2"], ["r0", "r1", "r2"]) in ("r0", "r1", "r2")


def test_top_level_imports_skip_function_bodies():
    src = ("import os, json\nfrom torch import nn\nfrom . import sibling\ntry:\n    import numpy\nexcept ImportError:\n"
           "    import array\nif True:\n    import re\ndef f():\n    import matplotlib\nclass C:\n    import csv\n")
    assert top_level_imports(src) == ["os", "json", "torch", "numpy", "array", "re"]


def test_events_stamped_after_a_kill_reveal_a_surviving_rank():
    s = RunStats(2)
    s.add({"event": "kill", "replica_id": "r1", "incarnation": 3, "t": 10.0, "why": "injected"})
    s.add(commit("r1", 5, 9.99, inc=3))  # written before the kill, read after it: fine
    s.add(commit("r1", 6, 10.05, inc=3))  # within the slack
    assert s.events_after_kill == 0
    s.add(commit("r1", 7, 11.0, inc=3))
    assert s.events_after_kill == 1


def test_fork_server_forgets_an_exit_code_when_its_pid_is_reused():
    import io
    from types import SimpleNamespace

    from ftrun.env.real import RealEnv
    from ftrun.launch.procs import ForkServer

    env = RealEnv()
    server = object.__new__(ForkServer)  # only the reply reader, fed a recorded zygote stream
    lines = [b'{"id": 1, "pid": 41}\n', b'{"exit": 41, "code": -9}\n', b'{"id": 2, "pid": 41}\n']
    server._proc, server.exit_codes, server._replies = SimpleNamespace(stdout=io.BytesIO(b"".join(lines))), {}, env.queue()
    server._read()
    assert server.exit_codes == {}  # pid 41 is the new child now, and it has not exited
    assert [server._replies.get(timeout=1)["id"] for _ in range(2)] == [1, 2]


def test_user_state_identical_compares_user_state_hash_when_steps_report_one():
    s = RunStats(2)
    s.add(stepped("r0", 0))
    s.add(stepped("r1", 0))
    assert s.user_state_identical is None and s.user_state_checks == 0  # no step carried one
    s.add({**stepped("r0", 1), "user_state_hash": "u1"})
    s.add({**stepped("r1", 1), "user_state_hash": "u1"})
    assert s.user_state_identical is True and s.user_state_checks == 1
    s.add({**stepped("r0", 2), "user_state_hash": "u2"})
    s.add({**stepped("r1", 2), "user_state_hash": "EMA drifted"})
    assert s.user_state_identical is False and s.user_state_divergences == 1
