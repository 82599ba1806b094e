"""Folding identical rings: the emulator's seam objects for ranks that mirror a lead rank.

With ftar_detail = "folded", the rings of rank k in every replica are alike for all k (same
participants, same failures, same hop classes), so only the ranks of each replica's first host
(`num_leads` = gpus_per_host rings, which share that host's NIC as all rings do) run FTAR and catch-up
for real. Every rank still runs the real trainer (quorum, 2PC, the data ledger and the audit are
every rank's own), but rank k >= num_leads gets:

- `MirrorExchange` as its GradientExchange: `average` waits for lead k % num_leads's exchange of the
  same call and ends with it, at the same virtual time, raising the same kind of error;
- `MirrorCatchup` as its CatchupService: `fetch` waits for the lead's fetch and returns its result
  (the state it loads is the lead's shape-only state: the same names and sizes); publish/retire do
  nothing (nobody fetches from a mirror: the fetch plan's sources are the healthy replicas' same rank,
  and only leads are asked);
- zero-time compute (the lead's compute is inside the lead's exchange that the mirror waits for).

Leads wrap their real exchange and catch-up in `LeadExchange`/`LeadCatchup`, which post each outcome.
The zone links are scaled to the hosts that send (LinkModel.zone_share) so each represented host keeps
its share of the oversubscribed uplinks.
"""

from __future__ import annotations

from typing import Any, Sequence

from ftrun.env.base import EnvTimeout


class Mirror:
    """One replica incarnation's lead outcomes, for the ranks that mirror them.

    A lead posts the outcome of its n-th call of a kind ("ftar", "heal"): (error or None, value).
    `poison` ends every later wait with an error (the lead is gone), so mirrors never wait for an
    outcome that cannot come.
    """

    def __init__(self, env: Any, num_leads: int) -> None:
        self._env, self.num_leads = env, num_leads
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
        """The value lead (rank % num_leads) posted for its n-th `kind`; raise what it raised."""
        key = (rank % self.num_leads, kind, n)
        if key not in self._results:
            if self._poisoned is None and not self._event(key).wait(timeout):
                raise EnvTimeout(f"lead rank {key[0]} posted no {kind} result within {timeout}s")
            if key not in self._results:
                raise _fresh(self._poisoned) if self._poisoned else EnvTimeout(f"lead rank {key[0]} is gone")
        error, value = self._results[key]
        if error is not None:
            raise _fresh(error)
        return value


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


class LeadCatchup:
    """A lead rank's CatchupService, posting each fetch outcome for its mirrors."""

    def __init__(self, service: Any, mirror: Mirror, rank: int) -> None:
        self._s, self._calls = service, _Counter(mirror, rank, "heal")
        self.url = service.url

    def publish(self, *args: Any, **kwargs: Any) -> None:
        self._s.publish(*args, **kwargs)

    def retire(self, step: int) -> None:
        self._s.retire(step)

    def fetch(self, step: int, sources: Sequence[str]) -> Any:
        return self._calls.run(self._s.fetch, step, sources)

    def stop(self) -> None:
        self._s.stop()


class MirrorCatchup:
    def __init__(self, *, mirror: Mirror, rank: int, timeout_s: float) -> None:
        self._calls, self._timeout = _Counter(mirror, rank, "heal"), timeout_s
        self.url = "folded:0"

    def publish(self, *args: Any, **kwargs: Any) -> None:
        """Nobody fetches from a mirror."""

    def retire(self, step: int) -> None:
        """Nothing published."""

    def fetch(self, step: int, sources: Sequence[str]) -> Any:
        return self._calls.wait(self._timeout)

    def stop(self) -> None:
        """Nothing to stop."""
