"""`ftrun fidelity`'s pure parts: the same figures from a real or an emulated event stream, and the table."""

from __future__ import annotations

import math

import pytest

from harness.calibrate.fidelity import NAMES, metrics, normalize, side_by_side


def job_events() -> list[dict]:
    """3 replicas, 0.1 s steps; r1 killed at t=0.55, its quorum-mates abort at 0.6 and step 5 takes 0.3 s;
    r1 restarts at 1.0, joins the quorum of step 9 (at 1.2, healed), which takes the others 0.15 s."""
    ev: list[dict] = []
    t_commit = {}
    for rid in ("r0", "r1", "r2"):
        t = 0.0
        for step in range(12):
            if rid == "r1" and step >= 5:
                break
            dur = 0.1 + (0.2 if step == 5 else 0.0) + (0.05 if step == 9 else 0.0)
            ev.append({"event": "quorum", "t": t + 0.01, "replica_id": rid, "incarnation": 0, "step": step, "rank": 0,
                       "participants": ["r0", "r1", "r2"] if step < 6 or step >= 9 else ["r0", "r2"]})
            t += dur
            ev.append({"event": "commit", "t": t, "replica_id": rid, "incarnation": 0, "step": step + 1, "rank": 0})
            ev.append({"event": "commit", "t": t, "replica_id": rid, "incarnation": 0, "step": step + 1, "rank": 1})
            t_commit[(rid, step + 1)] = t
    ev.append({"event": "kill", "t": 0.55, "replica_id": "r1", "incarnation": 0})
    ev.append({"event": "abort", "t": 0.6, "replica_id": "r0", "incarnation": 0, "rank": 0})
    ev.append({"event": "restart", "t": 1.0, "replica_id": "r1", "incarnation": 1})
    t = 1.2
    for step in range(9, 12):
        ev.append({"event": "quorum", "t": t, "replica_id": "r1", "incarnation": 1, "step": step, "rank": 0,
                   "participants": ["r0", "r1", "r2"]})
        if step == 9:
            ev.append({"event": "heal", "t": t + 0.01, "replica_id": "r1", "incarnation": 1, "to_step": 10, "rank": 0})
            ev.append({"event": "catchup", "t": t + 0.01, "replica_id": "r1", "incarnation": 1, "seconds": 0.02})
        t = t_commit[("r0", step + 1)]
        ev.append({"event": "commit", "t": t, "replica_id": "r1", "incarnation": 1, "step": step + 1, "rank": 0})
    return ev


def test_metrics_of_a_stream_with_a_kill_and_a_rejoin():
    m = metrics(job_events(), num_replicas=3)
    assert set(m) == set(NAMES)
    assert m["step_s"] == pytest.approx(0.1)
    assert m["get_quorum_s"] == pytest.approx(0.01)
    assert m["detection_s"] == pytest.approx(0.05)
    assert m["stall_per_failure_s"] == pytest.approx(0.2)
    assert m["rejoin_stall_s"] == pytest.approx(0.05)
    assert m["catchup_s"] == pytest.approx(0.02)
    started_late = [*job_events(), {"event": "catchup", "t": 0.05, "replica_id": "r2", "incarnation": 0, "seconds": 0.001}]
    assert metrics(started_late, num_replicas=3)["catchup_s"] == pytest.approx(0.02)  # not the failure's catch-up
    assert 0.5 < m["effective_training_time"] < 1.0


def test_detection_falls_back_to_the_first_quorum_without_the_replica():
    ev = [e for e in job_events() if e["event"] != "abort"]
    # r0's quorum of step 6, the first without r1, is at its step-5 commit + 0.01
    assert metrics(ev, num_replicas=3)["detection_s"] == pytest.approx(0.1 * 5 + 0.3 + 0.01 - 0.55)


def test_normalize_keeps_leaders_and_renames_restart():
    ev = normalize([{"event": "commit", "t": 2, "rank": 1}, {"event": "restart", "t": 1, "replica_id": "r1"},
                    {"event": "x"}])
    assert ev == [{"event": "start", "t": 1, "replica_id": "r1"}]


def test_empty_stream_gives_no_figures():
    assert all(v is None for v in metrics([], num_replicas=3).values())


