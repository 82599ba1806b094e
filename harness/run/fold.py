"""Folding identical rings: the emulator's seam objects for ranks that mirror a lead rank.

With ftar_detail = "folded", the rings of rank k in every replica are alike for all k (same
participants, same failures, same hop classes), so only the ranks of each replica's first host
(`num_leads` = gpus_per_host rings, which share that host's NIC as all rings do) run FTAR and catch-up
for real. Every rank still runs the real trainer (quorum, 2PC, the data ledger and the audit are
every rank's own), but rank k >= num_leads gets:

- `MirrorExchange` as its GradientExchange: `average` waits for lead `lead_of(k)`'s exchange of the
  same call and ends with it, at the same virtual time, raising the same kind of error;
- `MirrorCatchup` as its CatchupService: `fetch` waits for the lead's fetch and returns its result
  (the state it loads is the lead's shape-only state: the same names and sizes); publish/retire do
  nothing (nobody fetches from a mirror: the fetch plan's sources are the healthy replicas' same rank,
  and only leads are asked);
- zero-time compute (the lead's compute is inside the lead's exchange that the mirror waits for).

Leads wrap their real exchange and catch-up in `LeadExchange`/`LeadCatchup`, which post each outcome.
The zone links are scaled to the hosts that send (LinkModel.zone_share) so each represented host keeps
its share of the oversubscribed uplinks.

Under diagnose with rank folding the leads are two hosts (harness.run.job_fold): the first, where the
diagnose bench places every fault, and the second, a reference host that no fault touches and that every
other rank mirrors (`lead_of`); the diagnosis serves the ranks not run with their reference lead's
telemetry (harness.run.diag_mirror).
"""

from __future__ import annotations

from typing import Any, Sequence

from ftrun.env.base import EnvTimeout
from harness.run.catchup_forward import ForwardingCatchup


class Mirror:
    """One replica incarnation's lead outcomes, for the ranks that mirror them.

    A lead posts the outcome of its n-th call of a kind ("ftar", "heal"): (error or None, value).
    `poison` ends every later wait with an error (the lead is gone), so mirrors never wait for an
    outcome that cannot come.
    """

    def __init__(self, env: Any, num_leads: int, reference: int = 0) -> None:
        if not 0 <= reference < num_leads:
            raise ValueError(f"Mirror reference must be in 0..{num_leads - 1}, got {reference}")
        self._env, self.num_leads, self.reference = env, num_leads, reference
        self._results: dict[tuple, tuple[BaseException | None, Any]] = {}
        self._events: dict[tuple, Any] = {}
        self._poisoned: BaseException | None = None

    def _event(self, key: tuple) -> Any:
        ev = self._events.get(key)
        if ev is None:
            ev = self._events[key] = self._env.event()
        return ev

    def post(self, lead: int, kind: str, n: int, error: BaseException | None, value: Any = None) -> None:
        key = (lead, kind, n)
        self._results[key] = (error, value)
        self._event(key).set()
        self._events.pop((lead, kind, n - 2), None)  # mirrors are at most one call behind
        self._results.pop((lead, kind, n - 2), None)

    def poison(self, error: BaseException) -> None:
        self._poisoned = error
        for ev in list(self._events.values()):
            ev.set()

    def wait(self, rank: int, kind: str, n: int, timeout: float) -> Any:
        """The value lead `lead_of(rank)` posted for its n-th `kind`; raise what it raised."""
        key = (lead_of(rank, self.num_leads, self.reference), kind, n)
        if key not in self._results:
            if self._poisoned is None and not self._event(key).wait(timeout):
                raise EnvTimeout(f"lead rank {key[0]} posted no {kind} result within {timeout}s")
            if key not in self._results:
                raise _fresh(self._poisoned) if self._poisoned else EnvTimeout(f"lead rank {key[0]} is gone")
        error, value = self._results[key]
        if error is not None:
            raise _fresh(error)
        return value


