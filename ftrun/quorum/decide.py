"""The lighthouse's quorum decision: a pure function of (now, state, requests, config).

Rules, checked in this order:
0. Job finished: once a replica reported the job finished at step F (it committed its final step;
   `LighthouseState.finished_step`, persisted), a request for a step below F gets `job_finished`: the
   replica is stale (frozen, or restarted from an older checkpoint) and must exit, not train a fork of
   a finished job. A request at F or later (the job was extended) goes on by the rules below.
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
   6a. Except: a quorum at the join timeout waits for a live member of the previous quorum that has not
   asked while the requesters' highest step is the previous quorum's step and no requester (but a fresh
   restart) was in it: that member may have committed the step, and a quorum without it would train
   another lineage from the same step (found by `ftrun fidelity` at 3 x 2: r0 alone committed step 0 and, slow to ask
   again, was left out of r1 and r2's quorum at step 0, which forked the job). It waits until the member
   asks or its heartbeat times out.

A decision lists the participants (sorted by replica id, which is also the ring order), the highest
step asked for, the replicas behind it (they catch up), the quorum id, which increases whenever
membership changes or a participant reports a failed commit, and min_replicas: a replica commits only
when at least that many participants contributed a gradient (a healthy replica and a joiner that heals
in the same step must not commit on one contribution when min_replicas is 2).

Two more rules apply to a quorum about to form:
7. Left out: a requester that keeps failing by its own fault (`own_failures` since its last commit at
   least LighthouseConfig.leave_out_after) sits out this quorum when the others can form it without it
   (min_replicas, and one of them holds the step); it stays pending and joins the next one as a replica
   behind, so a replica that keeps failing its own compute does not keep failing its peers' steps.
8. No regress: a quorum never forms below the highest step the lighthouse has handed out
   (`LighthouseState.max_step`, persisted). While a live member has not asked (it may hold that step)
   the lighthouse waits; when every live member asked and none holds it, the requesters are refused:
   training them would fork the job (a replica frozen at step 10 resumed after its peers finished
   step 40 trained a lineage of its own and overwrote the run's loader_state). One exception, the full
   restart: when every requester at the quorum's step is `fresh` (a new incarnation on its first
   quorum, resumed from the job's durable state: its latest checkpoint, else step 0), the job rewinds
   to that step on purpose, and the floor moves down with it. A replica that trained on in memory
   across the others' progress is never fresh.

One rule applies outside a round, `evict`:
9. Eviction: a replica the diagnosis confirmed as the culprit of a hang (ftrun.diagnose.act) stops
   counting at once: it is no longer live (rule 1), so the survivors' next quorum forms as soon as they
   have all asked (rule 5) instead of after its heartbeat timeout; the quorum id moves on, since the
   membership changed. Its next incarnation joins again with a hello like any restarted replica.
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
    own_failures: int = 0  # failed commits by this replica's own fault since its last commit (rule 7)
    fresh: bool = False  # a new incarnation's first request: its state is the job's durable state (rule 8)


@dataclass(frozen=True)
class LighthouseState:
    quorum_id: int = 0
    prev_participants: tuple[str, ...] = ()
    members: dict[str, Member] = field(default_factory=dict)
    max_step: int = 0  # the highest step handed out: no quorum forms below it (rule 8)
    finished_step: int | None = None  # the job was reported finished at this step (rule 0)


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
    min_replicas: int = 1  # contributors (participants not behind) a commit needs
    left_out: tuple[str, ...] = ()  # requesters that sit this quorum out and stay pending (rule 7)
    refused: tuple[str, ...] = ()  # requesters refused for good (rule 8): each gets an error
    rewind: bool = False  # a full restart below the highest step handed out (rule 8): the floor moves down
    finished: tuple[str, ...] = ()  # requesters told the job finished (rule 0): each exits

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
    if state.finished_step is not None:
        stale = tuple(sorted(rid for rid, r in requests.items() if r.step < state.finished_step))
        if stale:
            return Decision(False, f"job_finished: the job finished at step {state.finished_step}; "
                                   f"{', '.join(stale)} asked for an earlier step", finished=stale)
    live = live_members(now, state, config)
    asking = {rid: r for rid, r in requests.items() if rid in live}
    num_asking, num_live = len(asking), len(live)
    if num_asking < config.min_replicas:
        return Decision(False, f"waiting: {num_asking} of min_replicas={config.min_replicas} asked")
    if 2 * num_asking <= num_live:
        return Decision(False, f"waiting: no majority ({num_asking} of {num_live} live replicas asked)")
    prev = set(state.prev_participants)
    if prev and prev <= asking.keys():
        return _form(state, asking, live, config, f"fast path: every member of quorum {state.quorum_id} asked again")
    if asking.keys() == live:
        return _form(state, asking, live, config, f"all {num_live} live replicas asked")
    from_prev = [r.asked_at for rid, r in asking.items() if rid in prev]
    started = min(from_prev) if from_prev else min(r.asked_at for r in asking.values())
    deadline = started + config.timeouts.join_timeout_s
    if now >= deadline:
        held = _held_back(now, state, asking, live, prev, config)
        if held is not None:
            return held
        return _form(
            state, asking, live, config, f"join timeout: {num_asking} of {num_live} live replicas asked "
            f"within {config.timeouts.join_timeout_s}s"
        )
    missing = sorted(live - asking.keys())
    return Decision(False, f"waiting for {', '.join(missing)} until join timeout", retry_at=deadline)


def _held_back(now: float, state: LighthouseState, asking: dict[str, QuorumRequest], live: set[str], prev: set[str],
               config: LighthouseConfig) -> Decision | None:
    """Rule 6a: a quorum that leaves out a live member of the previous quorum waits for it while it may hold
    a newer state than every requester: nobody asked above the previous quorum's step and no requester
    (other than a fresh restart) was in it, so nothing says that step did not commit there. None: go on."""
    silent = sorted((prev & live) - asking.keys())
    if (not silent or max(r.step for r in asking.values()) != state.max_step  # below: rule 8 waits; above: safe
            or any(rid in prev and not r.fresh for rid, r in asking.items())):
        return None
    timeout = config.timeouts.heartbeat_timeout_s
    return Decision(False, f"waiting for {', '.join(silent)} of quorum {state.quorum_id}: it may have committed "
                           f"step {state.max_step}, the requesters' highest; a quorum without it would fork the job",
                    retry_at=min(state.members[rid].last_heard for rid in silent) + timeout)


def _form(state: LighthouseState, asking: dict[str, QuorumRequest], live: set[str], config: LighthouseConfig,
          reason: str) -> Decision:
    max_step = max(r.step for r in asking.values())
    rewind = max_step < state.max_step
    if rewind:
        refusal = _regress(state, asking, live, max_step)
        if refusal is not None:
            return refusal
        reason += f"; rewinding the job from step {state.max_step} to {max_step} (a full restart)"
    left_out = _left_out(asking, max_step, config)
    if left_out:
        asking = {rid: r for rid, r in asking.items() if rid not in left_out}
        reason += f"; left out {', '.join(left_out)} (failing by its own fault)"
    ids = tuple(sorted(asking))
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
        min_replicas=config.min_replicas,
        left_out=left_out,
        rewind=rewind,
    )


def _left_out(asking: dict[str, QuorumRequest], max_step: int, config: LighthouseConfig) -> tuple[str, ...]:
    """Rule 7: the requesters that keep failing by their own fault, if the rest still form a quorum of at
    least min_replicas that holds max_step (otherwise nobody sits out: there would be no one to heal from)."""
    out = tuple(sorted(rid for rid, r in asking.items() if r.own_failures >= config.leave_out_after))
    rest = [r for rid, r in asking.items() if rid not in out]
    if not out or len(rest) < config.min_replicas or max(r.step for r in rest) < max_step:
        return ()
    return out


def _regress(state: LighthouseState, asking: dict[str, QuorumRequest], live: set[str],
             max_step: int) -> Decision | None:
    """Rule 8: the requesters are all below the step already handed out. None: a full restart, go on."""
    silent = sorted(live - asking.keys())
    if not silent and all(r.fresh for r in asking.values() if r.step == max_step):
        return None
    if silent:
        return Decision(False, f"waiting: the requesters' highest step {max_step} is below step {state.max_step} "
                               f"already handed out; waiting for {', '.join(silent)}, which may hold it")
    return Decision(
        False,
        f"refused: the requesters' highest step is {max_step}, but step {state.max_step} was already handed out "
        "and no live replica holds it to heal from; training from here would fork the job (restart the "
        "replica when a replica at that step is up, or give the lighthouse a fresh state to rewind on purpose)",
        refused=tuple(sorted(asking)),
    )


def apply(state: LighthouseState, decision: Decision) -> LighthouseState:
    """The state after a ready decision has been handed out."""
    assert decision.ready, "only a formed quorum changes the lighthouse state"
    floor = decision.max_step if decision.rewind else max(state.max_step, decision.max_step)
    return LighthouseState(quorum_id=decision.quorum_id, prev_participants=decision.replica_ids,
                           members=state.members, max_step=floor, finished_step=state.finished_step)


def finish(state: LighthouseState, step: int) -> LighthouseState:
    """The state after a replica reported the job finished at `step` (rule 0): the highest report holds."""
    return replace(state, finished_step=max(step, state.finished_step or 0))


def evict(now: float, state: LighthouseState, replica_ids: tuple[str, ...]) -> tuple[LighthouseState, tuple[str, ...]]:
    """Rule 9: the state with the evicted replicas no longer live, and the replicas actually evicted
    (live members only: evicting one twice, or an unknown one, is a no-op)."""
    hit = tuple(sorted(r for r in set(replica_ids) if r in state.members and
                       (state.members[r].connected or state.members[r].expected)))
    if not hit:
        return state, ()
    return replace(state, members={**state.members, **{r: Member(r, now, connected=False) for r in hit}}), hit