def test_side_by_side():
    real = {n: 1.0 for n in NAMES} | {"catchup_s": None}
    emu = {n: 2.0 for n in NAMES} | {"step_s": 0.5}
    t = side_by_side(real, emu)
    assert [r["name"] for r in t["metrics"]] == list(NAMES)
    rows = {r["name"]: r for r in t["metrics"]}
    assert rows["catchup_s"]["ratio"] is None and rows["get_quorum_s"]["ratio"] == 2.0
    assert t["max_abs_log_ratio"] == pytest.approx(math.log(2))
    assert side_by_side({}, {})["max_abs_log_ratio"] is None


def test_the_emulated_model_has_the_toy_lms_parameter_count():
    from harness.calibrate.fidelity import toy_model_overrides
    from harness.profile import apply_overrides, load_profile

    p = apply_overrides(load_profile("ci-small"), toy_model_overrides(5216))
    assert p.model.num_params == 5216 and p.model.dtype == "fp32"


def test_phases_split_a_step_at_its_commit():
    from harness.calibrate.fidelity import phases

    ph = phases(job_events())
    assert ph["quorum_to_commit_s"] == pytest.approx(0.09) and ph["commit_to_quorum_s"] == pytest.approx(0.01)


def test_both_runs_get_the_same_faults_in_the_one_grammar():
    import argparse

    from ftrun.launch.inject import parse
    from harness.calibrate.fidelity import add_arguments, emulated_overrides, fault_specs, total_steps
    from harness.run.faults import parse_inject

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--replicas", "4", "--ranks-per-replica", "2", "--kill-step-interval", "80"])
    specs = fault_specs(args)
    kills = [f"kill replica=1 step={15 + 80 * i} at=0.5" for i in range(10)]
    assert specs == kills + ["slow fetch replica=1 delay=0.2"]
    assert total_steps(args) == 815  # the last kill has its 80 steps to recover in, as the others
    assert total_steps(p.parse_args(["--steps", "900"])) == 900
    with pytest.raises(ValueError, match="total_steps"):
        total_steps(p.parse_args([]))  # the interval comes from the profile, once there is one
    with pytest.raises(ValueError, match="kill_steps"):
        fault_specs(p.parse_args([]))
    for spec in specs:
        parse(spec), parse_inject(spec)  # both worlds accept them
    o = emulated_overrides(args, 5216)
    assert {"replicas=4", "ranks_per_replica=2", "checkpoint=none", "timeouts.join_timeout_s=0.5"} <= set(o)
    from ftrun.train.ft_worker import config_from, parse_args

    worker = config_from(parse_args(["--steps", "1"])).timeouts  # the real run's worker, as `_real` starts it
    assert {f"timeouts.ftar_timeout_s={worker.ftar_timeout_s}", f"timeouts.commit_timeout_s={worker.commit_timeout_s}",
            f"timeouts.heartbeat_timeout_s={worker.heartbeat_timeout_s}"} <= set(o)
    assert fault_specs(p.parse_args(["--slow-fetch-delay", "0", "--kills", "1"])) == ["kill replica=1 step=15 at=0.5"]
    assert fault_specs(p.parse_args(["--slow-fetch-delay", "0", "--kills", "2", "--kill-step-interval", "10",
                                     "--kill-at-fraction", "0.25"])) == ["kill replica=1 step=15 at=0.25",
                                                                         "kill replica=1 step=25 at=0.25"]


def two_kill_events() -> list[dict]:
    """2 replicas, r0 alone after each kill of r1: 0.1 s steps, except the step containing a kill (0.4 s) and
    the step r1 rejoins in (0.25 s). r1 is killed at 0.25 and 2.5 and rejoins at step 8 and step 26."""
    ev: list[dict] = []
    t = 0.0
    slow = {2: 0.4, 8: 0.25, 20: 0.4, 26: 0.25}
    r1_up = lambda s: s < 2 or 8 <= s < 20 or s >= 26  # noqa: E731
    inc = lambda s: 0 if s < 2 else (1 if s < 20 else 2)  # noqa: E731
    for step in range(35):
        members = ["r0", "r1"] if r1_up(step) else ["r0"]
        ev.append({"event": "quorum", "t": t + 0.001, "replica_id": "r0", "step": step, "participants": members})
        if r1_up(step):
            ev.append({"event": "quorum", "t": t + 0.002, "replica_id": "r1", "incarnation": inc(step), "step": step,
                       "participants": members})
        t += slow.get(step, 0.1)
        ev.append({"event": "commit", "t": t, "replica_id": "r0", "step": step + 1})
        if r1_up(step):
            ev.append({"event": "commit", "t": t, "replica_id": "r1", "incarnation": inc(step), "step": step + 1})
    for at, n in ((0.25, 1), (2.5, 2)):
        ev.append({"event": "kill", "t": at, "replica_id": "r1", "incarnation": n - 1})
        ev.append({"event": "abort", "t": at + 0.03 * n, "replica_id": "r0"})
        ev.append({"event": "restart", "t": at + 0.3, "replica_id": "r1", "incarnation": n})
    return ev


