"""The time-to-train sweep: every scheme at every redundancy, averaged over the profile's event trails.

CKPT-only is redundancy 1 of both replication and SPARe; FT-HSDP has no redundancy knob and is one row.
Pure (no I/O); the CLI prints and plots what `run_sweep` returns.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from harness.analysis.sim.profile import TttProfile
from harness.analysis.sim.ttt import RunResult, simulate, wipeout_interval_s


@dataclass(frozen=True, kw_only=True)
class SchemeSummary:
    """Mean over event trails of one (scheme, redundancy)."""

    scheme: str
    redundancy: int
    ttt_norm: float
    ttt_days: float
    availability: float
    theory_availability: float
    mean_depth: float
    num_wipeouts: float
    period_s: float
    finished: bool

    def as_dict(self) -> dict:
        return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in asdict(self).items()}


def summarize(runs: list[RunResult]) -> SchemeSummary:
    """Average runs of one (scheme, redundancy); unfinished runs make the TTT infinite."""
    finished = all(r.finished for r in runs)
    return SchemeSummary(
        scheme=runs[0].scheme, redundancy=runs[0].redundancy,
        ttt_norm=float(np.mean([r.ttt_norm for r in runs])) if finished else math.inf,
        ttt_days=float(np.mean([r.wall_s for r in runs])) / 86400.0 if finished else math.inf,
        availability=float(np.mean([r.availability for r in runs])),
        theory_availability=runs[0].theory_availability,
        mean_depth=float(np.mean([r.mean_depth for r in runs])),
        num_wipeouts=float(np.mean([r.num_wipeouts for r in runs])),
        period_s=runs[0].period_s, finished=finished,
    )


def run_cell(profile: TttProfile, scheme: str, redundancy: int) -> SchemeSummary:
    """All event trails of one (scheme, redundancy), sharing one Tf (and so one checkpoint period)."""
    tf = wipeout_interval_s(profile, scheme, redundancy)
    seeds = range(profile.seed, profile.seed + profile.sweep.num_seeds)
    return summarize([simulate(profile, scheme, redundancy, s, wipeout_interval=tf) for s in seeds])


@dataclass(frozen=True, kw_only=True)
class SweepResult:
    ckpt_only: SchemeSummary
    ft_hsdp: SchemeSummary
    rep: tuple[SchemeSummary, ...]
    spare: tuple[SchemeSummary, ...]

    def best(self, scheme: str) -> SchemeSummary:
        rows = self.rep if scheme == "rep" else self.spare
        return min(rows, key=lambda s: s.ttt_norm)

    def as_dict(self) -> dict:
        return {
            "ckpt_only": self.ckpt_only.as_dict(), "ft_hsdp": self.ft_hsdp.as_dict(),
            "rep": [s.as_dict() for s in self.rep], "spare": [s.as_dict() for s in self.spare],
            "best": {k: {"r": self.best(k).redundancy, "ttt_norm": self.best(k).ttt_norm} for k in ("rep", "spare")},
        }


def run_sweep(profile: TttProfile) -> SweepResult:
    """Every scheme of the profile's sweep; rows for redundancy 1 are the CKPT-only run."""
    ckpt = run_cell(profile, "ckpt_only", 1)
    rep, spare = [], []
    for r in profile.sweep.redundancies:
        rep.append(ckpt if r == 1 else run_cell(profile, "rep", r))
        spare.append(ckpt if r == 1 else run_cell(profile, "spare", r))
    return SweepResult(ckpt_only=ckpt, ft_hsdp=run_cell(profile, "ft_hsdp", 1), rep=tuple(rep), spare=tuple(spare))


def format_sweep(result: SweepResult, profile: TttProfile) -> str:
    """The readable table `ftrun sim ttt` prints."""
    f, s, h = profile.failures, profile.system, profile.ft_hsdp
    lines = [
        f"Time-to-train: {s.train_horizon_h:g} h failure-free, N = {s.num_groups} groups, MTBF {f.mtbf_s / 60:g} min "
        f"(Weibull shape {f.weibull_shape:g}), global restart {s.global_restart_s / 60:g} min, "
        f"{profile.sweep.num_seeds} event trail(s)",
        "TTT = wall time / failure-free time; avail = share of wall time computing work that was kept "
        "(sim / Eq. 2 theory); depth = mean stacks per step",
        f"{'r':>3} | {'Rep+CKPT TTT':>12} {'days':>6} {'avail':>13} | {'SPARe+CKPT TTT':>14} {'days':>6} "
        f"{'avail':>13} {'depth':>5}",
    ]
    for rep, spare in zip(result.rep, result.spare):
        lines.append(f"{rep.redundancy:>3} | {_ttt(rep):>12} {_days(rep):>6} {_avail(rep):>13} | "
                     f"{_ttt(spare):>14} {_days(spare):>6} {_avail(spare):>13} {spare.mean_depth:>5.2f}")
    c, ft = result.ckpt_only, result.ft_hsdp
    best_rep, best_spare = result.best("rep"), result.best("spare")
    lines += [
        f"CKPT-only: TTT {_ttt(c)} ({_days(c)} days), avail {_avail(c)}, checkpoint every {c.period_s:.0f} s",
        f"FT-HSDP ({h.num_replicas} replicas, stall {h.stall_per_failure_s + h.rejoin_stall_s:g} s/failure, "
        f"repair {h.repair_s / 60:g} min): TTT {_ttt(ft)} ({_days(ft)} days), effective training time "
        f"{1 / ft.ttt_norm:.1%} (closed form {ft.theory_availability:.1%})",
        f"best: Rep+CKPT r = {best_rep.redundancy} (TTT {_ttt(best_rep)}), "
        f"SPARe+CKPT r = {best_spare.redundancy} (TTT {_ttt(best_spare)})",
    ]
    return "\n".join(lines)


def _ttt(s: SchemeSummary) -> str:
    return f"{s.ttt_norm:.3f}" if s.finished else "unfinished"


def _days(s: SchemeSummary) -> str:
    return f"{s.ttt_days:.2f}" if s.finished else "-"


def _avail(s: SchemeSummary) -> str:
    return f"{s.availability:.1%} / {s.theory_availability:.1%}"
