"""Full restart of a sharded job from its persistent checkpoint, into the same and into another shape.

3 replicas x 2 ranks of ftrun.train.ft_worker (FSDP2 inside each replica, real processes supervised by
ReplicaProcesses as `ftrun launch` uses them) train 10 steps, checkpointing the state after step 6
(every rank of the writer replica writes its shards); then every rank SIGKILLs itself before step 10.
The killed run is the uninterrupted reference for steps 0-9. The job is restarted three times from
copies of its run folder: as 3x2 (same shape), as 3x1 with twice the per-rank batch (same replica
batch, so the same data: ftrun.checkpoint.policy.ledger_for_layout), and as 2x4 with 3 samples per
rank: another replica count, so a new data era (LoaderState.resharded) in which the 2 replicas
partition what the 3 left untrained, and the model and optimizer reshard from 2 DCP shards to 4.

"Same loss curve" across a replica-count change. The rule: keep the global batch G constant (per-rank
batch = G / (replicas x ranks); G = 24 here). Batches are chunks of one global order
(ftrun.data.sampler), so when the replicas are in lockstep at the checkpoint, as here, every step after
the restart trains exactly the same 24 samples as the uninterrupted run, and the step's global loss
(the mean of the replicas' losses, replica batches being equal) matches the reference's within 1e-5
relative: the gradient is the same mean, summed in another order. Per-replica losses are not
comparable (the replicas hold other samples).

Checked: each restart resumes at the checkpoint's step, on its lineage (3x2, 3x1) or on a new era
chained to it (2x4); retraining steps 6-9 gives the reference's per-(step, replica) loss (mean over
the replica's ranks) bit for bit, parameter hashes included, as 3x2; within 1e-5 relative as 3x1; the
reference's global loss per step within 1e-5 relative as 2x4; and the audit over both lives shows
every batch of the final lineage trained exactly once, across the era change for 2x4 (every global
offset once).
"""

from __future__ import annotations

import datetime
import json
import math
import secrets
import shutil
from collections import defaultdict
from pathlib import Path

import pytest
import torch.distributed as dist

from ftrun.checkpoint import store
from ftrun.config import LighthouseConfig, Timeouts
from ftrun.data.audit import audit, read_log
from ftrun.data.loader_state import LoaderState
from ftrun.env.base import EnvTimeout
from ftrun.env.real import RealEnv
from ftrun.launch.supervisor import ReplicaProcesses
from ftrun.launch.worker_env import WorkerSpec
from ftrun.quorum.service import Lighthouse

IDS = ("r0", "r1", "r2")
STEPS, EVERY = 10, 6  # one checkpoint, of the state after step 6
TOKEN = secrets.token_hex(8)  # the job's: a restarted job trusts only checkpoints signed under it
LOSS_RTOL = 1e-5

pytestmark = pytest.mark.timeout(240)