def test_per_fault_figures_and_their_medians_over_two_kills():
    from harness.calibrate.fidelity import per_fault, spread

    ev = two_kill_events()
    f = per_fault(ev)
    assert f["detection_s"] == pytest.approx([0.03, 0.06])
    assert f["stall_per_failure_s"] == pytest.approx([0.3, 0.3])
    assert f["rejoin_stall_s"] == pytest.approx([0.15, 0.15])
    m = metrics(ev, num_replicas=2)
    assert m["detection_s"] == pytest.approx(0.045) and m["stall_per_failure_s"] == pytest.approx(0.3)
    sp = spread(f)
    assert sp["detection_s"] == {"n": 2, "min": pytest.approx(0.03), "median": pytest.approx(0.045),
                                 "max": pytest.approx(0.06)}
    assert "catchup_s" not in sp  # no values, no spread


def test_recoveries_count_the_steps_from_the_last_join_to_each_kill():
    from harness.calibrate.fidelity import recovered, recoveries

    ev = two_kill_events()
    # kill 1 (0.25 s): 2 steps after r1's start (its first quorum, step 0); kill 2 (2.5 s, the job at step 20):
    # 12 steps after r1's rejoin (its incarnation 1's first quorum, step 8)
    assert recoveries(ev) == [2, 12]
    assert recovered([2, 12]) == 1 and recovered([11, None, 10]) == 1  # more than LOCAL_GAPS (10) steps
    # r1's incarnation 1 never rejoined before the second kill: that kill met a job still recovering
    assert recoveries([e for e in ev if not (e["event"] == "quorum" and e.get("incarnation") == 1)]) == [2, None]
    assert recoveries([e for e in ev if e["event"] != "kill"]) == []


def test_kills_are_spaced_by_the_recovery_in_steps_of_a_lone_replica():
    import argparse

    from harness.calibrate.fidelity import add_arguments, recovery_inputs, spaced_interval

    assert spaced_interval(0.8, 0.004) == 200 + 11  # the recovery's steps, then LOCAL_GAPS + 1 steady ones
    assert spaced_interval(0.0, 0.01) == 11
    with pytest.raises(ValueError, match="spaced_interval"):
        spaced_interval(0.8, 0.0)
    p = argparse.ArgumentParser()
    add_arguments(p)
    keys = {"network.crash_fin_delay_s": 0.01, "scheduler.process_start_s": 0.1, "train.catchup_fetch_extra_s": 0.005,
            "train.step_compute_s": 0.002, "train.step_bookkeeping_s": 0.001}
    rec, period = recovery_inputs(keys, {"script_step_period_s": 0.004}, p.parse_args([]))
    assert rec == pytest.approx(0.01 + 0.5 + 0.1 + 0.2 + 0.01) and period == 0.004  # restart 0.5 s, slow fetch 0.2 s
    two = {"script_step_2_replicas_s": 0.002, "script_commit_to_quorum_2_replicas_s": 0.001}
    assert recovery_inputs(keys, {"script_step_period_s": 0.019, **two}, p.parse_args([]))[1] == pytest.approx(0.003)
    assert recovery_inputs(keys, {"script_step_period_s": 0.002, **two}, p.parse_args([]))[1] == 0.002  # the shorter
    rec, period = recovery_inputs(keys, {}, p.parse_args(["--restart-delay", "1", "--slow-fetch-delay", "0"]))
    assert rec == pytest.approx(0.01 + 1 + 0.1 + 0.01) and period == pytest.approx(0.003)  # the emulator's lone step


