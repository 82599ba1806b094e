"""The user-facing training API: an ordinary PyTorch training loop, made fault tolerant in a few lines.

    import ftrun.train

    with ftrun.train.init_from_env(ftrun.train.FTConfig(batch_size=8)) as ft:
        result = ft.train(model_fn=lambda: MyModel(),
                          optimizer_fn=lambda params: torch.optim.AdamW(params, lr=3e-4),
                          loss_fn=lambda model, batch: my_loss(model(batch[:, :-1]), batch[:, 1:]),
                          dataset=tokens, steps=1000)
    sys.exit(result.exit_code)

Run it with `ftrun launch --replicas 3 --ranks-per-replica 2 --steps N script.py` (one process per rank,
torchrun-compatible environment, see ftrun.launch.worker_env), or as `python script.py` alone: without
FTRUN_* variables `init_from_env` starts an in-process lighthouse and trains a one-replica, one-rank
job in a temporary run folder.

What `train` does per rank: builds the model from `model_fn` under the job's seed (the same weights in
every replica), shards it with FSDP2 over the replica's ranks when there is more than one
(ftrun.train.shard; `shard_fn` overrides the default of one unit per nn.ModuleList member), builds the
optimizer over the (sharded) parameters and runs FaultTolerantTrainer steps until `steps` are committed:
quorum, catch-up of a restarted replica, forward/backward on this rank's batch (`dataset[indices]`, a
deterministic, resumable, exactly-once order), FTAR across replicas, two-phase commit. On stdout it
prints JSON event lines: the Manager's and trainer's (rank 0: quorum, heal, commit, abort, error,
catchup, checkpoint) and every rank's own: ready (with the rank's device), step (loss; param_hash,
a fingerprint of this rank's parameter bytes, after a commit), final, failed. `ftrun launch` reads rank 0's.

One job per process: `init_from_env` makes the replica's ranks the process's default process group
(FSDP2 needs one), or adopts the one a torchrun-style script made itself (`dist.init_process_group()`
from the launcher's variables, which describe the replica's world: ftrun.launch.worker_env) and leaves
destroying it to the script. Only `init_from_env` reads the environment.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import secrets
import tempfile
from dataclasses import replace
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
import torch.distributed as dist

from ftrun.config import LighthouseConfig, Timeouts
from ftrun.env.real import RealEnv
from ftrun.ftar.cpu_kernels import Float32CpuKernels  # noqa: F401 (re-exported: workers import it here)
from ftrun.launch.worker_env import WorkerSpec
from ftrun.net import WILDCARDS
from ftrun.replica.comm import LocalComm, ReplicaComm
from ftrun.replica.manager import JobFinished, ReplicaError
from ftrun.train.device import rank_device
from ftrun.train.events import param_hash, print_event, step_event  # noqa: F401 (re-exported)
from ftrun.train.job_config import FTConfig, Hooks, JobBasics, TrainResult, steps_target  # noqa: F401 (the public API names FTConfig, Hooks, TrainResult here)
from ftrun.train.own import FTOptimizer, FTSampler, OwnLoop, StepOutcome
from ftrun.train.shard import (ShardFn, adopt_replica_group, check_sharded, close_replica_group, init_replica_group,
                               shard_model)
from ftrun.train.trainer import LossFn
from ftrun.train.user_state import UserState

__all__ = ["FTConfig", "FTJob", "Hooks", "TrainResult", "init_from_env", "param_hash"]  # as ftrun.train names them

log = logging.getLogger("ftrun.train")

ModelFn = Callable[[], torch.nn.Module]
OptimizerFn = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


def init_from_env(config: FTConfig | None = None, *, environ: Mapping[str, str] | None = None) -> "FTJob":
    """Join the job this process was started for: read the launcher's environment (WorkerSpec), or,
    without one, start a one-replica job with an in-process lighthouse. With more than one rank per
    replica this rendezvouses with the replica's other ranks (replica and FSDP groups) and blocks until
    they are all up. Raises ValueError for an incomplete environment."""
    from ftrun.cli import setup_logging
    from ftrun.launch.zygote_child import claim

    prepared = claim()  # a zygote's prepared spare: wait here until it is given a rank (no-op elsewhere)
    config = config or FTConfig()
    environ = os.environ if environ is None else environ
    phase_events = environ.get("FTRUN_PHASE_EVENTS", "")
    if phase_events not in ("", "0", "1"):
        raise ValueError(f"FTRUN_PHASE_EVENTS must be 1 (print every rank's phase events), 0 or unset, got "
                         f"{phase_events!r}")
    if phase_events == "1":
        config = replace(config, phase_events=True)
    setup_logging(config.log_level)
    torch.manual_seed(config.seed)  # a model the user's own loop builds next is the same in every replica
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)  # ranks share the host; torch's pool would fight FTAR's threads
    env = RealEnv(net_limits=config.net_limits)
    started = env.clock.now()
    lighthouse = None
    if any(k in environ for k in ("FTRUN_REPLICA_ID", "TORCHELASTIC_RUN_ID", "GROUP_RANK")):
        spec = WorkerSpec.from_environ(environ)  # torchrun without ftrun's replica settings: a clear error
    else:
        from ftrun.quorum.service import Lighthouse

        token = secrets.token_hex(16)
        lighthouse = Lighthouse(env=env, config=LighthouseConfig(timeouts=config.timeouts), token=token)
        lighthouse.start()
        spec = WorkerSpec(replica_id="r0", replica_index=0, num_replicas=1, rank=0, ranks_per_replica=1,
                          incarnation=0, lighthouse=lighthouse.addr, token=token, store_addr="", store_port=0,
                          run_dir=config.run_dir or tempfile.mkdtemp(prefix="ftrun-run-"))
    if config.run_dir is not None:
        spec = replace(spec, run_dir=config.run_dir)
    try:
        return FTJob(config=config, spec=spec, env=env, lighthouse=lighthouse,
                     startup={"forked": _float_or_none(environ.get("FTRUN_FORKED_AT")), "init": started,
                              "prepared": prepared})
    except BaseException:  # e.g. a CUDA device without a GPU: leave no lighthouse behind
        if lighthouse is not None:
            lighthouse.stop()
        raise


class FTJob(JobBasics):
    """This rank's membership in the job. `train` runs once; `close` (or the with-block) leaves the
    job. Threading: the training loop's thread only."""

    def __init__(self, *, config: FTConfig, spec: WorkerSpec, env: RealEnv, lighthouse=None,
                 startup: dict[str, float | None] | None = None) -> None:
        self.config, self.spec, self.env, self._lighthouse = config, spec, env, lighthouse
        self.comm: ReplicaComm = LocalComm()
        self.mesh = None
        self._trained = False
        self._user = UserState()
        self._own: OwnLoop | None = None  # the user's own loop (job.wrap), see ftrun.train.own
        self.device = rank_device(config.device, slot=spec.device_slot)  # the model's and batches' (job.device)
        if self.device.type != "cpu" and spec.ranks_per_replica > 1:
            raise ValueError(f"FTConfig.device={config.device!r} with {spec.ranks_per_replica} ranks per replica: "
                             "FSDP2 inside a replica runs on CPU (gloo) only; use one rank per replica on a GPU")
        # A torchrun-style script made the replica's group itself (init_process_group from the launcher's
        # environment): adopt it, and leave destroying it to the script.
        self._adopted = dist.is_initialized()
        if self._adopted:
            self.mesh = adopt_replica_group(rank=spec.rank, world_size=spec.ranks_per_replica,
                                            timeout_s=config.timeouts.commit_timeout_s)
        if spec.ranks_per_replica > 1:
            self.comm, self.mesh = _join_replica(spec, config.timeouts, self.mesh)
        # When this process was forked (by the zygote; None otherwise), entered init_from_env and had
        # joined its replica's groups: the `ready` event carries them (ftrun demo's rejoin breakdown).
        self.startup = {**(startup or {}), "joined": env.clock.now()}

    # -- the user's own loop (ftrun.train.own) -----------------------------------------------------
    def wrap(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
             shard_fn: ShardFn | None = None) -> tuple[torch.nn.Module, "FTOptimizer"]:
        """The model, FSDP2-sharded over the replica's ranks when it has more than one (`shard_fn`
        overrides the default units; a model the script already sharded with fully_shard over the
        replica's ranks is taken as it is), and the optimizer as an FTOptimizer (ftrun.train.own). The
        optimizer must not have stepped yet; under FSDP2 its param groups are pointed at the sharded
        parameters (same hyperparameters). The model is moved to `job.device` (FTConfig.device; in
        place, so the optimizer keeps its parameters): move the batches there too. Build the model the
        same way in every replica (the job seeds torch with FTConfig.seed in init_from_env). Once per
        job, instead of `train`."""
        if self._trained or self._own is not None:
            raise RuntimeError("FTJob.wrap runs once per job, and not together with FTJob.train")
        if not isinstance(model, torch.nn.Module) or not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"wrap(model, optimizer) takes a torch.nn.Module and a torch.optim.Optimizer, got "
                             f"{type(model).__name__} and {type(optimizer).__name__}")
        if len(optimizer.state):
            raise ValueError("wrap: the optimizer has already stepped; wrap it before training")
        fqn_of = {id(p): name for name, p in model.named_parameters()}
        names = [[fqn_of.get(id(p)) for p in g["params"]] for g in optimizer.param_groups]
        if any(n is None for group in names for n in group):
            raise ValueError("wrap: the optimizer holds parameters that are not the model's")
        model = self._make_model(lambda: model, shard_fn)
        elsewhere = sorted({str(p.device) for p in model.parameters()} - {str(self.device)})
        if elsewhere:
            raise ValueError(f"wrap: the model has parameters on {elsewhere}, FTConfig.device is "
                             f"{self.config.device!r} ({self.device}): set FTConfig.device to where the model trains")
        if self.mesh is not None:  # FSDP2 replaced the parameters: point the groups at the sharded ones
            params = dict(model.named_parameters())
            for group, group_names in zip(optimizer.param_groups, names):
                group["params"] = [params[n] for n in group_names]
        self._own = OwnLoop(job=self, model=model, optimizer=optimizer, user=self._user, build=self._build_own)
        self._own.ft_optimizer = FTOptimizer(self._own, optimizer)
        return model, self._own.ft_optimizer

    @contextlib.contextmanager
    def training_step(self) -> Iterator[StepOutcome]:
        """The step as a block, instead of explicit calls: entering it begins the step and zeroes the
        gradients (opt.zero_grad()); leaving it normally runs opt.step() (the exchange, unless
        clip_grad_norm_ ran, and the two-phase commit), and `outcome.committed` says whether it
        committed. An exception leaves the step uncommitted and propagates (end the process: the
        replica restarts and catches up)."""
        own = self._own_loop("training_step")
        own.ft_optimizer.zero_grad()
        outcome = StepOutcome()
        yield outcome
        outcome.committed = own.ft_optimizer.step()

    def sampler(self, dataset: Any) -> "FTSampler":
        """A torch Sampler over `dataset` (anything with len) in the job's exactly-once order; give it to
        a DataLoader (num_workers=0) with batch_size = the micro-batch size."""
        own = self._own_loop("sampler")
        if own.trainer is not None:
            raise RuntimeError("FTJob.sampler: make the sampler before the first step")
        size = len(dataset)
        if size < self.spec.num_replicas:
            raise ValueError(f"FTJob.sampler: the dataset has {size} samples, fewer than the "
                             f"{self.spec.num_replicas} replicas")
        own.dataset_size = size
        return FTSampler(own, size)

    def register_state(self, name: str, obj: Any) -> None:
        """Carry `obj` (state_dict/load_state_dict: tensors and JSON) in catch-up and persistent
        checkpoints, e.g. an LR scheduler, an EMA, counters. Register before the first step."""
        if self._own is not None and self._own.trainer is not None:
            raise RuntimeError(f"FTJob.register_state({name!r}): register before the first step")
        self._user.register(name, obj)

    @property
    def step(self) -> int:
        """Steps this replica has committed (the user's loop: `while job.step < job.max_steps`)."""
        return self._own_loop("step").step

    def log_metrics(self, **metrics: Any) -> None:
        """Custom metrics (JSON values) at the steps committed so far: a "metrics" event, which `ftrun
        launch` folds into metrics.jsonl (the row of the step just committed). A "loss" right after a
        commit also becomes that step's event loss (the launcher's loss curve)."""
        own = self._own_loop("log_metrics")
        step = own.step
        try:
            json.dumps(metrics)
        except (TypeError, ValueError) as e:
            raise ValueError(f"log_metrics: values must be JSON (call .item() on tensors): {e}") from None
        pending = own.pending
        if pending is not None and "loss" in metrics and not pending.get("healed"):
            pending["loss"] = metrics["loss"]
            step = pending["step"] + 1
        elif pending is not None:
            step = pending["step"] + 1
        self.emit({"event": "metrics", "t": self.env.clock.now(), "step": step, "rank": self.rank, **metrics})

    def _build_own(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dataset_size: int,
                   user: UserState):
        from ftrun.train.wiring import build_own_trainer

        return build_own_trainer(job=self, model=model, optimizer=optimizer, dataset_size=dataset_size, user=user,
                                 hooks=Hooks(), kernels=Float32CpuKernels())

    def _own_loop(self, what: str) -> OwnLoop:
        if self._own is None:
            raise RuntimeError(f"FTJob.{what}: call job.wrap(model, optimizer) first")
        return self._own

    def train(self, *, model_fn: ModelFn, optimizer_fn: OptimizerFn, loss_fn: LossFn, dataset: Any,
              steps: int | Callable[[], int] | None = None, shard_fn: ShardFn | None = None,
              hooks: Hooks | None = None) -> TrainResult:
        """Train until this replica has committed `steps` steps (a callable is asked before every step;
        None: the launcher's --steps). `dataset`: anything with len() that a LongTensor of sample indices
        indexes into one batch (e.g. a (num_samples, seq_len + 1) token tensor); the same in every rank.
        Returns the result; a replica failure is returned (ok=False, event "failed"), not raised."""
        from ftrun.train.wiring import build_trainer

        if self._trained or self._own is not None:
            raise RuntimeError("FTJob.train runs once per process (the replica's groups are closed after it), "
                               "and not after FTJob.wrap")
        self._trained = True
        target = steps_target(steps, self.spec.max_steps)
        hooks = hooks or Hooks()
        model = self._make_model(model_fn, shard_fn)
        if hooks.on_model is not None:
            hooks.on_model(model)
        optimizer = optimizer_fn(model.parameters())
        trainer, closers = build_trainer(job=self, model=model, optimizer=optimizer, loss_fn=loss_fn,
                                         dataset=dataset, hooks=hooks, kernels=hooks.kernels or Float32CpuKernels())
        try:
            return self._loop(trainer, target, hooks)
        finally:
            trainer.close()
            for close in closers:
                close()

    def _make_model(self, model_fn: ModelFn, shard_fn: ShardFn | None) -> torch.nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.config.seed)
            model = model_fn()
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"model_fn must return a torch.nn.Module, got {type(model).__name__}")
        if check_sharded(model, self.spec.ranks_per_replica):  # the script's own fully_shard, over the replica
            if shard_fn is not None:
                raise ValueError("the model is already sharded with fully_shard and a shard_fn was given too: shard "
                                 "it once, either yourself or through shard_fn")
            return model  # on the device it was sharded on (wrap checks it is FTConfig.device)
        if self.device.type != "cpu":
            model.to(self.device)  # in place: the parameters keep their identity (an optimizer of wrap holds them)
        if self.mesh is not None:
            if shard_fn is not None:
                shard_fn(model, self.mesh)
            else:
                shard_model(model, self.mesh, reshard_after_forward=self.config.reshard_after_forward)
        return model

    def _loop(self, trainer, target: Callable[[], int], hooks: Hooks) -> TrainResult:
        who = {"rank": self.rank}
        self.emit({"event": "ready", "t": self.env.clock.now(), "step": trainer.step, "pid": os.getpid(),
                   "lineage": trainer.progress.state.lineage, "startup": self.startup, "device": str(self.device),
                   "host_slot": self.spec.device_slot, **who})
        try:
            while trainer.step < (final := target()):
                trainer.manager.final_step = final  # no early quorum request after the last step
                r = trainer.train_step()
                self.emit(step_event(r, trainer.compute.model, self.env.clock.now(), rank=self.rank))
                if hooks.on_step is not None:
                    hooks.on_step(r)
        except JobFinished as e:  # stale (frozen while the others finished): exit cleanly, train nothing
            log.warning("replica %s rank %d stops at step %d: %s", self.replica_id, self.rank, trainer.step, e)
            self.emit({"event": "job_finished", "t": self.env.clock.now(), "step": trainer.step,
                       "finished_step": e.step, "reason": str(e), **who})
            return TrainResult(True, trainer.step, param_hash(trainer.compute.model),
                               trainer.progress.state.to_dict(), str(e))
        except ReplicaError as e:
            log.error("replica %s rank %d gives up: %s", self.replica_id, self.rank, e)
            self.emit({"event": "failed", "t": self.env.clock.now(), "step": trainer.step, "error": str(e), **who})
            return TrainResult(False, trainer.step, param_hash(trainer.compute.model), trainer.progress.state.to_dict(),
                               str(e))
        trainer.manager.report_finished()
        result = TrainResult(True, trainer.step, param_hash(trainer.compute.model), trainer.progress.state.to_dict())
        self.emit({"event": "final", "t": self.env.clock.now(), "step": result.step, "param_hash": result.param_hash,
                   "loader_state": result.loader_state, **who})
        return result

    def close(self, *, clean: bool = True) -> None:
        """Leave the job: the user's loop (its "final" event when `clean`), the replica's groups (once
        train has not) and the standalone lighthouse."""
        if self._own is not None:
            own, self._own = self._own, None
            started = own.trainer is not None
            own.after_commit()
            own.close(clean=clean)
            self._trained = self._trained or started  # a trainer closes the replica's comm
        if not self._trained:
            self.comm.close()
        if not self._adopted:
            close_replica_group()
        if self._lighthouse is not None:
            self._lighthouse.stop()
            self._lighthouse = None

    def __enter__(self) -> "FTJob":
        return self

    def __exit__(self, *exc) -> None:
        self.close(clean=exc[0] is None)


