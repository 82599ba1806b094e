"""The emulated side of the training API (ftrun.train.api): what an unchanged script's `ft.train(...)`, or
its own loop (`job.wrap`), runs under `ftrun emulate SCRIPT.py --profile P`.

The shadow loader maps ftrun.train.api to this module (mocks/shadow_registry.toml), so a script's
`ftrun.train.init_from_env(...)` lands here. The script's process trains nothing itself: it describes
its model, and the session of the shadow context (`shadow.current()`, the emulator's runner) runs the
profile's job with it, where every emulated rank runs the real trainer.

- `init_from_env`: this process's view of the emulated job: replica r0, rank 0 of the profile's layout
  (`traced_rank`); `spec.max_steps` and `max_steps` are the --steps. `launcher_environ`: the environment
  `ftrun emulate` gives the script's process, what `ftrun launch` sets for that rank (RANK, LOCAL_RANK, ...).
- `FTJob.train`: the model built on meta, its FSDP2 dim-0 shards and the FLOPs of one rank's micro-batch
  forward and backward (mocks.script); then `session.run(ScriptModel, steps=N)` runs the job and returns its
  figures. The TrainResult: ok when the job completed with consistent replicas, step = the steps committed.
- `FTJob.wrap` (the user's own loop): the loop's first step runs for real on the model the script built,
  with its FLOPs counted from `opt.zero_grad()` to `opt.step()`; at that `step()` the session runs the job,
  and `job.step` becomes the steps it committed, so the loop ends as it would after training.

Events on stdout as the real API prints them on rank 0: "ready", "emulated" (the job's figures) and "final".
Hooks are not called (the emulated ranks' StepResults stay inside the emulator; the report sums them up).
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

import shadow
from ftrun.launch.worker_env import WorkerSpec
from ftrun.train.events import param_hash, print_event  # noqa: F401 (re-exported, as the real API does)
from ftrun.train.job_config import FTConfig, Hooks, JobBasics, TrainResult, steps_target
from ftrun.train.own import FTOptimizer as RealFTOptimizer, StepOutcome
from mocks.script import ScriptModel, meta_model, script_shapes, step_flops, to_meta

__all__ = ["FTConfig", "FTJob", "Hooks", "TrainResult", "init_from_env", "param_hash"]

ModelFn = Callable[[], torch.nn.Module]
OptimizerFn = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


def init_from_env(config: FTConfig | None = None, *, environ: Mapping[str, str] | None = None) -> "FTJob":
    """This process's view of the emulated job of the active shadow session (`ftrun emulate SCRIPT.py`).
    Raises RuntimeError outside one (shadow.current)."""
    session = shadow.current()
    config = config or FTConfig()
    torch.manual_seed(config.seed)  # the model the user's own loop builds next, as the real API seeds it
    return FTJob(config=config, spec=traced_rank(session), env=None, startup={"session": session})


def traced_rank(session: Any) -> WorkerSpec:
    """The rank the script's process stands for in the session's emulated job: replica r0's rank 0 (host
    slot 0), `max_steps` the --steps. No store: the script's process rendezvouses with no one."""
    return WorkerSpec(replica_id="r0", replica_index=0, num_replicas=session.replicas, rank=0,
                      ranks_per_replica=session.ranks_per_replica, incarnation=0, lighthouse="emulated",
                      token="", store_addr="127.0.0.1", store_port=0, run_dir="", max_steps=session.steps,
                      host_slot=0)


# What `ftrun launch` sets for a rank (WorkerSpec.to_environ) that a script reads to know its rank and the
# job's layout (torchrun's names, ftrun's layout); the job's token, lighthouse and run directory are left out.
LAUNCHER_ENVIRON = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                    "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "FTRUN_REPLICA_ID",
                    "FTRUN_REPLICA_INDEX",
                    "FTRUN_REPLICA_RANK", "FTRUN_RANKS_PER_REPLICA", "FTRUN_NUM_REPLICAS", "FTRUN_MAX_STEPS",
                    "FTRUN_HOST_SLOT")


