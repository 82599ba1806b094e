"""ftrun chaos, the pure parts: seeded schedule generation, the invariants over a run's observations, and
the fault grammar's stop/slow/rank additions (ftrun.train.inject)."""

from __future__ import annotations

import pytest

from ftrun.chaos.invariants import Observation, check, fork_steps
from ftrun.chaos.schedule import KINDS, PROCESS_KINDS, Fault, Schedule, generate
from ftrun.data.audit import Attempt, Commit
from ftrun.data.loader_state import GENESIS, LoaderState, next_lineage
from ftrun.data.sampler import DataLayout
from ftrun.train.inject import DIE_PHASES, DieAt, parse_die_at

pytestmark = pytest.mark.timeout(30)


# -- schedules ------------------------------------------------------------------------------------------

def test_a_schedule_depends_on_seed_and_index_only():
    assert generate(1, 7) == generate(1, 7)
    assert generate(1, 7) != generate(2, 7) or generate(1, 8) != generate(1, 7)
    assert len({generate(1, i).describe() for i in range(50)}) > 40


def test_schedules_draw_every_kind_within_the_job():
    kinds, phases = set(), set()
    for i in range(400):
        s = generate(3, i, replicas=4, ranks_per_replica=2, steps=12)
        assert 1 <= len(s.faults) <= 3 and s.min_replicas == 3
        assert [f.step for f in s.faults] == sorted(f.step for f in s.faults)
        assert sum(f.kind == "joiner" for f in s.faults) <= 1
        for f in s.faults:
            kinds.add(f.kind)
            assert 1 <= f.step <= 8
            if f.kind in PROCESS_KINDS:
                phases.add(f.phase)
                assert f.replica in {"r0", "r1", "r2", "r3"} and 0 <= f.rank < 2 and f.phase in DIE_PHASES
                assert (f.seconds == 0) == (f.kind == "kill")
        assert s.as_json()["describe"] == s.describe()
    assert kinds == set(KINDS) - {"partition"} and phases == set(DIE_PHASES)


def test_partitions_are_drawn_only_when_asked_and_leave_other_runs_unchanged():
    assert all("partition" not in generate(3, i).describe() for i in range(200))
    assert [generate(1, i).describe() for i in range(2)] == [  # as drawn before partitions existed
        "slow r1.0@4/after_commit 0.90s; joiner r2@4",
        "kill r0.0@2/backward; lighthouse@5 down 0.85s; stop r2.0@7/quorum 1.52s"]
    cut = []
    for i in range(200):
        plain, with_p = generate(3, i), generate(3, i, partitions=True)
        assert with_p == generate(3, i, partitions=True)  # still (seed, index) only
        assert "partition" not in plain.describe()
        cut += [f for f in with_p.faults if f.kind == "partition"]
    assert len(cut) > 20
    for f in cut:
        assert f.replica in {"r0", "r1", "r2"} and 0.5 <= f.seconds <= 3.0 and 1 <= f.step <= 8
        assert f.describe() == f"partition {f.replica}@{f.step} cut {f.seconds:.2f}s"
    with pytest.raises(ValueError, match="partition"):
        Fault("partition", 3)


@pytest.mark.parametrize("shape, flag", [((1, 1, 12), "--replicas"), ((3, 0, 12), "--ranks-per-replica"),
                                         ((3, 1, 3), "--steps")])
def test_bad_job_shapes_are_refused_naming_the_flag(shape, flag):
    with pytest.raises(ValueError, match=flag):
        generate(0, 0, replicas=shape[0], ranks_per_replica=shape[1], steps=shape[2])


def test_a_process_fault_needs_a_replica_and_a_phase():
    with pytest.raises(ValueError):
        Fault("kill", 3)
    with pytest.raises(ValueError):
        Fault("flood", 3)
    assert Fault("stop", 3, "r1", 0, "exchange", 1.5).describe() == "stop r1.0@3/exchange 1.50s"


# -- the fault grammar ----------------------------------------------------------------------------------

