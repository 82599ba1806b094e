"""The user's own loop on a one-replica job (ftrun.train.own): FTOptimizer, FTSampler, register_state.

Each test runs a real one-replica, one-rank job in-process (its own lighthouse on 127.0.0.1 port 0,
catch-up server, FTAR engine), so the step goes through quorum, exchange and two-phase commit. The
multi-replica behaviour (kills, catch-up of the registered state, FSDP2) is
tests/integration/test_own_loop.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from ftrun.checkpoint.policy import CheckpointConfig
from ftrun.config import LighthouseConfig, Timeouts
from ftrun.env.real import RealEnv
from ftrun.ftar.ring import RecoverableError
from ftrun.launch.worker_env import WorkerSpec
from ftrun.quorum.service import Lighthouse
from ftrun.train.api import FTConfig, FTJob

TOKEN = "0123456789abcdef0123456789abcdef"
MICRO, ACCUM = 4, 2


class Pairs(Dataset):
    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(n, 5, generator=g)
        self.y = self.x.sum(1, keepdim=True).tanh()
        self.seen: list[int] = []

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        self.seen.append(i)
        return self.x[i], self.y[i]


class Ema:
    def __init__(self, model: torch.nn.Module) -> None:
        self.shadow = {n: p.detach().clone() for n, p in model.named_parameters()}

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        for n, p in model.named_parameters():
            self.shadow[n].lerp_(p, 0.5)

    def state_dict(self) -> dict:
        return {"shadow": self.shadow}

    def load_state_dict(self, state: dict) -> None:
        for n, t in state["shadow"].items():
            self.shadow[n].copy_(t)


def job_for(run_dir, **config) -> FTJob:
    """A one-replica job with a fixed token (so its checkpoints can be restored by the next one)."""
    env = RealEnv()
    lighthouse = Lighthouse(env=env, config=LighthouseConfig(timeouts=Timeouts()), token=TOKEN)
    lighthouse.start()
    spec = WorkerSpec(replica_id="r0", replica_index=0, num_replicas=1, rank=0, ranks_per_replica=1, incarnation=0,
                      lighthouse=lighthouse.addr, token=TOKEN, store_addr="", store_port=0, run_dir=str(run_dir))
    return FTJob(config=FTConfig(batch_size=MICRO * ACCUM, events=False, **config), spec=spec, env=env,
                 lighthouse=lighthouse)


def parts(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    return model, opt


def lambda_of(step: int) -> float:
    return min(1.0, (step + 1) / 3) * 0.5 * (1 + math.cos(math.pi * step / 20))


def own_steps(job: FTJob, data: Pairs, steps: int, *, clip: float = 0.5):
    """The ported loop; returns (model, opt, sched, ema, [per committed step: its sample indices],
    [per committed step: (scheduler state, EMA copy, parameter copies) after it])."""
    model, opt = parts()
    model, opt = job.wrap(model, opt)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda_of)
    ema = Ema(model)
    job.register_state("sched", sched)
    job.register_state("ema", ema)
    batches = iter(DataLoader(data, batch_size=MICRO, sampler=job.sampler(data)))
    order, history = [], []
    while job.step < steps:
        opt.zero_grad()
        start = len(data.seen)
        for _ in range(ACCUM):
            x, y = next(batches)
            (F.mse_loss(model(x), y) / ACCUM).backward()
        opt.clip_grad_norm_(clip)
        if opt.step():
            sched.step()
            ema.update(model)
            order.append(data.seen[start:])
            history.append((sched.state_dict(), {n: t.clone() for n, t in ema.shadow.items()},
                            [p.detach().clone() for p in model.parameters()]))
            job.log_metrics(loss=1.0)
    return model, opt, sched, ema, order, history


@pytest.mark.timeout(120)
def test_one_replica_own_loop_matches_the_plain_loop(tmp_path):
    data = Pairs()
    with job_for(tmp_path) as job:
        model, _, sched, ema, order, _ = own_steps(job, data, 6)
    assert len(order) == 6 and all(len(b) == MICRO * ACCUM for b in order)
    flat = [i for b in order for i in b]
    assert len(set(flat)) == len(flat)  # 48 of the 64 samples, none twice
    ref, opt = parts()  # the plain loop, on the same batches
    ref_sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda_of)
    ref_ema = Ema(ref)
    for batch in order:
        opt.zero_grad()
        for k in range(ACCUM):
            idx = batch[k * MICRO:(k + 1) * MICRO]
            (F.mse_loss(ref(data.x[idx]), data.y[idx]) / ACCUM).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        ref_sched.step()
        ref_ema.update(ref)
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert sched.get_last_lr() == ref_sched.get_last_lr()  # the user's schedule drove the LR
    for n, t in ema.shadow.items():
        torch.testing.assert_close(t, ref_ema.shadow[n], rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(120)
def test_a_failed_exchange_is_not_applied_and_the_retry_reads_the_same_batch(tmp_path):
    data = Pairs()
    with job_for(tmp_path) as job:
        model, opt = job.wrap(*parts())
        loader = iter(DataLoader(data, batch_size=MICRO, sampler=job.sampler(data)))
        trainer = job._own.start()
        real = trainer.exchange.average
        calls = []

        def flaky(*args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                raise RecoverableError("injected: a peer died mid-exchange")
            return real(*args, **kwargs)

        trainer.exchange.average = flaky
        results, batches = [], []
        for _ in range(2):
            opt.zero_grad()
            batch = [next(loader)[0] for _ in range(ACCUM)]
            batches.append(torch.cat(batch))
            sum(model(x).sum() for x in batch).backward()
            before = [p.detach().clone() for p in model.parameters()]
            results.append(opt.step())
            if not results[-1]:
                assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # not applied
        assert results == [False, True] and job.step == 1
        assert torch.equal(batches[0], batches[1])  # the retry trained the very same samples


@pytest.mark.timeout(120)
def test_registered_state_is_restored_from_the_persistent_checkpoint(tmp_path):
    data = Pairs()
    # Written inside the step: asynchronously, the step-2 write may still run at step 4, which is then skipped
    # (one write in flight), and the restore would find step 2; this test is about what a restore brings back.
    config = CheckpointConfig(every_steps=2, async_write=False)
    with job_for(tmp_path, checkpoint=config) as job:  # after 4 commits: written at step 5
        *_, history = own_steps(job, data, 5)
    with job_for(tmp_path, checkpoint=config) as job:
        model, opt = job.wrap(*parts(seed=7))  # other weights: the checkpoint must replace them
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda_of)
        ema = Ema(model)
        job.register_state("sched", sched)
        job.register_state("ema", ema)
        job.sampler(data)
        assert job.step == 4
    sched_sd, ema_sd, params = history[3]
    assert sched.state_dict() == sched_sd
    assert all(torch.equal(t, ema_sd[n]) for n, t in ema.shadow.items())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), params))


@pytest.mark.timeout(120)
@pytest.mark.timeout(120)
def test_misuse_gives_clear_errors(tmp_path):
    data = Pairs()
    with job_for(tmp_path) as job:
        with pytest.raises(RuntimeError, match="job.wrap"):
            job.step
        model, opt = job.wrap(*parts())
        with pytest.raises(RuntimeError, match="once per job"):
            job.wrap(*parts())
        sampler = job.sampler(data)
        batches = iter(DataLoader(data, batch_size=MICRO, sampler=sampler))
        opt.zero_grad()
        with pytest.raises(RuntimeError, match="register before the first step"):
            job.register_state("late", Ema(model))
        assert sampler.state_dict()["step"] == 0
        with pytest.raises(ValueError, match="restored by ftrun"):
            sampler.load_state_dict({**sampler.state_dict(), "step": 3})
        x, y = next(batches)  # half of the step's batch
        F.mse_loss(model(x), y).backward()
        with pytest.raises(RuntimeError, match=r"used 4 of the 8 samples"):
            opt.step()
        with pytest.raises(ValueError, match="metrics"):
            job.log_metrics(bad=torch.zeros(2))
        with pytest.raises(ValueError, match="closure"):
            opt.step(lambda: 0.0)
    with job_for(tmp_path) as job:
        model, opt = parts()
        model(torch.ones(1, 5)).sum().backward()
        opt.step()
        with pytest.raises(ValueError, match="already stepped"):
            job.wrap(model, opt)
        with pytest.raises(ValueError, match="not the model's"):
            job.wrap(torch.nn.Linear(5, 1), torch.optim.SGD(torch.nn.Linear(5, 1).parameters(), lr=0.1))


@pytest.mark.timeout(120)
def test_the_step_as_a_with_block(tmp_path):
    data = Pairs()
    with job_for(tmp_path) as job:
        model, opt = job.wrap(*parts())
        batches = iter(DataLoader(data, batch_size=MICRO, sampler=job.sampler(data)))
        outcomes = []
        while job.step < 3:
            with job.training_step() as outcome:
                assert outcome.committed is None
                for _ in range(ACCUM):
                    x, y = next(batches)
                    F.mse_loss(model(x), y).backward()
                opt.clip_grad_norm_(1.0)
            outcomes.append(outcome.committed)
        assert outcomes == [True, True, True] and len(data.seen) == 3 * MICRO * ACCUM
