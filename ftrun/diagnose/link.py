"""The relative slow-link test (pure: numpy only, part of the analysis).

A ring link is the path from a rank to its next ring rank; the history holds, per rank and per recent
all-reduce, the time the rank's sends on that link spent on the wire (`busy`) and the bytes they carried.
A link is slow when its transfer time is at least `factor` x the median of *comparable* links: the
transfers of the same all-reduce (the same (qid, cid) op key) in the same size class (bytes sent, by
power of two). Being relative, the test needs no absolute threshold: a 4x link is found whether a
transfer takes 40 us or 4 s. One noisy all-reduce does not make a link slow: the per-transfer ratios
are combined by their median over at least `min_ops` all-reduces. A class with fewer than `min_peers`
transfers is not compared (a median of two cannot tell which one is slow).
"""

from __future__ import annotations

import numpy as np


def size_class(sent_bytes: np.ndarray) -> np.ndarray:
    """Power-of-two class of each transfer's byte count (0 for anything under 2 bytes)."""
    b = np.maximum(np.asarray(sent_bytes, np.float64), 1.0)
    return np.floor(np.log2(b)).astype(np.int64)


def class_medians(key: np.ndarray, sent_bytes: np.ndarray, busy: np.ndarray, use: np.ndarray,
                  min_peers: int) -> np.ndarray:
    """Per cell: the median busy time of the comparable transfers (same op key, same size class) among
    the `use` cells; NaN where the cell is not used or its class has fewer than `min_peers` transfers.

    Column by column (a history column mostly holds one all-reduce of one size: one class, found with a
    min/max check), the classes pooled across columns, one median per class."""
    if not (key.shape == sent_bytes.shape == busy.shape == use.shape) or key.ndim != 2:
        raise ValueError(f"class_medians: key, sent_bytes, busy and use need one 2-d shape, got {key.shape}, "
                         f"{sent_bytes.shape}, {busy.shape}, {use.shape}")
    kt, st, bt, ut = (np.ascontiguousarray(a.T) for a in (key, sent_bytes, busy, use))  # column-major
    out = np.full(kt.shape, np.nan)
    groups: dict[tuple[int, int], list[tuple[int, np.ndarray | slice]]] = {}
    for j in range(kt.shape[0]):
        rows: np.ndarray | slice = slice(None) if ut[j].all() else np.flatnonzero(ut[j])
        kc, cc = kt[j, rows], size_class(st[j, rows])
        if not kc.size:
            continue
        if kc.min() == kc.max() and cc.min() == cc.max():  # the common case: one class in the column
            groups.setdefault((int(kc[0]), int(cc[0])), []).append((j, rows))
            continue
        idx = np.arange(kt.shape[1])[rows]
        pairs, inv = np.unique(np.stack([kc, cc], axis=1), axis=0, return_inverse=True)
        inv = inv.ravel()
        for i, (k, c) in enumerate(pairs):
            groups.setdefault((int(k), int(c)), []).append((j, idx[inv == i]))
    for parts in groups.values():
        vals = np.concatenate([bt[j, rows] for j, rows in parts])
        if vals.size >= min_peers:
            m = float(np.median(vals))
            for j, rows in parts:
                out[j, rows] = m
    return out.T


def slow_links(key: np.ndarray, sent_bytes: np.ndarray, busy: np.ndarray, use: np.ndarray, *, factor: float,
               min_ops: int, min_peers: int = 3) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(slow, ratio, extra) per rank (row). A rank's link is slow when it has at least `min_ops`
    comparable transfers and more than half of them took >= factor x their class median (its median
    ratio is >= factor, counted without sorting every row). For slow rows: `ratio`, the median over its
    comparable transfers of busy / class median, and `extra`, the median wire time its link adds per
    all-reduce (busy - class median); NaN and 0 elsewhere."""
    if factor <= 1 or min_ops < 1 or min_peers < 3:
        raise ValueError(f"slow_links: need factor > 1, min_ops >= 1, min_peers >= 3, got {factor}, {min_ops}, "
                         f"{min_peers}")
    med = class_medians(key, sent_bytes, busy, use, min_peers)
    with np.errstate(invalid="ignore"):
        comparable = med > 0  # NaN: not comparable
        n = comparable.sum(axis=1)
        over = (comparable & (busy >= factor * med)).sum(axis=1)
    slow = (n >= min_ops) & (2 * over > n)
    ratio, extra = np.full(len(key), np.nan), np.zeros(len(key))
    bad = np.flatnonzero(slow)
    if bad.size:
        c, m, b = comparable[bad], med[bad], busy[bad]
        ratio[bad] = row_median(b / np.where(c, m, 1.0), c)
        extra[bad] = row_median(b - np.where(c, m, 0.0), c)
    return slow, ratio, extra


def row_median(a: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Median of each row over its `valid` entries (NaN for a row with none)."""
    x = np.sort(np.where(valid, a, np.inf), axis=1)
    n = valid.sum(axis=1)
    lo = np.take_along_axis(x, np.maximum((n - 1) // 2, 0)[:, None], axis=1)[:, 0]
    hi = np.take_along_axis(x, np.maximum(n // 2, 0)[:, None], axis=1)[:, 0]
    with np.errstate(invalid="ignore"):
        return np.where(n > 0, (lo + hi) / 2, np.nan)
