"""The commit vote of the two-phase commit. Pure.

Every rank votes OK, PEER_FAILURE (its part failed because of another replica: a peer died or stalled
in the exchange) or OWN_FAILURE (its own part failed: its compute, a local fault); the replica's vote
is the minimum, so an own failure on any rank makes the whole replica's failure its own.

The replica commits when the vote is OK and at least min_replicas participants contributed a
gradient. Otherwise it discards the step and retries it. Own failures and peer failures since the last
commit are counted apart: after more than `max_retries` own failures the replica gives up, while
failures its peers caused spend only the larger `max_peer_retries` budget, so a replica that keeps
failing cannot take a healthy one down with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class Vote(IntEnum):
    OWN_FAILURE = 0
    PEER_FAILURE = 1
    OK = 2


@dataclass(frozen=True)
class FailureCounts:
    """Failed commits since the last commit, by who was at fault."""

    own: int = 0
    peer: int = 0


@dataclass(frozen=True)
class CommitOutcome:
    commit: bool
    give_up: bool
    counts: FailureCounts
    failed_own: bool  # the step failed by this replica's own fault (the lighthouse may leave it out)
    reason: str


def commit_outcome(min_vote: int, counts: FailureCounts, *, max_retries: int, max_peer_retries: int,
                   num_contributors: int = 1, min_replicas: int = 1) -> CommitOutcome:
    """The outcome of a replica's vote. Raises ValueError for a vote that is not a Vote value."""
    if min_vote not in tuple(Vote):
        raise ValueError(f"a commit vote is one of {[int(v) for v in Vote]}, got {min_vote!r}")
    vote = Vote(min_vote)
    if vote is Vote.OK and num_contributors >= min_replicas:
        return CommitOutcome(True, False, FailureCounts(), False, "every rank ok")
    if vote is Vote.OWN_FAILURE:
        after = FailureCounts(counts.own + 1, counts.peer)
        if after.own > max_retries:
            return CommitOutcome(False, True, after, True,
                                 f"{after.own} own failures since the last commit > max_retries={max_retries}")
        return CommitOutcome(False, False, after, True,
                             f"a rank failed; retrying (own failure {after.own} of {max_retries})")
    after = FailureCounts(counts.own, counts.peer + 1)
    why = ("a peer failed" if vote is Vote.PEER_FAILURE else
           f"{num_contributors} contributor(s) < min_replicas={min_replicas}")
    if after.peer > max_peer_retries:
        return CommitOutcome(False, True, after, False, f"{why}: {after.peer} failures caused by peers since the "
                             f"last commit > max_peer_retries={max_peer_retries}")
    return CommitOutcome(False, False, after, False,
                         f"{why}; retrying (peer-caused failure {after.peer} of {max_peer_retries})")
