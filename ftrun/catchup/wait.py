"""The wait limit (paper §6.1): wait for a slow joiner, or let it join one step later. Pure.

A behind replica fetches the step n-1 state while the healthy replicas train step n, then sends a zero
gradient at the end of step n. When the fetch fits in the time the step has left, nobody waits. When it
does not, there are two options: the healthy replicas hold the end of step n for the joiner (a stall,
but the joiner trains step n+1), or the joiner sits out step n and joins at the start of step n+1, when
a whole step is left for its fetch (no stall, one step without the joiner). `should_wait` picks one by
the configured wait limit (CatchupConfig.wait_limit_s):

    fetch <= step left                    -> JOIN      join at the end of this step, no stall
    fetch - step left <= wait_limit       -> WAIT      healthy replicas wait (fetch - step left) seconds
    otherwise                             -> NEXT_STEP join one step later, no stall
    ... unless a whole step would not help -> WAIT     (the fetch exceeds a whole step + the wait limit, so
                                                       deferring would never end; waiting is the only way)

How the training loop uses it: at the start of a step whose quorum has behind replicas, every
participant evaluates the decision on the same inputs (the snapshot size from the manifest divided by a
bandwidth estimate — `estimate_fetch_s` — and the step time the profile or the previous step gives), so
all agree without a message. JOIN and WAIT: the joiner stays in the quorum; healthy replicas run their
all-reduce with a wait of at least step time + stall_s (the joiner's zero gradient arrives when its fetch
ends). NEXT_STEP: the joiner leaves this step's quorum (it asks again for step n+1 and fetches then, with
the whole step ahead); the healthy replicas train step n without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class WaitAction(Enum):
    JOIN = "join"  # the fetch fits in the step: join at its end, no stall
    WAIT = "wait"  # the healthy replicas wait for the joiner at the end of the step
    NEXT_STEP = "next_step"  # the joiner joins one step later; nobody waits


@dataclass(frozen=True)
class WaitDecision:
    action: WaitAction
    stall_s: float  # how long the healthy replicas wait (0 unless WAIT)
    reason: str

    @property
    def wait(self) -> bool:
        return self.action is WaitAction.WAIT


def should_wait(estimated_fetch_s: float, step_time_s: float, wait_limit_s: float, *,
                whole_step_s: float | None = None) -> WaitDecision:
    """Decide how a joiner whose fetch takes `estimated_fetch_s` joins.

    Args:
        estimated_fetch_s: expected time to fetch the state (see estimate_fetch_s).
        step_time_s: time the healthy replicas have left in the step from the moment the fetch starts
            (a whole step when the joiner checked in at the start of the step).
        wait_limit_s: the longest stall the job accepts to have the joiner in this step.
        whole_step_s: the time of a whole step; defaults to step_time_s (the fetch starts with the step).
    Raises:
        ValueError: a negative input.
    """
    whole = step_time_s if whole_step_s is None else whole_step_s
    if min(estimated_fetch_s, step_time_s, wait_limit_s, whole) < 0:
        raise ValueError("should_wait takes non-negative seconds")
    stall = estimated_fetch_s - step_time_s
    if stall <= 0:
        return WaitDecision(WaitAction.JOIN, 0.0, f"fetch {estimated_fetch_s:.3g}s fits in the "
                                                  f"{step_time_s:.3g}s left in the step: no stall")
    if stall <= wait_limit_s:
        return WaitDecision(WaitAction.WAIT, stall, f"fetch runs {stall:.3g}s past the step, within the "
                                                    f"{wait_limit_s:.3g}s wait limit: healthy replicas wait")
    if estimated_fetch_s - whole > wait_limit_s:
        return WaitDecision(WaitAction.WAIT, stall, f"fetch {estimated_fetch_s:.3g}s exceeds a whole "
                                                    f"{whole:.3g}s step plus the {wait_limit_s:.3g}s wait "
                                                    f"limit, so a later step would not help: wait {stall:.3g}s")
    return WaitDecision(WaitAction.NEXT_STEP, 0.0, f"fetch would run {stall:.3g}s past the step, over the "
                                                   f"{wait_limit_s:.3g}s wait limit: join one step later")


def estimate_fetch_s(num_bytes: int, bytes_per_s: float, *, latency_s: float = 0.0) -> float:
    """Time to fetch `num_bytes` at an aggregate bandwidth (e.g. the last fetch's, from FetchResult)."""
    if bytes_per_s <= 0 or num_bytes < 0 or latency_s < 0:
        raise ValueError("estimate_fetch_s takes num_bytes >= 0, bytes_per_s > 0, latency_s >= 0")
    return latency_s + num_bytes / bytes_per_s
