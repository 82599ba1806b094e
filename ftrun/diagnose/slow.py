"""Slow ranks, hosts and links from the recent all-reduce history (part of the pure analysis).

Entry lag: for each recent all-reduce, how long after the first member of its ring a rank entered it.
A healthy rank's lag is noise; a slow rank (or every rank of a slow host) is late every step, so its
median lag over the last few steps stands out against the step period. Link: the time a rank's sends
spent on the wire (send busy time); the link to the next ring rank is slow when that is a multiple of
the median of comparable links, same all-reduce and size class (ftrun.diagnose.link: relative, no
absolute floor).

Per-ring reductions gather through the layout's ring table (groups x ring positions, computed once per
membership) instead of `ufunc.at` (ten times slower), and row medians sort the (ranks x HIST_LEN) matrix.
"""

from __future__ import annotations

import numpy as np

from ftrun.diagnose.link import row_median, slow_links
from ftrun.diagnose.model import (SLOW_HOST, SLOW_LINK, SLOW_RANK, AnalysisConfig, Layout, Snapshot,
                                  Verdict)


def find(snap: Snapshot, layout: Layout, cfg: AnalysisConfig) -> Verdict | None:
    h = snap.hist
    if h.ndim != 2 or h.shape[0] != len(layout.replica) or h.shape[1] == 0 or not layout.ring_table.size:
        return None
    ok, lag, period = _lags(snap, layout)
    enough = ok.sum(axis=1) >= cfg.slow_min_ops
    lag_med = np.where(enough, row_median(lag, ok), 0.0)
    slow = enough & (lag_med > max(cfg.slow_lag_frac * period, cfg.slow_min_lag_s))
    if slow.any():
        return _slow_verdict(np.flatnonzero(slow), lag_med, period, layout)
    return _slow_link(snap, layout, cfg, ok & enough[:, None])


def usual_lag_covers(r: int, snap: Snapshot, layout: Layout, cfg: AnalysisConfig) -> bool:
    """Whether rank r's ring has been waiting no longer than r's usual lag behind it (median over the
    recent all-reduces, times 1.5, plus stall_s): an alive rank that is always this late is slow, not hung."""
    table, h, s = layout.ring_table, snap.hist, snap.summary
    members = table[layout.group[r]]
    members = members[(members >= 0) & snap.answered[np.maximum(members, 0)]]
    key = (h["qid"][members].astype(np.int64) << 32) | h["cid"][members]
    same = (key == key[members == r]).all(axis=0) & (h["cid"][r] >= 0)
    if same.sum() < cfg.slow_min_ops:
        return False
    enter = h["enter"][members][:, same]
    lag = float(np.median(h["enter"][r][same] - enter.min(axis=0)))
    cur = (s["f_qid"][members].astype(np.int64) << 32) | s["f_cid"][members]
    entered = cur == cur.max()  # the members in the ring's current all-reduce
    waiting = snap.now - float(s["f_enter"][members][entered].min())
    return lag > cfg.slow_min_lag_s and waiting <= 1.5 * lag + cfg.stall_s


def _lags(snap, layout) -> tuple[np.ndarray, np.ndarray, float]:
    """(ok: the entry is this ring's op, lag behind the ring's first entry, median step period)."""
    h, table = snap.hist, layout.ring_table
    part = snap.answered & (layout.ring_pos >= 0)
    cid = np.ascontiguousarray(h["cid"])
    key = (np.ascontiguousarray(h["qid"]).astype(np.int64) << 32) | cid
    key[~part[:, None] | (cid < 0)] = -1
    full = layout.ring_full  # no holes: skip the masks (the common case, and the 98K benchmark's)
    cells = table if full else np.maximum(table, 0)
    ring_key = key[cells] if full else np.where((table >= 0)[:, :, None], key[cells], -1)  # (groups, pos, K)
    ref = ring_key.max(axis=1)  # (groups, K): the op each history column holds in this ring
    ok = (key >= 0) & (key == ref[layout.group])
    enter = (np.ascontiguousarray(h["enter"]) - snap.now).astype(np.float32)  # relative: float32 is exact enough
    at = np.where(ok, enter, np.float32(np.inf))[cells]
    first = (at if full else np.where((table >= 0)[:, :, None], at, np.inf)).min(axis=1)  # (groups, K)
    lag = enter - first[layout.group]
    with np.errstate(invalid="ignore"):
        d = np.diff(np.where(np.isfinite(first), first, np.nan), axis=1).ravel()
    d = d[np.isfinite(d)]
    period = float(np.median(d)) if d.size else float("inf")
    return ok, lag, period


def _slow_verdict(slow_ranks: np.ndarray, lag_med: np.ndarray, period: float, layout: Layout) -> Verdict:
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


def _slow_link(snap, layout, cfg, ok) -> Verdict | None:
    """The slowest ring link by the relative test (ftrun.diagnose.link): its transfers take at least
    link_factor x those of comparable links (same all-reduce, same size class), no absolute floor."""
    h = snap.hist
    sent, busy = np.ascontiguousarray(h["sent_bytes"]), np.ascontiguousarray(h["busy"])
    use = ok & (sent > 0) & (busy >= 0)
    if not use.any():
        return None
    key = (np.ascontiguousarray(h["qid"]).astype(np.int64) << 32) | np.ascontiguousarray(h["cid"])
    bad, ratio, extra = slow_links(key, sent, busy, use, factor=cfg.link_factor, min_ops=cfg.slow_min_ops)
    if not bad.any():
        return None
    a = int(np.argmax(np.where(bad, ratio, -np.inf)))
    table = layout.ring_table
    b = int(table[layout.group[a], (layout.ring_pos[a] + 1) % table.shape[1]])
    reason = (f"slow link {layout.rank_name(a)} -> {layout.rank_name(b)}: its sends take {float(ratio[a]):.1f}x the "
              f"median time of comparable links (same all-reduce and size)")
    ranks = (a, b) if b >= 0 else (a,)
    return Verdict(SLOW_LINK, reason, ranks, tuple(sorted({int(layout.host[r]) for r in ranks})),
                   tuple(sorted({int(layout.replica[r]) for r in ranks})), lag_s=max(float(extra[a]), 0.0))
