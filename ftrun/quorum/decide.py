"""The lighthouse's quorum decision: a pure function of (now, state, requests, config).

Rules, checked in this order:
1. Liveness: a member is live while it is connected and heard from within heartbeat_timeout_s. Only
   requests from live members count.
2. min_replicas: fewer requesters than min_replicas -> wait.
3. Split-brain guard: the requesters must be more than half of the live members -> otherwise wait.
4. Fast path: every participant of the previous quorum asked again -> decide now (requesters that
   joined meanwhile are included; live members that have not asked are not waited for).
5. Every live member asked -> decide now.
6. Otherwise wait for the missing live members until join_timeout_s after the round started, then
   decide with those that asked. The round starts with the first request from a member of the previous
   quorum (or the first request of all, when none of them has asked): a joiner that asked mid-step must
   not start the clock, or the first arrivals at the step boundary would form a quorum without the rest
   and split the job (found by the emulator on crusoe-300).

A decision lists the participants (sorted by replica id, which is also the ring order), the highest
step asked for, the replicas behind it (they catch up), and the quorum id, which increases whenever
membership changes or a participant reports a failed commit.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

from ftrun.config import LighthouseConfig


@dataclass(frozen=True)
class Member:
    """A replica known to the lighthouse (its leader holds a connection).

    `expected`: restored from the persisted last quorum by a restarted lighthouse and not heard from
    yet. It counts as live until the heartbeat timeout passes, so the first leader to reconnect cannot
    form a quorum alone while the others are still reconnecting (that split the job in two)."""

    replica_id: str
    last_heard: float
    connected: bool = True
    expected: bool = False


@dataclass(frozen=True)
class QuorumRequest:
    replica_id: str
    step: int
    asked_at: float
    commit_failed: bool = False
    data_addrs: tuple[str, ...] = ()  # per-rank data-plane addresses of the replica (FTAR, catch-up)


@dataclass(frozen=True)
class LighthouseState:
    quorum_id: int = 0
    prev_participants: tuple[str, ...] = ()
    members: dict[str, Member] = field(default_factory=dict)


@dataclass(frozen=True)
class Participant:
    replica_id: str
    step: int
    data_addrs: tuple[str, ...] = ()


@dataclass(frozen=True)
class Decision:
    ready: bool
    reason: str
    quorum_id: int = 0
    participants: tuple[Participant, ...] = ()
    max_step: int = 0
    behind: tuple[str, ...] = ()
    retry_at: float | None = None  # when a waiting decision should be evaluated again

    @functools.cached_property
    def replica_ids(self) -> tuple[str, ...]:
        return tuple(p.replica_id for p in self.participants)


def live_members(now: float, state: LighthouseState, config: LighthouseConfig) -> set[str]:
    timeout = config.timeouts.heartbeat_timeout_s
    return {m.replica_id for m in state.members.values()
            if (m.connected or m.expected) and now - m.last_heard <= timeout}


def expect_previous(state: LighthouseState, now: float) -> LighthouseState:
    """A restarted lighthouse's state: the last quorum's participants are expected back (see Member)."""
    members = {rid: Member(rid, now, connected=False, expected=True) for rid in state.prev_participants}
    return replace(state, members={**members, **state.members})


def decide(
    now: float, state: LighthouseState, requests: dict[str, QuorumRequest], config: LighthouseConfig
) -> Decision:
    """Decide whether a quorum forms now and who is in it. Pure: no I/O, no clock."""
    live = live_members(now, state, config)
    asking = {rid: r for rid, r in requests.items() if rid in live}
    num_asking, num_live = len(asking), len(live)
    if num_asking < config.min_replicas:
        return Decision(False, f"waiting: {num_asking} of min_replicas={config.min_replicas} asked")
    if 2 * num_asking <= num_live:
        return Decision(False, f"waiting: no majority ({num_asking} of {num_live} live replicas asked)")
    prev = set(state.prev_participants)
    if prev and prev <= asking.keys():
        return _form(state, asking, f"fast path: every member of quorum {state.quorum_id} asked again")
    if asking.keys() == live:
        return _form(state, asking, f"all {num_live} live replicas asked")
    from_prev = [r.asked_at for rid, r in asking.items() if rid in prev]
    started = min(from_prev) if from_prev else min(r.asked_at for r in asking.values())
    deadline = started + config.timeouts.join_timeout_s
    if now >= deadline:
        return _form(
            state, asking, f"join timeout: {num_asking} of {num_live} live replicas asked "
            f"within {config.timeouts.join_timeout_s}s"
        )
    missing = sorted(live - asking.keys())
    return Decision(False, f"waiting for {', '.join(missing)} until join timeout", retry_at=deadline)


def _form(state: LighthouseState, asking: dict[str, QuorumRequest], reason: str) -> Decision:
    ids = tuple(sorted(asking))
    max_step = max(r.step for r in asking.values())
    changed = ids != tuple(sorted(state.prev_participants))
    failed = [rid for rid in ids if asking[rid].commit_failed]
    quorum_id = state.quorum_id + 1 if changed or failed else state.quorum_id
    if failed and not changed:
        reason += f"; commit failed on {', '.join(failed)}"
    return Decision(
        ready=True,
        reason=reason,
        quorum_id=quorum_id,
        participants=tuple(Participant(rid, asking[rid].step, asking[rid].data_addrs) for rid in ids),
        max_step=max_step,
        behind=tuple(rid for rid in ids if asking[rid].step < max_step),
    )


def apply(state: LighthouseState, decision: Decision) -> LighthouseState:
    """The state after a ready decision has been handed out."""
    assert decision.ready, "only a formed quorum changes the lighthouse state"
    return LighthouseState(
        quorum_id=decision.quorum_id, prev_participants=decision.replica_ids, members=state.members
    )
