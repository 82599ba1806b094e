"""Slow ranks, hosts and links from the recent all-reduce history (part of the pure analysis).

Entry lag: for each recent all-reduce, how long after the first member of its ring a rank entered it.
A healthy rank's lag is noise; a slow rank (or every rank of a slow host) is late every step, so its
median lag over the last few steps stands out against the step period. Link: the time a rank's sends
spent on the wire per byte (send busy time); the link to the next ring rank is slow when that is a
multiple of the job's median.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ftrun.diagnose.analysis import AnalysisConfig, Layout, Snapshot, Verdict


def _nanmedian(a: np.ndarray, axis: int | None = None):
    """np.nanmedian without the warning for rows that are all NaN (ranks outside the quorum)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmedian(a, axis=axis)


def find(snap: "Snapshot", layout: "Layout", cfg: "AnalysisConfig") -> "Verdict | None":
    h = snap.hist
    if h.ndim != 2 or h.shape[0] != len(layout.replica) or h.shape[1] == 0:
        return None
    ok, lag, period = _lags(snap, layout)
    enough = ok.sum(axis=1) >= cfg.slow_min_ops
    with np.errstate(invalid="ignore"):
        lag_med = _nanmedian(np.where(ok, lag, np.nan), axis=1) if enough.any() else np.zeros(len(ok))
    slow = enough & (lag_med > cfg.slow_lag_frac * period)
    if slow.any():
        return _slow_verdict(np.flatnonzero(slow), lag_med, period, layout)
    return _slow_link(snap, layout, cfg, ok, enough, period)


def _lags(snap, layout) -> tuple[np.ndarray, np.ndarray, float]:
    h, num_k = snap.hist, snap.hist.shape[1]
    part = snap.answered & (layout.ring_pos >= 0)
    key = (h["qid"].astype(np.int64) << 32) | (h["cid"].astype(np.int64) & 0xFFFFFFFF)
    valid = part[:, None] & (h["cid"] >= 0)
    key = np.where(valid, key, -1)
    num_groups = int(layout.group.max()) + 1
    cell = (layout.group[:, None] * num_k + np.arange(num_k)[None, :])
    ref = np.full(num_groups * num_k, -1, np.int64)
    np.maximum.at(ref, cell[valid], key[valid])
    ok = valid & (key == ref[cell])
    first = np.full(num_groups * num_k, np.inf)
    np.minimum.at(first, cell[ok], h["enter"][ok])
    lag = np.where(ok, h["enter"] - first[cell], 0.0)
    starts = first.reshape(num_groups, num_k)
    with np.errstate(invalid="ignore"):
        d = np.diff(np.where(np.isfinite(starts), starts, np.nan), axis=1)
        period = float(_nanmedian(d)) if np.isfinite(d).any() else float("inf")
    return ok, lag, period


def _slow_verdict(slow_ranks: np.ndarray, lag_med: np.ndarray, period: float, layout: "Layout") -> "Verdict":
    from ftrun.diagnose.analysis import SLOW_HOST, SLOW_RANK, Verdict
    hosts = layout.host[slow_ranks]
    uh, counts = np.unique(hosts, return_counts=True)
    per_host = np.bincount(layout.host[layout.ring_pos >= 0], minlength=int(uh.max()) + 1)[uh]
    whole = uh[counts * 2 >= per_host]
    worst = int(slow_ranks[np.argmax(lag_med[slow_ranks])])
    lag_ms, step_ms = 1e3 * float(lag_med[worst]), 1e3 * period
    ranks = tuple(int(r) for r in slow_ranks)
    reps = tuple(sorted({int(layout.replica[r]) for r in ranks}))
    if whole.size:
        names = ", ".join(layout.host_name(int(x)) for x in whole[:4])
        reason = (f"slow host {names}: its ranks enter the all-reduce a median {lag_ms:.0f} ms after their ring "
                  f"peers, every step (step {step_ms:.0f} ms)")
        return Verdict(SLOW_HOST, reason, ranks, tuple(int(x) for x in whole), reps, lag_s=lag_ms / 1e3)
    reason = (f"slow rank: {layout.rank_name(worst)} enters the all-reduce a median {lag_ms:.0f} ms after its ring "
              f"peers (step {step_ms:.0f} ms)")
    return Verdict(SLOW_RANK, reason, ranks, tuple(sorted({int(x) for x in hosts})), reps, lag_s=lag_ms / 1e3)


def _slow_link(snap, layout, cfg, ok, enough, period) -> "Verdict | None":
    from ftrun.diagnose.analysis import SLOW_LINK, Verdict, _ring_table
    h = snap.hist
    with np.errstate(invalid="ignore", divide="ignore"):
        per_byte = np.where(ok & (h["sent_bytes"] > 0), h["busy"] / h["sent_bytes"], np.nan)
        rate = _nanmedian(np.where(enough[:, None], per_byte, np.nan), axis=1)
        busy = _nanmedian(np.where(ok, h["busy"], np.nan), axis=1)
    if not np.isfinite(rate).any():
        return None
    typical = float(_nanmedian(rate))
    bad = np.isfinite(rate) & (rate > cfg.link_factor * typical) & (busy > cfg.slow_lag_frac * period)
    if not bad.any():
        return None
    a = int(np.nanargmax(np.where(bad, rate, np.nan)))
    table = _ring_table(layout)
    b = int(table[layout.group[a], (layout.ring_pos[a] + 1) % table.shape[1]])
    factor = float(rate[a] / typical) if typical > 0 else float("inf")
    reason = (f"slow link {layout.rank_name(a)} -> {layout.rank_name(b)}: its sends take {factor:.1f}x the "
              f"job's median time per byte")
    ranks = (a, b) if b >= 0 else (a,)
    extra = float(busy[a] - _nanmedian(busy))
    return Verdict(SLOW_LINK, reason, ranks, tuple(sorted({int(layout.host[r]) for r in ranks})),
                   tuple(sorted({int(layout.replica[r]) for r in ranks})), lag_s=max(extra, 0.0))