def test_a_stall_is_measured_against_the_step_just_before_it():
    from harness.calibrate.fidelity import per_fault

    ev = two_kill_events()
    for e in ev:  # the second kill meets a loaded machine: r0's 10 steps before it take 0.2 s each
        if e["event"] == "commit" and e["replica_id"] == "r0" and 11 <= e["step"] <= 19:
            e["t"] += (e["step"] - 10) * 0.1
        elif e["t"] >= 2.45 - 1e-9:
            e["t"] += 1.0
    assert per_fault(ev)["stall_per_failure_s"] == pytest.approx([0.3, 0.2])
    assert per_fault([e for e in ev if e["event"] != "commit"])["stall_per_failure_s"] == []


def test_restep_emulates_with_the_mean_of_before_and_after():
    from harness.calibrate.fidelity import mean_overrides

    o = mean_overrides({"train.step_compute_s": 0.002, "ftar.sync_overhead_s": 0.01},
                       {"train.step_compute_s": 0.004, "scheduler.process_start_s": 0.2})
    assert o == ["train.step_compute_s=0.003", "ftar.sync_overhead_s=0.01", "scheduler.process_start_s=0.2"]


def test_the_real_runs_cpu_per_rank_step_against_the_resteps_and_the_cpu_work_at_that_speed():
    """real_cpu_speed: the real runs' median CPU per rank-step over the steps all R replicas trained, against the
    resteps' mean prediction with R up (rank_cpu_step_s + rank_ring_cpu_s x (2 (R - 1) / R - 1)); mean_overrides
    of CPU_WORK_KEYS scaled by a speed: the resteps' mean CPU work at it, the other keys left alone."""
    from harness.calibrate.fidelity import CPU_WORK_KEYS, mean_overrides, real_cpu_speed

    members = ("r0", "r1", "r2", "r3")

    def steps(cpu_per_step: float) -> list[dict]:
        out = []
        for rid in members:
            for s in range(1, 5):
                out.append({"event": "quorum", "rank": 0, "replica_id": rid, "incarnation": 0, "step": s,
                            "participants": list(members), "behind": []})
                out.append({"event": "phase", "phase": "quorum", "replica_id": rid, "incarnation": 0, "rank": 0,
                            "step": s, "t": 0.01 * s, "cpu": cpu_per_step * s})
        return out

    before = {"train.rank_cpu_step_s": 0.003, "train.rank_ring_cpu_s": 0.001, "train.step_compute_s": 0.002}
    after = {"train.rank_cpu_step_s": 0.005, "train.rank_ring_cpu_s": 0.001, "scheduler.process_start_s": 0.1}
    real, pred = real_cpu_speed([steps(0.004), steps(0.006)], 4, before, after)
    assert real == pytest.approx(0.005) and pred == pytest.approx(0.004 + 0.001 * 0.5)
    assert real_cpu_speed([steps(0.004)], 4, {}, {}) is None
    assert real_cpu_speed([[]], 4, before, after) is None
    o = mean_overrides(before, after, CPU_WORK_KEYS, 2.0)
    assert o == ["train.step_compute_s=0.004", "train.rank_cpu_step_s=0.008", "train.rank_ring_cpu_s=0.002"]


def test_kills_must_fit_in_the_run():
    import argparse

    from ftrun.cli import UsageError
    from harness.calibrate.fidelity import add_arguments, run

    p = argparse.ArgumentParser()
    add_arguments(p)
    for argv in (["--steps", "175", "--kills", "5", "--kill-step-interval", "40"], ["--kills", "0"],
                 ["--kill-step-interval", "0"], ["--kill-at-fraction", "1.0"]):
        with pytest.raises(UsageError, match="--kill"):
            run(p.parse_args(argv))


def test_repeated_real_runs_pool_their_faults_and_say_their_spread():
    from harness.calibrate.fidelity import noise, pooled_faults, repeated

    one, two = job_events(), two_kill_events()
    real, each = repeated([one, two], num_replicas=3)
    assert each == [metrics(one, num_replicas=3), metrics(two, num_replicas=3)]
    assert pooled_faults([one, two])["detection_s"] == pytest.approx([0.05, 0.03, 0.06])
    assert real["detection_s"] == pytest.approx(0.05)  # the median of the three kills, not of the two runs' medians
    assert real["step_s"] == pytest.approx((each[0]["step_s"] + each[1]["step_s"]) / 2)  # the runs' median
    sp = noise(each)
    assert sp["detection_s"] == pytest.approx(math.log(0.05 / 0.045))
    assert noise(each[:1])["step_s"] is None and noise([]) == {n: None for n in NAMES}


