"""The replica's per-step lifecycle, as data.

    IDLE --start--> QUORUM --healthy--> TRAINING --vote--> VOTING --commit--> IDLE
                           --behind---> HEALING --healed--^          --abort---> IDLE (retry the step)
    any --fail--> FAILED

An illegal transition is a bug in the caller and raises `LifecycleError`.
"""

from __future__ import annotations

from enum import Enum


class Phase(Enum):
    IDLE = "idle"
    QUORUM = "quorum"
    HEALING = "healing"
    TRAINING = "training"
    VOTING = "voting"
    FAILED = "failed"


TRANSITIONS: dict[tuple[Phase, str], Phase] = {
    (Phase.IDLE, "start"): Phase.QUORUM,
    (Phase.QUORUM, "healthy"): Phase.TRAINING,
    (Phase.QUORUM, "behind"): Phase.HEALING,
    (Phase.HEALING, "healed"): Phase.TRAINING,
    (Phase.TRAINING, "vote"): Phase.VOTING,
    (Phase.VOTING, "commit"): Phase.IDLE,
    (Phase.VOTING, "abort"): Phase.IDLE,
}


class LifecycleError(RuntimeError):
    """A transition that the table does not allow."""


def transition(phase: Phase, event: str) -> Phase:
    if event == "fail":
        return Phase.FAILED
    try:
        return TRANSITIONS[(phase, event)]
    except KeyError:
        raise LifecycleError(f"'{event}' is not allowed in phase {phase.value}") from None
