"""The per-replica manager: quorum at the start of each step, two-phase commit at its end.

Every rank of a replica runs one Manager. A step is:

    q = manager.start_step()        # leader asks the lighthouse, decision broadcast (collective)
    ... forward / backward / cross-replica exchange among q.participants ...
    manager.report_error(e)         # on any failure in this rank's part of the step
                                    # (peer=True: another replica caused it, e.g. it died mid-exchange)
    if manager.should_commit():     # every rank's vote (collective); all ok -> commit
        optimizer.step()

A failed commit discards the step (gradients are never half-applied); the next start_step retries it
under a new quorum (the leader reports the failure, which bumps quorum_id, and whether it was the
replica's own fault, which may leave it out of that quorum). A commit also needs min_replicas
contributors (the lighthouse's, carried by the decision). Own and peer-caused failures spend separate
budgets (ftrun.replica.vote). Build the ReplicaComm with
`Timeouts.replica_comm_s`: the other ranks wait in the decision broadcast while the leader waits for the
lighthouse (found by the emulator: a rejoining replica's ranks timed out and the failure cascaded). Threading: one task per
Manager; the lighthouse client's heartbeat runs in its own task.

Ask-ahead (`ManagerConfig.ask_ahead`, ftrun.replica.ask_ahead): after a commit the leader already sends
the next step's quorum request, and start_step reads its reply, so the lighthouse round trip overlaps
the rest of the step. `final_step` (the job's step count, when known) stops it after the last step.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from dataclasses import dataclass, replace
from typing import Callable

import msgpack

from ftrun.config import ManagerConfig
from ftrun.env.base import Env
from ftrun.quorum import protocol
from ftrun.quorum.client import JobFinished as LighthouseJobFinished, LighthouseClient, QuorumError
from ftrun.quorum.decide import Decision, Participant
from ftrun.replica import ask_ahead
from ftrun.replica.comm import ReplicaComm
from ftrun.replica.endpoints import decode_endpoints
from ftrun.replica.lifecycle import Phase, transition
from ftrun.replica.vote import FailureCounts, Vote, commit_outcome

log = logging.getLogger("ftrun.commit")


def _addrs_digest(d: Decision) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for p in d.participants:
        h.update(msgpack.packb([p.replica_id, list(p.data_addrs)]))
    return h.digest()


@functools.lru_cache(maxsize=16)
def _decode_reply(payload: bytes) -> tuple[Decision, bytes]:
    """The leader's broadcast -> (decision, address digest). Cached: every rank of a replica gets the
    same bytes (thousands of ranks in one emulator process), and a Decision is immutable."""
    reply = msgpack.unpackb(payload, raw=False)
    if not reply["ok"]:
        if reply.get("finished") is not None:
            raise JobFinished(f"the job already finished: {reply['error']}", int(reply["finished"]))
        raise ReplicaError(f"leader could not get a quorum: {reply['error']}")
    return protocol.decode_decision(reply["decision"]), reply["addrs"]


def _without_addrs(d: Decision) -> Decision:
    """The decision every rank needs: who and at which step, not the job's address table."""
    return replace(d, participants=tuple(replace(p, data_addrs=()) for p in d.participants))


class ReplicaError(Exception):
    """Base of the manager's errors: the replica cannot go on and should be restarted."""


