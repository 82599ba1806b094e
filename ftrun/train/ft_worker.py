"""One rank of an FT-HSDP training job on a tiny LM: the process a supervisor starts per rank.

    python -m ftrun.train.ft_worker --steps 100 [--stop-file PATH] [--checkpoint-every 10] ...
    ftrun launch --replicas 3 --steps 100 -m ftrun.train.ft_worker --step-time 0.05

A thin user of the training API (ftrun.train.api): reads its identity from the torchrun-compatible
environment, trains `ftrun.train.toy.TinyLM` on synthetic tokens (real quorum, catch-up over HTTP,
FTAR, 2PC, DCP checkpoints under run_dir/ckpt, loader_state under run_dir; FSDP2 inside a replica of
more than one rank) and prints the API's JSON event lines on stdout: the Manager's (quorum, heal,
commit, abort, error), the trainer's (catchup, checkpoint) and every rank's: ready, step (after every
step; `param_hash` = a fingerprint of this rank's parameter bytes after a commit), final (at a clean exit,
with the ledger), failed. Audit records go to run_dir/audit-{replica}-{incarnation}.jsonl. It stops
once it has committed --steps steps, or the step written in --stop-file (tests use it to end every
replica at the same step). It builds its data and unsharded model before it reads anything rank-specific
(ftrun.launch.zygote_child.claim), so a zygote's prepared spare (`ftrun launch --prepared-spares`) has done
that before a restart claims it.

Fault injection for tests and `ftrun chaos`: FTRUN_DIE_AT and FTRUN_CATCHUP_FAULT (see ftrun.train.inject),
or the same plans in a JSON --fault-file that is reloaded before every step. A planned fault prints
{"event": "fault", "t", "action", "phase", "step", "seconds", "rank"} before it acts (kill, stop or slow).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys
from pathlib import Path
from statistics import median
from typing import Callable

import torch

from ftrun.catchup.config import CatchupConfig
from ftrun.catchup.server import Fault
from ftrun.checkpoint.policy import CheckpointConfig
from ftrun.config import FtarConfig, Timeouts
from ftrun.launch.worker_env import WorkerSpec
from ftrun.launch.zygote_child import claim
from ftrun.train.api import FTConfig, Float32CpuKernels, Hooks, init_from_env
from ftrun.train.api import param_hash  # noqa: F401 (re-exported: tests hash models with it)
from ftrun.train.events import print_event
from ftrun.train.inject import DieAt, parse_catchup_fault, parse_die_at, plan_for
from ftrun.train.toy import ToyConfig, lm_loss, make_model, make_tokens


# Recent steps whose median compute times a DieAt's at=F.
COMPUTE_WINDOW = 20


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class _Sigevent(ctypes.Structure):  # struct sigevent (Linux): sigval, signo, notify, then a 48-byte union
    _fields_ = [("value", ctypes.c_void_p), ("signo", ctypes.c_int), ("notify", ctypes.c_int),
                ("rest", ctypes.c_byte * 48)]


class _Timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("interval", _Timespec), ("value", _Timespec)]


def kill_in(seconds: float) -> bool:
    """Have the kernel SIGKILL this process `seconds` from now (a POSIX timer on CLOCK_MONOTONIC, SIGEV_SIGNAL):
    on time whatever the process is doing. A Python task that sleeps and then kills must first take the GIL
    back from the busy trainer, up to the interpreter's switch interval (5 ms) late and more on loaded cores.
    False where the timer cannot be armed (no librt call): the caller falls back to a task."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        ev, timer = _Sigevent(signo=signal.SIGKILL, notify=0), ctypes.c_void_p()
        if libc.timer_create(1, ctypes.byref(ev), ctypes.byref(timer)) != 0:  # 1: CLOCK_MONOTONIC
            return False
        sec, frac = divmod(max(seconds, 1e-6), 1.0)
        when = _Itimerspec(_Timespec(0, 0), _Timespec(int(sec), int(frac * 1e9)))
        return libc.timer_settime(timer, 0, ctypes.byref(when), None) == 0
    except (OSError, AttributeError):
        return False