def _float_or_none(text: str | None) -> float | None:
    try:
        return float(text) if text else None
    except ValueError:
        return None


def _join_replica(spec: WorkerSpec, timeouts: Timeouts, mesh=None):
    """The replica's control group (check-in, votes) and its FSDP group (`mesh`: the script's, adopted;
    None: made here), each on its own store prefix naming this incarnation. The FSDP group's timeout is
    shorter than the control group's: a rank whose peer hangs in an FSDP collective fails there (and
    leaves the replica) before any control collective of its peers times out."""
    from ftrun.replica.comm import GlooComm

    store = dist.TCPStore(spec.store_addr, spec.store_port, is_master=False,
                          timeout=datetime.timedelta(seconds=timeouts.connect_timeout_s))
    gloo_host = spec.net.advertised if spec.net.bind_host in WILDCARDS else spec.net.bind_host
    comm = GlooComm(store=store, prefix=f"{spec.replica_id}/{spec.incarnation}/ctl/", rank=spec.rank,
                    world_size=spec.ranks_per_replica, timeout_s=timeouts.replica_comm_s, bind_host=gloo_host)
    if mesh is not None:
        return comm, mesh
    mesh = init_replica_group(store=store, replica_id=spec.replica_id, incarnation=spec.incarnation, rank=spec.rank,
                              world_size=spec.ranks_per_replica, timeout_s=timeouts.commit_timeout_s)
    return comm, mesh


