"""The replica tree collectives (check-in, commit vote) in the wait-for graph (part of the pure analysis).

A replica's current tree collective is the newest one any of its ranks entered. It is blocked when a rank
in it has waited `stall_s` (`silent_stall_s` when one of the replica's ranks did not answer). It waits on
every FTAR ring a missing rank is stuck in (an edge of the collective wait-for graph); a missing leader
waiting in its quorum ask waits on the lighthouse's round (an edge to "quorum for step S": it is behind
the replicas that round waits for, which are named on their own), not a culprit; other missing ranks in
no all-reduce are its own culprits (did not answer, or never joined). With nobody missing, the rank-level
graph of the tree: a rank that entered and whose children have all sent up, but has not sent itself,
joined without progress.
"""

from __future__ import annotations

import numpy as np

from ftrun.diagnose.model import AnalysisConfig, Layout, Snapshot
from ftrun.diagnose.summary import RUNNING
from ftrun.diagnose.telemetry import Ev

FANOUT = 16  # ftrun.replica.tree_comm.TreeComm's default


def per_replica_max(values: np.ndarray, replica: np.ndarray, mask: np.ndarray) -> np.ndarray:
    out = np.full(int(replica.max()) + 1 if len(replica) else 0, -1, np.int64)
    np.maximum.at(out, replica[mask], values[mask])
    return out


def blocked_trees(snap: Snapshot, layout: Layout, cfg: AnalysisConfig):
    """(replicas whose tree collective is blocked, their collective number, per-rank 'in it' mask)."""
    s, ans = snap.summary, snap.answered
    cid = s["t_cid"].astype(np.int64)
    cur = per_replica_max(cid, layout.replica, ans & (cid >= 0))
    in_seq = ans & (cid == cur[layout.replica]) & (cid >= 0)
    age = np.where(in_seq & (s["t_ev"] != Ev.DONE), snap.now - s["t_t"], -1.0)
    waiting = age >= cfg.stall_s
    if cfg.silent_stall < cfg.stall_s and not ans.all():  # a replica with a rank that did not answer
        silent_rep = np.zeros(int(layout.replica.max()) + 1, bool)
        silent_rep[layout.replica[~ans]] = True
        waiting |= (age >= cfg.silent_stall) & silent_rep[layout.replica]
    replicas = np.unique(layout.replica[waiting])
    return replicas, cur, in_seq


def edges_and_culprits(snap, layout, cfg, ring_blocked: np.ndarray):
    """Collective edges (tree -> ftar ring or -> rank) and the tree-level culprits {rank: why}.

    A missing rank inside an all-reduce, or in a blocked ring (`ring_blocked[g]`, a leaf of the ring
    analysis), makes an edge to that ring; the others are the tree's own culprits."""
    replicas, cur, in_seq = blocked_trees(snap, layout, cfg)
    if not replicas.size:
        return [], {}
    s = snap.summary
    in_blocked = snap.answered & (s["f_state"] == RUNNING) & (layout.ring_pos >= 0)  # inside an all-reduce
    if ring_blocked.size:
        in_blocked |= ring_blocked[layout.group] & (layout.ring_pos >= 0)
    of_blocked = np.isin(layout.replica, replicas)
    missing = of_blocked & ~in_seq
    asking = snap.answered & (s["q_ev"] == Ev.ENTER)  # behind the quorum round, not a culprit
    edges, culprits = [], {}
    for rep in replicas[:64]:
        name = f"tree collective {int(cur[rep])} of replica {int(rep)}"
        rings = np.unique(layout.group[missing & in_blocked & (layout.replica == rep)])
        edges += [(name, f"ftar ring {int(g)}") for g in rings[:8]]
        ask = np.flatnonzero(missing & ~in_blocked & asking & (layout.replica == rep))
        edges += [(name, f"quorum for step {int(s['q_step'][ask[0]])}")] if ask.size else []
    lone = np.flatnonzero(missing & ~in_blocked & ~asking)
    for r in lone:
        culprits[int(r)] = ("did not answer the collector while its replica's tree collective waits on it"
                            if not snap.answered[r] else
                            f"never joined tree collective {int(cur[layout.replica[r]])} of its replica")
    if not culprits and not edges:
        culprits = _no_progress(s, layout, of_blocked & in_seq)
    return edges, culprits


def _no_progress(s: np.ndarray, layout: Layout, members: np.ndarray) -> dict[int, str]:
    """Ranks in ENTER whose children (in the tree by group rank) have all sent up."""
    entered = members & (s["t_ev"] == Ev.ENTER)
    sent = members & np.isin(s["t_ev"], (Ev.SEND, Ev.RECV, Ev.DONE))
    width = int(layout.group.max()) + 1
    key = layout.replica.astype(np.int64) * width + layout.group
    order = np.argsort(key)
    has_parent = members & (layout.group > 0)
    parent_key = layout.replica.astype(np.int64) * width + (layout.group - 1) // FANOUT
    at = np.minimum(np.searchsorted(key[order], parent_key), len(order) - 1)
    parent = np.where(key[order][at] == parent_key, order[at], -1)
    has_parent &= parent >= 0
    kids = np.bincount(parent[has_parent], minlength=len(key))
    kids_sent = np.bincount(parent[has_parent & sent], minlength=len(key))
    stuck = np.flatnonzero(entered & (kids_sent == kids))
    return {int(r): "joined its tree collective without progress: every child sent up, it did not" for r in stuck}


def quorum_edges(snap: Snapshot, layout: Layout, cfg: AnalysisConfig) -> list[tuple[str, str]]:
    """Leaders waiting `stall_s` in a quorum ask wait on the replicas whose leader has not asked: on that
    replica's blocked tree collective, or on the replica itself."""
    s, ans = snap.summary, snap.answered
    leader = layout.group == 0
    asked = leader & ans & (s["q_ev"] == Ev.ENTER) & (snap.now - s["q_t"] >= cfg.stall_s)
    if not asked.any():
        return []
    step = int(s["q_step"][asked].max())
    name = f"quorum for step {step}"
    trees, cur, _ = blocked_trees(snap, layout, cfg)
    edges = []
    for r in np.flatnonzero(leader & ~(asked & (s["q_step"] == step)))[:64]:
        rep = int(layout.replica[r])
        if rep in trees:
            edges.append((name, f"tree collective {int(cur[rep])} of replica {rep}"))
        else:
            edges.append((name, f"replica {rep} ({'leader busy' if ans[r] else 'leader did not answer'})"))
    return edges
