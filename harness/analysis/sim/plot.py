"""PNG plot of a time-to-train sweep: normalized time-to-train and availability against redundancy r."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # headless: never open a window, whatever the user's default backend is

import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

from harness.analysis.sim.sweep import SweepResult  # noqa: E402


def plot_sweep(result: SweepResult, path: str, title: str = "") -> None:
    """Write a two-panel PNG to `path`. CKPT-only and FT-HSDP have no redundancy knob: horizontal lines."""
    fig, (ax_ttt, ax_av) = plt.subplots(1, 2, figsize=(11, 4.2))
    for rows, label, marker in ((result.rep, "Rep+CKPT", "s"), (result.spare, "SPARe+CKPT", "o")):
        done = [s for s in rows if s.finished]
        ax_ttt.plot([s.redundancy for s in done], [s.ttt_norm for s in done], marker=marker, label=label)
        ax_av.plot([s.redundancy for s in rows], [s.availability for s in rows], marker=marker, label=label)
        ax_av.plot([s.redundancy for s in rows], [s.theory_availability for s in rows], linestyle=":",
                   color=ax_av.lines[-1].get_color(), label=f"{label} (Eq. 2)")
    for summary, label, style in ((result.ckpt_only, "CKPT-only", "--"), (result.ft_hsdp, "FT-HSDP", "-.")):
        if summary.finished:
            ax_ttt.axhline(summary.ttt_norm, linestyle=style, color="gray" if style == "--" else "green", label=label)
        ax_av.axhline(summary.availability, linestyle=style, color="gray" if style == "--" else "green", label=label)
    ax_ttt.set(xlabel="redundancy r", ylabel="time-to-train / failure-free time", title="Time-to-train")
    ax_av.set(xlabel="redundancy r", ylabel="availability", title="Availability", ylim=(0, 1.02))
    for ax in (ax_ttt, ax_av):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
