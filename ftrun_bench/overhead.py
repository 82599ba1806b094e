"""`ftrun bench overhead`: FT overhead per step (quorum + two-phase commit) with real replica processes.

R replica processes (one rank each) run steps against a real lighthouse on loopback. A step is
start_step, should_commit, then a modelled compute sleep (`--compute-ms`: the optimizer step and the
rest of the step, where the trainer's work between a commit and the next quorum runs); the FT overhead
of a step is its time in start_step and should_commit, the sleep excluded. The steps run twice in the
same run, each time with fresh replica processes and a fresh lighthouse: without ask-ahead ("sync": the
leader asks at start_step and waits) and with it ("async": the request goes out at the
commit and the lighthouse decides during the sleep; ftrun.replica.ask_ahead). `hidden_ms` is what
ask-ahead takes off a step's FT overhead, `async_to_sync` the ratio of the two. The keys without a
prefix are ask-ahead's, the `sync_` ones the other run's. Baseline measured
in the same run: one control-message round trip over the same loopback network, so the ratio says how
many round trips a step's FT overhead costs.

The baseline is measured before and after the steps (the machine's load drifts; the mean follows it), and
also between two processes (`ratio_to_process_round_trip`), as every message of a step travels. Also
printed, because they move little with the machine's load: the thread wake-ups per step (voluntary
context switches; a replica's include the compute sleep's one) and the CPU time per step of the
lighthouse process and of each replica process (ask-ahead's run).

A step's critical path is one request: the leader sends it, the lighthouse's reader for that connection wakes and handles it (the last
of the R requests forms the quorum and answers all R), the leader wakes on its reply. The commit vote of
a one-rank replica is local, and the next request tells the lighthouse the commit's outcome, so the
commit costs no message. Ideal: 1 wake-up per replica per step, R in the lighthouse. With ask-ahead the
request leaves at the commit and its reply is usually there when start_step reads it.
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
from dataclasses import dataclass

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
    p.add_argument("--compute-ms", type=float, default=2.0,
                   help="modelled compute per step, slept after the commit (default 2.0; excluded from the overhead)")
    p.add_argument("--json", action="store_true")
    # The sync run's lighthouse, the ask-ahead run's, the replica's id; token: $FTRUN_TOKEN
    p.add_argument("--_worker", nargs=3, metavar=("SYNC", "ASYNC", "REPLICA"), help=argparse.SUPPRESS)
    p.add_argument("--_echo", action="store_true", help=argparse.SUPPRESS)  # the other process of a round trip


WARMUP = 20


def _worker(addrs: tuple[str, str], token: str, rid: str, steps: int, compute_s: float) -> None:
    """Both runs in one process (its start, a torch import, costs seconds on a loaded machine): the
    sync run, then, once the parent says go on stdin (it reads the lighthouse's counters between them),
    the ask-ahead run. One JSON line per run."""
    env = RealEnv()
    _worker_run(env, addrs[0], token, rid, steps, compute_s, ask_ahead=False)
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("the parent did not say go")
    _worker_run(env, addrs[1], token, rid, steps, compute_s, ask_ahead=True)


def _worker_run(env: RealEnv, addr: str, token: str, rid: str, steps: int, compute_s: float, ask_ahead: bool) -> None:
    client = LighthouseClient(env=env, addr=addr, token=token, replica_id=rid, timeouts=Timeouts())
    m = Manager(config=ManagerConfig(ask_ahead=ask_ahead), env=env, comm=LocalComm(), replica_id=rid,
                lighthouse=client, final_step=steps + WARMUP)
    times = []
    for i in range(steps + WARMUP):
        if i == WARMUP:
            wakes0, cpu0 = _wakeups(), _cpu_s()
        started = env.clock.now()
        m.start_step()
        m.should_commit()
        times.append(env.clock.now() - started)
        if compute_s > 0:
            env.clock.sleep(compute_s)
    wakes, cpu, ft = _wakeups() - wakes0, _cpu_s() - cpu0, times[WARMUP:]
    print(json.dumps({"per_step_s": sum(ft) / steps, "median_step_s": statistics.median(ft),
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


@dataclass(frozen=True)
class _ModeResult:
    overhead_s: float  # FT time per step, mean over the steps, the slowest replica's
    median_s: float
    replica_wakes: float
    replica_cpu_s: float
    lighthouse_wakes: float
    lighthouse_cpu_s: float


def _mode_result(results: list[dict], lh_wakes: int, lh_cpu_s: float, steps: int) -> _ModeResult:
    """The lighthouse's counters are this process's: its waits on the workers' output count too."""
    return _ModeResult(max(r["per_step_s"] for r in results), max(r["median_step_s"] for r in results),
                       max(r["wakeups_per_step"] for r in results), max(r["cpu_s_per_step"] for r in results),
                       lh_wakes / steps, lh_cpu_s / steps)


def _run_modes(env: RealEnv, args: argparse.Namespace) -> tuple[_ModeResult, _ModeResult]:
    """R replica processes, each running the sync steps against one lighthouse of this process, then
    the ask-ahead steps against another: (sync, ask-ahead)."""
    token = secrets.token_hex(8)
    lhs = [Lighthouse(env=env, config=LighthouseConfig(min_replicas=args.replicas), token=token) for _ in range(2)]
    for lh in lhs:
        lh.start()
    cmd = [sys.executable, "-m", "ftrun.cli", "bench", "overhead", "--steps", str(args.steps),
           "--compute-ms", str(args.compute_ms), "--_worker", lhs[0].addr, lhs[1].addr]
    steps = args.steps + WARMUP  # the workers' warm-up steps included
    procs = []
    try:
        procs = [subprocess.Popen(cmd + [f"r{i}"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "FTRUN_TOKEN": token}) for i in range(args.replicas)]
        wakes0, cpu0 = _wakeups(), _cpu_s()  # (the workers' start, a few seconds, barely wakes this process)
        sync = [json.loads(p.stdout.readline()) for p in procs]
        wakes1, cpu1 = _wakeups(), _cpu_s()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        fast = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
        wakes2, cpu2 = _wakeups(), _cpu_s()
    finally:
        for p in procs:
            p.kill()
        for lh in lhs:
            lh.stop()
    return (_mode_result(sync, wakes1 - wakes0, cpu1 - cpu0, steps),
            _mode_result(fast, wakes2 - wakes1, cpu2 - cpu1, steps))


def run(args: argparse.Namespace) -> int:
    if args._worker:
        _worker((args._worker[0], args._worker[1]), os.environ["FTRUN_TOKEN"], args._worker[2], steps=args.steps,
                compute_s=args.compute_ms / 1e3)
        return 0
    if args._echo:
        env = RealEnv()
        listener = env.net.listen("127.0.0.1:0")
        print(listener.addr, flush=True)
        _echo(env, listener)
        return 0
    if args.replicas < 1 or args.steps < 1:
        raise SystemExit(f"--replicas and --steps must be >= 1, got {args.replicas} and {args.steps}")
    if not 0 <= args.compute_ms <= 10_000:
        raise SystemExit(f"--compute-ms must be within 0..10000, got {args.compute_ms}")
    env = RealEnv()
    rtt_before = _round_trip_s(env)
    sync, fast = _run_modes(env, args)
    # The baseline before and after the steps: the machine's load drifts, the mean follows it.
    rtt = (rtt_before + _round_trip_s(env)) / 2
    process_rtt = _process_round_trip_s(env)
    overhead, median = fast.overhead_s, fast.median_s
    print(f"FT overhead per step (quorum + 2PC), {args.replicas} replicas, {args.steps} steps, "
          f"{args.compute_ms:g} ms modelled compute: ask-ahead {overhead * 1e3:.3f} ms (median {median * 1e3:.3f} ms), "
          f"sync {sync.overhead_s * 1e3:.3f} ms (median {sync.median_s * 1e3:.3f} ms), hidden "
          f"{(sync.overhead_s - overhead) * 1e3:.3f} ms, async/sync {overhead / sync.overhead_s:.2f}; loopback "
          f"message round trip {rtt * 1e3:.3f} ms; ratio {overhead / rtt:.1f}x (median {median / rtt:.1f}x; sync "
          f"{sync.overhead_s / rtt:.1f}x, median {sync.median_s / rtt:.1f}x); between two processes "
          f"{process_rtt * 1e3:.3f} ms, ratio {overhead / process_rtt:.1f}x; thread wake-ups per step: lighthouse "
          f"{fast.lighthouse_wakes:.2f}, replica {fast.replica_wakes:.2f}; CPU per step: lighthouse "
          f"{fast.lighthouse_cpu_s * 1e6:.0f} us, replica {fast.replica_cpu_s * 1e6:.0f} us")
    if args.json:
        emit_json({"replicas": args.replicas, "steps": args.steps, "compute_ms": args.compute_ms,
                   "overhead_ms": overhead * 1e3, "median_step_ms": median * 1e3, "round_trip_ms": rtt * 1e3,
                   "ratio_to_round_trip": overhead / rtt, "median_ratio_to_round_trip": median / rtt,
                   "process_round_trip_ms": process_rtt * 1e3, "ratio_to_process_round_trip": overhead / process_rtt,
                   "lighthouse_wakeups_per_step": fast.lighthouse_wakes, "replica_wakeups_per_step": fast.replica_wakes,
                   "lighthouse_cpu_us_per_step": fast.lighthouse_cpu_s * 1e6,
                   "replica_cpu_us_per_step": fast.replica_cpu_s * 1e6,
                   "sync_overhead_ms": sync.overhead_s * 1e3, "sync_median_step_ms": sync.median_s * 1e3,
                   "sync_ratio_to_round_trip": sync.overhead_s / rtt,
                   "sync_median_ratio_to_round_trip": sync.median_s / rtt,
                   "hidden_ms": (sync.overhead_s - overhead) * 1e3, "async_to_sync": overhead / sync.overhead_s})
    return 0
