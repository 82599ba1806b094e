"""`ftrun bench overhead`: FT overhead per step (quorum + two-phase commit) with real replica processes.

R replica processes (one rank each) run steps with no compute against a real lighthouse on loopback; the
time per step is the whole FT overhead. Baseline measured in the same run: one control-message round
trip over the same loopback network, so the ratio says how many round trips a step costs.

The baseline is measured before and after the steps (the machine's load drifts; the mean follows it), and
also between two processes (`ratio_to_process_round_trip`), as every message of a step travels. Also
printed, because they move little with the machine's load: the thread wake-ups per step (voluntary
context switches) and the CPU time per step of the lighthouse process and of each replica process.

A step's critical path is one request: the leader sends it, the lighthouse's reader for that connection wakes and handles it (the last
of the R requests forms the quorum and answers all R), the leader wakes on its reply. The commit vote of
a one-rank replica is local, and the next request tells the lighthouse the commit's outcome, so the
commit costs no message. Ideal: 1 wake-up per replica per step, R in the lighthouse.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import secrets
import statistics
import subprocess
import sys

from ftrun.cli import emit_json
from ftrun.config import LighthouseConfig, ManagerConfig, Timeouts
from ftrun.env.real import RealEnv
from ftrun.quorum.client import LighthouseClient
from ftrun.quorum.service import Lighthouse
from ftrun.replica.comm import LocalComm
from ftrun.replica.manager import Manager


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--json", action="store_true")
    p.add_argument("--_worker", nargs=2, metavar=("LIGHTHOUSE", "REPLICA"), help=argparse.SUPPRESS)  # token: $FTRUN_TOKEN
    p.add_argument("--_echo", action="store_true", help=argparse.SUPPRESS)  # the other process of a round trip


def _worker(addr: str, token: str, rid: str, steps: int) -> None:
    env = RealEnv()
    client = LighthouseClient(env=env, addr=addr, token=token, replica_id=rid, timeouts=Timeouts())
    m = Manager(config=ManagerConfig(), env=env, comm=LocalComm(), replica_id=rid, lighthouse=client)
    warmup = 20
    times = []
    for i in range(steps + warmup):
        if i == warmup:
            t0, wakes0, cpu0 = env.clock.now(), _wakeups(), _cpu_s()
        started = env.clock.now()
        m.start_step()
        m.should_commit()
        times.append(env.clock.now() - started)
    took, wakes, cpu = env.clock.now() - t0, _wakeups() - wakes0, _cpu_s() - cpu0
    print(json.dumps({"per_step_s": took / steps, "median_step_s": statistics.median(times[warmup:]),
                      "wakeups_per_step": wakes / steps, "cpu_s_per_step": cpu / steps}), flush=True)
    m.close()


def _wakeups() -> int:
    """Voluntary context switches of this process so far (every thread): each is a wait that ended."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw


def _cpu_s() -> float:
    """CPU seconds of this process so far (every thread, user and kernel)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


ROUND_TRIPS = 2000


def _echo(env: RealEnv, listener, n: int = ROUND_TRIPS) -> None:
    conn = listener.accept(timeout=30.0)
    for _ in range(n):
        conn.send(conn.recv(timeout=30.0))
    conn.close()


def _time_round_trips(env: RealEnv, addr: str, n: int = ROUND_TRIPS) -> float:
    conn = env.net.connect(addr, timeout=30.0)
    t0 = env.clock.now()
    for i in range(n):
        conn.send({"i": i})
        conn.recv(timeout=30.0)
    took = (env.clock.now() - t0) / n
    conn.close()
    return took


def _round_trip_s(env: RealEnv) -> float:
    """A control message's round trip between two threads of this process (the baseline since the start)."""
    listener = env.net.listen("127.0.0.1:0")
    task = env.spawn(_echo, env, listener, name="echo")
    took = _time_round_trips(env, listener.addr)
    task.join(timeout=30.0)
    listener.close()
    return took


def _process_round_trip_s(env: RealEnv) -> float:
    """The same round trip between two processes, as every message of a step travels."""
    echo = subprocess.Popen([sys.executable, "-m", "ftrun.cli", "bench", "overhead", "--_echo"],
                            stdout=subprocess.PIPE, text=True)
    try:
        took = _time_round_trips(env, echo.stdout.readline().strip())
        echo.wait(timeout=30.0)
    finally:
        echo.kill()
    return took


def run(args: argparse.Namespace) -> int:
    if args._worker:
        _worker(args._worker[0], os.environ["FTRUN_TOKEN"], args._worker[1], steps=args.steps)
        return 0
    if args._echo:
        env = RealEnv()
        listener = env.net.listen("127.0.0.1:0")
        print(listener.addr, flush=True)
        _echo(env, listener)
        return 0
    if args.replicas < 1 or args.steps < 1:
        raise SystemExit(f"--replicas and --steps must be >= 1, got {args.replicas} and {args.steps}")
    env, token = RealEnv(), secrets.token_hex(8)
    lh = Lighthouse(env=env, config=LighthouseConfig(min_replicas=args.replicas), token=token)
    lh.start()
    rtt_before = _round_trip_s(env)
    lh_wakes0, lh_cpu0 = _wakeups(), _cpu_s()
    procs = [subprocess.Popen([sys.executable, "-m", "ftrun.cli", "bench", "overhead", "--steps", str(args.steps),
                               "--_worker", lh.addr, f"r{i}"], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "FTRUN_TOKEN": token}) for i in range(args.replicas)]
    try:
        results = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
    finally:
        for p in procs:
            p.kill()
        lh.stop()
    lh_wakes = (_wakeups() - lh_wakes0) / (args.steps + 20)  # the workers' warm-up steps included
    lh_cpu = (_cpu_s() - lh_cpu0) / (args.steps + 20)
    # The baseline before and after the steps: the machine's load drifts, the mean follows it.
    rtt = (rtt_before + _round_trip_s(env)) / 2
    process_rtt = _process_round_trip_s(env)
    overhead = max(r["per_step_s"] for r in results)
    median = max(r["median_step_s"] for r in results)
    replica_wakes = max(r["wakeups_per_step"] for r in results)
    replica_cpu = max(r["cpu_s_per_step"] for r in results)
    print(f"FT overhead per step (quorum + 2PC), {args.replicas} replicas, {args.steps} steps: "
          f"{overhead * 1e3:.3f} ms (median {median * 1e3:.3f} ms); loopback message round trip {rtt * 1e3:.3f} ms; "
          f"ratio {overhead / rtt:.1f}x (median {median / rtt:.1f}x); between two processes {process_rtt * 1e3:.3f} ms, "
          f"ratio {overhead / process_rtt:.1f}x; thread wake-ups per step: "
          f"lighthouse {lh_wakes:.2f}, replica {replica_wakes:.2f}; CPU per step: lighthouse {lh_cpu * 1e6:.0f} us, "
          f"replica {replica_cpu * 1e6:.0f} us")
    if args.json:
        emit_json({"replicas": args.replicas, "steps": args.steps, "overhead_ms": overhead * 1e3,
                   "median_step_ms": median * 1e3, "round_trip_ms": rtt * 1e3,
                   "ratio_to_round_trip": overhead / rtt, "median_ratio_to_round_trip": median / rtt,
                   "process_round_trip_ms": process_rtt * 1e3, "ratio_to_process_round_trip": overhead / process_rtt,
                   "lighthouse_wakeups_per_step": lh_wakes, "replica_wakeups_per_step": replica_wakes,
                   "lighthouse_cpu_us_per_step": lh_cpu * 1e6, "replica_cpu_us_per_step": replica_cpu * 1e6})
    return 0
