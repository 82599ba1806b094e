"""Figures, the printed report and the PNG of a supervised run.

`summarize` turns a run's RunStats (and, when the workers write them, the exactly-once audit over every
replica's audit files) into the flat figures `ftrun launch --json` prints; `audit_figures` is the pure
part of the audit, `read_audit` the file part. report.png is ftrun.launch.report_png's picture (the same one
`ftrun emulate` draws), with the no-failure baseline's loss when there is one.
`job_figures` puts it together for a finished or stopped job (JobResult): it writes metrics.jsonl and
report.png and sets `complete` from checks.incomplete_reasons. A malformed audit file is an audit
problem (the job is incomplete), never a crash of the launcher.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from dataclasses import dataclass, field

from ftrun.data.audit import AuditReport, audit, read_log
from ftrun.data.loader_state import DataError, LoaderState
from ftrun.launch.checks import incomplete_reasons
from ftrun.launch.stats import RunStats, loss_at, loss_curve
from ftrun.launch.theory import FORMULA, realized_interval, theoretical_efficiency
from ftrun.launch.report_png import draw as draw_report
from ftrun.launch.trace import read_events, write_trace

LOSS_WINDOW_STEPS = 20  # the final loss is the mean over this many steps' worth of batches
MAX_ERRORS_SHOWN = 5  # distinct crash errors in the printed report (the JSON has up to MAX_ERRORS_KEPT)
MAX_ERRORS_KEPT = 50


@dataclass
class JobResult:
    stats: RunStats
    wall_s: float
    out: str
    goal: int  # the step the job was to end at
    stop_signal: str | None = None  # "SIGINT"/"SIGTERM" when a signal ended the job early
    timed_out: bool = False
    gave_up: list[dict] = field(default_factory=list)  # replicas in a crash loop, no longer restarted
    errors: list[dict] = field(default_factory=list)  # what crashed rank processes died of (CrashLog)
    warnings: list[str] = field(default_factory=list)  # kill options that never fired
    extra: dict = field(default_factory=dict)  # a job's own figures (--netns-hosts: hosts, shaping, faults)
    diagnosis: dict | None = None  # the diagnosis monitor's report (None: --no-diagnose)
    lighthouse_history: list[dict] = field(default_factory=list)  # its quorums and membership changes (trace.json)


def job_figures(result: JobResult, base: JobResult | None, *, args: argparse.Namespace, start_method: str) -> dict:
    """The figures of a finished (or stopped) job, with its metrics.jsonl and report.png written into its
    folder; `complete` only when incomplete_reasons finds nothing."""
    report = read_audit(result.out, final_state(result.stats))
    base_report = read_audit(base.out, final_state(base.stats)) if base else None
    figures = summarize(result.stats, wall_s=result.wall_s,
                        kill_interval_s=args.kill_every or args.kill_random_mean, report=report,
                        baseline=base.stats if base else None, baseline_report=base_report)
    write_metrics(result.stats, os.path.join(result.out, "metrics.jsonl"))
    figures["report_png"] = draw_report(read_events(os.path.join(result.out, "events.jsonl")),
                                        os.path.join(result.out, "report.png"), title=launch_title(figures, args),
                                        baseline=read_events(os.path.join(base.out, "events.jsonl")) if base else None,
                                        diagnosis=result.diagnosis)
    figures["trace"] = write_trace(result.out, result.lighthouse_history, result.diagnosis)
    if base is not None:
        figures["baseline_steps_reached"] = base.stats.max_step
        figures["baseline_replicas_identical"] = base.stats.replicas_identical
    figures.update(out=result.out, start_method=start_method, steps_goal=result.goal,
                   interrupted=result.stop_signal is not None, stop_signal=result.stop_signal,
                   timed_out=result.timed_out, gave_up=result.gave_up, errors=result.errors[:MAX_ERRORS_KEPT],
                   warnings=result.warnings, hosts=1)
    figures.update(result.extra)
    if "faults" in result.extra:  # host faults: one per fault, however many replicas it took out
        figures["failures_injected"] = sum(result.extra["faults"].values())
    figures["incomplete_reasons"] = incomplete_reasons(figures, goal=result.goal)
    figures["complete"] = not figures["incomplete_reasons"]
    return figures


def read_audit(run_dir: str, final: dict | None) -> AuditReport | None:
    """The exactly-once audit over run_dir/audit-*.jsonl for the final ledger; None without audit files."""
    paths = sorted(glob.glob(os.path.join(run_dir, "audit-*.jsonl")))
    if not paths:
        return None
    records, problems = [], []
    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        try:
            recs, probs = read_log(data, name=os.path.basename(path))
        except DataError as e:  # a malformed log is a finding of the audit, not a crash of the launcher
            recs, probs = [], [str(e)]
        records += recs
        problems += probs
    state = None
    if final and "loader_state" in final:
        try:
            state = LoaderState.from_dict(final["loader_state"])
        except DataError as e:
            problems.append(f"the final loader_state is unreadable: {e}")
    report = audit(records, final=state)
    if problems:
        report = AuditReport(report.trained, report.duplicates, report.gaps, report.problems + tuple(problems),
                             report.num_steps)
    return report


def audit_figures(report: AuditReport | None) -> dict:
    """duplicate/skipped batch counts and per-step batch counts; None values without an audit."""
    if report is None:
        return {"duplicate_batches": None, "skipped_batches": None, "audit_problems": None, "audit": "no audit files"}
    return {"duplicate_batches": len(report.duplicates), "skipped_batches": len(report.gaps),
            "audit_problems": len(report.problems), "batches_trained": len(report.trained),
            "audit": report.summary()}


def batches_per_step(report: AuditReport | None) -> dict[int, int] | None:
    if report is None:
        return None
    out: dict[int, int] = {}
    for t in report.trained:
        out[t.step] = out.get(t.step, 0) + 1
    return out


def final_state(stats: RunStats) -> dict | None:
    """The final event of the furthest replica (every replica ending at the job's step has the same)."""
    return max(stats.finals, key=lambda e: e.get("step", 0), default=None)


def summarize(stats: RunStats, *, wall_s: float, kill_interval_s: float | None,
              report: AuditReport | None, baseline: RunStats | None = None,
              baseline_report: AuditReport | None = None) -> dict:
    committed, total = stats.efficiency()
    downtime = [d.commit_after_s for d in stats.downtimes]
    mean_down = _mean(downtime)
    stall_s = sum(b - a for a, b in stats.stalls())
    window_s = (stats.last_t - stats.steady_t) if stats.steady_t is not None and stats.last_t is not None else 0.0
    stepping_down = _mean(stats.stepping_downtimes())
    stepping_interval = realized_interval(num_kills=stats.num_kills, window_s=window_s - stall_s)
    figures = {
        "steps_reached": stats.max_step, "steps_total": total, "steps_committed": committed,
        "step_efficiency": committed / total if total else 0.0,
        "failed_commits": sum(r.aborts for r in stats.rows.values()),
        "failures_injected": stats.num_kills, "events_after_kill": stats.events_after_kill, "crashes": stats.num_crashes, "restarts": stats.num_restarts,
        "replicas_identical": stats.replicas_identical, "identity_checks": stats.identity_checks,
        "user_state_identical": stats.user_state_identical, "user_state_checks": stats.user_state_checks,
        "divergences": [vars(d) for d in stats.divergences[:5]], "num_divergences": len(stats.divergences),
        "mean_downtime_s": mean_down, "stepping_downtime_s": stepping_down, "stall_s": stall_s,
        "stepping_kill_interval_s": stepping_interval,
        "mean_restart_s": _mean([d.ready_after_s for d in stats.downtimes if d.ready_after_s is not None]),
        "median_step_s": stats.step_period_s(), "kill_interval_s": kill_interval_s,
        "realized_kill_interval_s": realized_interval(num_kills=stats.num_kills, window_s=window_s),
        "theoretical_efficiency": None, "theory": FORMULA, "wall_s": wall_s,
        **audit_figures(report),
    }
    if stepping_interval and stepping_down is not None:
        figures["theoretical_efficiency"] = theoretical_efficiency(
            num_replicas=stats.num_replicas, kill_interval_s=stepping_interval, downtime_s=stepping_down)
    figures.update(_losses(stats, report, baseline, baseline_report))
    return figures


def _losses(stats: RunStats, report: AuditReport | None, baseline: RunStats | None,
            baseline_report: AuditReport | None) -> dict:
    curve = loss_curve(stats.rows, batches_per_step(report))
    if not curve:
        return {"final_loss": None, "baseline_final_loss": None, "batches_at_final_loss": None}
    batches, window = curve[-1][0], LOSS_WINDOW_STEPS * stats.num_replicas
    out = {"final_loss": loss_at(curve, batches, window), "batches_at_final_loss": batches,
           "loss_window_batches": window, "baseline_final_loss": None}
    if baseline is not None:
        base = loss_curve(baseline.rows, batches_per_step(baseline_report))
        out["baseline_final_loss"] = loss_at(base, batches, window)  # the same number of batches trained
        out["baseline_end_loss"] = loss_at(base, base[-1][0], window) if base else None
    return out


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def write_metrics(stats: RunStats, path: str) -> None:
    """One JSON line per step: replicas that committed it, failed commits, mean loss, batches, times."""
    with open(path, "w") as f:
        for step in sorted(stats.rows):
            f.write(json.dumps(stats.rows[step].as_json()) + "\n")


def print_report(f: dict) -> None:
    print("\nftrun launch report")
    print(f"  steps: {f['steps_reached']} reached; replica-steps {f['steps_committed']}/{f['steps_total']} committed "
          f"(steady part), {f['failed_commits']} failed commits; kills: {f['failures_injected']} injected, "
          f"{f['crashes']} crashes, {f['restarts']} restarts")
    print(f"  step efficiency (committed / total replica-steps): {f['step_efficiency']:.3f}")
    if f["theoretical_efficiency"] is not None:
        print(f"  theoretical for this kill rate:                   {f['theoretical_efficiency']:.3f}  "
              f"[{f['theory']}]")
        print(f"    D={f['stepping_downtime_s']:.2f}s (wall {f['mean_downtime_s']:.2f}s, of which restart "
              f"{f['mean_restart_s'] or 0:.2f}s), T={f['stepping_kill_interval_s']:.2f}s (wall "
              f"{f['realized_kill_interval_s']:.2f}s; nominal "
              f"{'-' if f['kill_interval_s'] is None else format(f['kill_interval_s'], '.2f') + 's'}), stalls "
              f"{f['stall_s']:.1f}s in all, t_step={f['median_step_s'] or 0:.3f}s")
    if f.get("user_state_identical") is not None:
        print(f"  identical registered state: {f['user_state_identical']} ({f['user_state_checks']} comparisons)")
    print(f"  identical state: {f['replicas_identical']} ({f['identity_checks']} param_hash comparisons); "
          f"audit: {f['audit']}; events after a kill: {f['events_after_kill']}")
    if f.get("final_loss") is not None:
        base = f.get("baseline_final_loss")
        print(f"  final loss {f['final_loss']:.4f} at {f['batches_at_final_loss']:.0f} batches"
              + (f"; no-failure baseline at the same batches {base:.4f}" if base is not None else ""))
    errors = f.get("errors", [])
    if len(errors) > MAX_ERRORS_SHOWN:
        print(f"  crashes: {len(errors)} distinct errors, the first {MAX_ERRORS_SHOWN}:")
    for e in errors[:MAX_ERRORS_SHOWN]:
        print(f"  crashes: {e['count']} x {e['error']} (first: {e['replica_id']} rank {e['rank']}, "
              f"incarnation {e['incarnation']}; its log: {f['out']}/logs/{e['replica_id']}.{e['incarnation']}."
              f"{e['rank']}.log)")
    for text in f.get("warnings", []):
        print(f"  warning: {text}")
    print(f"  per-step metrics: {f['out']}/metrics.jsonl; events: {f['out']}/events.jsonl; plots: {f['report_png']}"
          + (f"; trace (ui.perfetto.dev): {f['trace']}" if f.get("trace") else ""))
    print("  complete" if f["complete"] else f"  INCOMPLETE: {'; '.join(f['incomplete_reasons'])}")


def launch_title(figures: dict, args: argparse.Namespace) -> str:
    """report.png's title: the job's settings and its headline figures."""
    script = getattr(args, "script", "?")
    inject = "; ".join(f.describe() for f in getattr(args, "inject", None) or []) or None
    kills = (f"kill every {args.kill_every:g}s" if getattr(args, "kill_every", None) else
             f"kills at mean {args.kill_random_mean:g}s" if getattr(args, "kill_random_mean", None) else None)
    eff, arg = figures.get("step_efficiency"), lambda name: getattr(args, name, "?")  # noqa: E731
    delay = getattr(args, "restart_delay", None)
    parts = [f"ftrun launch {script}: {arg('replicas')} replicas x {arg('ranks_per_replica')} ranks, "
             f"{arg('steps')} steps", f"restart delay {delay:g}s" if delay is not None else None, inject, kills,
             f"{figures.get('steps_reached')} steps reached" + (f", step efficiency {eff:.2f}" if eff else "")]
    return "\n".join([", ".join(p for p in parts[:3] if p), ", ".join(p for p in parts[3:] if p)])