class Float32Kernels(Float32CpuKernels):
    """The API's CPU FTAR kernels, able to die (or stop, or stall) after a few reduces (mid-FTAR)."""

    def __init__(self) -> None:
        super().__init__()
        self.die_after: int | None = None  # reduces left before the armed action, when armed
        self.action: Callable[[], None] = die

    def _tick(self) -> None:
        if self.die_after is not None:
            self.die_after -= 1
            if self.die_after <= 0:
                self.die_after = None
                self.action()

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

    def __init__(self, spec: WorkerSpec, *, die_at: str, catchup: str, plan_file: str | None,
                 sleep: Callable[[float], None] = lambda s: None, now: Callable[[], float] = lambda: 0.0,
                 spawn: Callable[..., object] | None = None,
                 kill_later: Callable[[float], bool] | None = None) -> None:
        """sleep, now, spawn: the job's clock and tasks (Env.clock.sleep / now, Env.spawn); spawn runs a
        DieAt's `at=F` timer (without it such a plan acts inside the backward). kill_later(seconds) (`kill_in`),
        where given, times an `at=F` kill instead: a kernel timer, not a task (False: not armed, a task does it)."""
        self.spec, self._plan_file, self._plan_mtime, self._sleep, self._now = spec, plan_file, None, sleep, now
        self._spawn, self._kill_later = spawn, kill_later
        self.kernels = Float32Kernels()
        self._fired: set[DieAt] = set()
        self._step = 0
        self._forward_at: float | None = None
        self.computes: list[float] = []  # this rank's recent forward + backward times (a DieAt's at=F)
        self._set(die_at, catchup)

    def _set(self, die_at: str, catchup: str) -> None:
        self.die_at = tuple(d for d in plan_for(parse_die_at(die_at), self.spec.replica_id, self.spec.incarnation)
                            if d.for_rank(self.spec.rank))
        self.catchup = plan_for(parse_catchup_fault(catchup), self.spec.replica_id, self.spec.incarnation)
        self._spoiled = 0
        self._backward_plan: DieAt | None = None

    def _due(self, phase: str, step: int) -> DieAt | None:
        """The first entry due here that has not fired in this process (an entry fires once)."""
        return next((d for d in self.die_at if d.due(phase, step) and d not in self._fired), None)

    def _announce(self, plan: DieAt, phase: str, step: int, t: float) -> None:
        self._fired.add(plan)
        print_event({"event": "fault", "t": t, "action": plan.action, "phase": phase, "step": step,
                     "seconds": plan.seconds, "rank": self.spec.rank})  # one write: never split by an at=F timer's task

    def _act(self, plan: DieAt, phase: str, step: int) -> None:
        """Carry out `plan` here: announce it on stdout (the supervisor counts it, and resumes a stop), then
        SIGKILL, SIGSTOP or sleep."""
        self._announce(plan, phase, step, self._now())
        if plan.action == "kill":
            die()
        elif plan.action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            self._sleep(plan.seconds)

    def reload(self) -> None:
        try:
            st = os.stat(self._plan_file) if self._plan_file else None
            mtime = (st.st_mtime_ns, st.st_ino) if st is not None else None
        except FileNotFoundError:
            mtime = None
        if mtime is not None and mtime != self._plan_mtime:  # (mtime, inode): a replaced file is always new
            self._plan_mtime = mtime
            doc = json.loads(Path(self._plan_file).read_text() or "{}")
            self._set(doc.get("die_at", ""), doc.get("catchup", ""))

    def attach(self, model: torch.nn.Module) -> None:
        """Die inside autograd: a hook on the model's output fires when the backward reaches it (a hook
        on a parameter would not fire under FSDP2, whose sharded parameters are not in the graph)."""
        model.register_forward_hook(self._on_output)

    def _on_output(self, module: torch.nn.Module, args, output: torch.Tensor) -> None:
        if output.requires_grad:
            output.register_hook(self._in_backward)

    def _in_backward(self, grad: torch.Tensor) -> None:
        if self._backward_plan is not None:
            plan, self._backward_plan = self._backward_plan, None
            self._act(plan, "backward", self._step)

    def on_phase(self, phase: str, step: int) -> None:
        self._step = step
        if phase == "quorum":
            self.reload()
        if phase == "started" and (plan := self._due("backward", step)) is not None and plan.at:
            self._arm_timer(plan, step)
        if phase == "exchange" and self._forward_at is not None:  # the compute just done, timed
            self.computes = (self.computes + [self._now() - self._forward_at])[-COMPUTE_WINDOW:]
            self._forward_at = None
        if phase == "forward":
            self._forward_at = self._now()
            self._backward_plan = self._due("backward", step)
        elif phase == "exchange" and (plan := self._due("exchange", step)) is not None:
            self._fired.add(plan)  # armed: inside the all-reduce, after some chunks went around the ring
            self.kernels.die_after = 3
            self.kernels.action = lambda: self._act(plan, "exchange", step)
        elif (plan := self._due(phase, step)) is not None:
            self._act(plan, phase, step)

    def _arm_timer(self, plan: DieAt, step: int) -> None:
        """A DieAt with at=F, at the step's start: act F x this rank's median compute from now (the process is
        then wherever the step has got to): a kill by the kernel's timer (kill_later; a task where none could be
        armed), announced now with the time it lands, anything else from a task. Before any compute was timed, or
        without a spawn, the plan stays for the backward."""
        if not self.computes or self._spawn is None:
            return
        self._fired.add(plan)
        delay = plan.at * median(self.computes)
        if plan.action == "kill" and self._kill_later is not None:
            # announced before it is armed (a process preempted in between could otherwise die unannounced)
            self._announce(plan, "backward", step, self._now() + delay)
            if not self._kill_later(delay):
                self._spawn(lambda: (self._sleep(delay), die()), name=f"fault-at-{plan.at:g}")
            return

        def fire() -> None:
            self._sleep(delay)
            self._act(plan, "backward", step)

        self._spawn(fire, name=f"fault-at-{plan.at:g}")

    def catchup_hook(self, step: int, index: int) -> Fault | None:
        """CatchupServer fault hook (on the server's loop): spoil the first shard responses as planned."""
        plans = self.catchup
        if plans and plans[0].kind == "slow":  # a throttled source: every response
            return Fault("slow", factor=plans[0].factor, delay_s=plans[0].delay)
        if not plans or self._spoiled >= plans[0].count:
            return None
        self._spoiled += 1
        return Fault(plans[0].kind, then=die if plans[0].then_die else None)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ftrun.train.ft_worker", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="default: FTRUN_MAX_STEPS from the launcher")
    p.add_argument("--stop-file", default=None, help="stop at the step written in this file, once it exists")
    p.add_argument("--fault-file", default=os.environ.get("FTRUN_FAULT_FILE"),
                   help="JSON fault plan, reloaded when it changes (tests; `ftrun launch --inject` sets "
                        "FTRUN_FAULT_FILE, the default)")
    p.add_argument("--step-time", type=float, default=0.0, help="seconds of simulated compute per step")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints; 0: none")
    p.add_argument("--ftar-timeout", type=float, default=10.0)
    p.add_argument("--chunk-bytes", type=int, default=2048, help="FTAR chunk size S")
    p.add_argument("--max-shard-bytes", type=int, default=8192, help="catch-up shard size (CatchupConfig.max_shard_bytes)")
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("--overlap-bucket-bytes", type=int, default=None,
                   help="exchange gradients in buckets of this size during backward (default: after backward)")
    return p.parse_args(argv)


