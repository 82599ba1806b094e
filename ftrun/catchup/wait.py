"""The wait limit (paper §6.1): wait for a slow joiner, or let it join one step later. Pure.

A behind replica fetches the state after step n-1 while the healthy replicas train step n, then sends a
zero gradient at the end of step n. When the fetch fits in the time the step has left, nobody waits.
When it does not, there are two options: the healthy replicas hold the end of step n for the joiner (a
stall, but the joiner trains step n+1), or the joiner joins one step later (no stall, one step without
it). The wait limit (CatchupConfig.wait_limit_s) balances the two.

What the runtime does (ftrun.train.trainer). A joiner only enters at a step boundary: the lighthouse puts
it in the quorum of step n, it heals inside start_step (fetch + load) while the healthy replicas
compute, then it enters the step's FTAR with zeros. A step with a joiner always builds a new ring (its
membership changed), and a healthy rank next to the joiner in the ring first waits for it while the
ring is built. So a healthy rank of a step whose quorum has behind participants builds the ring with
every wait bounded by `exchange_wait_s` (the wait limit) instead of ftar_timeout_s; every other wait,
and every step without a joiner, keeps ftar_timeout_s. Ranks further round the ring learn of a give-up
at once (the ring's closed connections travel around it). Then, as the healthy rank saw it
(`wait_outcome`, reported as a "catchup_wait" event with the measured stall):

    ring built at once                     -> JOIN      the joiner was there: no stall
    ring built within the wait limit       -> WAIT      the step commits with everyone; stall measured
    ring not built within the wait limit   -> NEXT_STEP the step is aborted (RecoverableError, a 'no'
                                                        vote); the healthy replicas ask for the next
                                                        quorum at once, keeping their gradients

The joiner, healed to step n by then, finds its ring broken (its healthy predecessor closed the
connection when it gave up), votes no and asks again at step n: the retried step n has it as a full
participant that trains its own batch. It joined one step later. The healthy replicas lost the wait
limit in the FTAR, plus whatever is left of the joiner's fetch: the lighthouse forms the retry's quorum
when every participant of the aborted one asked again, or after join_timeout_s without the joiner
(then it is behind again at the next step). Their retry does not redo forward/backward: the kept
gradient of the same step, state and batch is bit for bit what a recompute would give. A joiner that
dies while it heals is not waited for: the lighthouse sees its connection drop and tells the quorum's
other participants (a `hung` notice), whose ring build of the step fails at once (NEXT_STEP, no stall).

`should_wait` is the planning rule of the paper, on estimates (`estimate_fetch_s` from a snapshot size
and a fetch bandwidth); the trainer reports its prediction next to the outcome when it has a measured
bandwidth, but the bound the runtime enforces is the timeout above:

    fetch <= step left                    -> JOIN      join at the end of this step, no stall
    fetch - step left <= wait_limit       -> WAIT      healthy replicas wait (fetch - step left) seconds
    otherwise                             -> NEXT_STEP join one step later, no stall
    ... unless a whole step would not help -> WAIT     (the fetch exceeds a whole step + the wait limit, so
                                                       deferring would never end; waiting is the only way)
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

MIN_WAIT_S = 0.05  # the shortest bound on a ring wait: loopback round trips, even with a wait limit of 0
JOIN_TOLERANCE_S = 0.05  # a ring built within this counts as no stall (healthy peers' skew, round trips)


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


def exchange_wait_s(*, num_behind: int, healed: bool, wait_limit_s: float) -> float | None:
    """The bound on each wait of this rank's ring setup in a step's exchange: the wait limit (at least
    MIN_WAIT_S) on a healthy rank of a step with `num_behind` > 0 joiners; None (ftar_timeout_s) on the
    joiner itself and in a step without one."""
    if wait_limit_s < 0 or num_behind < 0:
        raise ValueError("exchange_wait_s takes num_behind >= 0 and wait_limit_s >= 0")
    if healed or num_behind == 0:
        return None
    return max(wait_limit_s, MIN_WAIT_S)


@dataclass(frozen=True)
class WaitOutcome:
    """How a step with a joiner ended for one healthy rank (the runtime's side of `WaitDecision`)."""

    action: WaitAction
    stall_s: float  # seconds this rank spent waiting for the ring (the joiner), measured
    reason: str


def wait_outcome(*, waited_s: float, joined: bool, wait_limit_s: float,
                 tolerance_s: float = JOIN_TOLERANCE_S) -> WaitOutcome:
    """Classify what a healthy rank saw: `waited_s` building the step's ring, which completed (`joined`)
    or was given up. Raises ValueError for negative seconds."""
    if min(waited_s, wait_limit_s, tolerance_s) < 0:
        raise ValueError("wait_outcome takes non-negative seconds")
    if not joined:
        return WaitOutcome(WaitAction.NEXT_STEP, waited_s, f"no ring after {waited_s:.3g}s (wait limit "
                                                           f"{wait_limit_s:.3g}s): step aborted, the joiner "
                                                           f"trains the retry")
    if waited_s <= tolerance_s:
        return WaitOutcome(WaitAction.JOIN, waited_s, f"ring built in {waited_s:.3g}s: the joiner was ready")
    return WaitOutcome(WaitAction.WAIT, waited_s, f"waited {waited_s:.3g}s for the joiner, within the "
                                                  f"{wait_limit_s:.3g}s wait limit")
