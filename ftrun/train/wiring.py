"""Wire one rank's runtime for `FTJob.train`: catch-up server, FTAR engine, audit, loader_state, the
lighthouse link (the replica's leader only) and the FaultTolerantTrainer over them.

Kept apart from ftrun.train.api so the API module stays the user's page. Threading: the caller's.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch

from ftrun.catchup.http_transport import HttpCatchup
from ftrun.checkpoint.manifest import checkpoint_key
from ftrun.checkpoint.policy import CheckpointConfig
from ftrun.config import ManagerConfig
from ftrun.data.audit import AuditLog, FileAuditSink
from ftrun.data.loader_state import LoaderStateStore
from ftrun.data.sampler import DataLayout
from ftrun.ftar.engine import FtarEngine
from ftrun.ftar.kernels import Kernels
from ftrun.quorum.client import LighthouseClient
from ftrun.replica.rank_watch import RankWatch
from ftrun.storage import FileStorage
from ftrun.train.checkpointer import DcpCheckpointer
from ftrun.train.compute import TorchCompute
from ftrun.train.exchange import GradientExchange
from ftrun.train.job_config import Hooks, RankJob
from ftrun.train.overlap import OverlapExchange
from ftrun.train.state import ReplicaState
from ftrun.train.trainer import FaultTolerantTrainer, LossFn, PhaseFn, TrainerConfig, build
from ftrun.train.user_state import UserState, WithUserState
from ftrun.train.warm import announce, shapes_spec


log = logging.getLogger("ftrun.train")


def replica_ids(num_replicas: int) -> tuple[str, ...]:
    """The launcher's replica naming: r0, r1, ..."""
    return tuple(f"r{i}" for i in range(num_replicas))


def build_trainer(*, job: RankJob, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn,
                  dataset: Any, hooks: Hooks, kernels: Kernels) -> tuple[FaultTolerantTrainer, list[Callable]]:
    """The trainer and what to close after it (engine, server, audit file), in that order.
    Raises ValueError for a dataset or spec that does not fit the job."""
    layout = _layout(job, len(dataset))
    compute = TorchCompute(model=model, optimizer=optimizer, loss_fn=loss_fn, dataset=dataset,
                           min_samples=layout.dataset_size, device=job.device)
    return _build(job=job, model=model, optimizer=optimizer, compute=compute, layout=layout, hooks=hooks,
                  kernels=kernels,
                  overlap=job.config.overlap_bucket_bytes if job.spec.ranks_per_replica == 1 else None)


def build_own_trainer(*, job: RankJob, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      dataset_size: int, user: UserState, hooks: Hooks,
                      kernels: Kernels) -> tuple[FaultTolerantTrainer, list[Callable]]:
    """The trainer of the user's own loop (ftrun.train.own): no loss or dataset (the user's code
    computes the gradients), the registered state carried by catch-up and checkpoints."""
    layout = _layout(job, dataset_size)
    state = WithUserState(ReplicaState(model=model, optimizer=optimizer), user)
    compute = TorchCompute(model=model, optimizer=optimizer, loss_fn=None, dataset=None, state=state,
                           device=job.device)
    return _build(job=job, model=model, optimizer=optimizer, compute=compute, layout=layout, hooks=hooks,
                  kernels=kernels, extra=user.objects)


def _layout(job: RankJob, dataset_size: int) -> DataLayout:
    spec, cfg = job.spec, job.config
    return DataLayout(dataset_size=dataset_size, num_replicas=spec.num_replicas,
                      ranks_per_replica=spec.ranks_per_replica, batch_size_per_rank=cfg.batch_size, seed=cfg.seed)


