"""Ask-ahead quorum: when the replica leader sends its quorum request for the next step, and whether the
reply to a request sent early may be used. Pure: no I/O, no clock; the Manager drives it.

Without it a step's quorum costs a full lighthouse round trip at the start of every step. With it, right
after the leader commits step n it already sends its request for step n+1; the lighthouse decides while
the replica runs its optimizer step, checkpoint and whatever else lies between the commit and the next
start_step, and start_step only reads the reply (`LighthouseClient.ask` / `collect` / `discard`).

Not speculative: the request sent early is exactly the one start_step would send (the same step,
commit_failed, own_failures, fresh and data addresses), so the lighthouse's protocol and rules are
unchanged, and so are exactly-once and no-fork: a replica still trains only the quorum the lighthouse
handed it, for the step it holds. When anything the request said no longer holds at start_step, the
reply must not be used: the early request is discarded (the client drops its connection, so the
lighthouse forgets the pending request on the reconnect's hello and no stale reply can be mistaken for
the next one's) and start_step asks again as without ask-ahead. That covers:
  - the step changed since the ask (the state was replaced, e.g. a heal or restore outside start_step);
  - a retry: the commit failed, so no request goes early (the next one must carry commit_failed);
  - any other field of the request changed (own failures, fresh, the replica's data addresses).
No request goes early after the job's final step (the replica reports the job finished instead, and a
request for a step nobody trains would only form a useless quorum), nor after a failed commit, nor
when ask-ahead is off (`ManagerConfig.ask_ahead`).

What changes is when the request arrives, so one timing changes: the previous quorum's participants now
all ask right after their commits, and the lighthouse's fast path (ftrun.quorum.decide rule 4) forms
the next quorum then. A joiner whose first request arrives in the window after those commits, which
without ask-ahead would have been included at the next step's start, is in the quorum one step later.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass(frozen=True)
class QuorumAsk:
    """What a quorum request says (ftrun.quorum.client.LighthouseClient.quorum's arguments)."""

    step: int
    commit_failed: bool = False
    own_failures: int = 0
    fresh: bool = False
    data_addrs: tuple[str, ...] = ()


class Action(enum.Enum):
    ASK = "ask"  # nothing sent early: ask now and wait (as without ask-ahead)
    COLLECT = "collect"  # the early request is the one wanted: read its reply
    DISCARD = "discard"  # the early request no longer holds: forget it, then ask now


def should_ask_ahead(*, enabled: bool, leader: bool, committed: bool, next_step: int,
                     final_step: int | None) -> bool:
    """After a vote: send the request for `next_step` now? Only the leader asks; only after a commit (a
    failed one must be reported by the next request); never at or past the final step (None: not known)."""
    if next_step < 0:
        raise ValueError(f"a step is >= 0, got next_step={next_step}")
    if final_step is not None and final_step < 0:
        raise ValueError(f"a final step is >= 0, got final_step={final_step}")
    return enabled and leader and committed and (final_step is None or next_step < final_step)


def on_start_step(sent: QuorumAsk | None, wanted: QuorumAsk) -> Action:
    """At start_step: the request sent early (None: none) against the one this step needs now."""
    if sent is None:
        return Action.ASK
    return Action.COLLECT if sent == wanted else Action.DISCARD


def reason(sent: QuorumAsk, wanted: QuorumAsk) -> str:
    """Why an early request was discarded (for the log): the fields that differ."""
    diffs = [f"{name} {getattr(sent, name)!r} -> {getattr(wanted, name)!r}"
             for name in ("step", "commit_failed", "own_failures", "fresh")
             if getattr(sent, name) != getattr(wanted, name)]
    if sent.data_addrs != wanted.data_addrs:
        diffs.append("data addresses changed")
    return "; ".join(diffs) or "unchanged"
