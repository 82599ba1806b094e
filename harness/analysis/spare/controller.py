"""SPARe's reordering controller (ReCtlr, SPARe paper §3.2 and App. D), as a pure decision.

After a failure the controller is handed the committed stack order, the committed all-reduce stack depth
and the surviving groups, and decides in three phases:

- Phase 0 (HK-fixed): with the stacks as they are, do the first `depth` levels of the survivors still cover
  every type? A maximum bipartite matching (Hopcroft-Karp) between types and the survivors' slots
  (group, level < depth), each slot adjacent only to the type it holds. If it covers all N types, keep
  everything. (A failed phase 0 is also exactly the case where the failed step needs a patch compute.)
- Phase 1 (HK-free): the smallest depth K >= max(depth, ceil(N / survivors)) at which the survivors, each
  free to reorder its own stack, can cover every type: a matching between types and K copies of every
  surviving group, a type adjacent to the copies of its surviving hosts. None up to r means some type has
  no surviving host: a wipe-out, and the job must restart globally.
- Phase 2 (min-cost): among the stack orders that cover every type within K levels, one that changes the
  fewest slots (group, level < K): a minimum-cost assignment of types to slots (min-cost max-flow on the
  unit-capacity bipartite network), keeping a type where it already is costing nothing.

Graph algorithms come from scipy (Hopcroft-Karp and LAPJVsp, both compiled). Pure; no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.sparse import csr_array
from scipy.sparse.csgraph import maximum_bipartite_matching, min_weight_full_bipartite_matching

from harness.analysis.spare.layout import SpareLayout


@dataclass(frozen=True, kw_only=True)
class Decision:
    """What the controller decided.

    Attributes:
        wipe_out: some type has no surviving host; the job must restart globally.
        wiped_types: the types with no surviving host (empty unless wipe_out).
        depth: the all-reduce stack depth to commit (the committed one on phase 0 and on wipe-out).
        stacks: the (N, r) stack order to commit (the committed one on phase 0 and on wipe-out). Rows of
            failed groups are carried over unchanged.
        num_moved: slots (surviving group, level < depth) whose type changed.
        phase: 0 (committed order still covers), 2 (reordered), or 1 (wipe-out found in phase 1).
        reason: one line saying why.
    """

    wipe_out: bool
    wiped_types: tuple[int, ...]
    depth: int
    stacks: np.ndarray
    num_moved: int
    phase: int
    reason: str


def decide(layout: SpareLayout, stacks: np.ndarray, alive: np.ndarray, depth: int) -> Decision:
    """Run phases 0-2 for the survivors `alive` (bool mask over groups).

    Args:
        layout: the shard placement.
        stacks: committed (N, r) stack order; row g must be a permutation of layout.types[g].
        alive: bool mask of surviving groups.
        depth: committed all-reduce stack depth, 1 <= depth <= r.

    Raises:
        ValueError: shapes or depth out of range.
    """
    num_groups, r = layout.num_groups, layout.redundancy
    if stacks.shape != (num_groups, r) or alive.shape != (num_groups,):
        raise ValueError(f"stacks must be ({num_groups}, {r}) and alive ({num_groups},)")
    if not 1 <= depth <= r:
        raise ValueError(f"depth must be in [1, {r}], got {depth}")
    if _fixed_cover_size(stacks, alive, depth, num_groups) == num_groups:
        return Decision(wipe_out=False, wiped_types=(), depth=depth, stacks=stacks, num_moved=0, phase=0,
                        reason=f"phase 0: committed stacks still cover all {num_groups} types at depth {depth}")
    new_depth, unmatched = min_free_depth(layout, alive, start=depth)
    if new_depth is None:
        return Decision(wipe_out=True, wiped_types=tuple(int(t) for t in unmatched), depth=depth, stacks=stacks,
                        num_moved=0, phase=1,
                        reason=f"phase 1: wipe-out, {len(unmatched)} type(s) have no surviving host")
    new_stacks, moved = min_movement_reorder(layout, stacks, alive, new_depth)
    return Decision(wipe_out=False, wiped_types=(), depth=new_depth, stacks=new_stacks, num_moved=moved, phase=2,
                    reason=f"phase 2: depth {depth} -> {new_depth}, moved {moved} slot(s)")


def _fixed_cover_size(stacks: np.ndarray, alive: np.ndarray, depth: int, num_types: int) -> int:
    """Phase 0: size of a maximum matching between types and the survivors' first `depth` slots."""
    window = stacks[alive, :depth].ravel()
    graph = csr_array((np.ones(window.size, dtype=np.int8), (window, np.arange(window.size))),
                      shape=(num_types, window.size))
    return int(np.count_nonzero(maximum_bipartite_matching(graph, perm_type="column") >= 0))


