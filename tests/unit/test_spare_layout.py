"""Cyclic Golomb rulers and the SPARe placement built on them."""

from __future__ import annotations

from itertools import combinations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.analysis.spare.golomb import OPTIMAL_RULERS, cyclic_golomb_ruler, is_cyclic_golomb
from harness.analysis.spare.layout import SpareLayout, block_replication_hosts

pytestmark = pytest.mark.timeout(60)

GRID = [(n, r) for n in (200, 600, 1000) for r in range(1, 13)]


@pytest.mark.parametrize("ruler, modulus, ok", [
    ((0, 1, 3), 7, True),          # the Fano plane's perfect difference set: every non-zero residue once
    ((0, 1, 3, 9), 13, True),      # perfect difference set modulo 13
    ((0, 1, 2), 100, False),       # 1 - 0 == 2 - 1
    ((0, 1, 4, 6), 12, False),     # linear Golomb ruler, but 6 - 0 == 0 - 6 (mod 12)
    ((0, 1, 4, 6), 13, True),      # 2 * 6 < 13: a linear ruler is cyclic
    ((0, 5), 10, False),           # 5 == -5 (mod 10)
    ((0,), 5, True),
])
def test_is_cyclic_golomb_table(ruler, modulus, ok):
    assert is_cyclic_golomb(ruler, modulus) is ok


def test_known_optimal_rulers_are_golomb():
    for order, ruler in OPTIMAL_RULERS.items():
        assert len(ruler) == order and ruler[0] == 0
        assert is_cyclic_golomb(ruler, 10 * max(ruler) + 1), order  # a huge modulus tests the linear ruler


@pytest.mark.parametrize("n, r", GRID)
def test_ruler_for_the_paper_grid(n, r):
    ruler = cyclic_golomb_ruler(r, n)
    assert len(ruler) == r and ruler[0] == 0
    assert is_cyclic_golomb(ruler, n)


@given(st.integers(2, 400), st.integers(1, 20))
@settings(derandomize=True, deadline=None, max_examples=150)
def test_ruler_search_returns_golomb_or_says_why(n, r):
    try:
        ruler = cyclic_golomb_ruler(r, n)
    except ValueError as err:
        assert "order" in str(err)
        return
    assert len(ruler) == r and is_cyclic_golomb(ruler, n)


@pytest.mark.parametrize("order, modulus", [(0, 10), (4, 12), (13, 100)])
def test_impossible_rulers_raise(order, modulus):
    with pytest.raises(ValueError):
        cyclic_golomb_ruler(order, modulus)


@pytest.mark.parametrize("n, r", [(7, 3), (13, 4), (50, 5), (200, 8), (200, 12), (1000, 12)])
def test_any_two_groups_share_at_most_one_type(n, r):
    layout = SpareLayout(num_groups=n, redundancy=r)
    type_sets = [set(row) for row in layout.types.tolist()]
    assert all(len(row) == r for row in type_sets)
    # Counting shared pairs beats N^2 set intersections: each type contributes C(r, 2) group pairs, and
    # no pair may be contributed twice.
    pairs = [pair for hosts in layout.hosts.tolist() for pair in combinations(sorted(hosts), 2)]
    assert len(pairs) == len(set(pairs)) == n * r * (r - 1) // 2
    if n <= 50:
        for a, b in combinations(range(n), 2):
            assert len(type_sets[a] & type_sets[b]) <= 1


@pytest.mark.parametrize("n, r", [(7, 3), (200, 8)])
def test_hosts_and_types_agree_and_initial_levels_cover_everything(n, r):
    layout = SpareLayout(num_groups=n, redundancy=r)
    for s in range(n):
        for g in layout.hosts[s]:
            assert s in layout.types[g]
    stacks = layout.initial_stacks()
    for level in range(r):
        assert sorted(stacks[:, level].tolist()) == list(range(n))  # each level alone covers every type
    stacks[0, 0] = -1
    assert layout.types[0, 0] != -1  # initial_stacks returns a copy


def test_layout_validation():
    with pytest.raises(ValueError, match="num_groups"):
        SpareLayout(num_groups=1, redundancy=1)
    with pytest.raises(ValueError, match="redundancy"):
        SpareLayout(num_groups=10, redundancy=11)
    with pytest.raises(ValueError, match="not a cyclic Golomb ruler"):
        SpareLayout(num_groups=10, redundancy=3, ruler=(0, 1, 2))


def test_wiped_types():
    layout = SpareLayout(num_groups=7, redundancy=3)  # type s on groups s, s+1, s+3
    alive = np.ones(7, dtype=bool)
    alive[[0, 1, 3]] = False
    assert layout.wiped_types(alive).tolist() == [0]


@pytest.mark.parametrize("n, r, widths", [(12, 3, {3}), (10, 3, {3, 4}), (5, 5, {5})])
def test_block_replication_hosts(n, r, widths):
    hosts = block_replication_hosts(n, r)
    blocks = {tuple(sorted(set(row))) for row in hosts.tolist()}
    assert {len(b) for b in blocks} == widths
    assert sorted(g for b in blocks for g in b) == list(range(n))  # blocks partition the groups
