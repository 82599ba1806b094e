"""Root cause: a pure function of the collected telemetry summaries (no I/O, no clock).

`analyze(snap, layout, config)` returns a `Verdict`. It builds the wait-for graph of collectives (a
replica's tree collective waits on the FTAR ring one of its ranks is stuck in); its leaves are the
collectives the job is blocked in. For each blocked FTAR ring it builds the rank-level wait-for graph:
a running rank with nothing to read waits on its previous ring rank, one whose send is stuck waits on
its next; following the edges ends at the culprit: a rank that did not answer the collector (hung or
dead), one that never joined the all-reduce, one that joined and has its input but made no progress,
or a pair (sender, receiver) when a chunk was sent but never received (the two cannot be told apart).
Without a hang, the lag of each rank's all-reduce entry behind its ring across recent steps names a
slow rank or host, and the send busy time of each ring link against comparable links a slow link.

The collective graph's edges (a replica's tree collective waits on an FTAR ring; a quorum ask waits on a
replica's tree collective) come with every hang verdict, for display. All work is vectorized over ranks
(numpy), so 98,304 ranks take well under a second.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ftrun.diagnose import slow, tree
from ftrun.diagnose.model import (CANDIDATES, HANG, NO_HANG, SLOW_HOST, SLOW_LINK, SLOW_RANK,  # noqa: F401
                                  AnalysisConfig, Layout, Snapshot, Verdict)
from ftrun.diagnose.summary import DONE, FAILED, RUNNING
from ftrun.diagnose.telemetry import Ev

# rank status inside a blocked ring
_UNKNOWN, _ABSENT, _RUN, _DONE, _FAILED = 0, 1, 2, 3, 4


def analyze(snap: Snapshot, layout: Layout, config: AnalysisConfig = AnalysisConfig()) -> Verdict:
    if len(snap.answered) != len(layout.replica) or len(snap.summary) != len(layout.replica):
        raise ValueError(f"snapshot has {len(snap.summary)} ranks, layout {len(layout.replica)}")
    if not len(layout.replica):
        return Verdict(NO_HANG, "no ranks to analyze")
    hang = _ftar_hang(snap, layout, config) or _tree_hang(snap, layout, config)
    if hang is not None:
        return dataclasses.replace(hang, edges=hang.edges + tuple(tree.quorum_edges(snap, layout, config)))
    return slow.find(snap, layout, config) or Verdict(NO_HANG, "no hang: every all-reduce is moving or done")


def _tree_hang(snap: Snapshot, layout: Layout, cfg: AnalysisConfig) -> Verdict | None:
    edges, culprits = tree.edges_and_culprits(snap, layout, cfg, np.zeros(0, bool))
    for r in [r for r in culprits if snap.answered[r] and slow.usual_lag_covers(r, snap, layout, cfg)]:
        del culprits[r]  # alive and as late as usual: slow, not hung
    if not culprits:
        return None
    reps = sorted({int(layout.replica[r]) for r in culprits})
    seq = tree.blocked_trees(snap, layout, cfg)[1]
    leaves = tuple(f"tree collective {int(seq[r])} of replica {r}" for r in reps[:8])
    ranks = sorted(culprits)
    reasons = [f"{layout.rank_name(r)} {culprits[r]}" for r in ranks[:2]]
    if len(ranks) > 2:
        reasons.append(f"and {len(ranks) - 2} more ranks")
    return dataclasses.replace(_named(HANG, set(ranks), layout, reasons, leaves), edges=tuple(edges))


def _with_tree_edges(v: Verdict, snap: Snapshot, layout: Layout, cfg: AnalysisConfig, rings) -> Verdict:
    """The collective wait-for graph above a blocked ring: which tree collectives wait on it."""
    blocked = np.zeros(int(layout.group.max()) + 1, bool)
    blocked[rings] = True
    edges, _ = tree.edges_and_culprits(snap, layout, cfg, blocked)
    return dataclasses.replace(v, edges=tuple(edges))


# -- FTAR rings ------------------------------------------------------------------------------------
def _status(snap: Snapshot, layout: Layout) -> tuple[np.ndarray, np.ndarray]:
    """Per rank: its status in its ring's all-reduces, and its own op key (-1 if it did not answer or has
    none); a ring's current op is its members' newest. A rank still running the all-reduce before its
    ring's current one counts as running: its ring peers finished that one and entered the next, and it
    waits in it (typically at its last receive, from a hung previous rank); it did not stay away."""
    s, ans = snap.summary, snap.answered
    key = (s["f_qid"].astype(np.int64) << 32) | (s["f_cid"].astype(np.int64) & 0xFFFFFFFF)
    key = np.where(ans & (s["f_qid"] >= 0), key, -1)
    table = layout.ring_table
    cur = np.where(table >= 0, key[np.maximum(table, 0)], -1).max(axis=1) if table.size else \
        np.full(layout.num_groups, -1, np.int64)
    incur = key == cur[layout.group]
    status = np.full(len(ans), _ABSENT, np.int8)
    status[~ans] = _UNKNOWN
    st = s["f_state"]
    status[(incur | (key >= 0)) & (st == RUNNING)] = _RUN
    status[incur & (st == DONE)] = _DONE
    status[incur & (st == FAILED)] = _FAILED
    return status, key


def _ftar_hang(snap: Snapshot, layout: Layout, cfg: AnalysisConfig) -> Verdict | None:
    status, key = _status(snap, layout)
    s = snap.summary
    age, part = snap.now - s["f_last"], layout.ring_pos >= 0
    stalled = (status == _RUN) & (age >= cfg.stall_s) & part
    if cfg.silent_stall < cfg.stall_s:  # a ring with a member that did not answer: blocked sooner
        silent_ring = np.zeros(layout.num_groups, bool)
        silent_ring[layout.group[(status == _UNKNOWN) & part]] = True
        stalled |= (status == _RUN) & (age >= cfg.silent_stall) & part & silent_ring[layout.group]
    failed = (status == _FAILED) & (layout.ring_pos >= 0)
    if not stalled.any() and not failed.any():
        return None
    table = layout.ring_table
    rings = np.unique(layout.group[stalled | failed])
    sub = table[rings]  # (B, N) global ranks
    st = np.where(sub >= 0, status[np.maximum(sub, 0)], _UNKNOWN)
    if failed.any() and not stalled.any():
        return _failed_rings(sub, st, snap, layout, rings)
    keys = np.where(sub >= 0, key[np.maximum(sub, 0)], -1)
    verdict = _verdict_from_leaves(_follow(sub, st, keys, s), sub, st, keys, snap, layout, rings, cfg)
    return None if verdict is None else _with_tree_edges(verdict, snap, layout, cfg, rings)


def _edges(sub: np.ndarray, st: np.ndarray, keys: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Offset (-1: waits on the previous ring rank, +1: on the next, 0: leaf) of every ring cell.

    A running rank holding a received chunk it has not used yet is working (a leaf if it is stalled),
    unless a send of its is stuck: then it waits for that slot back (the shared-memory transport frees a
    slot when the next rank acks it) on the next rank; one that has read everything its previous rank
    sent waits on it; one whose send is stuck waits on the next; a previous rank that did not answer, never
    joined, or is still in an earlier all-reduce (`keys`: each cell's op) is waited on. Counters are
    compared only within one all-reduce: a previous rank already past this one sent all of it."""
    r = np.maximum(sub, 0)
    prev = np.roll(r, 1, axis=1)
    prev_st, prev_key = np.roll(st, 1, axis=1), np.roll(keys, 1, axis=1)
    run = st == _RUN
    working = s["f_recvd"][r] > s["f_used"][r]
    nothing_to_read = s["f_sent"][prev] <= s["f_recvd"][r]
    prev_blocks = (prev_st == _UNKNOWN) | (prev_key < keys) | \
        ((prev_key == keys) & (prev_st == _RUN) & nothing_to_read)
    stuck_send = s["f_sends"][r] > s["f_sent"][r]
    off = np.zeros(st.shape, np.int64)
    off[run & stuck_send & (working | ~prev_blocks)] = 1  # working with a stuck send: waits for its slot back
    off[run & ~working & prev_blocks] = -1
    return off