def launcher_environ(session: Any) -> dict[str, str]:
    """The environment of the script's process under `ftrun emulate` (shadow.active(environ=...)): what
    `ftrun launch` would set for `traced_rank` (LAUNCHER_ENVIRON), so a torchrun-style script's
    os.environ["LOCAL_RANK"] & co. agree with its job.spec (torchrun's names describe the replica's world:
    RANK 0, LOCAL_RANK 0, WORLD_SIZE and LOCAL_WORLD_SIZE the ranks per replica; ftrun.launch.worker_env)."""
    environ = traced_rank(session).to_environ()
    return {name: environ[name] for name in LAUNCHER_ENVIRON if name in environ}


class FTJob(JobBasics):
    """The script's membership in the emulated job (module docstring). Threading: the script's thread."""

    def __init__(self, *, config: FTConfig, spec: WorkerSpec, env: Any = None, lighthouse: Any = None,
                 startup: dict[str, Any] | None = None) -> None:
        self.config, self.spec, self.env = config, spec, env
        self._session = (startup or {}).get("session") or shadow.current()
        self._used = False
        self._own: _OwnLoop | None = None
        self.figures: dict[str, Any] | None = None  # the emulated job's, once it ran

    @property
    def device(self) -> torch.device:
        """Where the script's process runs its model: the CPU (the emulated ranks train shape-only; what a
        script asks for on a GPU is made there too, shadow.cuda_tensors)."""
        return torch.device("cpu")

    @property
    def step(self) -> int:
        """Steps committed: 0 until the emulated job ran, then the steps it committed."""
        return self._own_loop("step").step

    def train(self, *, model_fn: ModelFn, optimizer_fn: OptimizerFn, loss_fn: Callable[..., Any], dataset: Any,
              steps: int | Callable[[], int] | None = None, shard_fn: Any = None,
              hooks: Hooks | None = None) -> TrainResult:
        """Run the profile's emulated job with this script's model (module docstring)."""
        self._start("train")
        target = _target(steps, self.spec.max_steps)
        model = meta_model(model_fn, seed=self.config.seed)
        optimizer_fn(model.parameters())  # the script's optimizer builds over the parameters (no step)
        if len(dataset) < 1:
            raise ValueError("train: the dataset is empty")
        batch = to_meta(dataset[torch.arange(min(self.config.batch_size, len(dataset)))])
        flops = step_flops(lambda: loss_fn(model, batch))
        return self._run(model, flops, "train", target)

    def wrap(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
             shard_fn: Any = None) -> tuple[torch.nn.Module, "FTOptimizer"]:
        """The model as it is and the optimizer as an FTOptimizer whose first step() runs the emulated job."""
        if not isinstance(model, torch.nn.Module) or not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"wrap(model, optimizer) takes a torch.nn.Module and a torch.optim.Optimizer, got "
                             f"{type(model).__name__} and {type(optimizer).__name__}")
        self._start("wrap")
        self._own = _OwnLoop(self, model)
        return model, FTOptimizer(self._own, optimizer)

    @contextlib.contextmanager
    def training_step(self) -> Iterator[Any]:
        own = self._own_loop("training_step")
        own.optimizer.zero_grad()
        outcome = StepOutcome()
        yield outcome
        outcome.committed = own.optimizer.step()

    def sampler(self, dataset: Any) -> torch.utils.data.Sampler:
        """The dataset's indices in order: in the script's process they feed only the traced first step."""
        own = self._own_loop("sampler")
        if own.done:
            raise RuntimeError("FTJob.sampler: make the sampler before the first step")
        if len(dataset) < self.spec.num_replicas:
            raise ValueError(f"FTJob.sampler: the dataset has {len(dataset)} samples, fewer than the "
                             f"{self.spec.num_replicas} replicas")
        return torch.utils.data.SequentialSampler(range(len(dataset)))

    def register_state(self, name: str, obj: Any) -> None:
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise ValueError(f"register_state({name!r}): {type(obj).__name__} has no state_dict/load_state_dict")

    def log_metrics(self, **metrics: Any) -> None:
        own = self._own_loop("log_metrics")
        try:
            json.dumps(metrics)
        except (TypeError, ValueError) as e:
            raise ValueError(f"log_metrics: values must be JSON (call .item() on tensors): {e}") from None
        self.emit({"event": "metrics", "step": own.step, "rank": self.rank, "emulated": True, **metrics})

    def close(self, *, clean: bool = True) -> None:
        if self._own is not None and self._own.done and clean:
            self._final()
        self._own = None

    def __enter__(self) -> "FTJob":
        return self

    def __exit__(self, *exc) -> None:
        self.close(clean=exc[0] is None)

    # -- running the emulated job -------------------------------------------------------------------
    def _start(self, api: str) -> None:
        if self._used:
            raise RuntimeError(f"FTJob.{api}: train or wrap runs once per job")
        self._used = True
        self.emit({"event": "ready", "step": 0, "pid": os.getpid(), "rank": self.rank, "emulated": True})

    def _run(self, model: torch.nn.Module, flops: float, api: str, target: Callable[[], int]) -> TrainResult:
        shapes = script_shapes(model, flops, ranks_per_replica=self.spec.ranks_per_replica)
        script = ScriptModel(shapes=shapes, batch_size=self.config.batch_size, seed=self.config.seed, api=api)
        self.figures = f = self._session.run(script, steps=target())
        self.emit({"event": "emulated", "model": script.describe(),
                   **{k: f.get(k) for k in ("ranks", "steps_done", "complete", "replicas_consistent")}})
        ok = self._session.ok()
        # param_hash "": shape-only parameters have no bytes to hash; loader_state {}: the job's ledgers are
        # audited in its figures (audit_batches, ...)
        result = TrainResult(ok, int(f.get("steps_done", 0)), "", {}, "" if ok else "the emulated job failed")
        if api == "train":  # the script may end its process right after train returns (os._exit)
            self._final()
            self._session.report()
        return result

    def _final(self) -> None:
        f = self.figures or {}
        self.emit({"event": "final", "step": int(f.get("steps_done", 0)), "param_hash": "", "rank": self.rank,
                   "emulated": True})

    def _own_loop(self, what: str) -> "_OwnLoop":
        if self._own is None:
            raise RuntimeError(f"FTJob.{what}: call job.wrap(model, optimizer) first")
        return self._own