class JobFinished(ReplicaError):
    """The lighthouse says the job finished at `step`, past this replica's step (a stale replica, e.g.
    frozen while the others finished): it must exit cleanly, not train (ftrun.quorum.decide rule 0)."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


class ReplicaGaveUp(ReplicaError):
    """More failed commits in a row than max_retries."""


@dataclass(frozen=True)
class StepQuorum:
    """What one rank needs to train a step."""

    quorum_id: int
    step: int  # the step being trained; after healing, the healthy replicas' step
    participants: tuple[Participant, ...]
    replica_index: int  # this replica's position in participants (its place in the FTAR ring)
    healed: bool  # this replica was behind and caught up at the start of this step
    reason: str
    behind: tuple[str, ...] = ()  # replicas healing this step: in the ring, contributing zeros
    # This rank's peers: the data-plane address (encoded endpoints) of the same rank of each participant,
    # in participant order; "" where that replica published none. Only this column reaches a rank: the
    # leader scatters it, so no rank ever holds the job's O(replicas x ranks) address table.
    peer_addrs: tuple[str, ...] = ()
    min_replicas: int = 1  # contributors a commit of this step needs

    @property
    def num_participants(self) -> int:
        return len(self.participants)

    @property
    def num_contributors(self) -> int:
        """Participants that train this step (not behind): the divisor of the gradient mean."""
        return len(self.participants) - len(self.behind)


HealFn = Callable[[StepQuorum], None]
EventFn = Callable[[dict], None]


class Manager:
    def __init__(
        self, *, config: ManagerConfig, env: Env, comm: ReplicaComm, replica_id: str,
        lighthouse: LighthouseClient | None, step: int = 0, data_addr: str = "",
        heal: HealFn | None = None, on_event: EventFn | None = None, final_step: int | None = None,
    ) -> None:
        if (comm.rank == 0) != (lighthouse is not None):
            raise ValueError("exactly the replica's rank 0 (its leader) must hold a LighthouseClient")
        self.config, self.env, self.comm, self.replica_id = config, env, comm, replica_id
        self._lighthouse, self._data_addr = lighthouse, data_addr
        self._heal, self._on_event = heal, on_event
        self.step = step
        self.phase = Phase.IDLE
        self.quorum: StepQuorum | None = None
        self._errors: list[tuple[BaseException, bool]] = []  # (error, caused by a peer)
        self._failures = FailureCounts()
        self._report_commit_failure = False
        self._checked_in = False
        self._data_addrs: tuple[str, ...] = ()  # the leader's: every rank's address, sent to the lighthouse
        self._peers_key: tuple | None = None  # the quorum whose peer addresses this rank holds
        self._peer_addrs: tuple[str, ...] = ()
        self._leader_decision: Decision | None = None
        self.final_step = final_step  # the job's last step count, when known: no ask-ahead after it
        self._asked: ask_ahead.QuorumAsk | None = None  # the leader's request sent after the last commit

    # -- phase 1: quorum -----------------------------------------------------------------------
    def start_step(self) -> StepQuorum:
        """Check in, agree on the quorum, heal if behind. Raises ReplicaError if the replica is broken."""
        self._move("start")
        self._errors.clear()
        try:
            if not self._checked_in:
                self._check_in()
            decision, addrs_digest = self._agree_on_decision()
            self._receive_peer_addrs(decision, addrs_digest)
        except Exception as e:
            self._move("fail")
            raise e if isinstance(e, ReplicaError) else ReplicaError(f"quorum failed: {e}") from e
        return self._enter_step(decision)

    def _check_in(self) -> None:
        """Once per incarnation: every rank is up, agrees on the step, and shares its endpoints. Later
        steps need no check-in: the previous step's commit vote was a collective every rank took part in
        and whose result every rank holds, which proves the same thing. The endpoints go to the leader
        only (a gather, not an all-gather: at 8,192 ranks an all-gather is 67M addresses per replica)."""
        lo, hi = self.comm.all_reduce_int([-self.step, self.step], "max")
        if -lo != hi:
            raise ReplicaError(f"ranks of replica {self.replica_id} disagree on the step ({-lo}..{hi})")
        gathered = self.comm.gather_bytes(self._data_addr.encode())
        self._data_addrs = tuple(a.decode() for a in gathered) if gathered is not None else ()
        self._checked_in = True

    def _agree_on_decision(self) -> tuple[Decision, bytes]:
        payload = None
        if self._lighthouse is not None:
            try:
                d = self._leader_quorum(self._lighthouse)
                self._leader_decision = d
                self._report_commit_failure = False
                if self.comm.world_size == 1:  # a replica of one rank: no one to tell, nothing to encode
                    return _without_addrs(d), _addrs_digest(d)
                payload = msgpack.packb({"ok": True, "decision": protocol.encode_decision(_without_addrs(d)),
                                         "addrs": _addrs_digest(d)})
            except QuorumError as e:  # tell the others, then fail (or exit: the job finished)
                finished = e.step if isinstance(e, LighthouseJobFinished) else None
                payload = msgpack.packb({"ok": False, "error": str(e), "finished": finished})
        return _decode_reply(self.comm.broadcast_bytes(payload, root=0))

    def _wanted_ask(self) -> ask_ahead.QuorumAsk:
        return ask_ahead.QuorumAsk(self.step, self._report_commit_failure, self._failures.own,
                                   self.quorum is None, self._data_addrs)

    def _leader_quorum(self, lighthouse: LighthouseClient) -> Decision:
        """The decision for this step: the reply to the request sent after the last commit when it still
        holds (ftrun.replica.ask_ahead), else a request now."""
        wanted, sent = self._wanted_ask(), self._asked
        self._asked = None
        action = ask_ahead.on_start_step(sent if lighthouse.asked_ahead else None, wanted)
        if action is ask_ahead.Action.COLLECT:
            return lighthouse.collect()
        if action is ask_ahead.Action.DISCARD:
            assert sent is not None
            log.info("replica %s discards its early quorum request: %s", self.replica_id,
                     ask_ahead.reason(sent, wanted), extra=self._extra())
            lighthouse.discard()
        return lighthouse.quorum(wanted.step, commit_failed=wanted.commit_failed, own_failures=wanted.own_failures,
                                 fresh=wanted.fresh, data_addrs=wanted.data_addrs)

    def _ask_ahead(self) -> None:
        """After a commit: the leader sends the next step's request now (best effort)."""
        if not ask_ahead.should_ask_ahead(enabled=self.config.ask_ahead, leader=self._lighthouse is not None,
                                          committed=True, next_step=self.step, final_step=self.final_step):
            return
        assert self._lighthouse is not None
        wanted = self._wanted_ask()
        if self._lighthouse.ask(wanted.step, commit_failed=wanted.commit_failed, own_failures=wanted.own_failures,
                                fresh=wanted.fresh, data_addrs=wanted.data_addrs):
            self._asked = wanted

    def _receive_peer_addrs(self, d: Decision, addrs_digest: bytes) -> None:
        """A collective after a decision whose participants or addresses changed: the leader scatters to
        rank r the addresses of rank r of every participant. Every rank got the same broadcast, so all
        agree on whether this quorum needs it."""
        key = (d.replica_ids, addrs_digest)
        if key == self._peers_key:
            return
        chunks = None
        if self._lighthouse is not None:
            assert self._leader_decision is not None
            full = self._leader_decision.participants
            chunks = [msgpack.packb([p.data_addrs[r] if r < len(p.data_addrs) else "" for p in full])
                      for r in range(self.comm.world_size)]
        self._peer_addrs = tuple(msgpack.unpackb(self.comm.scatter_bytes(chunks), raw=False))
        if len(self._peer_addrs) != len(d.participants):
            raise ReplicaError(f"got {len(self._peer_addrs)} peer addresses for {len(d.participants)} participants")
        self._peers_key = key

    def _enter_step(self, d: Decision) -> StepQuorum:
        ids = d.replica_ids
        if self.replica_id not in ids:
            self._move("fail")
            raise ReplicaError(f"replica {self.replica_id} is not in quorum {d.quorum_id} ({', '.join(ids)})")
        behind = self.replica_id in d.behind
        q = StepQuorum(d.quorum_id, d.max_step, d.participants, ids.index(self.replica_id), behind, d.reason,
                       d.behind, self._peer_addrs, d.min_replicas)
        self.quorum = q
        self._emit("quorum", participants=list(ids), reason=d.reason, behind=list(d.behind))
        if behind:
            self._move("behind")
            log.info("replica %s behind at step %d; healing to %d", self.replica_id, self.step, d.max_step,
                     extra=self._extra())
            if self._heal is not None:
                try:
                    self._heal(q)
                except Exception as e:
                    self._move("fail")
                    raise ReplicaError(f"healing replica {self.replica_id} to step {d.max_step} failed: {e}") from e
            self._emit("heal", from_step=self.step, to_step=d.max_step)
            self.step = d.max_step
            self._move("healed")
        else:
            self._move("healthy")
        return q

    # -- phase 2: commit -----------------------------------------------------------------------
    def report_error(self, error: BaseException, *, peer: bool = False) -> None:
        """Record a failure in this rank's part of the step: it becomes a 'don't commit' vote.
        peer: another replica caused it (it died or stalled in the exchange); such failures do not
        spend this replica's own retry budget (ManagerConfig.max_peer_retries)."""
        log.warning("replica %s rank %d step %d: %s%s", self.replica_id, self.comm.rank, self.step, error,
                    " (caused by a peer)" if peer else "", extra=self._extra())
        self._errors.append((error, peer))
        self._emit("error", error=f"{type(error).__name__}: {error}", peer=peer)

    def should_commit(self) -> bool:
        """Two-phase commit vote. True: apply the step. False: discard it and call start_step again."""
        self._move("vote")
        vote = min((Vote.PEER_FAILURE if peer else Vote.OWN_FAILURE for _, peer in self._errors), default=Vote.OK)
        try:
            min_vote = self.comm.all_reduce_int([int(vote)], "min")[0]
        except Exception as e:
            self._move("fail")
            raise ReplicaError(f"commit vote failed: {e}") from e
        q = self.quorum
        assert q is not None, "a vote follows start_step"
        outcome = commit_outcome(min_vote, self._failures, max_retries=self.config.max_retries,
                                 max_peer_retries=self.config.max_peer_retries,
                                 num_contributors=q.num_contributors, min_replicas=q.min_replicas)
        self._failures = outcome.counts
        if outcome.commit:
            self.step += 1
            self._move("commit")
            self._emit("commit")
            self._ask_ahead()
            return True
        self._report_commit_failure = True
        self._emit("abort", reason=outcome.reason, own=outcome.failed_own)
        if outcome.give_up:
            self._move("fail")
            raise ReplicaGaveUp(outcome.reason)
        self._move("abort")
        return False

    def rank_ftar_addrs(self) -> tuple[str, ...]:
        """The leader's: every rank's "ftar" endpoint in this replica (from the check-in); () elsewhere."""
        return tuple(decode_endpoints(a).get("ftar", "") for a in self._data_addrs)

    def report_finished(self) -> None:
        """This replica committed the job's final step: the leader tells the lighthouse (rule 0), so a
        stale replica that asks later exits instead of training. Other ranks: nothing to do."""
        if self._lighthouse is not None:
            self._asked = None
            self._lighthouse.report_finished(self.step)  # discards an early request, if one was sent

    # -- helpers -------------------------------------------------------------------------------
    def _move(self, event: str) -> None:
        self.phase = transition(self.phase, event)

    def _extra(self) -> dict:
        qid = self.quorum.quorum_id if self.quorum else -1
        return {"replica_id": self.replica_id, "rank": self.comm.rank, "quorum_id": qid, "step": self.step}

    def _emit(self, kind: str, **fields) -> None:
        if self._on_event is not None:
            self._on_event({"event": kind, "t": self.env.clock.now(), **self._extra(), **fields})

    def close(self) -> None:
        if self._lighthouse is not None:
            self._lighthouse.close()
        self.comm.close()
