"""Full restart of every replica from the latest complete checkpoint plus its loader_state.

A two-replica job runs in one process (the replicated model and optimizer are one torch model and one
AdamW; each replica contributes its own batch through its DataProgress, and replica r1 is away for a
few steps so the replicas' data positions differ). It checkpoints every 3 steps, "crashes" (every
object dropped), restores, and finishes. The audit over both lives shows every batch trained exactly
once on the final lineage, and the final parameters equal an uninterrupted run's bit for bit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ftrun.checkpoint import store
from ftrun.checkpoint.policy import CheckpointConfig, checkpoint_writer, should_checkpoint
from ftrun.data.audit import AuditLog, FileAuditSink, audit, read_log
from ftrun.data.loader_state import LoaderState, LoaderStateStore
from ftrun.data.progress import DataProgress
from ftrun.data.sampler import DataLayout
from ftrun.storage import FileStorage
from ftrun.train.lr import apply_lr_factor, lr_factor

LAYOUT = DataLayout(dataset_size=48, num_replicas=2, ranks_per_replica=2, batch_size_per_rank=3, seed=11)
IDS = ("r0", "r1")
TOTAL_STEPS = 13
AWAY = {1, 2}  # r1 is down for these steps and heals (contributing zeros) in step 3
CONFIG = CheckpointConfig(every_steps=3, keep=2)
gen = torch.Generator().manual_seed(0)
X, Y = torch.randn(48, 5, generator=gen), torch.randn(48, 1, generator=gen)


@dataclass(frozen=True)
class P:
    replica_id: str
    step: int


def make_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)


class Job:
    """The training loop, as a real one would wire sampler, ledger, audit, LR and checkpoints."""

    def __init__(self, root: Path, model, opt, state: LoaderState) -> None:
        self.root, self.model, self.opt = root, model, opt
        self.progress = {rid: DataProgress(replica_id=rid, state=state) for rid in IDS}
        self.sink = FileAuditSink(root / "audit.jsonl")
        self.log = AuditLog(self.sink)
        self.ledger_file = LoaderStateStore(storage=FileStorage(root / "run"))

    def quorum(self, step: int) -> list[P]:
        if step in AWAY:
            return [P("r0", step)]
        return [P(rid, self.progress[rid].state.step) for rid in IDS]

    def run(self, until: int) -> None:
        while (step := self.progress["r0"].state.step) < until:
            quorum = self.quorum(step)
            writer = checkpoint_writer(quorum)
            if should_checkpoint(step, CONFIG):  # the state after `step` commits, before training it
                store.save(self.root / "ckpt", step=step, model=self.model, optimizer=self.opt,
                           loader_state=self.progress[writer].state, keep=CONFIG.keep)
            self.train_step(step, quorum)
            self.ledger_file.save(self.progress[writer].state)

    def train_step(self, step: int, quorum: list[P]) -> None:
        members = [self.progress[p.replica_id] for p in quorum]
        for prog in members:
            if prog.state.step < step:
                prog.heal(self.progress["r0"].state)  # behind: take the healthy peer's ledger
        attempts = [a for prog in members if (a := prog.start(step=step, participants=quorum))]
        for a in attempts:
            self.log.append(a)
        slices = [self.progress[a.replica].samples(rank) for a in attempts for rank in range(LAYOUT.ranks_per_replica)]
        self.opt.zero_grad()
        loss = sum(torch.nn.functional.mse_loss(self.model(X[idx]), Y[idx]) for idx in slices) / len(slices)
        loss.backward()
        apply_lr_factor(self.opt, lr_factor("sqrt", num_healthy=len(attempts), num_total=len(IDS)))
        self.opt.step()
        for prog in members:
            self.log.append(prog.commit(writer=prog.replica_id))


def uninterrupted(tmp_path: Path) -> list[torch.Tensor]:
    tmp_path.mkdir()
    model, opt = make_model()
    job = Job(tmp_path, model, opt, LoaderState.initial(LAYOUT, IDS))
    job.run(TOTAL_STEPS)
    job.sink.close()
    report = audit(read_log((tmp_path / "audit.jsonl").read_bytes())[0], final=job.progress["r0"].state)
    assert report.ok, report.summary()
    return [p.detach().clone() for p in model.parameters()]


def corrupt_newest(root: Path) -> Path:
    newest = max(root.glob("step-*"))
    victim = next(newest.glob("*.distcp"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    return victim


@pytest.mark.parametrize(("crash_at", "corrupt", "resume_step"), [
    (11, False, 9),  # steps 9 and 10 are lost and retrained from the step-9 checkpoint
    (11, True, 6),  # the step-9 checkpoint is corrupt: fall back to step 6
    (9, False, 6),  # crash just before the step-9 checkpoint: steps 6..8 are retrained
])
def test_full_restart_resumes_exactly_once_and_bitwise(tmp_path, caplog, crash_at, corrupt, resume_step):
    expected = uninterrupted(tmp_path / "straight")
    run = tmp_path / "restarted"
    run.mkdir()
    model, opt = make_model()
    job = Job(run, model, opt, LoaderState.initial(LAYOUT, IDS))
    job.run(crash_at)
    job.sink.close()
    if corrupt:
        victim = corrupt_newest(run / "ckpt")
    del job, model, opt  # the crash: nothing survives but the files

    model, opt = make_model()
    with caplog.at_level(logging.WARNING, logger="ftrun.checkpoint"):
        step, state = store.restore(run / "ckpt", model, opt)
    assert step == resume_step and state.step == resume_step
    if corrupt:
        assert f"{victim.name}: CRC32" in caplog.text
    rolling = LoaderStateStore(storage=FileStorage(run / "run")).load()
    assert rolling.step == crash_at  # newer than the checkpoint: a full restart must not use it
    job = Job(run, model, opt, state)
    job.run(TOTAL_STEPS)
    job.sink.close()

    records, problems = read_log((run / "audit.jsonl").read_bytes())
    report = audit(records, final=job.progress["r0"].state)
    assert report.ok and not problems, report.summary()
    assert report.num_steps == TOTAL_STEPS
    assert job.progress["r0"].state.committed_batches == (TOTAL_STEPS, TOTAL_STEPS - len(AWAY) - 1)
    assert len({(t.replica, t.position) for t in report.trained}) == len(report.trained)
    for got, want in zip(model.parameters(), expected):
        assert torch.equal(got, want)