class _OwnLoop:
    """The user's own loop: its first step traced (FLOPs), then the emulated job run once."""

    def __init__(self, job: FTJob, model: torch.nn.Module) -> None:
        self.job, self.model = job, model
        self.optimizer: Any = None
        self.counter: Any = None
        self.step = 0
        self.done = False

    def begin(self) -> None:
        if self.done or self.counter is not None:
            return
        from torch.utils.flop_counter import FlopCounterMode

        self.counter = FlopCounterMode(display=False)
        self.counter.__enter__()

    def end(self) -> None:
        if self.done:
            return
        if self.counter is None:
            raise RuntimeError("FTOptimizer.step: call zero_grad() before the step's forward and backward")
        counter, self.counter = self.counter, None
        counter.__exit__(None, None, None)
        result = self.job._run(self.model, float(counter.get_total_flops()), "wrap",
                               _target(None, self.job.spec.max_steps))
        self.done = True
        if not result.ok:
            raise RuntimeError(f"the emulated job did not complete: {result.step} steps committed")
        self.step = result.step


class FTOptimizer(RealFTOptimizer):
    """The script's optimizer as its own loop sees it: the real ftrun.train.own.FTOptimizer's view of the
    inner optimizer (param_groups, state, state_dict for schedulers); zero_grad starts the traced step,
    step() runs the emulated job and returns True."""

    def __init__(self, loop: _OwnLoop, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(loop, optimizer)  # type: ignore[arg-type]
        loop.optimizer = self

    def __repr__(self) -> str:
        return f"FTOptimizer({self.optim!r}, emulated)"

    def zero_grad(self, set_to_none: bool = True) -> None:  # type: ignore[override]
        self._loop.begin()
        self.optim.zero_grad(set_to_none=set_to_none)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        if not max_norm > 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm}")
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    def step(self, closure: Any = None) -> bool:  # type: ignore[override]
        if closure is not None:
            raise ValueError("FTOptimizer.step takes no closure: run forward/backward before it")
        first = not self._loop.done
        self._loop.end()
        if first:
            self.optim.step()  # the traced step's update, on the script's own model
        return True


def _target(steps: int | Callable[[], int] | None, launcher_steps: int | None) -> Callable[[], int]:
    """The real API's steps_target, and at least one step: an emulated job of 0 steps measures nothing."""
    count = launcher_steps if steps is None else steps
    if count is not None and not callable(count) and count < 1:
        raise ValueError(f"steps must be >= 1 under the emulator, got {count}")
    return steps_target(steps, launcher_steps)
