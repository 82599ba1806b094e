"""The data plane of an emulated rank: FTAR rings, catch-up transfers, and folding identical rings.

FTAR: the real ftrun.ftar.engine.FtarEngine and ftrun.train.exchange.GradientExchange, with the shadowed
CUDA kernels (mocks.ftar_kernels: modeled time) and a ShapeOnlyGrads buffer, so every chunk of the real
schedule travels the emulated network as a ShapeOnly bulk frame of its real size (NIC and zone links
serialize it) and every copy / reduce waits out its modeled kernel time.

Catch-up: a behind rank fetches its state shard (parameters + two fp32 Adam moments) from the same rank
of every healthy participant, spread by the real pure plan (ftrun.catchup.plan.plan_fetch, sources from
ftrun.catchup.heal.catchup_sources), as ShapeOnly bulk frames from a tiny shape-only server per source.

Folding (ftar_detail = "folded"): the rings of rank k in every replica are alike for all k (same
participants, same failures, same hop classes), so only the ranks of each replica's first host
(`num_leads` = gpus_per_host rings, which share that host's NIC as all rings do) run FTAR and catch-up
for real. Rank k mirrors lead k % num_leads: it waits for that lead's result (its compute and exchange
in one wait; its catch-up) and finishes with it, at the same virtual time, raising the same kind of
error. The zone links are scaled to the hosts that send
(LinkModel.zone_share) so each represented host keeps its share of the oversubscribed uplinks.
"""

from __future__ import annotations

from typing import Any, Callable

from ftrun.catchup.errors import CatchupError
from ftrun.catchup.heal import catchup_sources
from ftrun.catchup.plan import plan_fetch
from ftrun.env.base import EnvTimeout, NetError
from ftrun.replica.manager import StepQuorum
from harness.engine import ShapeOnly

NUM_SHARDS = 8  # per rank's state: the fetch plan spreads them over the sources


class Mirror:
    """One replica incarnation's lead results, for the ranks that mirror them (folded mode).

    A lead rank posts the outcome of its n-th call of a kind ("ftar", "heal"); mirrors wait for it.
    Outcomes are None (success) or the exception to re-raise. `poison` ends every later wait with an
    error (the lead is gone), so mirrors never wait for a result that cannot come.
    """

    def __init__(self, env: Any, num_leads: int) -> None:
        self._env, self.num_leads = env, num_leads
        self._results: dict[tuple, BaseException | None] = {}
        self._events: dict[tuple, Any] = {}
        self._poisoned: BaseException | None = None

    def _event(self, key: tuple) -> Any:
        ev = self._events.get(key)
        if ev is None:
            ev = self._events[key] = self._env.event()
        return ev

    def post(self, lead: int, kind: str, n: int, error: BaseException | None) -> None:
        key = (lead, kind, n)
        self._results[key] = error
        self._event(key).set()
        self._events.pop((lead, kind, n - 2), None)  # mirrors are at most one call behind
        self._results.pop((lead, kind, n - 2), None)

    def poison(self, error: BaseException) -> None:
        self._poisoned = error
        for ev in list(self._events.values()):
            ev.set()

    def wait(self, rank: int, kind: str, n: int, timeout: float) -> None:
        """Return when lead (rank % num_leads) finished its n-th `kind`; raise what it raised."""
        key = (rank % self.num_leads, kind, n)
        if key not in self._results:
            if self._poisoned is None and not self._event(key).wait(timeout):
                raise EnvTimeout(f"lead rank {key[0]} posted no {kind} result within {timeout}s")
            if key not in self._results:
                raise _fresh(self._poisoned) if self._poisoned else EnvTimeout(f"lead rank {key[0]} is gone")
        error = self._results[key]
        if error is not None:
            raise _fresh(error)


def _fresh(error: BaseException) -> BaseException:
    """A new exception like `error`: thousands of mirrors re-raising one instance would chain all
    their frames onto its traceback and keep them alive."""
    try:
        return type(error)(*error.args)
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


class MirroredCall:
    """Wraps one kind of call on one rank: a lead runs it and posts the outcome; a mirror waits."""

    def __init__(self, mirror: Mirror | None, rank: int, kind: str, timeout: float) -> None:
        self._mirror, self._rank, self._kind, self._timeout = mirror, rank, kind, timeout
        self._n = 0
        self.lead = mirror is None or rank < mirror.num_leads

    def __call__(self, fn: Callable[..., Any], *args: Any) -> None:
        self._n += 1
        if self._mirror is None:
            fn(*args)
        elif self.lead:
            try:
                fn(*args)
            except Exception as e:
                self._mirror.post(self._rank, self._kind, self._n, e)
                raise
            self._mirror.post(self._rank, self._kind, self._n, None)
        else:
            self._mirror.wait(self._rank, self._kind, self._n, self._timeout)


class ShapeCatchupServer:
    """Serves any byte range of a rank's state as a ShapeOnly frame: {"nbytes": n} -> n modeled bytes."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self._listener = env.net.listen("127.0.0.1:0")
        self.addr = self._listener.addr
        self.bytes_served = 0
        env.spawn(self._accept_loop, name="catchup-accept")

    def _accept_loop(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except NetError:
                return
            self.env.spawn(self._serve, conn, name="catchup-serve")

    def _serve(self, conn: Any) -> None:
        try:
            while True:
                nbytes = int(conn.recv(timeout=None)["nbytes"])
                conn.send_bytes(ShapeOnly(nbytes))
                self.bytes_served += nbytes
        except (NetError, KeyError, ValueError, TypeError):
            conn.close()


def shape_only_heal(*, env: Any, rank: int, state_bytes: int, timeout_s: float) -> Callable[[StepQuorum], None]:
    """A Manager heal hook: fetch this rank's state from the healthy participants' same rank, shard by
    shard per the real fetch plan, all sources at once. Raises CatchupError."""

    def heal(q: StepQuorum) -> None:
        sources = catchup_sources(q)
        if not sources:
            raise CatchupError(f"step {q.step}: no healthy participant serves rank {rank}")
        sizes = [state_bytes // NUM_SHARDS + (1 if i < state_bytes % NUM_SHARDS else 0) for i in range(NUM_SHARDS)]
        plan = plan_fetch(sizes, sources)
        errors: list[BaseException] = []

        def fetch(source: str, shards: tuple[int, ...]) -> None:
            try:
                conn = env.net.connect(source, timeout=timeout_s)
                try:
                    for i in shards:
                        conn.send({"nbytes": sizes[i]})
                        conn.recv_into(ShapeOnly(sizes[i]), timeout=timeout_s)
                finally:
                    conn.close()
            except NetError as e:
                errors.append(e)

        tasks = [env.spawn(fetch, src, shards, name=f"catchup-fetch-{i}")
                 for i, (src, shards) in enumerate(plan.assignment) if shards]
        for t in tasks:
            t.join()
        if errors:
            raise CatchupError(f"catch-up of rank {rank} to step {q.step} failed: {errors[0]}")

    return heal
