"""Where SPARe's shard replicas live, and the groups' initial stack order.

Glossary (SPARe paper §3): N data-parallel *groups*, N shard *types* (one per group in plain data
parallelism). With redundancy r every type is hosted by r groups and every group hosts r types, which it
computes one after another: its *stack*. A group's stack order is a permutation of its r types;
level j of the stack is the j-th shard it computes in a step. The *all-reduce stack depth* K is how many
levels every surviving group computes before the gradient all-reduce; a step succeeds when the first K
levels of the surviving groups cover every type.

Pure; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from harness.analysis.spare.golomb import cyclic_golomb_ruler, is_cyclic_golomb


@dataclass(frozen=True, kw_only=True)
class SpareLayout:
    """Cyclic Golomb placement: type s lives on groups (s + d_k) mod N for the ruler marks d_k.

    Args:
        num_groups: N, the number of data-parallel groups (and shard types).
        redundancy: r, how many groups host each type.
        ruler: the marks d_0..d_{r-1}; found with `cyclic_golomb_ruler` when left empty.

    Raises:
        ValueError: N < 2, r < 1, r > N, or a given ruler that is not a cyclic Golomb ruler of order r.
    """

    num_groups: int
    redundancy: int
    ruler: tuple[int, ...] = ()
    hosts: np.ndarray = field(init=False, repr=False, compare=False)
    types: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_groups < 2:
            raise ValueError(f"num_groups must be >= 2, got {self.num_groups}")
        if not 1 <= self.redundancy <= self.num_groups:
            raise ValueError(f"redundancy must be in [1, num_groups], got {self.redundancy}")
        ruler = tuple(self.ruler) or cyclic_golomb_ruler(self.redundancy, self.num_groups)
        if len(ruler) != self.redundancy or not is_cyclic_golomb(ruler, self.num_groups):
            raise ValueError(
                f"ruler {ruler} is not a cyclic Golomb ruler of order {self.redundancy} mod {self.num_groups}")
        marks = np.asarray(ruler, dtype=np.int64)
        ids = np.arange(self.num_groups, dtype=np.int64)[:, None]
        object.__setattr__(self, "ruler", ruler)
        # hosts[s, k] = k-th group hosting type s; types[g, k] = type that group g computes at level k.
        object.__setattr__(self, "hosts", (ids + marks) % self.num_groups)
        object.__setattr__(self, "types", (ids - marks) % self.num_groups)

    def initial_stacks(self) -> np.ndarray:
        """Stack order at (re)start: group g computes type (g - d_k) mod N at level k.

        Level k across all groups is then the permutation g -> g - d_k of the types ("cyclic rotation"), so
        depth 1 covers every type while no group has failed. Returns a fresh (N, r) int64 array.
        """
        return self.types.copy()

    def wiped_types(self, alive: np.ndarray) -> np.ndarray:
        """Sorted ids of the types with no surviving host (`alive` is a bool mask over groups)."""
        return np.flatnonzero(~alive[self.hosts].any(axis=1))


def block_replication_hosts(num_groups: int, redundancy: int) -> np.ndarray:
    """Host sets of traditional replication: groups in blocks of r, every group of a block hosting the
    block's r types. When r does not divide N the remainder joins the last block.

    Returns an (N, w) array whose row s lists the hosts of type s (w = the largest block; shorter rows
    repeat their first host, which changes no max/any over the row).
    """
    if not 1 <= redundancy <= num_groups:
        raise ValueError(f"redundancy must be in [1, num_groups], got {redundancy}")
    num_blocks = num_groups // redundancy
    block_of = np.minimum(np.arange(num_groups) // redundancy, num_blocks - 1)
    width = num_groups - (num_blocks - 1) * redundancy
    rows = np.empty((num_groups, width), dtype=np.int64)
    for b in range(num_blocks):
        members = np.flatnonzero(block_of == b)
        padded = np.concatenate([members, np.full(width - members.size, members[0])])
        rows[members] = padded
    return rows
