"""The reordering controller: phases, wipe-out detection, minimum-movement reordering."""

from __future__ import annotations

from itertools import combinations, permutations

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.analysis.spare.controller import covers_at_depth, decide, min_free_depth
from harness.analysis.spare.layout import SpareLayout

pytestmark = pytest.mark.timeout(60)

FANO = SpareLayout(num_groups=7, redundancy=3)  # ruler (0, 1, 3): type s on groups s, s+1, s+3


def alive_without(n: int, *failed: int) -> np.ndarray:
    alive = np.ones(n, dtype=bool)
    alive[list(failed)] = False
    return alive


def window_covers(stacks: np.ndarray, alive: np.ndarray, depth: int, n: int) -> bool:
    return set(stacks[alive, :depth].ravel().tolist()) == set(range(n))


# --- hand-checked cases on the Fano layout; initial stacks[g] = [g, g-1, g-3] mod 7 -------------------


def test_no_failure_keeps_everything():
    d = decide(FANO, FANO.initial_stacks(), alive_without(7), 1)
    assert (d.phase, d.depth, d.num_moved, d.wipe_out) == (0, 1, 0, False)


def test_first_failure_needs_depth_two_and_no_move():
    # Level 0 of groups 1..6 holds types 1..6 (type 0 is lost); level 1 holds 0..5, so depth 2 covers all
    # without touching a stack.
    d = decide(FANO, FANO.initial_stacks(), alive_without(7, 0), 1)
    assert (d.phase, d.depth, d.num_moved) == (2, 2, 0)
    assert np.array_equal(d.stacks, FANO.initial_stacks())


def test_second_failure_moves_exactly_one_slot():
    # Groups 0 and 1 down: type 0 (hosts 0, 1, 3) lives only on group 3, whose stack is [3, 2, 0] with 0
    # outside the depth-2 window. Depth 2 stays feasible (5 groups x 2 >= 7); one move brings 0 in.
    first = decide(FANO, FANO.initial_stacks(), alive_without(7, 0), 1)
    d = decide(FANO, first.stacks, alive_without(7, 0, 1), first.depth)
    assert (d.phase, d.depth, d.num_moved) == (2, 2, 1)
    assert 0 in d.stacks[3, :2]
    assert window_covers(d.stacks, alive_without(7, 0, 1), 2, 7)
    changed = np.argwhere(d.stacks[:, :2] != first.stacks[:, :2])
    assert changed.tolist() == [[3, int(np.flatnonzero(d.stacks[3, :2] == 0)[0])]]


def test_wipe_out_names_the_type():
    d = decide(FANO, FANO.initial_stacks(), alive_without(7, 0, 1, 3), 2)
    assert d.wipe_out and d.wiped_types == (0,) and d.phase == 1
    assert d.depth == 2 and np.array_equal(d.stacks, FANO.initial_stacks())
    everyone = decide(FANO, FANO.initial_stacks(), np.zeros(7, dtype=bool), 1)
    assert everyone.wipe_out and everyone.wiped_types == tuple(range(7))


def test_phase_zero_when_committed_depth_still_covers():
    # After group 0, groups 0 and 4 down: depth-2 windows [1,0] [2,1] [3,2] [5,4] [6,5] still hold 0..6,
    # so nothing moves and the failed step needs no patch compute.
    first = decide(FANO, FANO.initial_stacks(), alive_without(7, 0), 1)
    d = decide(FANO, first.stacks, alive_without(7, 0, 4), first.depth)
    assert (d.phase, d.depth, d.num_moved) == (0, 2, 0)
    assert d.stacks is first.stacks


def test_bad_arguments():
    with pytest.raises(ValueError):
        decide(FANO, FANO.initial_stacks(), alive_without(7), 0)
    with pytest.raises(ValueError):
        decide(FANO, FANO.initial_stacks()[:3], alive_without(7), 1)


# --- minimality against brute force over every stack order of every survivor -------------------------


def brute_force(layout: SpareLayout, stacks: np.ndarray, alive: np.ndarray) -> tuple[int | None, int | None]:
    """(least coverable depth, fewest window slots changed at that depth) over all survivors' orders."""
    n, r = layout.num_groups, layout.redundancy
    survivors = np.flatnonzero(alive)
    perms = [np.array(list(permutations(layout.types[g].tolist()))) for g in survivors]
    choice = np.indices([len(p) for p in perms]).reshape(len(perms), -1).T  # every combination
    for depth in range(1, r + 1):
        mask = np.zeros(len(choice), dtype=np.int64)
        moves = np.zeros(len(choice), dtype=np.int64)
        for i, g in enumerate(survivors):
            window = perms[i][choice[:, i], :depth]
            mask |= np.bitwise_or.reduce(np.left_shift(1, window), axis=1)
            moves += np.count_nonzero(window != stacks[g, :depth], axis=1)
        covered = mask == (1 << n) - 1
        if covered.any():
            return depth, int(moves[covered].min())
    return None, None


