"""report.png, the one picture of a job, real (`ftrun launch`) or emulated (`ftrun emulate`): both hand it the
same event dicts (the launch schema: "commit"/"step"/"metrics" from the ranks' leaders, "kill"/"restart"/"hang"/
"fault" from the supervisor, each with "t", "replica_id", "incarnation"; the emulator's Recorder converts to it,
harness.report_files.launch_schema).

    draw(events, path, *, title, diagnosis=None, baseline=None, time_label=...) -> path

Panels, on one time axis (seconds from the job's first event):
1. each replica's committed steps (orange: a step the replica caught up to rather than trained), its kills (red
   x), restarts (green >), hangs and host losses (purple v) and job-level faults (dotted lines);
2. replicas committing each step;
3. training loss (points) smoothed (a line) with the eval loss (squares: "eval_loss" or "val_loss" metrics), and
   the no-failure baseline's smoothed loss when there is one; kills as vertical lines;
4. with a diagnosis monitor's report: the verdict it last named something in, with its wait-for graph.
The title holds the job's settings (the caller's `title`).
"""

from __future__ import annotations

from typing import Any, Iterable

EVAL_KEYS = ("eval_loss", "val_loss")
SMOOTH_POINTS = 20  # the smoothed loss: a trailing mean over this many points


def _t0(events: list[dict]) -> float:
    return min((e["t"] for e in events if isinstance(e.get("t"), (int, float))), default=0.0)