def test_emulated_runs_pool_their_heal_spans_as_catchup_times():
    from harness.calibrate.fidelity import pooled_faults, repeated

    one, two = job_events(), two_kill_events()
    emulated, each = repeated([one, two], num_replicas=3, catchups=[[0.4], [0.1, 0.3]])
    assert [m["catchup_s"] for m in each] == pytest.approx([0.4, 0.2])  # each run's own heals
    assert emulated["catchup_s"] == pytest.approx(0.3)  # the median of all three, not of the runs' medians
    assert pooled_faults([one, two], [[0.4], [0.1, 0.3]])["catchup_s"] == pytest.approx([0.4, 0.1, 0.3])
    assert emulated["detection_s"] == repeated([one, two], num_replicas=3)[0]["detection_s"]  # the rest as real runs


def test_the_table_says_which_ratios_are_inside_the_real_runs_noise():
    real = {n: 1.0 for n in NAMES}
    emu = {n: 1.1 for n in NAMES} | {"detection_s": 2.0}
    spreads = {n: 0.2 for n in NAMES} | {"catchup_s": None}
    t = side_by_side(real, emu, spreads)
    rows = {r["name"]: r for r in t["metrics"]}
    assert rows["step_s"]["inside_noise"] is True and rows["detection_s"]["inside_noise"] is False
    assert rows["catchup_s"]["inside_noise"] is None and rows["catchup_s"]["real_spread"] is None
    assert t["real_vs_real_max_abs_log_ratio"] == pytest.approx(0.2)
    assert "real_vs_real_max_abs_log_ratio" not in side_by_side(real, emu)  # one real run: no noise figure


def test_the_write_measured_during_the_real_runs_replaces_the_restep_mean():
    from harness.calibrate.fidelity import WRITE_KEY, with_override

    restep = ["train.step_compute_s=0.002", f"{WRITE_KEY}=0.013"]
    assert with_override(restep, WRITE_KEY, 0.004) == ["train.step_compute_s=0.002", f"{WRITE_KEY}=0.004"]
    assert with_override(["a.b=1"], WRITE_KEY, 0.004) == ["a.b=1", f"{WRITE_KEY}=0.004"]
    assert with_override(restep, WRITE_KEY, None) == restep


def test_the_write_sampler_times_writes_while_it_runs():
    import time

    from harness.calibrate.measure import WriteSampler

    sampler = WriteSampler(period_s=0.01).start()
    time.sleep(0.3)
    sampler.stop()
    f = sampler.figure()
    assert f is not None and f.name == "storage_write_s" and f.samples == len(sampler.times) >= 5 and f.value > 0
    assert WriteSampler().figure() is None  # never started: no figure


def test_start_offsets_are_each_replicas_median_ready_after_the_first():
    from harness.calibrate.fidelity import start_offsets

    def ready(rid: str, t: float, rank: int = 0, incarnation: int = 0) -> dict:
        return {"event": "ready", "t": t, "replica_id": rid, "rank": rank, "incarnation": incarnation}

    runs = [[ready("r0", 10.0), ready("r1", 10.2), ready("r1", 10.1, rank=1), ready("r2", 10.3),
             ready("r1", 12.0, incarnation=1)],  # a restart's ready and other ranks' are not the start
            [ready("r1", 5.0), ready("r0", 5.1), ready("r2", 5.5)],
            [ready("r0", 1.0), ready("r1", 1.3)]]  # r2 never ready: the run says nothing
    # per replica: r0 (0, 0.1) -> 0.05, r1 (0.2, 0) -> 0.1, r2 (0.3, 0.5) -> 0.4; less the smallest, 0.05
    assert start_offsets(runs, ["r0", "r1", "r2"]) == pytest.approx([0.0, 0.05, 0.35])
    assert start_offsets([[ready("r0", 1.0)]], ["r0", "r1"]) is None