def _build(*, job: RankJob, model: torch.nn.Module, optimizer: torch.optim.Optimizer, compute: TorchCompute,
           layout: DataLayout, hooks: Hooks, kernels: Kernels,
           extra: dict | None = None, overlap: int | None = None) -> tuple[FaultTolerantTrainer, list[Callable]]:
    """`overlap`: bucket bytes of the exchange overlapped with backward (None: after backward; an
    unsharded replica's own compute only: FSDP2 sets its shards' gradients without autograd's hooks)."""
    spec, cfg, env = job.spec, job.config, job.env
    ids = replica_ids(spec.num_replicas)
    if ids[spec.replica_index] != spec.replica_id:
        raise ValueError(f"replica {spec.replica_id} at index {spec.replica_index}: expected ids {ids}")
    closers: list[Callable] = []
    lighthouse = None
    try:
        catchup = replace(cfg.catchup, bind=spec.net.bind(), advertise_host=spec.net.advertised)
        server = HttpCatchup(env=env, token=spec.token, config=catchup, fault=hooks.catchup_fault)
        closers.append(server.stop)
        engine = FtarEngine(env=env, kernels=kernels, token=spec.token, config=cfg.ftar, bind=spec.net.bind(),
                            advertise_host=spec.net.advertised)
        closers.insert(0, engine.close)
        leader = spec.rank == 0
        sink = FileAuditSink(Path(spec.run_dir) / f"audit-{spec.replica_id}-{spec.incarnation}.jsonl") if leader \
            else _no_audit
        if leader:
            closers.append(sink.close)
        lighthouse = LighthouseClient(env=env, addr=spec.lighthouse, token=spec.token, replica_id=spec.replica_id,
                                      timeouts=cfg.timeouts) if leader else None
        checkpoint = cfg.checkpoint or CheckpointConfig()  # the trainer's (unused without a checkpointer)
        config = TrainerConfig(replica_id=spec.replica_id, rank=spec.rank, rng_seed=cfg.seed, lr=cfg.lr,
                               catchup=catchup, checkpoint=checkpoint)
        checkpointer = DcpCheckpointer(root=Path(spec.run_dir) / "ckpt", model=model, optimizer=optimizer,
                                       keep=checkpoint.keep, key=checkpoint_key(spec.token), comm=job.comm,
                                       extra=extra, timeout_s=cfg.timeouts.replica_comm_s) \
            if cfg.checkpoint is not None else None
        exchange = GradientExchange(engine=engine, rank=spec.rank)
        overlapped = OverlapExchange(env=env, exchange=exchange, flat=compute.flat, bucket_bytes=overlap) \
            if overlap is not None else None
        trainer = build(
            config=config, env=env, compute=compute, layout=layout, replica_ids=ids,
            manager_config=ManagerConfig(max_retries=cfg.max_retries, timeouts=cfg.timeouts),
            comm=job.comm, lighthouse=lighthouse, exchange=exchange,
            catchup=server, loader_store=LoaderStateStore(storage=FileStorage(spec.run_dir)),
            audit=AuditLog(sink), checkpointer=checkpointer, on_event=job.emit, on_phase=_phase_hook(job, hooks.on_phase),
            overlap=overlapped, joining=spec.incarnation > 0)
        if lighthouse is not None and spec.ranks_per_replica > 1:  # a frozen rank stops the leader's heartbeats
            t = cfg.timeouts
            watch = RankWatch(env=env, token=spec.token, own=engine.addr, interval_s=t.heartbeat_interval_s,
                              timeout_s=t.heartbeat_timeout_s)
            lighthouse.healthy = lambda: watch.healthy(trainer.manager.rank_ftar_addrs())
            closers.insert(0, watch.close)
        if spec.ranks_per_replica > 1:  # the zygote, if any, warms this model's shapes for later restarts
            try:
                announce(shapes_spec(model, optimizer, spec.ranks_per_replica), spec.run_dir)
            except OSError as e:  # an optimisation only
                log.warning("could not tell the zygote this job's shapes: %s", e)
        if spec.diagnose:  # root-cause telemetry, served to the collector beside the lighthouse
            closers.append(_serve_telemetry(job, engine=engine, lighthouse=lighthouse, trainer=trainer).stop)
    except BaseException:
        if lighthouse is not None:
            lighthouse.close()
        for close in closers:
            close()
        raise
    return trainer, closers


def _serve_telemetry(job: RankJob, **parts: Any):
    from ftrun.diagnose.attach import serve_rank
    from ftrun.diagnose.collect import RankInfo

    spec = job.spec
    info = RankInfo(f"{spec.replica_id}/{spec.rank}", spec.replica_index, spec.rank, spec.net.advertised,
                    spec.incarnation)
    return serve_rank(job.env, token=spec.token, info=info, collector=spec.diagnose, bind=spec.net.bind(),
                      advertise=spec.net.advertise, comm=job.comm, **parts)[1]


def _no_audit(data: bytes) -> None:
    """Ranks other than the leader write no audit records (the trainer appends on the leader only)."""


def _phase_hook(job: RankJob, on_phase: PhaseFn | None) -> PhaseFn | None:
    """The trainer's phase hook: the user's (Hooks.on_phase), after this rank's "phase" event where
    FTConfig.phase_events asks for them (printed first: the user's hook may end the process). The event's `cpu`:
    the rank process's CPU seconds so far (the Env's clock.cpu()), for its busy share of a step."""
    if not job.config.phase_events:
        return on_phase
    clock, rank = job.env.clock, job.spec.rank

    def hook(phase: str, step: int) -> None:
        job.emit({"event": "phase", "t": clock.now(), "cpu": clock.cpu(), "phase": phase, "step": step, "rank": rank})
        if on_phase is not None:
            on_phase(phase, step)

    return hook
