"""The fork of issue 12, item 1, with real processes: three ft_worker replicas under a lighthouse with
min_replicas=1 and a state dir; r2 is frozen (SIGSTOP) at step 10 while r0 and r1 finish all their
steps and exit; then r2 is resumed. Before the no-regress rule the lighthouse gave r2 a quorum of its
own at step 11 and r2 trained a lineage of its own to the end. Now r0 and r1 report the job finished
(ftrun.quorum.decide rule 0, persisted in the state dir), so r2 is told `job_finished` and exits 0 with
a clear message, training nothing, and the run's loader_state keeps r0/r1's lineage."""

from __future__ import annotations

import os
import secrets
import signal
from dataclasses import replace

import pytest

from ftrun.config import LighthouseConfig, Timeouts
from ftrun.env.base import EnvTimeout
from ftrun.env.real import RealEnv
from ftrun.launch.supervisor import ReplicaProcesses
from ftrun.launch.worker_env import WorkerSpec
from ftrun.quorum.service import Lighthouse, load_state
from ftrun.storage import FileStorage
from tests.integration.replicas import stop_replicas

pytestmark = pytest.mark.timeout(90)
IDS = ("r0", "r1", "r2")
STEPS = 40


def test_a_replica_frozen_while_the_others_finish_is_told_the_job_finished_instead_of_forking(tmp_path):
    env = RealEnv()
    lighthouse = Lighthouse(env=env, token=(token := secrets.token_hex(8)), storage=FileStorage(tmp_path / "lh"),
                            config=LighthouseConfig(min_replicas=len(IDS), timeouts=Timeouts(
                                heartbeat_timeout_s=1.0, join_timeout_s=2.0)))
    lighthouse.start()
    events = env.queue()
    argv = ["-m", "ftrun.train.ft_worker", "--steps", str(STEPS), "--step-time", "0.01", "--ftar-timeout", "2"]
    reps = {rid: ReplicaProcesses(env=env, events=events, log_dir=str(tmp_path), argv=argv, spec=WorkerSpec(
        replica_id=rid, replica_index=i, num_replicas=3, rank=0, ranks_per_replica=1, incarnation=0,
        lighthouse=lighthouse.addr, token=token, store_addr="127.0.0.1", store_port=0, run_dir=str(tmp_path)))
        for i, rid in enumerate(IDS)}
    log: list[dict] = []

    def pump(until, timeout=60.0):
        deadline = env.clock.now() + timeout
        while not until():
            assert env.clock.now() < deadline, f"timed out; last events: {log[-6:]}"
            try:
                log.append(events.get(timeout=0.05))
            except EnvTimeout:
                pass

    def commits(rid):
        return [e["step"] for e in log if e["event"] == "step" and e["replica_id"] == rid and e["committed"]]

    try:
        for rep in reps.values():
            rep.start()
        # The job starts with all three (a replica started early must not train alone before the others
        # exist); then the floor drops to 1, so the frozen r2 could form a quorum of its own when resumed.
        pump(lambda: all(commits(r) for r in IDS))
        lighthouse.config = replace(lighthouse.config, min_replicas=1)
        pump(lambda: len(commits("r2")) >= 10)
        frozen = reps["r2"].procs[0].pid
        os.kill(frozen, signal.SIGSTOP)
        frozen_at = max(commits("r2")) + 1
        pump(lambda: all(reps[r].exited()[0] is not None for r in ("r0", "r1")))
        assert [reps[r].exited()[0] for r in ("r0", "r1")] == [0, 0]
        assert max(commits("r0")) == STEPS - 1
        before = len(commits("r2"))
        os.kill(frozen, signal.SIGCONT)
        pump(lambda: reps["r2"].exited()[0] is not None)
        reps["r2"].drain()
        while True:
            try:
                log.append(events.get(timeout=0.0))
            except EnvTimeout:
                break
        assert reps["r2"].exited()[0] == 0
        assert len(commits("r2")) == before, "the stale replica trained on its own after its peers finished"
        told = [e for e in log if e["event"] == "job_finished" and e["replica_id"] == "r2"]
        assert told and told[0]["finished_step"] == STEPS and "job finished at step" in told[0]["reason"], told
        assert not [e for e in log if e["event"] == "failed" and e["replica_id"] == "r2"]
        assert any(h["event"] == "told_finished" and h["replica_id"] == "r2" for h in lighthouse.history)
        assert lighthouse.status()["max_step"] >= STEPS - 1 > frozen_at
        assert lighthouse.status()["finished_step"] == STEPS
        assert load_state(FileStorage(tmp_path / "lh")).finished_step == STEPS  # persisted for a restart
        final = [e for e in log if e["event"] == "final" and e["replica_id"] == "r0"]
        assert final, "r0 reports its final ledger"
    finally:
        stop_replicas(reps.values(), lighthouse)
