"""`ftrun emulate [PROFILE | SCRIPT.py] [--steps N] [--inject "kill replica=R step=S"] [--set key=value]
[--seed S] [--json] [--sweep ranks=1k,8k,32k,98k] [--out DIR] [--ftar-detail folded|full] [--comm tree|flat]`

Runs the real runtime for every emulated rank of a scale profile on the virtual-time engine (harness.run)
and prints a report (harness.report); `--out DIR` also writes PNG plots, a Chrome/Perfetto trace and
report.json. With no PROFILE: ci-small with its scripted replica kill and rejoin. `--json` prints the
figures as one JSON object last. `--sweep ranks=...` runs a short failure-free job at each total rank
count (ranks per replica varied, replicas as in the profile) and prints get_quorum latency against scale.
SCRIPT.py runs a training script unchanged under the shadow loader (`shadow.active(profile, session=...)`):
its `ft.train(...)` (or own loop's first `opt.step()`) runs the profile's job with the script's model, built
on meta, on every emulated rank (harness.script); `--profile P` names the profile (without a script,
`--profile P` is the same as PROFILE).

Determinism: the same seed gives the same events and report when CPU charging is off (ci-small's
default; `--cpu-charging off` for any profile). With charging on, the real CPU time of each task's slices
is charged to its emulated host, which is what exposes O(N) hot spots, and modeled times vary slightly
from run to run.
"""

from __future__ import annotations

import argparse
import gc
import logging
import resource
import runpy
import shlex
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ftrun.cli import UsageError, add_emulation_arguments, emit_json
from harness import report
from harness.profile import PROFILE_DIR, Profile, apply_overrides, load_profile
from harness.run import EmulatedJob, JobOptions, check_faults, faults_from_profile, parse_inject, split_faults

DEFAULT_PROFILE = "ci-small"
SWEEP_STEPS = 3


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("profile", nargs="?", default=None,
                   help=f"scale profile name or TOML path (default {DEFAULT_PROFILE}), or a training script .py")
    p.add_argument("--profile", dest="script_profile", default=None,
                   help="with SCRIPT.py: the profile whose job runs the script's training (and the torch.cuda shim "
                        f"follows; default {DEFAULT_PROFILE}); without one: the same as the PROFILE argument")
    p.add_argument("--script-args", default="", metavar='"--dim 4096 ..."',
                   help="with SCRIPT.py: its own command-line arguments (one string, split as a shell would)")
    p.add_argument("--steps", type=int, default=None, help="steps to train (default: the profile's)")
    p.add_argument("--inject", action="append", default=[], metavar='"kill replica=R step=S"',
                   help="fault to inject, in the one fault grammar of `ftrun launch --inject` and the profiles' "
                        "[failures] events (ftrun/faultspec.py: kill, kill lighthouse, hang, cut, slow host|link|"
                        "fetch, release); repeatable; replaces the profile's failure model")
    p.add_argument("--seed", type=int, default=None)
    add_emulation_arguments(p)
    p.add_argument("--comm", choices=("tree", "flat"), default="tree",
                   help="the replica's check-in / vote collectives: TreeComm or the naive FlatComm")
    p.add_argument("--wiring", choices=("auto", "connect", "prewired"), default="auto",
                   help="how replica trees are wired (auto: prewired above 4096 ranks per replica)")
    p.add_argument("--sweep", default=None, metavar="ranks=1k,8k,32k,98k")
    p.add_argument("--out", default=None, metavar="DIR", help="write PNG plots, trace.json and report.json here")
    p.add_argument("--diagnose", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                   help="root-cause telemetry on every rank and a collector beside the lighthouse, diagnosing every "
                        "SECONDS (default 2): verdicts in the report, report.json and trace.json")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true")