def losses(events: Iterable[dict]) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(training, eval) loss points (t, loss) of rank-0 events: a committed, trained (not healed) "step" event's
    loss, a "metrics" event's loss; eval from a "metrics" event's eval_loss or val_loss."""
    train, ev = [], []
    for e in events:
        if e.get("rank", 0) != 0 or not isinstance(e.get("t"), (int, float)):
            continue
        if e.get("event") == "step" and e.get("committed") and not e.get("healed") and _num(e.get("loss")):
            train.append((e["t"], float(e["loss"])))
        elif e.get("event") == "metrics":
            if _num(e.get("loss")):
                train.append((e["t"], float(e["loss"])))
            for key in EVAL_KEYS:
                if _num(e.get(key)):
                    ev.append((e["t"], float(e[key])))
    return sorted(train), sorted(ev)


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def smooth(points: list[tuple[float, float]], n: int = SMOOTH_POINTS) -> list[tuple[float, float]]:
    """Trailing mean over n points."""
    out, total = [], 0.0
    for i, (t, y) in enumerate(points):
        total += y - (points[i - n][1] if i >= n else 0.0)
        out.append((t, total / min(i + 1, n)))
    return out


def lanes(events: Iterable[dict]) -> dict[str, Any]:
    """What panel 1 draws, pure: {"replicas": sorted ids, "steps": [(rid, t0, t1, healed)], "starting": [(rid, t0,
    t1)] (a restarted incarnation from its restart to its first quorum), "kills": [(rid, t)], "restarts": [(rid, t)],
    "hangs": [(rid, t)], "faults": [(t, what)], "commits": {step: count}} (times raw)."""
    replicas: set[str] = set()
    steps, starting, kills, restarts, hangs, faults = [], [], [], [], [], []
    restarted: dict[tuple[str, int], float] = {}
    commits: dict[int, int] = {}
    last: dict[tuple[str, int], float] = {}
    healed = {(e.get("replica_id"), e.get("to_step")) for e in events if e.get("event") == "heal"}
    for e in sorted((e for e in events if isinstance(e.get("t"), (int, float))), key=lambda e: e["t"]):
        rid, kind, t, inc = e.get("replica_id"), e.get("event"), e["t"], int(e.get("incarnation") or 0)
        if kind == "fault" or (kind in ("lighthouse_kill", "cut_start") and rid is None):
            faults.append((t, str(e.get("fault") or kind)))
        if not isinstance(rid, str):
            continue
        if kind in ("start", "restart", "ready", "quorum") and (rid, inc) not in last:
            last[(rid, inc)] = t
            if kind == "restart":
                restarted[(rid, inc)] = t
        if kind == "quorum" and (rid, inc) in restarted:
            starting.append((rid, restarted.pop((rid, inc)), t))
            last[(rid, inc)] = t
        if kind == "commit" and e.get("rank", 0) == 0 and isinstance(e.get("step"), int):
            replicas.add(rid)
            step = e["step"] - 1
            commits[step] = commits.get(step, 0) + 1
            steps.append((rid, last.get((rid, inc), t), t, (rid, step) in healed))
            last[(rid, inc)] = t
        elif kind == "kill":
            kills.append((rid, t))
        elif kind == "restart":
            restarts.append((rid, t))
        elif kind == "hang":
            hangs.append((rid, t))
    replicas |= {r for r, _ in kills + restarts + hangs}
    return {"replicas": sorted(replicas), "steps": steps, "starting": starting, "kills": kills, "restarts": restarts, "hangs": hangs,
            "faults": faults, "commits": commits}


def draw(events: list[dict], path: str, *, title: str, diagnosis: dict | None = None,
         baseline: list[dict] | None = None, time_label: str = "time (s, from the job's first event)") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ftrun.diagnose.graph import draw as draw_graph
    from ftrun.diagnose.graph import shown_verdict

    t0 = _t0(events)
    lane = lanes(events)
    y = {rid: i for i, rid in enumerate(lane["replicas"])}
    rows = 3 if diagnosis is None else 4
    fig, axes = plt.subplots(rows, 1, figsize=(11, 2.2 + 2.6 * rows),
                             gridspec_kw={"height_ratios": [max(2.0, 0.25 * len(y))] + [1.4] * (rows - 1)})
    ax = axes[0]
    for rid, a, b, healed in lane["steps"]:
        ax.plot([a - t0, b - t0], [y[rid]] * 2, color="tab:orange" if healed else "tab:blue", lw=6,
                solid_capstyle="butt")
        ax.plot([b - t0], [y[rid]], "|", color="white", ms=8)
    for rid, a, b in lane["starting"]:
        if rid in y:
            ax.plot([a - t0, b - t0], [y[rid]] * 2, color="tab:gray", lw=2, solid_capstyle="butt")
    for key, marker, color in (("kills", "x", "red"), ("restarts", ">", "green"), ("hangs", "v", "purple")):
        pts = [(t - t0, y[rid]) for rid, t in lane[key] if rid in y]
        if pts:
            ax.plot(*zip(*pts), marker, color=color, ms=9, mew=2, ls="none", label=key)
    for t, what in lane["faults"]:
        ax.axvline(t - t0, color="purple", ls=":", lw=1)
        ax.annotate(what[:40], (t - t0, len(y) - 0.5), fontsize=7, color="purple", rotation=90, va="top")
    ax.set_yticks(range(len(y)), list(y), fontsize=7 if len(y) > 16 else 9)
    ax.set_ylim(-0.7, max(len(y), 1) - 0.3)
    ax.set_xlabel(time_label)
    ax.set_title("committed steps per replica (blue; orange: caught up, not trained; grey: restarting, to its first "
                 "quorum); x kill, > restart, v hang / host loss", fontsize=9)
    if any(lane[k] for k in ("kills", "restarts", "hangs")):
        ax.legend(loc="lower right", fontsize=7)
    steps = sorted(lane["commits"])
    axes[1].step(steps, [lane["commits"][s] for s in steps], where="post")
    axes[1].set(title="replicas committing each step", xlabel="step", ylabel="replicas",
                ylim=(0, max(len(y), 1) + 0.5))
    ax = axes[2]
    train, evals = losses(events)
    if train or evals:
        if train:
            ax.plot([t - t0 for t, _ in train], [v for _, v in train], ".", ms=2, color="tab:red", alpha=0.4,
                    label="training loss")
            sm = smooth(train)
            ax.plot([t - t0 for t, _ in sm], [v for _, v in sm], color="tab:red", label="smoothed")
        if evals:
            ax.plot([t - t0 for t, _ in evals], [v for _, v in evals], "s", ms=5, color="black", label="eval loss")
        base = smooth(losses(baseline)[0]) if baseline else []
        if base:
            b0 = _t0(baseline or [])
            ax.plot([t - b0 for t, _ in base], [v for _, v in base], color="tab:blue", label="no failures (baseline)")
        for _, t in lane["kills"]:
            ax.axvline(t - t0, color="red", lw=0.8, alpha=0.5)
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no loss reported (the script logs none, or the compute is shape-only)", ha="center",
                va="center", transform=ax.transAxes)
    ax.set(title="loss", xlabel=time_label, ylabel="loss", xlim=axes[0].get_xlim())
    if diagnosis is not None:
        verdict = shown_verdict(diagnosis)
        draw_graph(axes[3], verdict)
        reason = str((verdict or {}).get("reason", ""))
        axes[3].set_title("diagnosis: no verdict" if not verdict else
                          f"diagnosis, last verdict naming something: {verdict.get('kind')}: "
                          + (reason if len(reason) <= 70 else reason[:69] + "\u2026"), fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