def _free_graph(layout: SpareLayout, alive: np.ndarray, depth: int, weights: np.ndarray | None = None) -> csr_array:
    """Types x (surviving group, level < depth) graph; a type is adjacent to every slot of its live hosts.

    Column of slot (g, j) is rank(g) * depth + j, rank(g) being g's index among the survivors.
    `weights[s, k, j]`, if given, is the edge weight for host k of type s at level j.
    """
    rank = np.full(layout.num_groups, -1, dtype=np.int64)
    rank[alive] = np.arange(np.count_nonzero(alive))
    host_rank = rank[layout.hosts]  # (N, r); -1 where the host failed
    live = host_rank >= 0
    types, host_k = np.nonzero(live)
    cols = host_rank[types, host_k][:, None] * depth + np.arange(depth)[None, :]
    rows = np.repeat(types, depth)
    data = np.ones(rows.size, dtype=np.int8) if weights is None else weights[types, host_k].ravel()
    return csr_array((data, (rows, cols.ravel())), shape=(layout.num_groups, int(rank.max() + 1) * depth))


def min_free_depth(layout: SpareLayout, alive: np.ndarray, start: int = 1) -> tuple[int | None, np.ndarray]:
    """Phase 1: the least depth K >= start at which the survivors, reordering freely, cover every type.

    Returns (K, empty array), or (None, types left unmatched at K = r) on a wipe-out; at K = r every type
    with a surviving host can be matched (each group has a slot per type it hosts), so the unmatched types
    are exactly those without one.
    """
    num_alive = int(np.count_nonzero(alive))
    if num_alive == 0:
        return None, np.arange(layout.num_groups)
    lower = max(start, -(-layout.num_groups // num_alive))  # capacity bound: K * survivors >= N
    for k in range(min(lower, layout.redundancy), layout.redundancy + 1):
        match = _free_matching(layout, alive, k)
        if np.all(match >= 0):
            return k, np.empty(0, dtype=np.int64)
    return None, np.flatnonzero(match < 0)


def covers_at_depth(layout: SpareLayout, alive: np.ndarray, depth: int) -> bool:
    """True iff the survivors, reordering freely, can cover every type within `depth` levels."""
    if int(np.count_nonzero(alive)) * depth < layout.num_groups:
        return False
    return bool(np.all(_free_matching(layout, alive, depth) >= 0))


def _free_matching(layout: SpareLayout, alive: np.ndarray, depth: int) -> np.ndarray:
    """Hopcroft-Karp on the phase-1 graph: the slot matched to each type, -1 if none."""
    return maximum_bipartite_matching(_free_graph(layout, alive, depth), perm_type="column")


def min_movement_reorder(layout: SpareLayout, stacks: np.ndarray, alive: np.ndarray,
                         depth: int) -> tuple[np.ndarray, int]:
    """Phase 2: a stack order covering every type within `depth` levels of the survivors that changes the
    fewest window slots (surviving group, level < depth).

    Precondition: min_free_depth(layout, alive) <= depth (else ValueError from the assignment).
    Returns (new stacks, number of window slots whose type changed).
    """
    # weight[s, k, j] = 1 if host k of type s already holds s at level j, else 2: every full matching
    # has exactly N edges, so minimizing the sum minimizes the number of moved types (weights must be
    # non-zero for the sparse solver).
    holds = stacks[layout.hosts][:, :, :depth] == np.arange(layout.num_groups)[:, None, None]
    weights = np.where(holds, 1, 2).astype(np.int64)
    rows, cols = min_weight_full_bipartite_matching(_free_graph(layout, alive, depth, weights))
    survivors = np.flatnonzero(alive)
    groups, levels = survivors[cols // depth], cols % depth
    new = stacks.copy()
    changed = np.unique(groups[stacks[groups, levels] != rows])
    for g in changed:
        mine = groups == g
        new[g] = _rebuild_stack(stacks[g], rows[mine], levels[mine])
    moved = int(np.count_nonzero(new[survivors, :depth] != stacks[survivors, :depth]))
    return new, moved


def _rebuild_stack(old: np.ndarray, assigned_types: np.ndarray, assigned_levels: np.ndarray) -> np.ndarray:
    """One group's new order: assigned types at their levels, every other slot keeps its old type when that
    type is not placed elsewhere, and the leftover types fill the remaining slots in their old order."""
    new = np.full(old.size, -1, dtype=old.dtype)
    new[assigned_levels] = assigned_types
    placed = set(assigned_types.tolist())
    for j, t in enumerate(old.tolist()):
        if new[j] < 0 and t not in placed:
            new[j] = t
            placed.add(t)
    leftovers = [t for t in old.tolist() if t not in placed]
    new[new < 0] = leftovers
    return new