def failure_prefixes(n: int, max_failures: int):
    for size in range(1, max_failures + 1):
        yield from combinations(range(n), size)


# Brute force enumerates (r!)^survivors orders, so the layouts stay tiny.
# With r = 2, depth 2 is the whole stack, so nothing ever moves there.
@pytest.mark.parametrize("layout, max_failures, min_moved",
                         [(FANO, 3, 4), (SpareLayout(num_groups=8, redundancy=2), 4, 0)])
def test_depth_and_movement_are_minimal(layout, max_failures, min_moved):
    n = layout.num_groups
    checked = moved = 0
    for failed in failure_prefixes(n, max_failures):
        stacks, depth = layout.initial_stacks(), 1
        for k in range(1, len(failed) + 1):  # walk the controller through the failures in order
            alive = alive_without(n, *failed[:k])
            d = decide(layout, stacks, alive, depth)
            if d.wipe_out:
                assert brute_force(layout, stacks, alive) == (None, None)
                break
            if k == len(failed):
                best_depth, best_moves = brute_force(layout, stacks, alive)
                assert d.depth == max(depth, best_depth)
                if d.depth == best_depth:
                    assert d.num_moved == best_moves, (failed, d.reason)
                    checked += 1
                    moved += d.num_moved > 0
            stacks, depth = d.stacks, d.depth
    assert checked > 10 and moved >= min_moved  # the walk reaches cases that need reordering


def networkx_min_moves(layout: SpareLayout, stacks: np.ndarray, alive: np.ndarray, depth: int) -> int:
    """Min-cost max-flow source -> type -> (group, level) -> sink; keeping a type in place costs 0."""
    g = nx.DiGraph()
    for t in range(layout.num_groups):
        g.add_edge("s", ("t", t), capacity=1, weight=0)
        for h in layout.hosts[t]:
            if alive[h]:
                for j in range(depth):
                    g.add_edge(("t", t), ("slot", int(h), j), capacity=1, weight=int(stacks[h, j] != t))
                    g.add_edge(("slot", int(h), j), "z", capacity=1, weight=0)
    flow = nx.max_flow_min_cost(g, "s", "z")
    assert sum(flow["s"].values()) == layout.num_groups
    return int(nx.cost_of_flow(g, flow))


@pytest.mark.parametrize("n, r, seed", [(31, 5, 0), (40, 4, 1), (57, 6, 2)])
def test_movement_matches_networkx_min_cost_flow(n, r, seed):
    layout = SpareLayout(num_groups=n, redundancy=r)
    rng = np.random.default_rng(seed)
    stacks, depth, alive = layout.initial_stacks(), 1, np.ones(n, dtype=bool)
    compared = 0
    for group in rng.permutation(n):
        alive[group] = False
        d = decide(layout, stacks, alive, depth)
        if d.wipe_out:
            break
        if d.phase == 2:
            assert d.num_moved == networkx_min_moves(layout, stacks, alive, d.depth)
            compared += 1
        stacks, depth = d.stacks, d.depth
    assert compared >= 3


# --- wipe-out exactly when a type has no surviving host (property) ------------------------------------

LAYOUTS = [FANO, SpareLayout(num_groups=5, redundancy=1), SpareLayout(num_groups=13, redundancy=4), SpareLayout(num_groups=31, redundancy=5),
           SpareLayout(num_groups=50, redundancy=3)]


@st.composite
def controller_inputs(draw):
    layout = draw(st.sampled_from(LAYOUTS))
    n, r = layout.num_groups, layout.redundancy
    # Bias toward many failures so that wipe-outs and near-wipe-outs are common.
    p_fail = draw(st.floats(0.0, 0.9))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    alive = rng.random(n) >= p_fail
    stacks = np.array([rng.permutation(row) for row in layout.types])
    return layout, stacks, alive, draw(st.integers(1, r))


@given(controller_inputs())
@settings(derandomize=True, deadline=None, max_examples=300)
def test_wipe_out_reported_exactly_when_a_type_has_no_surviving_host(case):
    layout, stacks, alive, depth = case
    orphaned = [s for s in range(layout.num_groups) if not alive[layout.hosts[s]].any()]
    d = decide(layout, stacks, alive, depth)
    assert d.wipe_out == bool(orphaned)
    assert list(d.wiped_types) == orphaned
    if d.wipe_out:
        return
    assert window_covers(d.stacks, alive, d.depth, layout.num_groups)
    for g in range(layout.num_groups):
        assert sorted(d.stacks[g].tolist()) == sorted(layout.types[g].tolist())  # still a permutation
    assert np.array_equal(d.stacks[~alive], stacks[~alive])
    least, _ = min_free_depth(layout, alive)
    assert d.depth == max(depth, least)
    assert d.depth == depth or not covers_at_depth(layout, alive, d.depth - 1)
