"""`ftrun chaos` with real processes: a few seeded schedules through the CLI, and one hand-written
schedule on 2-rank replicas whose faults are all sure to fire (a kill inside the all-reduce, a stop in
the quorum phase, a lighthouse restart, a corrupted loader_state slot, a joiner). Every invariant must
hold, and nothing of the runs may be left behind."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from ftrun.chaos.driver import WORKER, ScheduleRun, leaked_processes
from ftrun.chaos.invariants import check, finals_at_goal
from ftrun.chaos.schedule import Fault, Schedule
from ftrun.env.real import RealEnv
from ftrun.launch.procs import ForkServer

pytestmark = pytest.mark.timeout(240)


def test_seeded_schedules_through_the_cli_hold_every_invariant(tmp_path):
    out = tmp_path / "chaos"
    proc = subprocess.run([sys.executable, "-m", "ftrun.cli", "chaos", "--schedules", "2", "--seed", "5", "--json",
                           "--partitions", "off",  # namespaces belong to the netns suite (test_chaos_partitions.py)
                           "--out", str(out)], capture_output=True, text=True, timeout=220)
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, (figures["violations"], proc.stderr[-3000:])
    assert {"schedules", "faults_injected", "violations", "duplicate_batches", "forks"} <= set(figures)
    assert figures["schedules"] == 2 and figures["violations"] == [] and figures["forks"] == 0
    assert figures["duplicate_batches"] == 0 and figures["faults_injected"] >= 1
    assert proc.stderr.count("ftrun chaos: schedule ") == 2
    assert sorted(os.listdir(out)) == ["zygote.log"]  # passing schedules leave no folder behind


def test_a_schedule_with_every_driver_fault_on_two_rank_replicas(tmp_path):
    logging.getLogger("ftrun.quorum").setLevel(logging.ERROR)
    schedule = Schedule(seed=0, index=0, replicas=3, ranks_per_replica=2, steps=12, faults=(
        Fault("joiner", 2, "r2"),
        Fault("kill", 3, "r0", 1, "exchange"),
        Fault("lighthouse", 5, seconds=0.3),
        Fault("corrupt", 6, rank=0),
        Fault("stop", 7, "r1", 0, "quorum", 0.8),
    ))
    env = RealEnv()
    launcher = ForkServer(env=env, script=WORKER, module=True, cwd=os.getcwd(), log_path=str(tmp_path / "z.log"),
                          run_dir=str(tmp_path))
    try:
        driver = ScheduleRun(schedule, env=env, launcher=launcher, workdir=str(tmp_path))
        obs = driver.run()
    finally:
        launcher.close()
    verdict = check(obs)
    assert verdict.ok, verdict.violations
    fired = {(e["replica_id"], e["action"], e["phase"], e["rank"]) for e in obs.events if e["event"] == "fault"}
    assert ("r0", "kill", "exchange", 1) in fired and ("r1", "stop", "quorum", 0) in fired
    driver_faults = [e["fault"] for e in obs.events if e["event"] == "chaos"]
    assert driver_faults == ["joiner r2@2", "lighthouse@5 down 0.30s", "corrupt loader_state slot-0@6"]
    assert driver.faults_injected == 5
    finals = finals_at_goal(obs.events, 12)
    assert {e["rank"] for e in finals} == {0, 1} and len(finals) >= 4  # two replicas or more, both ranks
    assert leaked_processes(driver.run_dir) == []
