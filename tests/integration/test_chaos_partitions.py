"""`ftrun chaos` with network partitions (root; skips where namespaces cannot be built): one hand-written
schedule on 2-rank replicas whose partition is sure to fire (a replica's host link cut mid-job, then
restored), and a few seeded schedules through the CLI, partitions among the drawn faults. Every invariant
must hold, and no process or namespace may be left behind."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from ftrun.chaos.driver import WORKER, ScheduleRun, leaked_processes
from ftrun.chaos.invariants import check
from ftrun.chaos.schedule import Fault, Schedule, generate
from ftrun.env.real import RealEnv
from ftrun.launch.procs import ForkServer

pytestmark = [pytest.mark.netns, pytest.mark.timeout(300)]


def test_a_partitioned_replica_rejoins_and_every_invariant_holds(tmp_path, netns_hosts):
    logging.getLogger("ftrun.quorum").setLevel(logging.ERROR)
    hosts = netns_hosts(4)
    schedule = Schedule(seed=0, index=0, replicas=3, ranks_per_replica=2, steps=12, faults=(
        Fault("partition", 3, "r1", seconds=1.5),
        Fault("kill", 6, "r0", 1, "exchange"),
    ))
    env = RealEnv()
    launcher = ForkServer(env=env, script=WORKER, module=True, cwd=os.getcwd(), log_path=str(tmp_path / "z.log"),
                          run_dir=str(tmp_path))
    try:
        driver = ScheduleRun(schedule, env=env, launcher=launcher, workdir=str(tmp_path), hosts=hosts)
        obs = driver.run()
    finally:
        launcher.close()
    verdict = check(obs)
    assert verdict.ok, verdict.violations
    chaos = [e["fault"] for e in obs.events if e["event"] in ("chaos", "chaos_end")]
    assert chaos == ["partition r1@3 cut 1.50s", "partition of host 2 healed"]
    assert leaked_processes(driver.run_dir) == []
    assert all(hosts.pids(i) == [] for i in range(len(hosts)))  # nothing runs on the hosts any more


def test_seeded_schedules_with_partitions_through_the_cli(tmp_path, need_namespaces):
    seed, n = 1, 4
    assert any(f.kind == "partition" for i in range(n) for f in generate(seed, i, partitions=True).faults)
    out = tmp_path / "chaos"
    proc = subprocess.run([sys.executable, "-m", "ftrun.cli", "chaos", "--schedules", str(n), "--seed", str(seed),
                           "--json", "--out", str(out)], capture_output=True, text=True, timeout=280)
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, (figures["violations"], proc.stderr[-3000:])
    assert figures["partitions"] == "on" and figures["schedules"] == n and figures["forks"] == 0
    assert figures["duplicate_batches"] == 0 and "ftrun chaos: partitions on" in proc.stderr
    assert "partition r" in proc.stderr and figures["partitions_injected"] >= 1
    # the run's own hosts being gone is checked by the run itself (a violation otherwise)


def test_partitions_off_runs_as_without_namespaces(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ftrun.cli", "chaos", "--schedules", "1", "--seed", "1",
                           "--partitions", "off", "--json", "--out", str(tmp_path / "c")],
                          capture_output=True, text=True, timeout=200)
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, (figures["violations"], proc.stderr[-3000:])
    assert figures["partitions"] == "off (--partitions off)" and figures["partitions_injected"] == 0
    assert "partition r" not in proc.stderr
