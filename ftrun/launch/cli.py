"""`ftrun launch`: a lighthouse and R replicas x K ranks of a training script on this machine.

    ftrun launch --replicas 3 --ranks-per-replica 2 --steps 500 --kill-every 30s [--baseline] [--json] \\
        [-m] SCRIPT [ARGS...]

Each rank process gets torchrun-compatible environment variables plus ftrun's (see worker_env.py) and
FTRUN_MAX_STEPS. Rank processes are forked from a zygote that has the script's imports loaded
(zygote.py; `--start-method spawn` starts fresh interpreters instead). The supervisor restarts a replica
whose process dies (waiting twice as long after each crash in a row, from --restart-delay), injects
failures (`--kill-every`, `--kill-random-mean`, `--kill-at`; a kill SIGKILLs every rank of a replica,
which restarts after --restart-delay), shows live progress and writes into --out: events.jsonl (every event), metrics.jsonl (one line per step), report.png and the ranks'
stdout/stderr under logs/.

Ranks report JSON event lines on stdout: the Manager's {"event": "commit"|"abort"|"quorum", "step", ...}
and, optionally, {"event": "step", "step", "committed", "loss", "param_hash", "healed"} after each step
(ftrun.train.ft_worker does) and {"event": "final", "loader_state"} at a clean exit. From them the
report computes step efficiency next to its theoretical value for the kill rate (theory.py:
E = 1 - D/(R*T)), the identical-state check (every replica that committed a step shows the same
param_hash, per rank) and, from run_dir/audit-*.jsonl, the exactly-once audit. `--baseline` first runs
the same job (seed, steps, script arguments) without failures and compares the losses at the same number
of batches trained. With --json the last stdout line is one JSON object with all figures.

Where it runs: this machine by default; `--netns-hosts N` a rehearsal on N network namespaces as hosts
(netns_job.py, with host faults from host_faults.py); `--hosts FILE --host-index I` a job over real
hosts, an agent on each (multihost.py, agent.py, remote.py). Options are declared in options.py.

Listener caps: --max-connections / --max-pending / --max-hello-bytes (ftrun.cli.add_listen_arguments) cap the
listeners of the services it runs (lighthouse, diagnosis monitor, status page; a host's agent); the ranks' own
listeners take FTConfig.net_limits from the script.

When things go wrong: bad flags exit 2 with a message naming the flag (checks.py). A crashed rank's
error, with its traceback from the rank's stderr, is shown once per job (crashes.py); a replica that
crashes --max-startup-failures times in a row with the same error, each time before its first commit or
with the job no further, is in a crash loop: it is not restarted, and the job ends when the others
cannot make a quorum (either way it does not count as complete). The exit status
is 0 only for a complete job: it reached its steps with identical replicas, no duplicated or skipped
batch, and was neither interrupted nor given up on (`incomplete_reasons` in the JSON says why not).
Ctrl-C or SIGTERM stops the job and writes the partial report (exit 128 + signal); a second one quits
at once. Kill options that never fired are warnings in the report and the JSON.

Diagnosis (unless --no-diagnose): a monitor beside the lighthouse (ftrun.diagnose.monitor) pulls every
rank's collective telemetry and names the culprit of a hang; a confirmed culprit's replica is evicted at
once (killed, `why: evicted`, and restarted) instead of its peers waiting out the FTAR timeout. Its
verdicts are "verdict" events, its evictions "evict" events; --out gets lighthouse (the address for
`ftrun diagnose --lighthouse`), token (mode 0600, for --token-file) and report.json (the figures and
the diagnosis: verdicts, evictions).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Callable

from ftrun.cli import emit_json, listen_limits
from ftrun.diagnose.graph import as_json as graph_json
from ftrun.diagnose.graph import shown_verdict
from ftrun.env.real import RealEnv
from ftrun.launch.checks import problems
from ftrun.launch.interrupts import Interrupts
from ftrun.launch.options import add_arguments  # noqa: F401  (ftrun.cli finds the parser's options here)
from ftrun.launch.procs import ForkServer, Launcher, SpawnLauncher
from ftrun.launch.job import Job, run_job
from ftrun.launch.report import job_figures, print_report


def make_launcher(env: RealEnv, args: argparse.Namespace, out: str) -> Launcher:
    if args.start_method == "spawn":
        return SpawnLauncher()
    return ForkServer(env=env, script=args.script, module=args.module, cwd=os.getcwd(),
                      log_path=os.path.join(out, "zygote.log"), run_dir=out, sharded=args.ranks_per_replica > 1,
                      spares=args.ranks_per_replica,  # a replica's restart takes spares: no fork on its path
                      prepared_spares=args.prepared_spares)


def run(args: argparse.Namespace) -> int:
    from ftrun.launch.multihost import hosts_problems, run_agent
    from ftrun.launch.netns_job import netns_problems

    limits = listen_limits(args)
    bad = problems(args) + netns_problems(args) + hosts_problems(args)
    out = os.path.abspath(args.out) if args.out else None
    if not bad and out is not None and (why := unwritable(out)):
        bad.append(f"--out {args.out}: {why}")
    if bad:
        for text in bad:
            print(f"ftrun launch: error: {text}", file=sys.stderr)
        return 2
    out = out or tempfile.mkdtemp(prefix="ftrun-launch-")
    if args.hosts is not None and args.host_index != 0:
        return run_agent(args, out, limits)  # this host serves the launcher on host 0 (multihost.py)
    stop = Interrupts()
    stop.install()
    try:
        return _launch(RealEnv(net_limits=limits), args, out, stop)
    except KeyboardInterrupt:
        print("ftrun launch: interrupted again: stopped without a report", file=sys.stderr)
        return 130
    finally:
        stop.restore()


def unwritable(out: str) -> str | None:
    """Why the job cannot write into the folder `out` (made if missing); None when it can."""
    try:
        os.makedirs(out, exist_ok=True)
        probe = os.path.join(out, f".ftrun-write-test-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        return f"cannot write there ({e.strerror or e})"
    return None


def _launch(env: RealEnv, args: argparse.Namespace, out: str, stop: Interrupts) -> int:
    launcher = make_launcher(env, args, out)
    base = result = hosts = None
    make_job: Callable[..., Job] = Job
    remote_jobs: list = []
    try:
        if args.hosts is not None:  # host 0 of a multi-host job: the others run agents (multihost.py)
            from ftrun.launch.multihost import job_factory as hosts_job_factory, read_hosts

            make_job = hosts_job_factory(read_hosts(args.hosts), remote_jobs)
        if args.netns_hosts is not None:  # a multi-host rehearsal: the job runs on namespaces (netns_job.py)
            from ftrun.launch.netns_job import job_factory, open_hosts

            hosts = open_hosts(args)
            make_job = job_factory(hosts)
        if args.baseline:
            base = run_job(env, args, os.path.join(out, "baseline"), launcher, inject=False, label="baseline",
                           stop=stop, make_job=make_job)
        if stop.signal is None or base is None:  # stopped before any job: an empty one writes the report
            result = run_job(env, args, out, launcher, inject=True, label="ftrun launch", stop=stop,
                             make_job=make_job)
    finally:
        launcher.close()
        if hosts is not None:
            hosts.teardown()
        if remote_jobs:
            from ftrun.launch.multihost import say_bye

            say_bye(remote_jobs)
    if result is None:  # stopped during the baseline: that run's partial report is the report
        result, base = base, None
    figures = job_figures(result, base, args=args,
                          start_method="spawn (fallback)" if getattr(launcher, "fallback_reason", None)
                          else args.start_method)
    figures["diagnosis"] = _diagnosis_figures(result.diagnosis)
    with open(os.path.join(result.out, "report.json"), "w") as f:
        json.dump({**figures, "diagnosis_report": result.diagnosis}, f, default=str)
    print_report(figures)
    if args.json:
        emit_json(figures)
    if stop.signal is not None:
        return stop.exit_code
    return 0 if figures["complete"] else 1


def _diagnosis_figures(report: dict | None) -> dict | None:
    """The diagnosis in the JSON figures: the evictions acted on, the monitor's notices (a notice for an
    incarnation already gone is not acted on), the last verdicts; report.json has it all."""
    if report is None:
        return None
    return {"rounds": report["rounds"], "evictions": report["evicted"], "eviction_notices": len(report["evictions"]),
            "verdicts": [{k: v[k] for k in ("t", "kind", "ranks", "silent", "reason")}
                         for v in report["verdicts"][-20:]],
            "telemetry_records": report["records"], "telemetry_serve_s": report["serve_s"],
            "graph": {"verdict": _brief(shown_verdict(report)), **graph_json(shown_verdict(report))}}


def _brief(v: dict | None) -> dict | None:
    return None if v is None else {k: v.get(k) for k in ("t", "kind", "reason", "ranks")}