def stalled_step_events() -> list[dict]:
    """r0 and r2 train 0.1 s steps (commit -> quorum 0.02 s, quorum -> commit 0.08 s); r1 is killed 0.03 s into
    step 12. r0 errors 0.02 s after the kill, aborts 1 ms later, has its next quorum 4 ms after that and commits
    the retried step 0.07 s after it; r2 does the same 5 ms sooner (a shorter interval: not the stall)."""
    ev: list[dict] = []
    for rid, early in (("r0", 0.0), ("r2", 0.005)):
        t = 0.0
        for step in range(20):
            ev.append({"event": "quorum", "t": t + 0.02, "replica_id": rid, "step": step})
            if step == 12:
                kill = t + 0.05
                ev += [{"event": "error", "t": kill + 0.02 - early, "replica_id": rid},
                       {"event": "abort", "t": kill + 0.021 - early, "replica_id": rid},
                       {"event": "quorum", "t": kill + 0.025 - early, "replica_id": rid, "step": step}]
                t = kill + 0.095 - early
            else:
                t += 0.1
            ev.append({"event": "commit", "t": t, "replica_id": rid, "step": step + 1})
    ev.append({"event": "kill", "t": 1.25, "replica_id": "r1", "incarnation": 0})
    return ev


def test_stall_phases_cut_the_stalled_interval_at_both_worlds_events():
    from harness.calibrate.fidelity import STALL_PHASES, per_fault, stall_phase_medians, stall_phases

    ev = stalled_step_events()
    [row] = stall_phases(ev)
    assert row["commit_to_quorum"] == pytest.approx(0.02)
    assert row["quorum_to_kill"] == pytest.approx(0.03)
    assert row["detection"] == pytest.approx(0.02)
    assert row["vote"] == pytest.approx(0.001)
    assert row["requorum"] == pytest.approx(0.004)
    assert row["more_quorums"] == pytest.approx(0.0)
    assert row["retry_step"] == pytest.approx(0.07)
    assert row["step"] == pytest.approx(0.1)
    assert row["step_commit_to_quorum"] == pytest.approx(0.02) and row["step_quorum_to_commit"] == pytest.approx(0.08)
    assert sum(row[p] for p in STALL_PHASES) - row["step"] == pytest.approx(row["stall"])
    assert row["stall"] == pytest.approx(per_fault(ev)["stall_per_failure_s"][0]) == pytest.approx(0.045)
    no_abort = [e for e in ev if not (e["event"] == "abort" and e["replica_id"] == "r0")]
    [row] = stall_phases(no_abort)  # a missing boundary: its phase is None, its time goes to the next one
    assert row["vote"] is None and row["requorum"] == pytest.approx(0.005)
    med = stall_phase_medians([row, {**row, "vote": 0.003}])
    assert med["vote"] == pytest.approx(0.003) and med["stall"] == pytest.approx(0.045)
    early_kill = [{**e, "t": 1.21} if e["event"] == "kill" else e for e in ev]  # before r0's quorum (1.22)
    [row] = stall_phases(early_kill)  # no phase is negative: that quorum is not the step's before the kill
    assert row["commit_to_quorum"] is None and row["quorum_to_kill"] == pytest.approx(0.01)
    assert row["detection"] == pytest.approx(0.06) and row["requorum"] == pytest.approx(0.004)


def test_teardowns_are_each_kill_to_the_lighthouses_loss_of_that_replica():
    from harness.calibrate import teardowns

    trace = {"traceEvents": [
        {"name": "kill", "cat": "job", "ph": "i", "ts": 1000.0, "args": {"replica_id": "r1"}},
        {"name": "member_lost r0", "cat": "quorum", "ph": "i", "ts": 2000.0, "args": {"replica_id": "r0", "why": "lost"}},
        {"name": "member_lost r1", "cat": "quorum", "ph": "i", "ts": 15000.0, "args": {"replica_id": "r1", "why": "lost"}},
        {"name": "kill", "cat": "job", "ph": "i", "ts": 50000.0, "args": {"replica_id": "r1"}},
        {"name": "member_lost r1", "cat": "quorum", "ph": "i", "ts": 60000.0, "args": {"replica_id": "r1", "why": "hung"}},
        {"name": "member_lost r1", "cat": "quorum", "ph": "i", "ts": 75000.0, "args": {"replica_id": "r1", "why": "lost"}},
        {"name": "kill", "cat": "job", "ph": "i", "ts": 90000.0, "args": {"replica_id": "r1"}}]}  # never seen lost
    assert teardowns(trace) == pytest.approx([0.014, 0.025])
    assert teardowns({}) == []
    unseen_first = {"traceEvents": [e for e in trace["traceEvents"] if e["ts"] != 15000.0]}
    assert teardowns(unseen_first) == pytest.approx([0.025])  # not 0.074: the next kill's loss is the next kill's


