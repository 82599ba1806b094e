"""One rank of an FT-HSDP training job on a tiny LM: the process a supervisor starts per rank.

    python -m ftrun.train.ft_worker --steps 100 [--stop-file PATH] [--checkpoint-every 10] ...
    ftrun launch --replicas 3 --steps 100 -m ftrun.train.ft_worker --step-time 0.05

Reads its identity from the torchrun-compatible environment (WorkerSpec.from_environ), trains
`ftrun.train.toy.TinyLM` on synthetic tokens with FaultTolerantTrainer (real quorum, catch-up over HTTP,
FTAR, 2PC, DCP checkpoints under run_dir/ckpt, loader_state under run_dir) and prints JSON event lines
on stdout: the Manager's (quorum, heal, commit, abort, error), the trainer's (catchup, checkpoint) and
its own: ready, step (after every step; `param_hash` = sha256 of every parameter's bytes after a
commit), final (at a clean exit, with the ledger), failed. Audit records go to
run_dir/audit-{replica}-{incarnation}.jsonl. It stops once it has committed --steps steps, or the step
written in --stop-file (tests use it to end every replica at the same step).

Fault injection for tests: FTRUN_DIE_AT and FTRUN_CATCHUP_FAULT (see ftrun.train.inject), or the same
plans in a JSON --fault-file that is reloaded before every step.
One rank per replica (FSDP2 inside a replica is a later issue).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import sys
from pathlib import Path

import numpy as np
import torch

from ftrun.catchup.config import CatchupConfig
from ftrun.catchup.server import CatchupServer, Fault
from ftrun.checkpoint.policy import CheckpointConfig
from ftrun.cli import setup_logging
from ftrun.config import ManagerConfig, Timeouts
from ftrun.data.audit import AuditLog, FileAuditSink
from ftrun.data.loader_state import LoaderStateStore
from ftrun.data.sampler import DataLayout
from ftrun.env.real import RealEnv
from ftrun.ftar.cpu_kernels import CpuKernels
from ftrun.ftar.engine import FtarConfig, FtarEngine
from ftrun.ftar.kernels import DType
from ftrun.launch.worker_env import WorkerSpec
from ftrun.quorum.client import LighthouseClient
from ftrun.replica.comm import LocalComm
from ftrun.replica.manager import ReplicaError
from ftrun.storage import FileStorage
from ftrun.train.exchange import GradientExchange
from ftrun.train.inject import parse_catchup_fault, parse_die_at, plan_for
from ftrun.train.lr import LRConfig
from ftrun.train.toy import ToyConfig, lm_loss, make_model, make_tokens
from ftrun.train.trainer import FaultTolerantTrainer, StepResult, TrainerConfig, build

log = logging.getLogger("ftrun.train")


def emit(event: dict) -> None:
    print(json.dumps(event), flush=True)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def param_hash(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for _, p in model.named_parameters():
        h.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Float32Kernels(CpuKernels):
    """CPU FTAR kernels that warm up float32 only (the others' numba loops cost ~1.5 s at start, which
    a restarted replica would spend before checking in), and can die after a few reduces (mid-FTAR)."""

    def __init__(self) -> None:
        super().__init__()
        self.die_after: int | None = None  # reduces left before SIGKILL, when armed

    def warmup(self) -> None:
        a = np.zeros(16, np.uint8)
        self.reduce(a, 0, a.copy(), 0, 8, DType.FLOAT32)
        self.reduce_copy(a, 0, a.copy(), 0, a, 8, 8, DType.FLOAT32)

    def _tick(self) -> None:
        if self.die_after is not None:
            self.die_after -= 1
            if self.die_after <= 0:
                die()

    def reduce(self, *args) -> float:
        self._tick()
        return super().reduce(*args)

    def reduce_copy(self, *args) -> float:
        self._tick()
        return super().reduce_copy(*args)


class Faults:
    """This incarnation's fault plan, wired into the trainer's phases, autograd and the kernels.

    The plan comes from FTRUN_DIE_AT / FTRUN_CATCHUP_FAULT at start and, with --fault-file, is replaced
    whenever that file changes (checked before every step): a JSON object {"die_at": ..., "catchup": ...}
    in the same formats, so a test can script a sequence of faults into one running job.
    """

    def __init__(self, spec: WorkerSpec, *, die_at: str, catchup: str, plan_file: str | None) -> None:
        self.spec, self._plan_file, self._plan_mtime = spec, plan_file, None
        self.kernels = Float32Kernels()
        self._backward_armed = False
        self._set(die_at, catchup)

    def _set(self, die_at: str, catchup: str) -> None:
        self.die_at = plan_for(parse_die_at(die_at), self.spec.replica_id, self.spec.incarnation)
        self.catchup = plan_for(parse_catchup_fault(catchup), self.spec.replica_id, self.spec.incarnation)
        self._spoiled = 0

    def reload(self) -> None:
        try:
            mtime = os.stat(self._plan_file).st_mtime_ns if self._plan_file else None
        except FileNotFoundError:
            mtime = None
        if mtime is not None and mtime != self._plan_mtime:
            self._plan_mtime = mtime
            doc = json.loads(Path(self._plan_file).read_text() or "{}")
            self._set(doc.get("die_at", ""), doc.get("catchup", ""))

    def attach(self, model: torch.nn.Module) -> None:
        next(model.parameters()).register_hook(self._in_backward)

    def _in_backward(self, grad: torch.Tensor) -> None:
        if self._backward_armed:
            die()

    def on_phase(self, phase: str, step: int) -> None:
        if phase == "quorum":
            self.reload()
        if phase == "forward":
            self._backward_armed = any(d.due("backward", step) for d in self.die_at)
        elif phase == "exchange" and any(d.due("exchange", step) for d in self.die_at):
            self.kernels.die_after = 3  # inside the all-reduce, after some chunks went around the ring
        elif any(d.due(phase, step) for d in self.die_at):
            die()

    def catchup_hook(self, step: int, index: int) -> Fault | None:
        """CatchupServer fault hook (on the server's loop): spoil the first shard responses as planned."""
        plans = self.catchup
        if not plans or self._spoiled >= plans[0].count:
            return None
        self._spoiled += 1
        return Fault(plans[0].kind, then=die if plans[0].then_die else None)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ftrun.train.ft_worker", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="default: FTRUN_MAX_STEPS from the launcher")
    p.add_argument("--stop-file", default=None, help="stop at the step written in this file, once it exists")
    p.add_argument("--fault-file", default=None, help="JSON fault plan, reloaded when it changes (tests)")
    p.add_argument("--step-time", type=float, default=0.0, help="seconds of simulated compute per step")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints; 0: none")
    p.add_argument("--ftar-timeout", type=float, default=10.0)
    p.add_argument("--chunk-bytes", type=int, default=2048, help="FTAR chunk size S")
    p.add_argument("--shard-bytes", type=int, default=8192, help="catch-up shard size")
    p.add_argument("--log-level", default="WARNING")
    return p.parse_args(argv)


def stop_step(args: argparse.Namespace, steps: int) -> int:
    if args.stop_file and os.path.exists(args.stop_file):
        text = Path(args.stop_file).read_text().strip()
        if text.isdigit():  # written atomically by the controller; anything else is ignored
            return min(steps, int(text))
    return steps


def make_trainer(args: argparse.Namespace, spec: WorkerSpec, env: RealEnv, faults: Faults):
    """Everything a rank holds, wired; returns (trainer, things to close)."""
    timeouts = Timeouts(ftar_timeout_s=args.ftar_timeout)
    toy = ToyConfig(seed=args.seed)
    dataset, model = make_tokens(toy), make_model(toy)
    faults.attach(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    layout = DataLayout(dataset_size=len(dataset), num_replicas=spec.num_replicas, ranks_per_replica=1,
                        batch_size_per_rank=args.batch_size, seed=args.seed)
    replica_ids = tuple(f"r{i}" for i in range(spec.num_replicas))  # the launcher's naming
    if replica_ids[spec.replica_index] != spec.replica_id:
        raise ValueError(f"replica {spec.replica_id} at index {spec.replica_index}: expected ids {replica_ids}")
    catchup = CatchupConfig(max_shard_bytes=args.shard_bytes, timeouts=timeouts)
    server = CatchupServer(env=env, token=spec.token, config=catchup, fault=faults.catchup_hook)
    server.start()
    ftar = FtarConfig(chunk_bytes=args.chunk_bytes, num_chunks=2, timeout_s=timeouts.ftar_timeout_s)
    engine = FtarEngine(env=env, kernels=faults.kernels, token=spec.token, config=ftar)
    sink = FileAuditSink(Path(spec.run_dir) / f"audit-{spec.replica_id}-{spec.incarnation}.jsonl")
    checkpoint_dir = str(Path(spec.run_dir) / "ckpt") if args.checkpoint_every > 0 else None
    config = TrainerConfig(replica_id=spec.replica_id, rng_seed=args.seed, lr=LRConfig(), catchup=catchup,
                           checkpoint=CheckpointConfig(every_steps=max(args.checkpoint_every, 1)),
                           checkpoint_dir=checkpoint_dir)

    def loss_fn(m: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        env.clock.sleep(args.step_time)  # stands in for the compute of a real model
        return lm_loss(m, batch)

    trainer = build(
        config=config, env=env, model=model, optimizer=optimizer, loss_fn=loss_fn, dataset=dataset, layout=layout,
        replica_ids=replica_ids, manager_config=ManagerConfig(timeouts=timeouts), comm=LocalComm(),
        lighthouse=LighthouseClient(env=env, addr=spec.lighthouse, token=spec.token, replica_id=spec.replica_id,
                                    timeouts=timeouts),
        exchange=GradientExchange(engine=engine, rank=0), server=server, token=spec.token,
        loader_store=LoaderStateStore(storage=FileStorage(spec.run_dir)), audit=AuditLog(sink),
        on_event=emit, on_phase=faults.on_phase)
    return trainer, (engine.close, server.stop, sink.close)


def step_event(trainer: FaultTolerantTrainer, r: StepResult, env: RealEnv) -> dict:
    event = {"event": "step", "t": env.clock.now(), "step": r.step, "quorum_id": r.quorum_id,
             "participants": list(r.participants), "committed": r.committed, "loss": r.loss, "healed": r.healed,
             "lineage": r.lineage}
    if r.committed:
        event["param_hash"] = param_hash(trainer.model)
    return event


def train(args: argparse.Namespace, spec: WorkerSpec, trainer: FaultTolerantTrainer, env: RealEnv, steps: int) -> int:
    emit({"event": "ready", "t": env.clock.now(), "step": trainer.step, "lineage": trainer.progress.state.lineage})
    try:
        while trainer.step < stop_step(args, steps):
            emit(step_event(trainer, trainer.train_step(), env))
    except ReplicaError as e:
        log.error("replica %s gives up: %s", spec.replica_id, e)
        emit({"event": "failed", "t": env.clock.now(), "step": trainer.step, "error": str(e)})
        return 1
    emit({"event": "final", "t": env.clock.now(), "step": trainer.step, "param_hash": param_hash(trainer.model),
          "loader_state": trainer.progress.state.to_dict()})
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    spec = WorkerSpec.from_environ()
    steps = args.steps if args.steps is not None else spec.max_steps
    if steps is None:
        raise SystemExit("--steps is required when FTRUN_MAX_STEPS is not set")
    if spec.ranks_per_replica != 1:
        raise SystemExit("ft_worker runs replicas of one rank (FSDP2 inside a replica is not built yet)")
    setup_logging(args.log_level)
    torch.set_num_threads(1)  # one rank per process; torch's pool would fight the FTAR and HTTP threads
    env = RealEnv()
    faults = Faults(spec, die_at=os.environ.get("FTRUN_DIE_AT", ""), catchup=os.environ.get("FTRUN_CATCHUP_FAULT", ""),
                    plan_file=args.fault_file)
    trainer, closers = make_trainer(args, spec, env, faults)
    try:
        return train(args, spec, trainer, env, steps)
    finally:
        trainer.close()
        for close in closers:
            close()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown (~1.4 s in torch/numba finalizers): every file is closed