class Job:
    """R replicas x K ranks of ft_worker on one lighthouse (every quorum waits for all replicas)."""

    def __init__(self, run_dir: Path, *, ranks: int, batch: int, steps: int, incarnation: int,
                 replicas: int = len(IDS)) -> None:
        self.env, self.run_dir = RealEnv(), run_dir
        token = TOKEN
        self.ids = tuple(f"r{i}" for i in range(replicas))
        self.lighthouse = Lighthouse(env=self.env, token=token, config=LighthouseConfig(
            min_replicas=replicas, timeouts=Timeouts(join_timeout_s=2.0)))
        self.lighthouse.start()
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=60))
        self.events = self.env.queue()
        fault_file = run_dir / "faults.json"
        argv = ["-m", "ftrun.train.ft_worker", "--steps", str(steps), "--checkpoint-every", str(EVERY),
                "--batch-size", str(batch), "--ftar-timeout", "20", "--fault-file", str(fault_file)]
        self.replicas = [ReplicaProcesses(
            env=self.env, events=self.events, log_dir=str(run_dir), argv=argv,
            spec=WorkerSpec(replica_id=rid, replica_index=i, num_replicas=replicas, rank=0, ranks_per_replica=ranks,
                            incarnation=incarnation, lighthouse=self.lighthouse.addr, token=token,
                            store_addr="127.0.0.1", store_port=self.store.port, run_dir=str(run_dir)))
            for i, rid in enumerate(self.ids)]
        self.log: list[dict] = []

    def run(self, timeout: float = 200.0) -> list[list[int | None]]:
        """Start every rank, collect events until all have exited; their exit codes per replica."""
        for rep in self.replicas:
            rep.start()
        try:
            deadline = self.env.clock.now() + timeout
            while not all(c is not None for rep in self.replicas for c in rep.exited()):
                if self.env.clock.now() > deadline:
                    raise AssertionError(f"timed out; last events {self.log[-6:]}\n{self.worker_logs()}")
                self._take(0.05)
            for rep in self.replicas:
                rep.drain()
            while self._take(0.0):
                pass
        finally:
            for rep in self.replicas:
                rep.kill()
            self.lighthouse.stop()
        return [rep.exited() for rep in self.replicas]

    def _take(self, timeout: float) -> bool:
        try:
            self.log.append(self.events.get(timeout=timeout))
            return True
        except EnvTimeout:
            return False

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.log if e["event"] == kind]

    def commits(self) -> list[dict]:
        return [e for e in self.of("step") if e["committed"]]

    def worker_logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(self.run_dir.glob("*.log")))


def losses(job: Job) -> dict[tuple[int, str], float]:
    """(step, replica) -> the mean of its ranks' losses (each rank's loss is the mean over its samples)."""
    by = defaultdict(list)
    for e in job.commits():
        by[(e["step"], e["replica_id"])].append(e["loss"])
    return {k: sum(v) / len(v) for k, v in by.items()}


def global_losses(job: Job) -> dict[int, float]:
    """step -> the mean of its replicas' losses: the loss of the global batch (replica batches are equal)."""
    by = defaultdict(list)
    for (step, _), loss in losses(job).items():
        by[step].append(loss)
    return {step: sum(v) / len(v) for step, v in by.items()}


def check_exactly_once(job: Job) -> LoaderState:
    finals = job.of("final")
    ledgers = {json.dumps(e["loader_state"], sort_keys=True) for e in finals}
    assert len(ledgers) == 1 and all(e["step"] == STEPS for e in finals), finals
    final = LoaderState.from_dict(finals[0]["loader_state"])
    records = []
    for path in sorted(job.run_dir.glob("audit-*.jsonl")):  # both lives
        got, problems = read_log(path.read_bytes(), name=path.name)
        assert not problems, problems
        records += got
    report = audit(records, final=final)
    assert report.ok, report.summary()
    before = sum(sum(era.committed_batches) for era in final.eras)  # batches of earlier eras (a reshard)
    trained = sum(len(era.replica_ids) * (era.end_step - era.start_step) for era in final.eras) + \
        len(final.replica_ids) * (STEPS - final.era_start)
    assert report.num_steps == STEPS and before + sum(final.committed_batches) == len(report.trained) == trained
    return final


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> tuple[Path, Job]:
    run_dir = tmp_path_factory.mktemp("killed")
    (run_dir / "faults.json").write_text(json.dumps({"die_at": f"step={STEPS},phase=quorum"}))
    job = Job(run_dir, ranks=2, batch=4, steps=STEPS + 1, incarnation=0)
    codes = job.run()
    assert codes == [[-9, -9]] * len(IDS), job.worker_logs()
    assert {(e["step"], e["replica_id"]) for e in job.commits()} == {(s, r) for s in range(STEPS) for r in IDS}
    latest = store.latest_complete(run_dir / "ckpt")
    assert latest is not None and latest.step == EVERY
    assert {f.name for f in latest.manifest.files} >= {"__0_0.distcp", "__1_0.distcp", ".metadata"}
    return run_dir, job