def test_die_at_entries_carry_action_seconds_and_rank_and_encode_back():
    plan = DieAt(phase="exchange", step=4, replica="r1", incarnation=2, rank=1, action="stop", seconds=1.5)
    assert parse_die_at(plan.encode()) == (plan,)
    assert parse_die_at("phase=heal") == (DieAt(phase="heal"),) and DieAt(phase="heal").action == "kill"
    assert plan.for_rank(1) and not plan.for_rank(0) and DieAt(phase="heal").for_rank(3)
    for bad in ("phase=heal,action=dance", "phase=heal,action=slow,seconds=x", "phase=heal,seconds=-1",
                "phase=heal,seconds=nan", "phase=heal,rank=one"):
        with pytest.raises(ValueError):
            parse_die_at(bad)


# -- invariants -----------------------------------------------------------------------------------------

LAYOUT = DataLayout(dataset_size=64, num_replicas=2, ranks_per_replica=1, batch_size_per_rank=2)
IDS = ("r0", "r1")


def lineage_run(steps: int, *, writer: str = "r0") -> tuple[list, LoaderState]:
    """Audit records of `steps` steps that both replicas contributed to, and the final ledger."""
    records, state = [], LoaderState.initial(LAYOUT, IDS)
    for step in range(steps):
        parent = state.lineage
        for i, rid in enumerate(IDS):
            records.append(Attempt(rid, step, parent, state.position(rid), 100 * i + state.position(rid)))
        nxt = state.advance(step=step, contributors=IDS)
        records.append(Commit(writer, step, parent, nxt.lineage, IDS, tuple(state.position(r) for r in IDS)))
        state = nxt
    return records, state


def step_events(state_lineages: list[str], hash_of=lambda step: f"h{step}") -> list[dict]:
    return [{"event": "step", "step": s, "committed": True, "lineage": lin, "param_hash": hash_of(s),
             "replica_id": rid, "rank": 0} for s, lin in enumerate(state_lineages) for rid in IDS]


def healthy(steps: int = 4) -> Observation:
    records, final = lineage_run(steps)
    lineages = [r.lineage for r in records if isinstance(r, Commit)]
    events = step_events(lineages) + [
        {"event": "final", "step": steps, "param_hash": "end", "rank": 0, "replica_id": rid,
         "loader_state": final.to_dict()} for rid in IDS]
    return Observation(steps=steps, events=events, audit_records=records, disk_ledger=(final.step, final.lineage))


def test_a_healthy_run_passes():
    v = check(healthy())
    assert v.ok and v.forks == 0 and v.duplicate_batches == 0, v.violations


def test_two_lineages_at_one_step_are_a_fork():
    obs = healthy()
    obs.events.append({"event": "step", "step": 2, "committed": True, "lineage": "f" * 16, "param_hash": "x",
                       "replica_id": "r1", "rank": 0})
    v = check(obs)
    assert v.forks == 1 and any(s.startswith("fork: step 2") for s in v.violations)
    assert fork_steps(healthy().events, healthy().audit_records) == {}


def test_different_param_hashes_for_one_step_are_a_fork():
    obs = healthy()
    obs.events.append({"event": "step", "step": 1, "committed": True, "lineage": obs.events[2]["lineage"],
                       "param_hash": "other", "replica_id": "r1", "rank": 0})
    assert check(obs).forks == 1


def test_a_batch_trained_twice_is_an_exactly_once_violation():
    obs = healthy()
    first = next(r for r in obs.audit_records if isinstance(r, Attempt))
    dup = [i for i, r in enumerate(obs.audit_records) if isinstance(r, Attempt) and r.step == 1][0]
    r = obs.audit_records[dup]
    obs.audit_records[dup] = Attempt(r.replica, r.step, r.parent, r.position, first.batch_id)
    v = check(obs)
    assert v.duplicate_batches == 1 and any(s.startswith("exactly-once") for s in v.violations)


