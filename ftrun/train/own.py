"""Primitives for the user's own training loop: the loop stays the user's, ftrun makes each step safe.

    with ftrun.train.init_from_env(ftrun.train.FTConfig(batch_size=MICRO * ACCUM)) as job:
        model, opt = job.wrap(Net(), torch.optim.AdamW(...))   # FSDP2 inside the replica; opt: FTOptimizer
        loader = DataLoader(train_set, batch_size=MICRO, sampler=job.sampler(train_set))
        sched = LambdaLR(opt, warmup_cosine); job.register_state("sched", sched); job.register_state("ema", ema)
        batches = iter(loader)
        while job.step < job.max_steps:
            opt.zero_grad()                      # the step starts: quorum; a restarted replica catches up here
            for _ in range(ACCUM):
                x, y = next(batches)             # the step's batch, exactly once across the job
                (loss_fn(model(x), y) / ACCUM).backward()
            opt.clip_grad_norm_(1.0)             # FTAR mean across replicas, then one global norm
            if opt.step():                       # two-phase commit: applied only if every replica commits
                sched.step(); ema.update(model)
            job.log_metrics(loss=...)            # -> the step event and the launcher's metrics.jsonl

What each piece does (one trainer: `ft.train()` runs the same begin_step / exchange / finish_step of
ftrun.train.trainer, with its own compute in between):

- `FTOptimizer.zero_grad()` (or the first sample the sampler is asked for) begins the step:
  `trainer.begin_step()` (quorum, heal of a replica that is behind: model, optimizer AND the
  registered state are loaded from a healthy peer; the catch-up snapshot and persistent checkpoint
  of the state so far; the ledger's audited attempt).
- `FTSampler` (a torch Sampler, `job.sampler(dataset)`) yields the sample indices of the started
  step's batch for this rank, exactly the ledger's (ftrun.data.sampler: deterministic, resumable,
  exactly once); a retried step yields the same batch again. A replica behind the step (it healed in
  it) gets a batch to run the user's code on, but contributes zeros. At commit, a training replica
  must have consumed its whole batch (else the ledger would count samples it never trained: an
  error). `state_dict()` is the ledger, which catch-up and checkpoints already carry. Use it with
  `num_workers=0` (a prefetching loader asks for samples of steps that have not started: an error).
- `FTOptimizer.clip_grad_norm_(max_norm)` averages the gradients across replicas (FTAR), then clips
  with one norm over every shard of the replica (identical across replicas after the average).
- `FTOptimizer.step()` exchanges (if clipping did not), runs the two-phase commit and applies the
  inner optimizer's step only if the step commits, with the LR intervention as a multiplier of the
  group's LR for that one step (ftrun.train.lr.scaled_lr: the user's scheduler is never overridden).
  Returns True if committed: the user advances its scheduler/EMA/counters only then.
- `with job.training_step() as outcome:` is the same step as a block: zero_grad on entry, step() on
  a normal exit, `outcome.committed` after it.
- `job.register_state(name, obj)`: anything with state_dict/load_state_dict (tensors and JSON),
  carried by catch-up and persistent checkpoints (DcpCheckpointer extra, "user.<name>"). The step
  event carries `user_state_hash` (ftrun.train.user_state) so `ftrun launch` reports
  `user_state_identical`.

A ReplicaError (no quorum, failed heal, too many failed commits) is raised into the user's loop
after a "failed" event: the process should end (the launcher restarts it; it catches up). A stale
replica told that the job finished without it (JobFinished) emits "job_finished" and exits 0
(SystemExit), as `ft.train()` returns. An
exception in the user's forward/backward ends the process too; the restarted replica heals.
Threading: the training loop's thread only.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

import numpy as np
import torch

from ftrun.data.loader_state import LoaderState
from ftrun.replica.manager import JobFinished, ReplicaError, StepQuorum
from ftrun.train.events import param_hash, step_event
from ftrun.train.shard import local
from ftrun.train.trainer import FaultTolerantTrainer, step_seed
from ftrun.train.user_state import UserState


class Job(Protocol):
    """What the loop uses of ftrun.train.api.FTJob (named structurally: api imports this module)."""

    spec: Any  # WorkerSpec
    env: Any  # RealEnv
    comm: Any  # ReplicaComm
    device: Any  # torch.device: where the model is

    @property
    def rank(self) -> int: ...

    def emit(self, event: dict) -> None: ...

BuildFn = Callable[[torch.nn.Module, torch.optim.Optimizer, int, UserState],
                   tuple[FaultTolerantTrainer, list[Callable]]]  # (model, optimizer, dataset size, user) -> trainer


class OwnLoop:
    """The job's side of the user's loop: builds the trainer at the first step (after the user has
    wrapped, made the sampler and registered state) and tracks the started step."""

    def __init__(self, *, job: Job, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 user: UserState, build: BuildFn) -> None:
        self.job, self.model, self.optimizer, self.user, self._build = job, model, optimizer, user, build
        self.dataset_size: int | None = None
        self.trainer: FaultTolerantTrainer | None = None
        self._closers: list[Callable] = []
        self.q: StepQuorum | None = None  # the started step
        self.attempt = 0  # begun steps, for the sampler to notice a retry
        self.exchanged = False
        self.consumed: tuple[int, int, int] | None = None  # (attempt, consumed, batch size) from the sampler
        self.failed = False
        self.pending: dict | None = None  # the committed step's event, until the user updated its state
        self.ft_optimizer: FTOptimizer | None = None  # the wrapper job.wrap returned

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> FaultTolerantTrainer:
        """Build the trainer (resuming from the latest checkpoint, model/optimizer/registered state
        included) once; emits "ready"."""
        if self.trainer is None:
            size = self.dataset_size if self.dataset_size is not None else self.job.spec.num_replicas
            self.trainer, self._closers = self._build(self.model, self.optimizer, size, self.user)
            self.trainer.manager.final_step = self.job.max_steps  # no early quorum request after it
            self.job.emit({"event": "ready", "t": self.job.env.clock.now(), "step": self.trainer.step,
                           "lineage": self.trainer.progress.state.lineage, "startup": self.job.startup,
                           "device": str(self.job.device), "host_slot": self.job.spec.device_slot,
                           "rank": self.job.rank})
        return self.trainer

    def close(self, *, clean: bool) -> None:
        if self.trainer is None:
            return
        t = self.trainer
        if clean and not self.failed:
            self.job.emit({"event": "final", "t": self.job.env.clock.now(), "step": t.step,
                           "param_hash": param_hash(self.model), "user_state_hash": self.user.hash(),
                           "loader_state": t.progress.state.to_dict(), "rank": self.job.rank})
        try:
            t.close()
        finally:
            for close in self._closers:
                close()
            self.trainer = None

    @property
    def step(self) -> int:
        return self.start().step

    # -- one step ----------------------------------------------------------------------------------
    def begin(self) -> StepQuorum:
        """Begin a step unless one is started."""
        if self.q is None:
            trainer = self.start()
            self.q = self._guard(trainer.begin_step)
            if trainer.config.rng_seed is not None:  # dropout & co. a pure function of the step (trainer docstring)
                index = trainer.progress.state.index(trainer.config.replica_id)
                torch.manual_seed(step_seed(trainer.config.rng_seed, index, self.job.rank, self.q.step))
            self.attempt += 1
            self.exchanged = False
            self.consumed = None
        return self.q

    def exchange(self) -> None:
        """The FTAR mean of the step's gradient into .grad (once per step)."""
        q = self.begin()
        if not self.exchanged:
            self._guard(lambda: self.trainer.exchange_user_grads(q))
            self.exchanged = True

    def finish(self, loss: float | None) -> bool:
        """Exchange if needed, two-phase commit, the step event. Returns whether the step committed."""
        self.exchange()
        q, trainer = self.q, self.trainer
        if trainer.progress.trains and self.consumed is not None:
            attempt, used, size = self.consumed
            if attempt == self.attempt and used != size:
                raise RuntimeError(f"step {q.step}: this rank used {used} of the {size} samples of its batch; "
                                   "FTConfig.batch_size must be the samples per rank per step "
                                   "(micro-batch size x accumulation steps)")
        try:
            result = self._guard(lambda: trainer.finish_step(q, loss))
        finally:
            self.q = None
        event = step_event(result, self.model, self.job.env.clock.now(), rank=self.job.rank)
        if result.committed:
            self.pending = event  # emitted by `after_commit`, once the user's state advanced
        else:
            self.job.emit(event)
        return result.committed

    def after_commit(self) -> None:
        """Emit the committed step's event with the user state's hash after the user's updates of it
        (called at the next step's begin, or at the end)."""
        event = self.pending
        if event is not None:
            self.pending = None
            event["user_state_hash"] = self.user.hash()
            self.job.emit(event)

    def samples(self) -> np.ndarray:
        """This rank's sample indices for the started step (a batch to run on, unused, when behind)."""
        trainer = self.trainer
        progress = trainer.progress
        if progress.trains:
            return progress.samples(self.job.rank)
        return progress.sampler.batch(progress.state.index(progress.replica_id), self.job.rank, progress.position)

    def _guard(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except JobFinished as e:  # stale (frozen while the others finished): exit cleanly, train nothing
            self.failed = True
            self.job.emit({"event": "job_finished", "t": self.job.env.clock.now(), "step": self.trainer.step,
                           "finished_step": e.step, "reason": str(e), "rank": self.job.rank})
            raise SystemExit(0) from e
        except ReplicaError as e:
            self.failed = True
            self.job.emit({"event": "failed", "t": self.job.env.clock.now(), "step": self.trainer.step,
                           "error": str(e), "rank": self.job.rank})
            raise


@dataclass
class StepOutcome:
    """What `with job.training_step() as outcome:` reports after the block: whether the step committed."""

    committed: bool | None = None  # None inside the block


class FTOptimizer(torch.optim.Optimizer):
    """The user's optimizer, made fault tolerant (module docstring). A torch Optimizer to schedulers
    (param_groups, state and state_dict are the inner optimizer's)."""

    def __init__(self, loop: OwnLoop, optimizer: torch.optim.Optimizer) -> None:  # noqa: no super().__init__
        self._loop, self.optim = loop, optimizer
        self.defaults = optimizer.defaults

    @property
    def param_groups(self):  # type: ignore[override]
        return self.optim.param_groups

    @property
    def state(self):  # type: ignore[override]
        return self.optim.state

    def state_dict(self):  # type: ignore[override]
        return self.optim.state_dict()

    def load_state_dict(self, state_dict) -> None:  # type: ignore[override]
        self.optim.load_state_dict(state_dict)

    def add_param_group(self, param_group) -> None:  # type: ignore[override]
        raise RuntimeError("FTOptimizer: add param groups before job.wrap (the replicas' layouts must match)")

    def __repr__(self) -> str:
        return f"FTOptimizer({self.optim!r})"

    def zero_grad(self, set_to_none: bool = True) -> None:  # type: ignore[override]
        """Begin the step (if the sampler has not already) and drop the gradients."""
        self._loop.after_commit()
        self._loop.begin()
        self.optim.zero_grad(set_to_none=set_to_none)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Average the gradients across replicas, then clip them with one 2-norm over every shard of
        the replica (the same on every replica). Returns the norm before clipping."""
        if norm_type != 2.0:
            raise ValueError(f"FTOptimizer.clip_grad_norm_ supports norm_type=2.0, got {norm_type}")
        if not max_norm > 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm}")
        self._loop.exchange()
        grads = [local(p.grad) for g in self.param_groups for p in g["params"] if p.grad is not None]
        total = global_norm(grads, self._loop.job.comm)
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            with torch.no_grad():
                for g in grads:
                    g.mul_(coef)
        return torch.tensor(total)

    def step(self, closure: Any = None) -> bool:  # type: ignore[override]
        """Two-phase commit; the inner optimizer steps only if the step commits. Returns whether it did."""
        if closure is not None:
            raise ValueError("FTOptimizer.step takes no closure: run forward/backward before it")
        return self._loop.finish(None)


def global_norm(grads: list[torch.Tensor], comm) -> float:
    """sqrt of the sum of squares of every rank's local gradient shards (float64, summed in rank order)."""
    sq = 0.0
    for g in grads:
        sq += float(torch.sum(g.detach().double() ** 2))
    if comm.world_size > 1:
        parts = comm.all_gather_bytes(struct.pack("<d", sq))
        sq = sum(struct.unpack("<d", p)[0] for p in parts)
    return math.sqrt(sq)


class FTSampler(torch.utils.data.Sampler):
    """A torch Sampler over the ledger's exactly-once order (module docstring). Infinite: it yields the
    started step's batch, then the next step's, ..."""

    def __init__(self, loop: OwnLoop, dataset_size: int) -> None:
        self._loop, self.dataset_size = loop, dataset_size
        self._attempt = -1
        self._indices: np.ndarray = np.zeros(0, np.int64)
        self._cursor = 0

    def __iter__(self) -> Iterator[int]:
        while True:
            yield self.next_index()

    def next_index(self) -> int:
        loop = self._loop
        if loop.q is None:
            loop.after_commit()
            loop.begin()  # the user's loop asks for data first: the step begins here
        if loop.attempt != self._attempt:  # a new step, or the retry of one: its batch from the start
            self._attempt, self._indices, self._cursor = loop.attempt, loop.samples(), 0
        if loop.exchanged:
            raise RuntimeError("FTSampler: a sample was asked for after the step's gradients were exchanged "
                               "(clip_grad_norm_ or step); with a DataLoader use num_workers=0")
        if self._cursor >= len(self._indices):
            raise RuntimeError(f"FTSampler: the step's batch of {len(self._indices)} samples per rank is used up; "
                               "FTConfig.batch_size must be the samples per rank per step (micro-batch size x "
                               "accumulation steps), and a DataLoader must not prefetch (num_workers=0)")
        index = int(self._indices[self._cursor])
        self._cursor += 1
        loop.consumed = (self._attempt, self._cursor, len(self._indices))
        return index

    def state_dict(self) -> dict:
        """The ledger (ftrun.data.loader_state): catch-up and checkpoints carry it already."""
        return self._loop.start().progress.state.to_dict()

    def load_state_dict(self, state: dict) -> None:
        """Accepts only the ledger the job already holds: ftrun restores it (checkpoint, catch-up)."""
        mine = self._loop.start().progress.state
        if LoaderState.from_dict(state) != mine:
            raise ValueError("FTSampler.load_state_dict: the data order is restored by ftrun (catch-up, "
                             f"checkpoints); this ledger (step {state.get('step')}) is not the job's (step {mine.step})")