def build_profile(name: str | None, overrides: list[str], *, steps: int | None, cpu_charging: str | None) -> Profile:
    extra = list(overrides)
    if steps is not None:
        extra.append(f"train.steps={steps}")
    if cpu_charging is not None:
        extra.append(f"emulation.cpu_charging={'true' if cpu_charging == 'on' else 'false'}")
    name = name or DEFAULT_PROFILE
    try:
        return apply_overrides(load_profile(name), extra)
    except FileNotFoundError:
        known = ", ".join(sorted(p.stem for p in PROFILE_DIR.glob("*.toml")))
        raise UsageError(f"no scale profile {name!r} (known: {known}; or a path to a .toml file)") from None
    except (ValueError, tomllib.TOMLDecodeError) as e:
        raise UsageError(f"profile {name!r}: {e}") from None


def job_options(profile: Profile, args: argparse.Namespace, *, kills: tuple | None = None) -> JobOptions:
    seed = profile.seed if args.seed is None else args.seed
    faults: tuple = ()
    if kills is None:
        if args.inject:
            kills, faults = split_faults([parse_inject(t) for t in args.inject])
        else:  # the profile's failure model, over a generous horizon of modeled time
            horizon = 2 * profile.train.steps * profile.train.step_compute_s
            kills, faults = split_faults(faults_from_profile(profile, seed, horizon))
    wiring = args.wiring if args.wiring != "auto" else ("prewired" if profile.ranks_per_replica > 4096 else "connect")
    diagnose = getattr(args, "diagnose", None)
    if diagnose is not None and not diagnose > 0:
        raise UsageError(f"--diagnose SECONDS must be > 0, got {diagnose}")
    return JobOptions(steps=profile.train.steps, kills=kills, faults=faults, seed=seed, ftar_detail=args.ftar_detail,
                      fold_ranks=getattr(args, "fold_ranks", "auto"),
                      ftar_model=getattr(args, "ftar_model", "auto"), comm=args.comm, wiring=wiring, diagnose=diagnose is not None, diagnose_interval_s=diagnose)


def execute(profile: Profile, options: JobOptions, *, progress: bool = False, out: str | None = None,
            ) -> tuple[dict[str, Any], EmulatedJob]:
    """Run one emulated job; returns (figures, job). Figures include wall_s and peak_rss_mb."""
    gc.collect()
    started, cpu0 = time.monotonic(), time.process_time()
    job = EmulatedJob(profile, options)
    with tqdm(total=options.steps, desc=f"emulate {profile.name}", unit="step", file=sys.stderr,
              disable=not progress) as bar:
        def advance(step: int) -> None:
            bar.update(step - bar.n)
        rec = job.run(progress=advance)
    f = report.figures(rec, profile=profile, steps=options.steps, folded=job.folded, comm=options.comm,
                       kills=[k.describe() for k in options.injected])
    f.update(wall_s=round(time.monotonic() - started, 3), cpu_s=round(time.process_time() - cpu0, 3),
             peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
             engine=job.world.stats(), shape_propagations=job.shapes.num_propagations, **job.data_figures(),
             **job.folding())
    if job.diagnosis is not None:
        from harness.run.diagnosis import figures as diagnosis_figures

        f["diagnosis"] = diagnosis_figures(job.diagnosis, rec.events)
    if out is not None:
        from harness.report_files import write_all

        f["files"] = [str(p) for p in write_all(out, f, rec)]
    return f, job


def _quiet_runtime_logs(args: argparse.Namespace) -> int:
    """Thousands of ranks each logging their failed step would drown the report; the report sums them
    up. Keep WARNING-level runtime logs off unless a more verbose --log-level was asked for."""
    logger = logging.getLogger("ftrun")
    saved = logger.level
    if str(getattr(args, "log_level", "WARNING")).upper() in ("WARNING", "ERROR", "CRITICAL"):
        logger.setLevel(logging.ERROR)
    return saved