def test_an_unfinished_or_divergent_job_and_leftovers_are_violations():
    obs = healthy()
    obs.events = [e for e in obs.events if e["event"] != "final"]
    obs.timed_out = True
    assert {s.split(":")[0] for s in check(obs).violations} == {"liveness"}
    obs = healthy()
    obs.events[-1] = {**obs.events[-1], "param_hash": "other"}
    obs.services_down, obs.leaked_processes, obs.leaked_shm = ["lighthouse: gone"], ["pid 9"], ["ftrun-ftar-x-9-a"]
    obs.disk_ledger = (3, GENESIS)
    kinds = {s.split(":")[0] for s in check(obs).violations}
    assert kinds == {"divergence", "loader_state", "service down", "leaked process", "leaked /dev/shm file"}


def test_the_lineage_helper_matches_the_ledger():
    records, final = lineage_run(2)
    assert final.lineage == records[-1].lineage
    assert records[-1].lineage == next_lineage(records[-1].parent, 1, zip(IDS, records[-1].positions))


def test_schedule_json_round_trips_its_faults():
    s = Schedule(1, 2, 3, 1, 12, (Fault("lighthouse", 4, seconds=0.5),))
    assert s.as_json()["faults"][0]["kind"] == "lighthouse" and s.joiner is None


@pytest.mark.parametrize("argv, flag", [(["--replicas", "1"], "--replicas"), (["--steps", "3"], "--steps"),
                                        (["--ranks-per-replica", "9"], "--ranks-per-replica"),
                                        (["--schedule-timeout", "0"], "--schedule-timeout")])
def test_the_cli_refuses_bad_flags_naming_them_before_starting_anything(argv, flag, capsys):
    from ftrun.cli import main

    assert main(["chaos", *argv]) == 2
    assert flag in capsys.readouterr().err


def test_a_full_restart_retrains_on_a_new_lineage_without_a_fork_but_a_stale_lineage_after_it_is_one():
    def ev(step, lineage, quorum_id, rid="r0"):
        return {"event": "step", "step": step, "committed": True, "lineage": lineage, "param_hash": lineage,
                "quorum_id": quorum_id, "replica_id": rid, "rank": 0}

    before = [ev(s, f"old{s}", 1) for s in range(4)]
    after = [ev(s, f"new{s}", 3) for s in range(6)]
    assert len(fork_steps(before + after, [])) == 4  # no rewind known: steps 0-3 have two lineages
    assert fork_steps(before + after, [], rewinds=[3]) == {}  # the lighthouse rewound at quorum 3
    stale = ev(3, "old3", 4, rid="r1")  # the old lineage's step 3 committed again after the rewind
    assert list(fork_steps(before + after + [stale], [], rewinds=[3])) == [(1, 3)]
    obs = healthy()
    obs.rewinds = [7]
    assert check(obs).ok


def test_an_unreadable_loader_state_is_named_in_the_violation():
    obs = healthy()
    obs.disk_ledger, obs.disk_error = None, "loader_state 'loader_state/slot-0' is corrupt: bad CRC"
    assert [s for s in check(obs).violations if "bad CRC" in s and s.startswith("loader_state")]


def test_without_namespaces_partitions_are_off_and_say_why(monkeypatch):
    import argparse

    from ftrun.chaos import cli as chaos_cli
    from ftrun.launch import netns

    monkeypatch.setattr(netns, "available", lambda: (False, "not root"))
    hosts, state = chaos_cli._hosts(argparse.Namespace(partitions="auto", replicas=3))
    assert hosts is None and state == "off (network namespaces cannot be created here: not root)"
    assert chaos_cli._hosts(argparse.Namespace(partitions="off", replicas=3)) == (None, "off (--partitions off)")


def test_a_schedule_with_partitions_needs_namespace_hosts(tmp_path):
    from ftrun.chaos.driver import ScheduleRun

    s = Schedule(seed=0, index=0, replicas=3, ranks_per_replica=1, steps=12,
                 faults=(Fault("partition", 3, "r1", seconds=1.0),))
    with pytest.raises(ValueError, match="namespace hosts"):
        ScheduleRun(s, env=None, launcher=None, workdir=str(tmp_path))
