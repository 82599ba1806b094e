"""The commit vote of the two-phase commit. Pure.

Every rank votes 1 (its part of the step succeeded) or 0; the replica's result is the minimum. All ok
-> commit. Otherwise the replica discards the step and retries it; after `max_retries` failures in a
row it gives up.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CommitOutcome:
    commit: bool
    give_up: bool
    failures_in_a_row: int
    reason: str


def commit_outcome(min_vote: int, failures_in_a_row: int, max_retries: int) -> CommitOutcome:
    if min_vote not in (0, 1):
        raise ValueError(f"a commit vote is 0 or 1, got {min_vote}")
    if min_vote == 1:
        return CommitOutcome(True, False, 0, "every rank ok")
    failures = failures_in_a_row + 1
    if failures > max_retries:
        return CommitOutcome(False, True, failures, f"{failures} failed commits in a row > max_retries={max_retries}")
    return CommitOutcome(False, False, failures, f"a rank failed; retrying (failure {failures} of {max_retries})")