def run(args: argparse.Namespace) -> int:
    if args.profile is not None and args.profile.endswith(".py"):
        return run_script(args)
    if args.script_profile is not None:  # `--profile P` with no script: P is the profile (as in diagnose bench)
        if args.profile is not None:
            raise UsageError(f"two profiles given: {args.profile!r} and --profile {args.script_profile!r} "
                             "(--profile names a SCRIPT.py's profile, or the profile when no script is given)")
        args.profile = args.script_profile
    saved = _quiet_runtime_logs(args)
    try:
        if args.sweep:
            return run_sweep(args)
        profile = build_profile(args.profile, args.overrides, steps=args.steps, cpu_charging=args.cpu_charging)
        options = checked_job_options(profile, args)
        f, _ = execute(profile, options, progress=not args.no_progress, out=args.out)
    finally:
        logging.getLogger("ftrun").setLevel(saved)
    print(report.text(f))
    if "diagnosis" in f:
        d = f["diagnosis"]
        print(f"  diagnosis: {d['rounds']} collections, {d['non_clear_verdicts']} verdict(s) other than no hang, "
              f"analysis p50 {d['analysis_s_p50']} s, collection p50 {d['collect_s_p50']} modeled s, "
              f"{d['telemetry_bytes_per_rank']} telemetry bytes per rank")
        for v in [v for v in d["verdicts"] if v["kind"] != "no_hang"][:5]:
            print(f"    t={v['t']:.2f}s step {v['step']}: {v['kind']}: {v['reason'][:160]}")
    if args.out:
        print(f"  files: {', '.join(f['files'])}")
    if args.json:
        emit_json(f)
    return 0 if report.succeeded(f) else 1


def checked_job_options(profile: Profile, args: argparse.Namespace) -> JobOptions:
    """job_options, with its injected faults checked against the profile's places (SystemExit naming a bad
    --inject)."""
    options = job_options(profile, args)
    try:
        check_faults(options.injected, replicas=profile.replicas, ranks_per_replica=profile.ranks_per_replica,
                     buildings=profile.topology.buildings, hosts=_training_hosts(profile))
    except ValueError as e:
        raise SystemExit(f"ftrun emulate: --inject {e}") from None
    return options


def _training_hosts(profile: Profile) -> tuple[str, ...] | None:
    """The profile's training host names (for scenario faults' host places), or None without the inventory."""
    from harness.topology import Topology

    try:
        return Topology.from_profile(profile).training_hosts
    except Exception:
        return None


# -- sweep ---------------------------------------------------------------------------------------------

def parse_sweep(text: str) -> list[int]:
    """"ranks=1k,8k,32k,98k" -> total rank counts (k = 1000)."""
    key, sep, values = text.partition("=")
    if key.strip() != "ranks" or not sep:
        raise ValueError(f"--sweep {text!r}: expected ranks=N,N,... (e.g. ranks=1k,8k,32k,98k)")
    out = []
    for v in values.split(","):
        v = v.strip().lower()
        mult = 1000 if v.endswith("k") else 1
        try:
            out.append(int(float(v.rstrip("k")) * mult))
        except ValueError:
            raise ValueError(f"--sweep {text!r}: {v!r} is not a rank count") from None
    if not out or min(out) < 1:
        raise ValueError(f"--sweep {text!r}: need positive rank counts")
    return out


def sweep_layout(base: Profile, total_ranks: int) -> int:
    """Ranks per replica for about `total_ranks` in all: the profile's own layout when within 5%,
    else a whole number of hosts per replica."""
    if abs(base.num_ranks - total_ranks) <= 0.05 * total_ranks:
        return base.ranks_per_replica
    gpus = base.topology.gpus_per_host
    return max(gpus, round(total_ranks / base.replicas / gpus) * gpus)