@pytest.mark.parametrize(("ranks", "batch"), [pytest.param(2, 4, marks=pytest.mark.slow), (1, 8)])
def test_sharded_job_resumes_from_its_checkpoint_in_another_shape(killed, tmp_path, ranks, batch):
    src, reference = killed
    run_dir = tmp_path / "resumed"
    shutil.copytree(src, run_dir)
    (run_dir / "faults.json").write_text("{}")
    job = Job(run_dir, ranks=ranks, batch=batch, steps=STEPS, incarnation=1)
    assert job.run() == [[0] * ranks] * len(IDS), job.worker_logs()

    checkpoint = store.latest_complete(run_dir / "ckpt")
    assert {(e["step"], e["lineage"]) for e in job.of("ready")} == {(EVERY, checkpoint.manifest.lineage)}
    want, got = losses(reference), losses(job)
    assert set(got) == {(s, r) for s in range(EVERY, STEPS) for r in IDS}
    worst = max(abs(got[k] - want[k]) / abs(want[k]) for k in got)
    print(f"\n[sharded restart 3x2 -> 3x{ranks}] steps {EVERY}-{STEPS - 1} retrained; "
          f"worst relative loss difference to the reference {worst:.2e}")
    if ranks == 2:
        assert got == {k: want[k] for k in got}, "the same shape retrains the lost steps bit for bit"
        hashes = {(e["step"], e["replica_id"], e["rank"]): e["param_hash"] for e in reference.commits()}
        assert all(hashes[(e["step"], e["replica_id"], e["rank"])] == e["param_hash"] for e in job.commits())
    else:
        assert all(math.isclose(got[k], want[k], rel_tol=LOSS_RTOL) for k in got), (got, want)
    lineages = {(e["step"], e["lineage"]) for e in reference.commits()}
    assert {(e["step"], e["lineage"]) for e in job.commits()} <= lineages, "the same data, step by step"
    final = check_exactly_once(job)
    assert final.layout.ranks_per_replica == ranks and final.layout.replica_batch_size == 8


def test_sharded_job_resumes_with_another_replica_count(killed, tmp_path):
    """3x2 -> 2x4, keeping the global batch of 24 (2 replicas x 4 ranks x 3 samples)."""
    src, reference = killed
    run_dir = tmp_path / "resumed"
    shutil.copytree(src, run_dir)
    (run_dir / "faults.json").write_text("{}")
    job = Job(run_dir, replicas=2, ranks=4, batch=3, steps=STEPS, incarnation=1)
    assert job.run() == [[0] * 4] * 2, job.worker_logs()

    checkpoint = store.latest_complete(run_dir / "ckpt")
    ready = {(e["step"], e["lineage"]) for e in job.of("ready")}
    assert len(ready) == 1 and next(iter(ready))[0] == EVERY and next(iter(ready))[1] != checkpoint.manifest.lineage
    want, got = global_losses(reference), global_losses(job)
    assert set(got) == set(range(EVERY, STEPS)) and {k[1] for k in losses(job)} == {"r0", "r1"}
    worst = max(abs(got[k] - want[k]) / abs(want[k]) for k in got)
    print(f"\n[sharded restart 3x2 -> 2x4, global batch 24] steps {EVERY}-{STEPS - 1} retrained; "
          f"worst relative global-loss difference to the reference {worst:.2e}")
    assert all(math.isclose(got[k], want[k], rel_tol=LOSS_RTOL) for k in got), (got, want)
    final = check_exactly_once(job)
    assert final.layout.num_replicas == 2 and final.layout.replica_batch_size == 12
    assert [(e.start_step, e.end_step, e.lineage) for e in final.eras] == [(0, EVERY, checkpoint.manifest.lineage)]
    assert final.origin.prefix == () and final.origin.tail == EVERY * 24  # lockstep: no holes to hand over
