"""The fetch plan: which source serves which shard. Pure, deterministic, no I/O.

`plan_fetch` spreads shards over the healthy sources balanced by bytes (largest shard first, each to the
source with the fewest bytes so far), and caps each source at ceil(num_shards / num_sources) shards, so
with equal shards every source serves the same number. While a fetch runs, `replan` moves the
unfinished shards of a source that died onto the survivors (keeping what each survivor already has, so
shards in flight stay where they are) and `reassign` moves one bad shard (checksum mismatch, short body)
to another source. `steal` is work stealing: a source that has finished its own shards takes about
half of the untouched shards of the source with the most bytes left (from the end of its list, which
that source fetches last), so a slow source holds up the fetch by at most the shard it has in flight.
Every plan carries a one-line reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Collection, Iterable, Sequence

from ftrun.catchup.manifest import ceil_div


@dataclass(frozen=True)
class FetchPlan:
    sizes: tuple[int, ...]  # bytes of each shard, by shard index
    assignment: tuple[tuple[str, tuple[int, ...]], ...]  # (source, its shards in fetch order), in source order
    reason: str

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(src for src, _ in self.assignment)

    @cached_property
    def _by_source(self) -> dict[str, tuple[int, ...]]:
        return dict(self.assignment)

    def shards_of(self, source: str) -> tuple[int, ...]:
        return self._by_source.get(source, ())  # steal asks for every source's, several times

    def source_of(self, shard: int) -> str | None:
        return next((src for src, shards in self.assignment if shard in shards), None)

    def bytes_of(self, source: str, done: Collection[int] = ()) -> int:
        return sum(self.sizes[i] for i in self.shards_of(source) if i not in done)


def plan_fetch(sizes: Sequence[int], sources: Sequence[str]) -> FetchPlan:
    """Assign every shard to one of `sources` (at least one, no duplicates)."""
    if not sources or len(set(sources)) != len(sources):
        raise ValueError(f"need at least one source and no duplicates, got {list(sources)}")
    if any(s < 0 for s in sizes):
        raise ValueError("shard sizes must be >= 0")
    cap = ceil_div(len(sizes), len(sources))
    assigned = _spread(sizes, range(len(sizes)), {src: [] for src in sources}, cap)
    reason = f"{len(sizes)} shards ({sum(sizes)} bytes) over {len(sources)} sources, at most {cap} each"
    return _plan(sizes, assigned, reason)


def replan(plan: FetchPlan, failed_source: str, done_shards: Collection[int]) -> FetchPlan:
    """Drop `failed_source`; its unfinished shards go to the survivors with the fewest outstanding bytes.

    Survivors keep their own shards (some may be in flight). With no survivor left the plan has no
    sources, and the unfinished shards can no longer be fetched.
    """
    orphans = [i for i in plan.shards_of(failed_source) if i not in done_shards]
    survivors = {src: [i for i in shards] for src, shards in plan.assignment if src != failed_source}
    if not survivors:
        return _plan(plan.sizes, {}, f"source {failed_source} failed and no source is left "
                                     f"for {len(orphans)} unfinished shards")
    num_left = len(orphans) + sum(1 for sh in survivors.values() for i in sh if i not in done_shards)
    cap = ceil_div(num_left, len(survivors))
    assigned = _spread(plan.sizes, orphans, survivors, cap, done_shards)
    return _plan(plan.sizes, assigned, f"source {failed_source} failed: {len(orphans)} unfinished shards "
                                       f"moved to {len(survivors)} remaining sources")


def reassign(plan: FetchPlan, shard: int, failed_source: str, done_shards: Collection[int]) -> FetchPlan:
    """Move one shard away from the source it failed on, to the other source with the fewest
    outstanding bytes; with no other source it stays (and is retried) where it is."""
    others = [src for src in plan.sources if src != failed_source]
    if not others:
        return _plan(plan.sizes, {s: list(sh) for s, sh in plan.assignment},
                     f"shard {shard} failed on {failed_source}, the only source: retry there")
    target = min(others, key=lambda s: (plan.bytes_of(s, done_shards), plan.sources.index(s)))
    assigned = {s: [i for i in sh if i != shard] for s, sh in plan.assignment}
    assigned[target].append(shard)
    return _plan(plan.sizes, assigned, f"shard {shard} failed on {failed_source}: retry from {target}")


def steal(plan: FetchPlan, thief: str, done: Collection[int], inflight: Collection[int]) -> FetchPlan | None:
    """`thief` has no shard left to start: give it the tail of the busiest other source's spare shards,
    about half of that source's untouched bytes (shards neither done nor in flight), at least one shard.

    A source with a shard in flight can spare all its untouched ones; one with none in flight (not
    started yet, or between two shards) keeps its first, so every source of a plan does some work.
    None when `thief` is not in the plan, still has a shard to start, or no other source has a spare
    shard (what is left is in flight: stealing it would fetch it twice).
    """
    if thief not in plan.sources or any(i not in done and i not in inflight for i in plan.shards_of(thief)):
        return None

    def untouched(src: str) -> list[int]:
        return [i for i in plan.shards_of(src) if i not in done and i not in inflight]

    def spare(src: str) -> list[int]:
        busy = any(i in inflight for i in plan.shards_of(src))
        return untouched(src) if busy else untouched(src)[1:]

    victims = [(sum(plan.sizes[i] for i in untouched(s)), len(untouched(s)), -k, s)
               for k, s in enumerate(plan.sources) if s != thief and spare(s)]
    if not victims:
        return None
    left, _, _, victim = max(victims)
    taken: list[int] = []
    for i in reversed(spare(victim)):
        if taken and 2 * sum(plan.sizes[j] for j in taken) >= left:
            break
        taken.append(i)
    assigned = {s: [i for i in sh if not (s == victim and i in taken)] for s, sh in plan.assignment}
    assigned[thief] += taken
    return _plan(plan.sizes, assigned, f"{thief} finished its shards and took {len(taken)} "
                                       f"({sum(plan.sizes[i] for i in taken)} bytes) from {victim}")


def _spread(sizes: Sequence[int], shards: Iterable[int], assigned: dict[str, list[int]], cap: int,
            done: Collection[int] = ()) -> dict[str, list[int]]:
    """Add `shards` to `assigned` largest first, each to the least-loaded source under `cap` outstanding
    shards (any source once all are at the cap)."""
    order = list(assigned)
    load = {s: sum(sizes[i] for i in sh if i not in done) for s, sh in assigned.items()}
    count = {s: sum(1 for i in sh if i not in done) for s, sh in assigned.items()}
    for i in sorted(shards, key=lambda i: (-sizes[i], i)):
        open_ = [s for s in order if count[s] < cap] or order
        target = min(open_, key=lambda s: (load[s], count[s], order.index(s)))
        assigned[target].append(i)
        load[target] += sizes[i]
        count[target] += 1
    return assigned


def _plan(sizes: Sequence[int], assigned: dict[str, list[int]], reason: str) -> FetchPlan:
    return FetchPlan(tuple(sizes), tuple((s, tuple(sorted(sh))) for s, sh in assigned.items()), reason)
