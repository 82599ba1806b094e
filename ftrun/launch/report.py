"""Figures and plots of a supervised run, from its event log (commit/abort/quorum events of replica
leaders plus the supervisor's kill/restart events). Pure apart from writing the PNG."""

from __future__ import annotations

from collections import defaultdict


def summarize(log: list[dict], *, num_replicas: int, steps: int, wall_s: float,
              kill_interval_s: float | None) -> dict:
    commits = [e for e in log if e.get("event") == "commit"]
    by_step: dict[int, set[str]] = defaultdict(set)
    for e in commits:
        by_step[e["step"] - 1].add(e["replica_id"])
    reached = max(by_step) + 1 if by_step else 0
    replica_steps = sum(len(v) for v in by_step.values())
    kills = [e for e in log if e.get("event") == "kill"]
    downtime = _downtimes(log)
    step_times = _step_times(commits)
    t_step = sorted(step_times)[len(step_times) // 2] if step_times else 0.0
    figures = {
        "steps_reached": reached,
        "replica_steps_committed": replica_steps,
        "failed_commits": sum(1 for e in log if e.get("event") == "abort"),
        "kills": len(kills),
        "restarts": sum(1 for e in log if e.get("event") == "restart"),
        "step_efficiency": replica_steps / (num_replicas * reached) if reached else 0.0,
        "mean_downtime_s": sum(downtime) / len(downtime) if downtime else None,
        "median_step_s": t_step,
        "kill_interval_s": kill_interval_s,
        "theoretical_efficiency": None,
        "wall_s": wall_s,
        "complete": reached >= steps,
    }
    if kill_interval_s and downtime:
        d = figures["mean_downtime_s"]
        # A kill takes one of R replicas away for its downtime D, and the survivors lose the step that was
        # in flight (a failed commit): per interval T, D/R + t_step of the job's replica-time is lost.
        figures["theoretical_efficiency"] = max(0.0, 1.0 - d / (kill_interval_s * num_replicas) - t_step / kill_interval_s)
    return figures


def _downtimes(log: list[dict]) -> list[float]:
    """Kill -> first commit of that replica's next incarnation."""
    out, killed_at = [], {}
    for e in log:
        rid = e.get("replica_id")
        if e.get("event") == "kill":
            killed_at[rid] = e["t"]
        elif e.get("event") == "commit" and rid in killed_at and e.get("incarnation", 0) > 0:
            out.append(e["t"] - killed_at.pop(rid))
    return out


def _step_times(commits: list[dict]) -> list[float]:
    per_replica: dict[tuple, list[float]] = defaultdict(list)
    for e in commits:
        per_replica[(e["replica_id"], e.get("incarnation", 0))].append(e["t"])
    return [b - a for ts in per_replica.values() for a, b in zip(sorted(ts), sorted(ts)[1:])]


def write_plots(log: list[dict], path: str) -> str:
    """Participants per step, committed vs failed steps, loss vs tokens (when the script reports them)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    commits = [e for e in log if e.get("event") == "commit"]
    by_step: dict[int, int] = defaultdict(int)
    for e in commits:
        by_step[e["step"] - 1] += 1
    aborts: dict[int, int] = defaultdict(int)
    for e in log:
        if e.get("event") == "abort":
            aborts[e["step"]] += 1
    fig, axes = plt.subplots(3, 1, figsize=(9, 9))
    steps = sorted(by_step)
    axes[0].step(steps, [by_step[s] for s in steps], where="post")
    axes[0].set(title="replicas committing each step", xlabel="step", ylabel="replicas")
    axes[1].bar(steps, [by_step[s] for s in steps], label="committed", color="tab:green")
    axes[1].bar(sorted(aborts), [aborts[s] for s in sorted(aborts)], label="failed", color="tab:red")
    axes[1].set(title="committed vs failed replica-steps", xlabel="step")
    axes[1].legend()
    with_loss = [e for e in commits if "loss" in e]
    if with_loss:
        x = [e.get("tokens", e["step"]) for e in with_loss]
        axes[2].plot(x, [e["loss"] for e in with_loss], ".", markersize=3)
    else:
        axes[2].text(0.5, 0.5, "the script reported no loss", ha="center", va="center", transform=axes[2].transAxes)
    axes[2].set(title="loss", xlabel="tokens" if with_loss and "tokens" in with_loss[0] else "step", ylabel="loss")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