def _follow(sub: np.ndarray, st: np.ndarray, keys: np.ndarray, s: np.ndarray) -> np.ndarray:
    """For every cell, the ring position its wait-for chain ends at (-1 if it ends in a cycle)."""
    off = _edges(sub, st, keys, s)
    n = sub.shape[1]
    pos = np.broadcast_to(np.arange(n), sub.shape).copy()
    rows = np.arange(sub.shape[0])[:, None]
    for _ in range(n):
        nxt = (pos + off[rows, pos]) % n
        if np.array_equal(nxt, pos):
            return pos
        pos = nxt
    return np.where(off[rows, pos] == 0, pos, -1)


def _verdict_from_leaves(leaves, sub, st, keys, snap, layout, rings, cfg) -> Verdict | None:
    """The verdict from the ends of the rank wait-for chains; None when the only culprits are alive ranks
    whose usual lag explains the wait (then the slow-rank analysis speaks)."""
    s, n = snap.summary, sub.shape[1]
    bs, ps = np.nonzero(st == _RUN)
    code = np.unique(bs.astype(np.int64) * (n + 1) + leaves[bs, ps] + 1)  # distinct (ring row, end position)
    ends = np.stack([code // (n + 1), code % (n + 1) - 1], axis=1)
    reasons: list[str] = []
    pairs: set[tuple[int, int]] = set()
    for b in ends[ends[:, 1] < 0, 0]:  # cycles: rare, each ring on its own
        cells = np.flatnonzero(st[b] == _RUN)
        old = int(cells[np.argmin(s["f_last"][sub[b, cells]])])
        pairs.add((int(sub[b, old]), int(sub[b, (old + 1) % n])))
        reasons.append(f"ring {int(rings[b])}: every rank waits on another (a cycle); the oldest progress is at "
                       f"{layout.rank_name(int(sub[b, old]))}")
    ends = ends[ends[:, 1] >= 0]
    r, kind = sub[ends[:, 0], ends[:, 1]], st[ends[:, 0], ends[:, 1]]
    prev = sub[ends[:, 0], (ends[:, 1] - 1) % n]
    k, pk = keys[ends[:, 0], ends[:, 1]], keys[ends[:, 0], (ends[:, 1] - 1) % n]
    unread = ((pk == k) & (s["f_sent"][prev] > s["f_recvd"][r])) | (pk > k)  # a previous rank past it sent it all
    in_flight = (kind == _RUN) & (s["f_recvd"][r] == s["f_used"][r]) & unread
    for a, b, g in zip(prev[in_flight][:3], r[in_flight][:3], rings[ends[in_flight, 0]][:3]):
        reasons.append(f"ring {int(g)}: {layout.rank_name(int(a))} sent chunk {int(s['f_recvd'][b]) + 1} but "
                       f"{layout.rank_name(int(b))} did not receive it (the link or either rank)")
    pairs.update(zip(prev[in_flight].tolist(), r[in_flight].tolist()))
    holes = ~in_flight & (r < 0)
    for b, p in ends[holes][:3]:
        reasons.append(f"ring {int(rings[b])}: position {int(p)} is waited on but no known rank holds it")
    culprits = dict(zip(r[~in_flight & ~holes].tolist(), kind[~in_flight & ~holes].tolist()))
    late = [x for x, c in culprits.items() if c != _UNKNOWN and slow.usual_lag_covers(x, snap, layout, cfg)]
    for x in late:  # alive, and as late as it always is: a slow rank (the history names it), not a hang
        del culprits[x]
    if late and not culprits and not pairs and not holes.any():
        return None
    leaves_c = tuple(f"ftar ring {int(g)}" for g in rings[:8]) + ((f"and {len(rings) - 8} more rings",) if len(rings) > 8 else ())
    if culprits:
        behind = set(sub[(keys >= 0) & (keys < keys.max(axis=1, keepdims=True))].tolist())
        return _named(HANG, set(culprits), layout, _culprit_reasons(culprits, snap, layout, behind), leaves_c)
    if holes.any() and not pairs:
        return _named(HANG, set(), layout, reasons, leaves_c)
    return _named(CANDIDATES, {x for pr in pairs for x in pr}, layout, reasons, leaves_c)


_GROUP_WHY = {_UNKNOWN: "did not answer the collector while their ring peers wait on them (hung or dead)",
              _ABSENT: "never joined the all-reduce", _RUN: "joined the all-reduce without progress"}


def _culprit_reasons(culprits: dict[int, int], snap: Snapshot, layout: Layout, behind: set[int]) -> list[str]:
    """One line per culprit, or per kind for many (a host or a building). `behind`: ranks still in the
    all-reduce before their ring's current one."""
    if len(culprits) <= 2:
        return [f"{layout.rank_name(r)} {_why(k, r, snap, r in behind)}" for r, k in sorted(culprits.items())]
    out = []
    for kind in sorted(set(culprits.values())):
        ranks = [r for r, k in culprits.items() if k == kind]
        hosts = sorted({int(layout.host[r]) for r in ranks})
        names = ", ".join(layout.host_name(h) for h in hosts[:4]) + (", ..." if len(hosts) > 4 else "")
        out.append(f"{len(ranks)} ranks on {len(hosts)} host(s) ({names}) {_GROUP_WHY[kind]}")
    return out


def _why(kind: int, r: int, snap: Snapshot, behind: bool = False) -> str:
    s = snap.summary[r]
    if kind == _UNKNOWN:
        return "did not answer the collector while its ring peers wait on it (hung or dead)"
    if kind == _ABSENT:
        where = f"it is in tree collective {int(s['t_cid'])}" if s["t_ev"] and s["t_ev"] != Ev.DONE else \
            "it is outside any collective (compute or data)"
        return f"never joined the all-reduce ({where})"
    where = " (still in the all-reduce before its ring's current one)" if behind else ""
    return (f"joined without progress{where}: has its input, no stuck send, no progress for "
            f"{snap.now - float(s['f_last']):.1f}s at chunk step {int(s['f_steps'])} of {int(s['f_total'])}")


def _failed_rings(sub, st, snap, layout, rings) -> Verdict:
    """A ring that aborted (a peer closed, or the lighthouse aborted a hung replica's quorum): the members that
    did not answer are the dead. Else the silent ranks of the replicas whose ranks failed: a replica whose
    rank (its leader's host) hung before its ring peers entered the all-reduce loses its heartbeat, the
    lighthouse aborts the quorum, the peers fail before they enter (they stay in the previous all-reduce)
    and only the replica's own live ranks enter and fail, in rings the silent ranks are not in. Else the
    pair around the rank that failed first."""
    dead = {int(r) for r in sub[(st == _UNKNOWN) & (sub >= 0)]}  # holes (-1) are not named
    leaves = tuple(f"ftar ring {int(g)}" for g in rings[:8]) + ((f"and {len(rings) - 8} more rings",) if len(rings) > 8 else ())
    if dead:
        names = ", ".join(layout.rank_name(r) for r in sorted(dead)[:3]) + (" ..." if len(dead) > 3 else "")
        return _named(HANG, dead, layout, [f"{names} died: did not answer and its ring aborted around it"], leaves)
    cells = sub[(st == _FAILED) & (sub >= 0)]
    silent = np.flatnonzero(~snap.answered & (layout.ring_pos >= 0) & np.isin(layout.replica, layout.replica[cells]))
    if silent.size:
        names = ", ".join(layout.rank_name(int(r)) for r in silent[:3]) + (" ..." if silent.size > 3 else "")
        return _named(HANG, set(silent.tolist()), layout,
                      [f"{names} did not answer; {len(np.unique(cells))} other ranks of their replica entered the "
                       f"all-reduce and it aborted before their ring peers joined (a hung replica's quorum aborted)"],
                      leaves)
    first = int(cells[np.argmin(snap.summary["f_last"][cells])])
    return _named(CANDIDATES, {first}, layout, [f"{layout.rank_name(first)} failed first; all answered"], leaves)


def _named(kind: str, ranks: set[int], layout: Layout, reasons: list[str], leaves: tuple[str, ...]) -> Verdict:
    rs = tuple(sorted(ranks))
    hosts = tuple(sorted({int(layout.host[r]) for r in rs}))
    reps = tuple(sorted({int(layout.replica[r]) for r in rs}))
    text = "; ".join(reasons[:3]) + (f"; and {len(reasons) - 3} more" if len(reasons) > 3 else "")
    return Verdict(kind, text, rs, hosts, reps, leaves)
