"""`ftrun launch`: a lighthouse and R replicas x K ranks of a training script on this machine.

Each rank process gets torchrun-compatible environment variables plus ftrun's (see worker_env.py) and
FTRUN_MAX_STEPS. The supervisor restarts a replica whose process dies, injects failures
(`--kill-every`, `--kill-random-mean`, `--kill-at`), shows live progress and writes per-step metrics
(JSONL) and a PNG report into --out. Rank 0 of each replica reports JSON event lines on stdout:
{"event": "commit", "step", "quorum_id", ...} and optionally "loss" and "tokens".
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import secrets
import sys
import tempfile

import torch.distributed as dist
from tqdm import tqdm

from ftrun.cli import emit_json
from ftrun.config import LighthouseConfig, Timeouts
from ftrun.env.base import EnvTimeout
from ftrun.env.real import RealEnv
from ftrun.launch.faults import KillAt, KillPlan, parse_duration
from ftrun.launch.report import summarize, write_plots
from ftrun.launch.supervisor import ReplicaProcesses
from ftrun.launch.worker_env import WorkerSpec
from ftrun.quorum.service import Lighthouse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--ranks-per-replica", type=int, default=1)
    p.add_argument("--steps", type=int, required=True, help="stop once every replica committed this many steps")
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--kill-every", type=parse_duration, default=None, metavar="DURATION")
    p.add_argument("--kill-random-mean", type=parse_duration, default=None, metavar="DURATION")
    p.add_argument("--kill-at", type=KillAt.parse, action="append", default=[], metavar="step=N[,replica=ID]")
    p.add_argument("--restart-delay", type=parse_duration, default=0.5, metavar="DURATION")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=parse_duration, default=3600.0, metavar="DURATION")
    p.add_argument("--out", default=None, help="folder for metrics.jsonl, report.png and rank logs")
    p.add_argument("--json", action="store_true")
    p.add_argument("-m", "--module", action="store_true", help="SCRIPT names a module to run as python -m")
    p.add_argument("script", help="training script (or module, with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER)


class _Job:
    """The running job: replicas, the kill plan, restarts, and the event log."""

    def __init__(self, env: RealEnv, args: argparse.Namespace, lighthouse: Lighthouse, token: str,
                 store_port: int) -> None:
        self.env, self.args = env, args
        self.log: list[dict] = []
        self.out = args.out or tempfile.mkdtemp(prefix="ftrun-launch-")
        self.logs = os.path.join(self.out, "logs")
        os.makedirs(self.logs, exist_ok=True)
        self.events = env.queue()
        self.metrics = open(os.path.join(self.out, "metrics.jsonl"), "w")
        argv = (["-m", args.script] if args.module else [args.script]) + list(args.script_args)
        self.replicas = {
            f"r{i}": ReplicaProcesses(
                env=env, events=self.events, log_dir=self.logs, argv=argv,
                spec=WorkerSpec(replica_id=f"r{i}", replica_index=i, num_replicas=args.replicas, rank=0,
                                ranks_per_replica=args.ranks_per_replica, incarnation=0, lighthouse=lighthouse.addr,
                                token=token, store_addr="127.0.0.1", store_port=store_port, run_dir=self.out,
                                max_steps=args.steps))
            for i in range(args.replicas)
        }
        self.down_until: dict[str, float] = {}  # replica -> when to restart it
        self.done: set[str] = set()
        self.max_step = 0
        self.plan = KillPlan(every_s=args.kill_every, random_mean_s=args.kill_random_mean, at_steps=args.kill_at,
                             min_up=max(args.min_replicas, 1), seed=args.seed)

    def record(self, event: dict) -> None:
        self.log.append(event)
        self.metrics.write(json.dumps(event) + "\n")

    def kill(self, rid: str, why: str) -> None:
        now = self.env.clock.now()
        self.replicas[rid].kill()
        self.down_until[rid] = now + self.args.restart_delay
        self.record({"event": "kill", "replica_id": rid, "t": now, "why": why, "step": self.max_step})

    def tick(self) -> None:
        now = self.env.clock.now()
        for rid, at in list(self.down_until.items()):
            if now >= at:
                del self.down_until[rid]
                self.replicas[rid].restart()
                self.record({"event": "restart", "replica_id": rid, "t": now,
                             "incarnation": self.replicas[rid].spec.incarnation})
        for rid, rep in self.replicas.items():
            codes = rep.exited()
            if rid in self.down_until or rid in self.done or not any(c is not None for c in codes):
                continue
            if all(c == 0 for c in codes):
                self.done.add(rid)
            else:
                self.kill(rid, f"rank exited with {codes}")  # a crash: the whole replica restarts
        if self.max_step >= self.args.steps:
            return  # the job reached its goal: no more injected failures
        up = [r for r in self.replicas if r not in self.down_until and r not in self.done]
        victim = self.plan.due(now, self.max_step, up)
        if victim is not None:
            self.kill(victim, "injected")


def run(args: argparse.Namespace) -> int:
    env, token = RealEnv(), secrets.token_hex(16)
    lighthouse = Lighthouse(env=env, config=LighthouseConfig(min_replicas=args.min_replicas, timeouts=Timeouts()),
                            token=token)
    lighthouse.start()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    job = _Job(env, args, lighthouse, token, store.port)
    started = env.clock.now()
    try:
        for rep in job.replicas.values():
            rep.start()
        job.plan.start(started)
        _drive(env, args, job, started)
    finally:
        lighthouse.stop()
        for rep in job.replicas.values():
            rep.kill()
        job.metrics.close()
    figures = summarize(job.log, num_replicas=args.replicas, steps=args.steps, wall_s=env.clock.now() - started,
                        kill_interval_s=args.kill_every or args.kill_random_mean)
    figures["report_png"] = write_plots(job.log, os.path.join(job.out, "report.png"))
    figures["out"] = job.out
    _print_report(figures)
    if args.json:
        emit_json(figures)
    return 0 if figures["complete"] else 1


def _drive(env: RealEnv, args: argparse.Namespace, job: _Job, started: float) -> None:
    bar = tqdm(total=args.steps, desc="ftrun launch", unit="step", file=sys.stderr, dynamic_ncols=True)
    committed = failed = 0
    finished_at = None  # when the job first reached its step goal
    while len(job.done) < args.replicas and env.clock.now() - started < args.timeout:
        if job.max_step >= args.steps:
            finished_at = finished_at or env.clock.now()
            if env.clock.now() - finished_at > 2.0:
                break  # replicas still healing at the end cannot finish alone: stop them
        job.tick()
        try:
            ev = job.events.get(timeout=0.05)
        except EnvTimeout:
            continue
        job.record(ev)
        if ev.get("event") == "commit":
            committed += 1
            if ev["step"] > job.max_step:
                bar.update(ev["step"] - job.max_step)
                job.max_step = ev["step"]
            bar.set_postfix(participants=len(ev.get("participants", [])) or "-", loss=ev.get("loss", "-"),
                            committed=f"{100 * committed / max(committed + failed, 1):.0f}%", refresh=False)
        elif ev.get("event") == "abort":
            failed += 1
    bar.close()


def _print_report(f: dict) -> None:
    print("\nftrun launch report")
    print(f"  steps: {f['steps_reached']} reached, {f['replica_steps_committed']} replica-steps committed, "
          f"{f['failed_commits']} failed commits; kills: {f['kills']}, restarts: {f['restarts']}")
    print(f"  step efficiency (committed replica-steps / replicas x steps): {f['step_efficiency']:.3f}")
    if f.get("theoretical_efficiency") is not None:
        print(f"  theoretical for this kill rate: {f['theoretical_efficiency']:.3f} "
              f"(1 - D/(T*R) - t_step/T with downtime D={f['mean_downtime_s']:.2f}s, T={f['kill_interval_s']:.1f}s)")
    print(f"  metrics: {f['out']}/metrics.jsonl; plots: {f['report_png']}; {'complete' if f['complete'] else 'INCOMPLETE'}")
