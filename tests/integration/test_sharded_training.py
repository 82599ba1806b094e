"""FSDP2 inside replicas, end to end: 2 replicas x 2 ranks of examples/train_llama_tiny.py as real processes.

The test is the supervisor (ReplicaProcesses, as `ftrun launch` uses them). Scenario: both replicas
train; one rank of r1 is SIGKILLed, and the rest of r1 must turn that into a replica failure (a "failed"
event and a non-zero exit, not a hang); r0 trains on alone meanwhile (its FTAR with the dead rank fails,
the step is retried under a one-replica quorum); r1 is restarted, every rank catches up its own shards
from the same rank of r0, and both replicas train to the end. Checked: every committed (step, lineage,
rank) has one parameter hash in both replicas, the final hashes per rank agree, and the exactly-once
audit holds for the final ledger.
"""

from __future__ import annotations

import datetime
import json
import os
import secrets
from collections import defaultdict
from dataclasses import replace

import pytest
import torch.distributed as dist

from ftrun.config import LighthouseConfig, Timeouts
from ftrun.data.audit import audit, read_log
from ftrun.data.loader_state import LoaderState
from ftrun.env.base import EnvTimeout
from ftrun.env.real import RealEnv
from ftrun.launch.supervisor import ReplicaProcesses
from ftrun.launch.worker_env import WorkerSpec
from ftrun.quorum.service import Lighthouse

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "train_llama_tiny.py")
STEPS = 40
IDS = ("r0", "r1")

pytestmark = pytest.mark.timeout(120)


class Job:
    def __init__(self, run_dir, cache_dir) -> None:
        self.env, self.run_dir = RealEnv(), run_dir
        token = secrets.token_hex(8)
        self.lighthouse = Lighthouse(env=self.env, token=token, config=LighthouseConfig(
            min_replicas=2, timeouts=Timeouts(join_timeout_s=2.0)))
        self.lighthouse.start()
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=30))
        self.events = self.env.queue()
        argv = [EXAMPLE, "--steps", str(STEPS), "--cache-dir", str(cache_dir), "--corpus-chars", "40000",
                "--dim", "32", "--seq-len", "32", "--batch-size", "4"]
        self.replicas = {rid: ReplicaProcesses(
            env=self.env, events=self.events, log_dir=str(run_dir), argv=argv,
            spec=WorkerSpec(replica_id=rid, replica_index=i, num_replicas=len(IDS), rank=0, ranks_per_replica=2,
                            incarnation=0, lighthouse=self.lighthouse.addr, token=token, store_addr="127.0.0.1",
                            store_port=self.store.port, run_dir=str(run_dir)))
            for i, rid in enumerate(IDS)}
        self.log: list[dict] = []

    def __enter__(self) -> "Job":
        for rep in self.replicas.values():
            rep.start()
        return self

    def __exit__(self, *exc) -> None:
        for rep in self.replicas.values():
            rep.kill()
        self.lighthouse.stop()

    def pump(self, until, timeout: float = 60.0) -> None:
        deadline = self.env.clock.now() + timeout
        while not until():
            if self.env.clock.now() > deadline:
                raise AssertionError(f"timed out; last events: {self.log[-6:]}\n{self.worker_logs()}")
            try:
                self.log.append(self.events.get(timeout=0.05))
            except EnvTimeout:
                pass

    def of(self, kind: str, rid: str | None = None, incarnation: int | None = None, rank: int | None = None):
        return [e for e in self.log if e["event"] == kind and rid in (None, e["replica_id"])
                and incarnation in (None, e["incarnation"]) and rank in (None, e.get("rank"))]

    def commits(self, rid: str | None = None, incarnation: int | None = None) -> list[dict]:
        return [e for e in self.of("step", rid, incarnation) if e["committed"]]

    def min_replicas(self, n: int) -> None:
        self.lighthouse.config = replace(self.lighthouse.config, min_replicas=n)

    def worker_logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-1200:]}" for p in sorted(self.run_dir.glob("*.log")))