def stop_step(args: argparse.Namespace, steps: int) -> int:
    if args.stop_file and os.path.exists(args.stop_file):
        text = Path(args.stop_file).read_text().strip()
        if text.isdigit():  # written atomically by the controller; anything else is ignored
            return min(steps, int(text))
    return steps


def config_from(args: argparse.Namespace) -> FTConfig:
    every = args.checkpoint_every
    return FTConfig(batch_size=args.batch_size, seed=args.seed,
                    checkpoint=CheckpointConfig(every_steps=every) if every > 0 else None,
                    timeouts=Timeouts(ftar_timeout_s=args.ftar_timeout),
                    ftar=FtarConfig(chunk_bytes=args.chunk_bytes, num_chunks=2), catchup=CatchupConfig(max_shard_bytes=args.max_shard_bytes),
                    log_level=args.log_level, overlap_bucket_bytes=args.overlap_bucket_bytes)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    die_at, catchup = os.environ.get("FTRUN_DIE_AT", ""), os.environ.get("FTRUN_CATCHUP_FAULT", "")
    parse_die_at(die_at), parse_catchup_fault(catchup)  # a bad plan fails before the rank joins the job
    # Nothing above or here is rank-specific: in a zygote's prepared spare (ftrun launch --prepared-spares)
    # it runs before a restart, and claim() waits for the rank's identity (a no-op in any other process).
    toy = ToyConfig(seed=args.seed)
    dataset, model = make_tokens(toy), make_model(toy)  # unsharded: FSDP2 shards it once the rank is known
    claim()
    spec = WorkerSpec.from_environ()
    steps = args.steps if args.steps is not None else spec.max_steps
    if steps is None:
        raise SystemExit("--steps is required when FTRUN_MAX_STEPS is not set")
    with init_from_env(config_from(args)) as ft:
        faults = Faults(spec, die_at=die_at, catchup=catchup, plan_file=args.fault_file,
                        sleep=ft.env.clock.sleep, now=ft.env.clock.now, spawn=ft.env.spawn,  # a slow rank stalls on the job's clock
                        kill_later=kill_in)

        def loss_fn(m: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
            ft.env.clock.sleep(args.step_time)  # stands in for the compute of a real model
            return lm_loss(m, batch)

        result = ft.train(
            model_fn=lambda: model, loss_fn=loss_fn, dataset=dataset,
            steps=lambda: stop_step(args, steps),
            optimizer_fn=lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01),
            hooks=Hooks(kernels=faults.kernels, on_model=faults.attach, on_phase=faults.on_phase,
                        catchup_fault=faults.catchup_hook))
    return result.exit_code


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown (~1.4 s in torch/numba finalizers): every file is closed
