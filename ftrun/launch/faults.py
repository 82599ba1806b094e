"""Failure injection for `ftrun launch`: when to kill which replica. Pure (no clock, no processes).

Policies: every fixed interval (`--kill-every 60s`), exponential inter-arrival times with a mean
(`--kill-random-mean 15s`), or at given steps (`--kill-at step=40[,replica=r1]`). Victims are drawn
with a seeded generator among the replicas that are up, unless `--kill-at` names one; a kill waits while killing would leave fewer
than `min_up` healthy replicas (committed since their last start), so injection never takes the job
below its quorum nor kills the last replicas that hold the current state.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field


def parse_duration(text: str) -> float:
    """'90', '90s', '1.5m', '2h', '250ms' -> seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|h)?\s*", text)
    if not m:
        raise ValueError(f"bad duration {text!r}: expected e.g. 30s, 1.5m, 250ms")
    scale = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}[m.group(2) or "s"]
    return float(m.group(1)) * scale


def check_fault_timing(owner: str, every_s: float | None, random_mean_s: float | None) -> None:
    """Raise ValueError unless at most one of the two timers is set, and that one is > 0."""
    if every_s is not None and random_mean_s is not None:
        raise ValueError("choose one of --kill-every and --kill-random-mean")
    for name, value in (("every_s", every_s), ("random_mean_s", random_mean_s)):
        if value is not None and value <= 0:
            raise ValueError(f"{owner}.{name} must be > 0, got {value}")


def next_fault_at(now: float, every_s: float | None, random_mean_s: float | None, rng: random.Random) -> float | None:
    """When the next timed fault is due: every `every_s`, or after an exponential wait of mean `random_mean_s`."""
    if every_s is not None:
        return now + every_s
    if random_mean_s is not None:
        return now + rng.expovariate(1.0 / random_mean_s)
    return None

@dataclass(frozen=True)
class KillAt:
    step: int
    replica: str | None = None

    @classmethod
    def parse(cls, text: str) -> "KillAt":
        fields = dict(part.split("=", 1) for part in text.split(",") if "=" in part)
        if "step" not in fields or set(fields) - {"step", "replica"}:
            raise ValueError(f"bad --kill-at {text!r}: expected step=N[,replica=ID]")
        try:
            step = int(fields["step"])
        except ValueError:
            raise ValueError(f"bad --kill-at {text!r}: step must be an integer") from None
        return cls(step, fields.get("replica"))


@dataclass
class KillPlan:
    every_s: float | None = None
    random_mean_s: float | None = None
    at_steps: list[KillAt] = field(default_factory=list)
    min_up: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        check_fault_timing("KillPlan", self.every_s, self.random_mean_s)
        self._rng = random.Random(self.seed)
        self._next_at: float | None = None
        self._pending_steps = sorted(self.at_steps, key=lambda k: k.step)
        self.num_timed_kills = 0  # kills made by every_s / random_mean_s

    def start(self, now: float) -> None:
        self._next_at = self._after(now)

    def _after(self, now: float) -> float | None:
        return next_fault_at(now, self.every_s, self.random_mean_s, self._rng)

    def due(self, now: float, step: int, up: list[str], healthy: list[str] | None = None) -> str | None:
        """The replica to kill now, if any.

        step: the job's highest committed step; up: replicas whose processes run; healthy: those of them
        that have committed since they last started (default: all of `up`). Only a replica whose loss
        leaves at least `min_up` healthy replicas is a candidate, so the job never loses its last copies
        of the state. A due kill without a candidate waits (it happens once there is one); so does an
        at-step kill whose named replica is not a candidate yet (another replica is never killed in its place)."""
        healthy_set = set(up if healthy is None else healthy)
        candidates = sorted(r for r in up if len(healthy_set - {r}) >= self.min_up)
        if not candidates:
            return None
        if self._pending_steps and step >= self._pending_steps[0].step:
            target = self._pending_steps[0].replica
            if target is not None and target not in candidates:
                return None
            self._pending_steps.pop(0)
            return target if target is not None else self._rng.choice(candidates)
        if self._next_at is not None and now >= self._next_at:
            self._next_at = self._after(now)
            self.num_timed_kills += 1
            return self._rng.choice(candidates)
        return None

    @property
    def pending(self) -> list[KillAt]:
        """The at-step kills that have not fired yet."""
        return list(self._pending_steps)

    @property
    def next_at(self) -> float | None:
        return self._next_at