def check_bitwise(job: Job) -> int:
    hashes: dict[tuple, set[str]] = defaultdict(set)
    for e in job.commits():
        hashes[(e["step"], e["lineage"], e["rank"])].add(e["param_hash"])
    diverged = sorted(k for k, v in hashes.items() if len(v) > 1)
    assert not diverged, f"replicas diverged at (step, lineage, rank) {diverged[:3]}"
    return len(hashes)


def test_rank_killed_in_sharded_replica_restarts_it_and_it_rejoins_bitwise(tmp_path):
    cache = tmp_path / "cache"
    with Job(tmp_path, cache) as job:
        r1 = job.replicas["r1"]
        job.pump(lambda: all(len(job.commits(r)) >= 2 * 3 for r in IDS))  # 3 steps on both ranks of each
        job.min_replicas(1)
        killed_at = job.env.clock.now()
        r1.procs[1].kill()  # one rank of r1 dies: the rest of r1 must fail, not hang
        job.pump(lambda: r1.exited()[0] is not None, timeout=30)
        failed_s = job.env.clock.now() - killed_at
        assert r1.exited() == [1, -9]
        assert job.of("failed", "r1", 0, rank=0), "r1's surviving rank reports the replica failure"
        alone = len([e for e in job.commits("r0") if e["participants"] == ["r0"]])
        job.pump(lambda: len([e for e in job.commits("r0") if e["participants"] == ["r0"]]) >= alone + 2 * 2)
        restarted_at = job.env.clock.now()
        r1.restart()
        job.min_replicas(2)  # r0 waits for r1 to rejoin rather than run to the end alone
        job.pump(lambda: all(code is not None for rep in job.replicas.values() for code in rep.exited()))
        assert [rep.exited() for rep in job.replicas.values()] == [[0, 0], [0, 0]], job.worker_logs()

    assert job.of("heal", "r1", 1) and job.of("catchup", "r1", 1, rank=0)
    rejoined = min(e["t"] for e in job.commits("r1", 1))
    print(f"\n[sharded kill] r1 failed {failed_s:.2f}s after its rank 1 died; rejoined (first commit) "
          f"{rejoined - restarted_at:.2f}s after its restart; r0 aborts: {len(job.of('abort', 'r0'))}; "
          f"catch-up {job.of('catchup', 'r1', 1, rank=0)[0]['num_bytes']} bytes on rank 0")
    healed = {e["rank"] for e in job.of("step", "r1", 1) if e["healed"]}
    assert healed == {0, 1}, "every rank of the restarted replica caught up its own shards"
    assert any(e["participants"] == ["r0"] for e in job.commits("r0")), "r0 trained on alone meanwhile"
    assert check_bitwise(job) >= 2 * STEPS
    finals = {(e["replica_id"], e["rank"]): e for e in job.of("final")}
    assert set(finals) == {(r, k) for r in IDS for k in (0, 1)}
    for rank in (0, 1):
        assert finals[("r0", rank)]["param_hash"] == finals[("r1", rank)]["param_hash"]
    assert finals[("r0", 0)]["param_hash"] != finals[("r0", 1)]["param_hash"]  # different shards
    ledgers = {json.dumps(e["loader_state"], sort_keys=True) for e in finals.values()}
    assert len(ledgers) == 1 and all(e["step"] == STEPS for e in finals.values())

    records = []
    for path in sorted(tmp_path.glob("audit-*.jsonl")):
        got, problems = read_log(path.read_bytes(), name=path.name)
        assert not problems or path.name == "audit-r1-0.jsonl", problems  # r1's killed incarnation may be cut
        records += got
    final = LoaderState.from_dict(finals[("r0", 0)]["loader_state"])
    report = audit(records, final=final)
    assert report.ok, report.summary()
    assert report.num_steps == STEPS and sum(final.committed_batches) == len(report.trained)