def lead_of(rank: int, num_leads: int, reference: int = 0) -> int:
    """The lead rank whose FTAR and catch-up rank `rank` mirrors (itself when it is a lead): leads are ranks
    0..num_leads-1, and a mirror follows lead reference + rank % (num_leads - reference). With one host of
    leads reference is 0 (rank % num_leads); under diagnose with rank folding the leads are two hosts
    (harness.run.job_fold) and reference is the second host's first rank, so mirrors follow the reference
    host (which no scenario fault touches), never the first host where the faults go."""
    if not 0 <= reference < num_leads:
        raise ValueError(f"reference must be in 0..{num_leads - 1}, got {reference}")
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    return rank if rank < num_leads else reference + rank % (num_leads - reference)


def _fresh(error: BaseException) -> BaseException:
    """A new exception like `error`: thousands of mirrors re-raising one instance would chain all
    their frames onto its traceback and keep them alive."""
    try:
        return type(error)(*error.args)
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


class _Counter:
    def __init__(self, mirror: Mirror, rank: int, kind: str) -> None:
        self.mirror, self.rank, self.kind, self.n = mirror, rank, kind, 0

    def run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """A lead's call: run it and post its outcome."""
        self.n += 1
        try:
            value = fn(*args, **kwargs)
        except Exception as e:
            self.mirror.post(self.rank, self.kind, self.n, e)
            raise
        self.mirror.post(self.rank, self.kind, self.n, None, value)
        return value

    def wait(self, timeout: float) -> Any:
        """A mirror's call: the lead's outcome of the same call."""
        self.n += 1
        return self.mirror.wait(self.rank, self.kind, self.n, timeout)


class LeadExchange:
    """A lead rank's GradientExchange, posting each `average` outcome for its mirrors."""

    def __init__(self, exchange: Any, mirror: Mirror, rank: int) -> None:
        self._x, self._calls = exchange, _Counter(mirror, rank, "ftar")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._x, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("_x", "_calls"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._x, name, value)

    def average(self, quorum: Any, grads: Any, **kwargs: Any) -> None:
        self._calls.run(self._x.average, quorum, grads, **kwargs)


class _NoEngine:
    """What a mirror publishes as its FTAR endpoint: nothing connects to it."""

    def __init__(self, config: Any) -> None:
        self.addr, self.config = "folded:0", config


class MirrorExchange:
    def __init__(self, *, mirror: Mirror, rank: int, ftar_config: Any, timeout_s: float) -> None:
        self._calls, self._timeout = _Counter(mirror, rank, "ftar"), timeout_s
        self.engine, self.rank, self.joiner_wait_s = _NoEngine(ftar_config), rank, None
        self.setup_s, self.setup_ok = 0.0, True

    def average(self, quorum: Any, grads: Any, **kwargs: Any) -> None:
        self._calls.wait(self._timeout)


class LeadCatchup(ForwardingCatchup):
    """A lead rank's CatchupService, posting each fetch outcome for its mirrors."""

    def __init__(self, service: Any, mirror: Mirror, rank: int) -> None:
        super().__init__(service)
        self._calls = _Counter(mirror, rank, "heal")

    def fetch(self, step: int, sources: Sequence[str]) -> Any:
        return self._calls.run(self._s.fetch, step, sources)


class MirrorCatchup:
    def __init__(self, *, mirror: Mirror, rank: int, timeout_s: float) -> None:
        self._calls, self._timeout = _Counter(mirror, rank, "heal"), timeout_s
        self.url = "folded:0"

    def publish(self, *args: Any, **kwargs: Any) -> None:
        """Nobody fetches from a mirror."""

    def check(self, state: Any, metadata: Any = None) -> None:
        """Nothing is published."""

    def reserve(self, *args: Any, **kwargs: Any) -> None:
        """Nothing is published."""

    def prepare_fetch(self, shapes: Any) -> None:
        """A mirror receives nothing."""

    def release_fetch(self) -> None:
        """Nothing was prepared."""

    def retire(self, step: int) -> None:
        """Nothing published."""

    def fetch(self, step: int, sources: Sequence[str]) -> Any:
        return self._calls.wait(self._timeout)

    def stop(self) -> None:
        """Nothing to stop."""


