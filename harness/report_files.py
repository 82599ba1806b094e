"""The emulated job's files: PNG plots (matplotlib, Agg) and a Chrome / Perfetto trace.

    write_all(out_dir, figures, recorder) -> [paths]

- timeline.png: each replica's committed steps over modeled time, with kills and restarts marked;
  participants per step; where the leaders' time went.
- quorum_latency.png: the distribution of start_step times across all ranks and of get_quorum rounds.
- trace.json: Chrome trace-event JSON (open in https://ui.perfetto.dev or chrome://tracing). One process
  per replica, one thread per incarnation, the leader's phase spans `ftrun::<component>::<op>`;
  kills, restarts and the lighthouse's quorum decisions as instant events.
- report.json: the figures.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness.run.record import Recorder

_US = 1e6


def chrome_trace(rec: Recorder) -> dict[str, Any]:
    events: list[dict[str, Any]] = []
    pids: dict[str, int] = {"lighthouse": 0, "job": 1}

    def pid(replica_id: str) -> int:
        if replica_id not in pids:
            pids[replica_id] = len(pids)
        return pids[replica_id]

    for replica_id, inc, name, t0, t1 in rec.spans or []:
        events.append({"name": name, "cat": name.split("::")[1], "ph": "X", "pid": pid(replica_id), "tid": inc,
                       "ts": round(t0 * _US, 3), "dur": round((t1 - t0) * _US, 3)})
    for e in rec.events:
        kind = e["event"]
        if kind in ("kill", "start", "noticed", "allocated", "failed", "teardown", "no_capacity"):
            events.append({"name": f"ftrun::job::{kind}", "cat": "job", "ph": "i", "s": "p",
                           "pid": pid(e["replica_id"]), "tid": e.get("incarnation", 0), "ts": round(e["t"] * _US, 3),
                           "args": {k: v for k, v in e.items() if k not in ("t", "event")}})
        elif kind in ("diagnosis", "scenario_fault", "diagbench_scenario"):  # root-cause verdicts and faults
            events.append({"name": f"ftrun::diagnose::{kind}", "cat": "diagnose", "ph": "i", "s": "g",
                           "pid": pid("job"), "tid": 0, "ts": round(e["t"] * _US, 3),
                           "args": {k: v for k, v in e.items() if k not in ("t", "event")}})
        elif kind.startswith("lighthouse_"):
            args = {k: v for k, v in e.items() if k not in ("t", "event")}
            events.append({"name": f"ftrun::quorum::{kind.removeprefix('lighthouse_')}", "cat": "quorum",
                           "ph": "i", "s": "p", "pid": 0, "tid": 0, "ts": round(e["t"] * _US, 3), "args": args})
    for name, p in pids.items():
        label = name if name in ("lighthouse", "job") else f"replica {name}"
        events.append({"name": "process_name", "ph": "M", "pid": p, "args": {"name": label}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": p, "args": {"sort_index": p}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"clock": "modeled (virtual) time of the emulator"}}


def plot(out: Path, f: dict[str, Any], rec: Recorder) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, axes = plt.subplots(3, 1, figsize=(11, 10), gridspec_kw={"height_ratios": [3, 1.2, 1]})
    ax = axes[0]
    lanes = sorted({e["replica_id"] for e in rec.events if "replica_id" in e and e["event"] == "commit"})
    y = {rid: i for i, rid in enumerate(lanes)}
    last: dict[tuple[str, int], float] = {}
    healed = {(e["replica_id"], e["to_step"]) for e in rec.events if e["event"] == "heal"}
    starting: set[tuple] = set()  # incarnations between their start and their first quorum
    for e in rec.events:
        key = (e.get("replica_id"), e.get("incarnation"))
        if e["event"] == "start":
            last[key] = e["t"]
            if e["incarnation"] > 0 and e["replica_id"] in y:
                starting.add(key)
                ax.plot([e["t"]], [y[e["replica_id"]]], ">", color="green", ms=8)
        elif e["event"] == "quorum" and key in starting and e["replica_id"] in y:
            starting.discard(key)  # process start, warm-up and check-in: a thin grey line
            ax.plot([last[key], e["t"]], [y[e["replica_id"]]] * 2, color="tab:gray", lw=2, solid_capstyle="butt")
            last[key] = e["t"]
        elif e["event"] == "commit" and e["replica_id"] in y:
            t0 = last.get(key, e["t"])
            color = "tab:orange" if (e["replica_id"], e["step"] - 1) in healed else "tab:blue"
            ax.plot([t0, e["t"]], [y[e["replica_id"]]] * 2, color=color, lw=6, solid_capstyle="butt")
            ax.plot([e["t"]], [y[e["replica_id"]]], "|", color="white", ms=8)
            last[key] = e["t"]
        elif e["event"] == "kill" and e["replica_id"] in y:
            ax.plot([e["t"]], [y[e["replica_id"]]], "x", color="red", ms=10, mew=2)
    ax.set_yticks(range(len(lanes)), lanes, fontsize=7 if len(lanes) > 16 else 9)
    ax.set_xlabel("modeled time (s)\n[blue: committed steps, orange: caught-up (zero-gradient) step, "
                  "grey: restarting (process start, warm-up, check-in), x: kill, >: restart]")
    ax.set_title(f"{f['profile']}: {f['replicas']} x {f['ranks_per_replica']} ranks; stall per failure "
                 f"{f['stall_per_failure_s']} s, rejoin stall {f['rejoin_stall_s']} s, effective "
                 f"{100 * f['effective_training_time']:.1f}%")
    axes[1].bar(range(len(f["participants_per_step"])), f["participants_per_step"], color="tab:blue")
    axes[1].set_xlabel("step")
    axes[1].set_ylabel("replicas committed")
    axes[1].set_ylim(0, f["replicas"] + 0.5)
    split = f["time_split"]
    axes[2].barh(list(split), [100 * v for v in split.values()], color="tab:gray")
    axes[2].set_xlabel("% of the replica leaders' time")
    fig.tight_layout()
    paths.append(out / "timeline.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ms = [1e3 * x for x in rec.start_step_s]
    axes[0].hist(ms, bins=60, log=True, color="tab:orange")
    axes[0].set_xlabel("start_step time per rank (ms, modeled)")
    axes[0].set_ylabel("rank-steps")
    rounds = [1e3 * x for x in rec.round_latencies_s()]
    axes[1].plot(sorted(rounds), marker="o", lw=1)
    axes[1].set_xlabel("quorum round (sorted)")
    axes[1].set_ylabel("get_quorum latency (ms, modeled)")
    axes[1].set_title(f"p50 {f['get_quorum_p50_ms']} ms, p99 {f['get_quorum_p99_ms']} ms")
    fig.tight_layout()
    paths.append(out / "quorum_latency.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def write_all(out_dir: str | Path, f: dict[str, Any], rec: Recorder) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = plot(out, f, rec)
    trace = out / "trace.json"
    trace.write_text(json.dumps(chrome_trace(rec)))
    report = out / "report.json"
    report.write_text(json.dumps(f, indent=1, sort_keys=True))
    return paths + [trace, report]
