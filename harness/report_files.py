"""The emulated job's files. The report picture and the Perfetto trace are the ones `ftrun launch` writes
(ftrun.launch.report_png, ftrun.launch.trace), from the same event dicts: `launch_schema` converts the
emulator's Recorder to them.

    write_all(out_dir, figures, recorder) -> [paths]

- report.png: ftrun.launch.report_png.draw (time axis, committed steps per replica, kills and restarts
  marked, loss when the compute reports one, the settings in the title), on modeled time.
- quorum_latency.png: the distribution of start_step times across all ranks and of get_quorum rounds, and
  where the replica leaders' time went (emulator-only figures).
- events.jsonl: the job's events in `ftrun launch`'s schema (launch_schema).
- trace.json: ftrun.launch.trace.write_trace (Perfetto), from events.jsonl as for a real job: one process per replica, one thread per incarnation,
  the leader's phase spans `ftrun::<component>::<op>`, kills, restarts and the lighthouse's quorum decisions.
- report.json: the figures.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ftrun.launch.report_png import draw as draw_report
from ftrun.launch.trace import write_trace
from harness.run.record import Recorder

CLOCK = "modeled (virtual) time of the emulator"


def launch_schema(rec: Recorder) -> tuple[list[dict], list[dict], dict | None]:
    """(events, lighthouse history, diagnosis) of an emulated job in `ftrun launch`'s schema: a replica's
    later starts are "restart" events, an injected kill says why="injected", the lighthouse's events
    (recorded as lighthouse_<event>) are its history, the root-cause verdicts ("diagnosis" events) the
    monitor's report."""
    events, history, verdicts = [], [], []
    for e in rec.events:
        kind = e["event"]
        if kind == "diagnosis":
            verdicts.append(e)
        elif kind.startswith("lighthouse_") and kind not in ("lighthouse_kill", "lighthouse_restart"):
            history.append({**e, "event": kind.removeprefix("lighthouse_")})
        elif kind == "start" and e.get("incarnation", 0) > 0:
            events.append({**e, "event": "restart"})
        elif kind == "kill":
            events.append({"why": "injected", **e})
        elif kind == "diagbench_scenario":  # a scored scenario of `ftrun diagnose bench`
            events.append({**e, "event": "fault", "fault": f"scored {e.get('place')}: {e.get('score')}"})
        else:
            events.append(e)
    return events, history, ({"verdicts": verdicts, "evictions": []} if verdicts else None)


def title(f: dict[str, Any]) -> str:
    """report.png's title for an emulated job: its settings and headline figures."""
    injected = "; ".join(f.get("injected") or []) or "no faults"
    eff = f.get("effective_training_time")
    return (f"ftrun emulate {f['profile']}: {f['replicas']} replicas x {f['ranks_per_replica']} ranks, "
            f"{f['steps']} steps, {injected}\nstall per failure {f.get('stall_per_failure_s')} s, rejoin stall "
            f"{f.get('rejoin_stall_s')} s" + (f", effective {100 * eff:.1f}%" if eff is not None else ""))


def plot(out: Path, f: dict[str, Any], rec: Recorder) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events, _, diagnosis = launch_schema(rec)
    paths = [Path(draw_report(events, str(out / "report.png"), title=title(f), diagnosis=diagnosis,
                              time_label="modeled time (s)"))]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ms = [1e3 * x for x in rec.start_step_s]
    axes[0].hist(ms, bins=60, log=True, color="tab:orange")
    axes[0].set_xlabel("start_step time per rank (ms, modeled)")
    axes[0].set_ylabel("rank-steps")
    rounds = [1e3 * x for x in rec.round_latencies_s()]
    axes[1].plot(sorted(rounds), marker="o", lw=1)
    axes[1].set_xlabel("quorum round (sorted)")
    axes[1].set_ylabel("get_quorum latency (ms, modeled)")
    axes[1].set_title(f"p50 {f['get_quorum_p50_ms']} ms, p99 {f['get_quorum_p99_ms']} ms")
    split = f["time_split"]
    axes[2].barh(list(split), [100 * v for v in split.values()], color="tab:gray")
    axes[2].set_xlabel("% of the replica leaders' time")
    fig.tight_layout()
    paths.append(out / "quorum_latency.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def write_all(out_dir: str | Path, f: dict[str, Any], rec: Recorder) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = plot(out, f, rec)
    events, history, diagnosis = launch_schema(rec)
    log = out / "events.jsonl"  # the job's events as `ftrun launch` writes them
    log.write_text("".join(json.dumps(e, default=str) + "\n" for e in events))
    trace = Path(write_trace(str(out), history, diagnosis, rec.spans, clock=CLOCK))
    report = out / "report.json"
    report.write_text(json.dumps(f, indent=1, sort_keys=True))
    return paths + [log, trace, report]