def run_sweep(args: argparse.Namespace) -> int:
    base = build_profile(args.profile, args.overrides, steps=args.steps or SWEEP_STEPS, cpu_charging=args.cpu_charging)
    rows = []
    for total in parse_sweep(args.sweep):
        per = sweep_layout(base, total)
        hosts = -(-per // base.topology.gpus_per_host)
        t = base.topology
        racks = max(t.racks_per_zone, -(-base.replicas * hosts // (t.hosts_per_rack * t.zones_per_building * t.buildings)))
        profile = apply_overrides(base, [f"ranks_per_replica={per}", f"topology.racks_per_zone={racks}",
                                         "failures.mode=none"])
        f, _ = execute(profile, job_options(profile, args, kills=()), progress=not args.no_progress)
        rows.append({"ranks": f["ranks"], "ranks_per_replica": per, "get_quorum_p50_ms": f["get_quorum_p50_ms"],
                     "get_quorum_p99_ms": f["get_quorum_p99_ms"], "start_step_p50_ms": f["start_step_p50_ms"],
                     "leader_quorum_rtt_p50_ms": f["leader_quorum_rtt_p50_ms"], "wall_s": f["wall_s"],
                     "peak_rss_mb": f["peak_rss_mb"], "complete": f["complete"]})
        print(f"  {f['ranks']:>7} ranks ({base.replicas} x {per:>5}): get_quorum p50 {f['get_quorum_p50_ms']} ms, "
              f"p99 {f['get_quorum_p99_ms']} ms; start_step p50 {f['start_step_p50_ms']} ms; "
              f"wall {f['wall_s']:.1f} s (cpu {f['cpu_s']:.1f} s), peak RSS {f['peak_rss_mb']:.0f} MB", flush=True)
    if args.json:
        emit_json({"profile": base.name, "comm": args.comm, "steps": base.train.steps, "sweep": rows})
    return 0 if all(r["complete"] for r in rows) else 1


# -- a training script under the shadow loader ---------------------------------------------------------

def run_script(args: argparse.Namespace) -> int:
    """Run SCRIPT.py unchanged under the shadow loader; its train call runs the profile's emulated job
    (harness.script). Exit status: the job's (complete, consistent), or the script's own if it fails."""
    import shadow
    from harness.script import ScriptSession
    from mocks.train_api import launcher_environ

    profile = build_profile(args.script_profile, args.overrides, steps=args.steps, cpu_charging=args.cpu_charging)
    script = Path(args.profile)
    if not script.is_file():
        raise SystemExit(f"ftrun emulate: no such script {script}")
    checked_job_options(profile, args)  # the faults do not depend on the script's model: refuse a bad --inject first
    session = ScriptSession(profile, args, job_options=job_options, execute=execute)
    saved_argv, saved_level = sys.argv, _quiet_runtime_logs(args)
    try:
        script_args = shlex.split(args.script_args)
    except ValueError as e:
        raise SystemExit(f"ftrun emulate: --script-args {args.script_args!r}: {e}") from None
    sys.argv = [str(script), *script_args]
    code: Any = 0
    try:
        with shadow.active(profile, session=session, environ=launcher_environ(session)) as registry:
            print(f"ftrun emulate: running {script} under the shadow loader "
                  f"({', '.join(f'{k} -> {v}' for k, v in registry.modules.items())}; torch.cuda shimmed) "
                  f"at {profile.name}: {profile.replicas} x {profile.ranks_per_replica} ranks", file=sys.stderr)
            try:
                runpy.run_path(str(script), run_name="__main__")
            except SystemExit as e:
                if isinstance(e.code, str):
                    raise  # a message: the script (or the job it started) failed and said why
                code = e.code
    finally:
        sys.argv = saved_argv
        logging.getLogger("ftrun").setLevel(saved_level)
    if session.figures is None:  # it only imported and ran things under the shadow loader: its own exit status
        print(f"ftrun emulate: {script} started no training job (no ft.train, or no opt.step after job.wrap)",
              file=sys.stderr)
    session.report()
    if code not in (0, None):
        return code if isinstance(code, int) else 1
    return 0 if session.figures is None or session.ok() else 1