def test_the_real_teardown_is_the_median_over_every_real_runs_kills():
    from harness.calibrate.fidelity import real_teardown

    def trace(*pairs: tuple[float, float]) -> dict:  # (kill, loss) in ms
        ev = []
        for kill, lost in pairs:
            ev += [{"name": "kill", "cat": "job", "ph": "i", "ts": kill * 1e3, "args": {"replica_id": "r1"}},
                   {"name": "member_lost r1", "cat": "quorum", "ph": "i", "ts": lost * 1e3,
                    "args": {"replica_id": "r1", "why": "lost"}}]
        return {"traceEvents": ev}

    t = real_teardown([trace((100, 112), (500, 560)), trace((100, 120)), {}])
    assert t.name == "real_teardown_s" and t.value == pytest.approx(0.020) and t.samples == 3
    assert real_teardown([{}, {}]) is None


def test_rank_phases_are_medians_over_every_runs_ranks_steps():
    from harness.calibrate.fidelity import rank_phases

    def run(compute: float) -> list[dict]:
        ev = []
        for rank, lag in ((0, 0.0), (1, 0.002)):
            for phase, t in (("started", 1.0), ("forward", 1.001), ("exchange", 1.001 + compute),
                             ("before_commit", 1.011 + compute)):
                ev.append({"event": "phase", "replica_id": "r0", "rank": rank, "phase": phase, "step": 0,
                           "t": t + lag})
        ev.append({"event": "commit", "replica_id": "r0", "rank": 0, "step": 1, "t": 1.016 + compute})
        return ev

    ph = rank_phases([run(0.010), run(0.020)])
    assert ph["compute_s"] == pytest.approx(0.015) and ph["all_reduce_s"] == pytest.approx(0.010)
    assert ph["commit_vote_s"] == pytest.approx(0.003) and ph["decision_broadcast_s"] == pytest.approx(0.002)
    assert rank_phases([[]]) == {"compute_s": None, "all_reduce_s": None, "commit_vote_s": None,
                                 "decision_broadcast_s": None}


def test_the_real_write_is_the_real_runs_own_writers_else_the_sampled_one():
    from harness.calibrate.fidelity import real_write
    from harness.calibrate.measure import Figure

    def phase(rid: str, phase: str, step: int, t: float) -> dict:
        return {"event": "phase", "replica_id": rid, "rank": 0, "phase": phase, "step": step, "t": t}

    run = [{"event": "quorum", "replica_id": "r0", "rank": 0, "step": 3, "t": 0.5, "participants": ["r0", "r1"]},
           phase("r0", "after_commit", 3, 1.0), phase("r0", "quorum", 4, 1.005),
           phase("r1", "after_commit", 3, 1.0), phase("r1", "quorum", 4, 1.001)]
    sampled = Figure("storage_write_s", 0.009, "s", "sampled", 4)
    w = real_write([run, run], sampled)
    assert w.name == "real_writer_write_s" and w.value == pytest.approx(0.004) and w.samples == 2
    assert real_write([[e for e in run if e["event"] != "phase"]], sampled) is sampled


def test_the_real_skews_are_the_calibrations_estimators_over_every_real_run():
    from harness.calibrate.fidelity import real_skews
    from harness.calibrate.provenance import median_abs_diff_max_exp

    def run(lag: float) -> list[dict]:
        return [{"event": "phase", "phase": "started", "replica_id": "r0", "rank": 0, "step": 1, "t": 1.0},
                {"event": "phase", "phase": "started", "replica_id": "r1", "rank": 0, "step": 1, "t": 1.0 + lag},
                {"event": "commit", "replica_id": "r0", "rank": 0, "step": 2, "t": 2.0},
                {"event": "commit", "replica_id": "r1", "rank": 0, "step": 2, "t": 2.0 + 2 * lag}]

    skews = real_skews([run(0.001), run(0.003)], ranks=2)
    assert skews["train.rank_start_skew_s"].value == pytest.approx(0.002 / math.log(2))
    assert skews["train.rank_exchange_skew_s"].value == pytest.approx(0.004 / median_abs_diff_max_exp(2))
    assert skews["train.rank_start_skew_s"].samples == 2
    assert real_skews([[]], ranks=1) == {}