# -- folding whole ranks: a replica runs only the ranks that differ -------------------------------
#
# At thousands of ranks per replica the mirrors' own trainers are the emulator's cost (each mirror's
# quorum broadcast, commit vote and bookkeeping every step). With rank folding a replica incarnation
# runs only its represented ranks: the leads (the first host) and every rank a fault names; the rest
# are identical to a lead (same quorum, same vote, the lead's FTAR and catch-up) and are not started.
# The represented ranks form the replica's TreeComm among themselves, and `FoldedComm` charges each
# collective the latency the full tree's deeper paths add (the modeled timing of the ranks not run).


def represented_ranks(ranks_per_replica: int, num_leads: int, targets: Sequence[int]) -> tuple[int, ...]:
    """The ranks a folded replica runs: its leads (0..num_leads-1) and the fault targets, in rank order."""
    if not 1 <= num_leads <= ranks_per_replica:
        raise ValueError(f"num_leads must be in 1..{ranks_per_replica}, got {num_leads}")
    bad = [t for t in targets if not 0 <= t < ranks_per_replica]
    if bad:
        raise ValueError(f"fault target ranks {bad} outside 0..{ranks_per_replica - 1}")
    return tuple(sorted(set(range(num_leads)) | set(targets)))


def tree_depth_latency(ranks: Sequence[int], fanout: int, latency: Any) -> float:
    """The longest root-to-leaf latency of a TreeComm (parent of tree index i: (i - 1) // fanout) whose
    tree index i is rank ranks[i]; `latency(rank_a, rank_b)` is one message's latency between two ranks."""
    if fanout < 1:
        raise ValueError(f"fanout must be >= 1, got {fanout}")
    path = [0.0] * len(ranks)
    for i in range(1, len(ranks)):
        parent = (i - 1) // fanout
        path[i] = path[parent] + latency(ranks[parent], ranks[i])
    return max(path, default=0.0)


# Tree passes per collective: an all-reduce goes up and down the tree; a broadcast or scatter goes down,
# a gather up (TreeComm).
_PASSES = {"all_reduce_int": 2, "all_gather_bytes": 2, "broadcast_bytes": 1, "scatter_bytes": 1, "gather_bytes": 1}


class FoldedComm:
    """The represented ranks' TreeComm, each collective followed by `extra_s` x its tree passes: the latency
    the full replica's tree (deeper, across more racks) adds to the represented ranks' shallower one. Every
    represented rank waits it out, as every rank of the full tree ends the collective that much later.
    `pass_s` x its passes too: what a pass of a real collective over the replica's comm costs beyond the modeled
    network (network.replica_collective_pass_s), paid by every rank but the root of a broadcast or scatter (a
    root's send returns; its receivers have the data that much later)."""

    def __init__(self, comm: Any, env: Any, extra_s: float, pass_s: float = 0.0) -> None:
        if extra_s < 0 or pass_s < 0:
            raise ValueError(f"extra_s and pass_s must be >= 0, got {extra_s}, {pass_s}")
        self._comm, self._env, self.extra_s, self.pass_s = comm, env, extra_s, pass_s
        self.rank, self.world_size = comm.rank, comm.world_size

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    def _after(self, op: str, result: Any, root: int | None = None) -> Any:
        due = (self.extra_s + (self.pass_s if self.rank != root else 0.0)) * _PASSES[op]
        if due:
            self._env.clock.sleep(due)
        return result

    def all_reduce_int(self, values: list[int], op: Any) -> list[int]:
        return self._after("all_reduce_int", self._comm.all_reduce_int(values, op))

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        return self._after("all_gather_bytes", self._comm.all_gather_bytes(data))

    def broadcast_bytes(self, data: bytes | None, root: int = 0) -> bytes:
        return self._after("broadcast_bytes", self._comm.broadcast_bytes(data, root), root)

    def scatter_bytes(self, chunks: list[bytes] | None) -> bytes:
        return self._after("scatter_bytes", self._comm.scatter_bytes(chunks), 0)

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        return self._after("gather_bytes", self._comm.gather_bytes(data))

    def close(self) -> None:
        self._comm.close()
