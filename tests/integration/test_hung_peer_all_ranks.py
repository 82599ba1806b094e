"""A replica hung inside FTAR is evicted within the heartbeat timeout on every rank (issue 12), with
real processes: 2 replicas x 2 ranks of ftrun.train.ft_worker; both ranks of r1 are SIGSTOPped mid-run.
Each rank r of r0 is in a ring with rank r of r1 only, so the lighthouse's notice to r0's leader alone
would end rank 0's all-reduce but leave rank 1 waiting out its FTAR timeout (and rank 0 with it, in the
commit vote). The leader forwards the abort to its other ranks' FTAR listeners, so r0 commits alone
after about the heartbeat timeout. Also with only r1's non-leader rank frozen (the leader's rank watch). The FTAR timeout is 30 s; the test checks the stall against half of
it, a bound load cannot break (`benchmarks/detection.py` measures it precisely)."""

from __future__ import annotations

import datetime
import os
import secrets
import signal

import pytest
import torch.distributed as dist

from ftrun.config import LighthouseConfig, Timeouts
from ftrun.env.base import EnvTimeout
from ftrun.env.real import RealEnv
from ftrun.launch.supervisor import ReplicaProcesses
from ftrun.launch.worker_env import WorkerSpec
from ftrun.quorum.service import Lighthouse
from tests.integration.replicas import stop_replicas

pytestmark = pytest.mark.timeout(150)
FTAR_TIMEOUT = 30.0
HEARTBEAT_TIMEOUT = 1.0
IDS = ("r0", "r1")


def run_hung_peer(tmp_path, *, ftar_timeout: float = FTAR_TIMEOUT, freeze: tuple[int, ...] = (0, 1)) -> dict:
    """Start the job, freeze the ranks `freeze` of r1 after 3 steps, and wait until r0 commits without it
    on both ranks. Returns {stall_s, errors (r0's, after the freeze), lost (the lighthouse's member_lost)}."""
    env = RealEnv()
    token = secrets.token_hex(8)
    lighthouse = Lighthouse(env=env, token=token, config=LighthouseConfig(min_replicas=1, timeouts=Timeouts(
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT, join_timeout_s=2.0)))
    lighthouse.start()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    events, log = env.queue(), []
    argv = ["-m", "ftrun.train.ft_worker", "--steps", "100000", "--step-time", "0.2",
            "--ftar-timeout", str(ftar_timeout)]
    reps = {rid: ReplicaProcesses(env=env, events=events, log_dir=str(tmp_path), argv=argv, spec=WorkerSpec(
        replica_id=rid, replica_index=i, num_replicas=len(IDS), rank=0, ranks_per_replica=2, incarnation=0,
        lighthouse=lighthouse.addr, token=token, store_addr="127.0.0.1", store_port=store.port,
        run_dir=str(tmp_path))) for i, rid in enumerate(IDS)}

    def pump(until, timeout=90.0):
        deadline = env.clock.now() + timeout
        while not until():
            if env.clock.now() > deadline:
                logs = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(tmp_path.glob("*.log")))
                raise AssertionError(f"timed out; last events: {log[-6:]}\n{logs}")
            try:
                log.append(events.get(timeout=0.05))
            except EnvTimeout:
                pass

    def commits(rid, rank):
        return [e for e in log if e["event"] == "step" and e["replica_id"] == rid and e["rank"] == rank
                and e["committed"]]

    try:
        for rep in reps.values():
            rep.start()
        pump(lambda: all(len(commits(r, k)) >= 3 for r in IDS for k in (0, 1)))
        for rank in freeze:
            os.kill(reps["r1"].procs[rank].pid, signal.SIGSTOP)
        frozen = env.clock.now()
        seen = {k: len(commits("r0", k)) for k in (0, 1)}
        pump(lambda: all(any(e["participants"] == ["r0"] for e in commits("r0", k)[seen[k]:]) for k in (0, 1)))
        stall = env.clock.now() - frozen
        errors = [(e["rank"], e["error"]) for e in log if e["event"] == "error" and e["replica_id"] == "r0"
                  and e["t"] >= frozen - 1.0]
        lost = [h for h in lighthouse.history if h["event"] == "member_lost" and h["replica_id"] == "r1"]
        return {"stall_s": stall, "errors": errors, "lost": lost}
    finally:
        stop_replicas(reps.values(), lighthouse)


@pytest.mark.parametrize("freeze", [pytest.param((0, 1), marks=pytest.mark.slow), (1,)], ids=["both-ranks", "non-leader-rank"])
def test_a_frozen_replica_is_given_up_on_by_every_rank_within_the_heartbeat_timeout(tmp_path, freeze):
    """both-ranks: the lighthouse sees r1's leader go silent. non-leader-rank: r1's leader runs on, but
    its rank watch (ftrun.replica.rank_watch) sees rank 1 stop answering and stops the heartbeats, so the
    lighthouse declares r1 hung as well (about two heartbeat timeouts in all)."""
    got = run_hung_peer(tmp_path, freeze=freeze)
    assert got["lost"] and got["lost"][0]["why"] == "hung", got["lost"]
    assert got["stall_s"] < FTAR_TIMEOUT / 2, got  # not the FTAR timeout on rank 1
    assert not any("Timeout" in err or "within" in err for _, err in got["errors"]), got["errors"]
    print(f"\n[hung peer, all ranks] r0 committed alone on both ranks {got['stall_s']:.2f}s after ranks {freeze} "
          f"of r1 were SIGSTOPped (heartbeat timeout {HEARTBEAT_TIMEOUT} s, FTAR timeout {FTAR_TIMEOUT} s)")
