"""Cyclic Golomb rulers: the offsets that place SPARe's shard replicas.

A set D = {d_0 < ... < d_{r-1}} of residues modulo N is a *cyclic Golomb ruler* of order r when the
r(r-1) differences d_i - d_j (i != j) are distinct and non-zero modulo N. SPARe puts shard s on the groups
(s + d_k) mod N; the ruler property is what makes any two groups share at most one shard type (group g
hosts s = g - d_k, and two types common to g and g' would give two equal differences), so the wipe-out of
one type says almost nothing about another.

Pure; no I/O.
"""

from __future__ import annotations

from itertools import combinations

# Optimal (shortest) Golomb rulers of order 2..14, the known marks from the literature. A ruler of length L
# is also cyclic modulo N whenever 2L < N (positive differences lie in [1, L], negative ones in [N-L, N-1]),
# and short rulers keep a shard's replicas on nearby groups. `is_cyclic_golomb` re-checks every use.
OPTIMAL_RULERS: dict[int, tuple[int, ...]] = {
    1: (0,),
    2: (0, 1),
    3: (0, 1, 3),
    4: (0, 1, 4, 6),
    5: (0, 1, 4, 9, 11),
    6: (0, 1, 4, 10, 12, 17),
    7: (0, 1, 4, 10, 18, 23, 25),
    8: (0, 1, 4, 9, 15, 22, 32, 34),
    9: (0, 1, 5, 12, 25, 27, 35, 41, 44),
    10: (0, 1, 6, 10, 23, 26, 34, 41, 53, 55),
    11: (0, 1, 4, 13, 28, 33, 47, 54, 64, 70, 72),
    12: (0, 2, 6, 24, 29, 40, 43, 55, 68, 75, 76, 85),
    13: (0, 2, 5, 25, 37, 43, 59, 70, 85, 89, 98, 99, 106),
    14: (0, 4, 6, 20, 35, 52, 59, 77, 78, 86, 89, 99, 122, 127),
}

# Nodes the fallback depth-first search may visit before giving up; the greedy first branch almost always
# succeeds when r(r-1) is well below N, so the budget only bounds pathological (N, r) pairs.
_SEARCH_BUDGET = 200_000


def is_cyclic_golomb(ruler: tuple[int, ...] | list[int], modulus: int) -> bool:
    """True iff all pairwise differences of `ruler` are distinct and non-zero modulo `modulus`."""
    diffs = [(a - b) % modulus for a, b in combinations(ruler, 2)]
    diffs += [(b - a) % modulus for a, b in combinations(ruler, 2)]
    return 0 not in diffs and len(set(diffs)) == len(diffs)


def cyclic_golomb_ruler(order: int, modulus: int) -> tuple[int, ...]:
    """A cyclic Golomb ruler of `order` marks modulo `modulus`, starting at 0.

    Uses the optimal ruler of that order when it is cyclic modulo `modulus`, otherwise a depth-first search
    that tries the smallest next mark first.

    Raises:
        ValueError: order < 1, or order*(order-1) > modulus-1 (not enough distinct non-zero residues for
            the differences), or the search budget ran out.
    """
    if order < 1:
        raise ValueError(f"order must be >= 1, got {order}")
    if order * (order - 1) > modulus - 1:
        raise ValueError(
            f"no cyclic Golomb ruler of order {order} modulo {modulus}: needs order*(order-1) <= modulus-1")
    known = OPTIMAL_RULERS.get(order)
    if known is not None and is_cyclic_golomb(known, modulus):
        return known
    found = _search(order, modulus)
    if found is None:
        raise ValueError(f"no cyclic Golomb ruler of order {order} modulo {modulus} found within the search budget")
    return found


def _search(order: int, modulus: int) -> tuple[int, ...] | None:
    """Depth-first search over increasing marks; None when the node budget is spent."""
    marks = [0]
    used: set[int] = set()
    budget = [_SEARCH_BUDGET]

    def extend(start: int) -> bool:
        if len(marks) == order:
            return True
        for x in range(start, modulus):
            budget[0] -= 1
            if budget[0] < 0:
                return False
            new = _new_differences(x, marks, used, modulus)
            if new is None:
                continue
            marks.append(x)
            used.update(new)
            if extend(x + 1):
                return True
            marks.pop()
            used.difference_update(new)
        return False

    return tuple(marks) if extend(1) else None


def _new_differences(x: int, marks: list[int], used: set[int], modulus: int) -> set[int] | None:
    """The differences mark `x` adds to `marks`, or None if one repeats a used (or another new) one."""
    new: set[int] = set()
    for m in marks:
        for d in ((x - m) % modulus, (m - x) % modulus):
            if d in used or d in new:
                return None
            new.add(d)
    return new
