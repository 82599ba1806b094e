"""The FT-HSDP step driver for one rank of a replica: quorum, catch-up, compute, FTAR, two-phase commit.

One `train_step()` (paper §4.1-4.4, DESIGN "The runtime, part by part"):

    q = manager.start_step()            # quorum; a behind replica heals here (`heal`: fetch + load)
    serve(q)                            # healthy + someone behind: publish the state after q.step commits
                                        # for catch-up; the writer: a persistent checkpoint of the same state
                                        # (async_write: staged to host memory, written in the background)
    attempt = progress.start(q)         # leader: audit Attempt (before the gradient can enter FTAR)
    forward/backward on this rank's batch, gather grads into one float32 buffer
    exchange.average(q, buffer)         # FTAR mean over contributors; a healed replica sends zeros
    scatter the mean back into .grad
    manager.should_commit()             # 2PC vote
      yes: LR factor (healthy/total), optimizer.step, ledger commit, audit Commit, loader_state save
           (the step's writer), retire the snapshot
      no:  grads dropped, ledger unchanged: the next train_step retries the step under a new quorum

Catch-up timing. The snapshot of step n (the state after n commits) is published at the START of
step n, before the compute: the behind replica fetches it inside its start_step (the server long-polls
until it is published) while the healthy replicas compute, and the healthy replicas' FTAR cannot finish
before the behind replica sends its zeros. Publishing after the exchange would deadlock the two (each
waiting for the other until ftar_timeout_s). Nothing changes the state between the publish and the
optimizer step, so this is the paper's "snapshot before the optimizer step". The snapshot serves the
state's stable tensors (TrainState.stable: parameters and optimizer state, on the CPU; none in the
user's own loop, whose code runs inside the step) in place rather than copying them, so the trainer
retires it before anything changes them: before the optimizer step of a commit and before a heal's
load (tests/unit/test_trainer.py checks both).

Waiting for a joiner (paper §6.1, ftrun.catchup.wait). When the fetch is slower than the step, the
healthy replicas wait in the FTAR for the joiner's zeros, each wait of the step's ring build bounded by
CatchupConfig.wait_limit_s instead of ftar_timeout_s. Within it the step commits with everyone (WAIT);
past it the step fails ('no' vote) and is retried under the next quorum, where the joiner, healed to
the same step meanwhile, trains with them (it joined one step later; its own exchange of the aborted
step fails at once on the connection its healthy predecessor closed). Either way the leader emits a
"catchup_wait" event with the measured stall. The healthy ranks keep the gradient of such a step: the
retry on the same state and batch reuses it instead of running forward/backward again.

Failures. Any exception in forward, backward or the exchange (a peer dying mid-FTAR is a
RecoverableError, reported as caused by a peer: it does not spend this replica's own retry budget) is
reported to the Manager and becomes a 'don't commit' vote: nothing is applied,
model and optimizer are untouched (gradients dropped, FSDP2's per-iteration state reset), and the step
is retried. A rank that fails before its exchange does not enter it, so its peers' FTAR fails too (by
their ftar_timeout_s): never a half-trained step (the ledger's contract, ftrun.data.loader_state).
Errors the Manager raises (ReplicaError: no quorum, a failed heal, too many failed commits) propagate:
the replica must be restarted. A forward/backward that raises again on the retry is a bug in the
training code: `UserCodeError`, with the traceback logged at ERROR, ends the replica at once.

One exception to the retry: in a replica of K > 1 ranks, a failure in forward/backward raises
`ShardedComputeError` (a ReplicaError) at once. The ranks' FSDP collectives inside the replica may then
be out of step (this rank left the sequence while a peer waits in an all-gather or reduce-scatter), and
no reset re-aligns a gloo/NCCL group's sequence, so the replica restarts and heals from its peers, the
way a dead rank does. Not voting is what keeps it fast: the peer stuck in the collective sees this
rank's process end at once, where a vote would wait for the peer's collective timeout. A failure in
the exchange comes after the replica's last FSDP collective of the step, so it is retried in place.

RNG. With `rng_seed` set, torch's CPU RNG is reseeded before every forward from (seed, replica, rank,
step): dropout masks are a pure function of the step, so a retry, a healed replica and a full restart
draw the same numbers without shipping RNG state (a state captured at publish time, before the
forward, would be the wrong one after the step anyway).

Inside the replica: plain replication with one rank, or FSDP2 over K ranks (ftrun.train.shard). The
default `ReplicaState` and `FlatGrads` cover each rank's local shards (whole tensors when unsharded);
every rank runs a trainer and serves/fetches its own shards, which is why catch-up sources are the
same rank of the healthy replicas. The leader (rank 0) writes audit and loader_state; every rank of the
checkpoint writer's replica calls the checkpointer (each writes its own shards; ftrun.checkpoint.store).
Overlap (ftrun.train.overlap, `overlap=` in build): in a plain training step (nobody behind, no kept
gradient) the exchange runs bucket by bucket during backward instead of after it; the vote, retries and
the joiner paths are the ones above. The "exchange" phase is then called after backward, while the
last buckets are still being reduced.
Persistent checkpoints (ftrun.train.checkpointing): with CheckpointConfig.async_write (the default)
the step waits only while the writer's ranks stage the state; the write runs in a background task,
which `close` waits for.

Threading: one task per trainer; `heal` runs in it, called by the Manager; a background checkpoint
write is a second one (ftrun.train.checkpointing).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from ftrun.catchup.config import CatchupConfig
from ftrun.catchup.errors import CatchupError, CatchupUsageError
from ftrun.catchup.fetcher import FetchResult
from ftrun.catchup.heal import catchup_sources, should_publish, should_reserve
from ftrun.catchup.transport import CatchupService
from ftrun.catchup.wait import estimate_fetch_s, exchange_wait_s, should_wait, wait_outcome
from ftrun.checkpoint.policy import CheckpointConfig, checkpoint_writer
from ftrun.config import ManagerConfig
from ftrun.data.audit import AuditLog
from ftrun.data.loader_state import LoaderState, LoaderStateError, LoaderStateStore
from ftrun.data.progress import DataProgress
from ftrun.data.sampler import DataLayout
from ftrun.env.base import Env
from ftrun.ftar.ring import RecoverableError
from ftrun.quorum.client import LighthouseClient
from ftrun.replica.comm import ReplicaComm
from ftrun.replica.endpoints import encode_endpoints
from ftrun.replica.manager import Manager, ReplicaError, StepQuorum
from ftrun.train.checkpointer import Checkpointer
from ftrun.train.checkpointing import CheckpointWriter
from ftrun.train.compute import Compute, LossFn  # noqa: F401 (LossFn re-exported)
from ftrun.train.exchange import GradientExchange
from ftrun.train.lr import LRConfig, lr_factor
from ftrun.train.overlap import OverlapExchange, may_overlap
from ftrun.train.state import peer_shapes, stable_names

log = logging.getLogger("ftrun.train")

EventFn = Callable[[dict], None]
PhaseFn = Callable[[str, int], None]  # (phase, step): instrumentation and fault injection
ProgressFn = Callable[..., DataProgress]
PHASES = ("quorum", "heal", "started", "forward", "exchange", "before_commit", "after_commit")


class ShardedComputeError(ReplicaError):
    """Forward/backward failed on a rank of a sharded replica: the replica must restart (module docstring)."""


class UserCodeError(ReplicaError):
    """The user's code (loss_fn, forward, backward) raised again on the retry of a failed attempt: a bug,
    not a fault; the replica ends with the traceback logged at ERROR instead of retrying forever."""


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """replica_id/rank: who this is. rng_seed: reseed per step (see the module docstring); None leaves
    torch's RNG alone (then the model must not draw random numbers, or a healed replica diverges).
    checkpoint: cadence and retention (the trainer's checkpointer writes; none: off). catchup: the
    wait limit and timeouts."""

    replica_id: str
    rank: int = 0
    rng_seed: int | None = 0
    lr: LRConfig = field(default_factory=LRConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    catchup: CatchupConfig = field(default_factory=CatchupConfig)

    def __post_init__(self) -> None:
        if not self.replica_id:
            raise ValueError("TrainerConfig.replica_id must be non-empty")
        if self.rank < 0:
            raise ValueError(f"TrainerConfig.rank must be >= 0, got {self.rank}")
        if self.rng_seed is not None and self.rng_seed < 0:
            raise ValueError(f"TrainerConfig.rng_seed must be >= 0 or None, got {self.rng_seed}")


@dataclass(frozen=True)
class StepResult:
    step: int  # the step trained (the number of commits before it)
    quorum_id: int
    participants: tuple[str, ...]
    committed: bool
    loss: float | None  # None when this replica trained no batch (it healed this step) or failed
    healed: bool
    lineage: str  # the ledger's lineage after the step (unchanged when not committed)


def step_seed(seed: int, replica_index: int, rank: int, step: int) -> int:
    """The RNG seed of one rank's forward at `step`: a pure function, the same on every retry."""
    digest = hashlib.blake2b(f"{seed}/{replica_index}/{rank}/{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class FaultTolerantTrainer:
    """Drives one rank's steps. Build with `build(...)`, which also makes the Manager (it needs this
    trainer's `heal` hook and endpoints).

    compute: the rank's computation, gradient buffer and state (the Compute seam: a torch model, or
    shape-only compute in the emulator). catchup: the rank's catch-up endpoint and client (the
    CatchupService seam). checkpointer: writes persistent checkpoints when this rank is the elected
    writer (None: off). loader_store/audit: the ledger's storage (the Storage seam underneath).
    checkpointed: (step, lineage) of a persistent checkpoint that exists, e.g. the one this replica
    resumed from, so the writer does not rewrite it (a rewrite first discards the complete one).
    on_event: structured events (catchup, checkpoint) from the leader. on_phase: called at every phase
    boundary of a step (PHASES), for instrumentation and fault injection.
    """

    telemetry = None  # this rank's ftrun.diagnose.telemetry.Recorder (records the catch-up fetches), or None

    def __init__(self, *, config: TrainerConfig, env: Env, compute: Compute, progress: DataProgress,
                 manager: Manager, exchange: GradientExchange, catchup: CatchupService,
                 loader_store: LoaderStateStore, audit: AuditLog, checkpointer: Checkpointer | None = None,
                 checkpointed: tuple[int, str] | None = None, on_event: EventFn | None = None,
                 on_phase: PhaseFn | None = None, overlap: OverlapExchange | None = None,
                 fetch_prepared: bool = False) -> None:
        self.config, self.env, self.compute, self.progress, self.manager = config, env, compute, progress, manager
        self.exchange, self.catchup = exchange, catchup
        self.loader_store, self.audit = loader_store, audit
        self.state = compute.state
        self._on_event, self._on_phase = on_event, on_phase
        self._leader = manager.comm.rank == 0
        self._published: tuple[int, str] | None = None  # (step, lineage) of the snapshot being served
        self.checkpoints = CheckpointWriter(
            checkpointer=checkpointer, config=config.checkpoint, env=env, replica_id=config.replica_id,
            rank=config.rank, emit=self._emit, checkpointed=checkpointed) if checkpointer is not None else None
        self.last_fetch: FetchResult | None = None  # the last heal's fetch, without its tensors
        self._reserved = False  # the catch-up snapshot's buffer was reserved (once: its layout stays)
        self._fetch_prepared = fetch_prepared  # a receive buffer waits for a heal (build's `joining`)
        self._kept: tuple[tuple[int, str], float, Any] | None = None  # ((step, lineage), loss, gradient)
        self._compute_s: float | None = None  # the last forward/backward's seconds
        self._snapshot_bytes = 0  # the size of the last published catch-up snapshot
        self._compute_failures = 0  # forward/backward attempts in a row that raised
        self._begun_at = 0.0  # when the started step's begin_step ended (the own loop's compute time)
        self.overlap = overlap  # the exchange overlapped with backward (None: always after it)

    @property
    def step(self) -> int:
        """Steps this replica has committed (or healed to)."""
        return self.manager.step

    # -- one step --------------------------------------------------------------------------------
    def train_step(self) -> StepResult:
        """Run one FT-HSDP step (see the module docstring). Raises ReplicaError when the replica is broken.
        `ft.train()`'s loop; the user's own loop (ftrun.train.own) calls the same three parts itself."""
        q = self.begin_step()
        loss = self._compute_and_exchange(q, trains=self.progress.trains)
        return self.finish_step(q, loss)

    def begin_step(self) -> StepQuorum:
        """The step's start: quorum (a behind replica heals inside it), the catch-up snapshot and
        checkpoint of the state so far, the ledger's attempt (audited before any gradient is exchanged).
        After it, `progress.trains` says whether this replica trains a batch in the step."""
        self._phase("quorum", self.manager.step)
        q = self.manager.start_step()
        self._phase("started", q.step)
        self._serve(q)
        attempt = self.progress.start(step=q.step, participants=q.participants)
        if attempt is not None and self._leader:
            self.audit.append(attempt)  # before the gradient can enter the all-reduce
        self._begun_at = self.env.clock.now()
        return q

    def exchange_user_grads(self, q: StepQuorum) -> None:
        """The user's own loop: the gradient its backward left in the model's .grad (zeros when this
        replica does not train the step) averaged across replicas by FTAR, back into .grad. A failed
        exchange is a 'no' vote (gradients dropped), as in `train_step`."""
        if self.progress.trains:
            self._compute_s = self.env.clock.now() - self._begun_at  # the user's forward/backward (and data)
            self.compute.gather()
        else:
            self.compute.zero_grads()  # behind this step: contributes zeros, receives the contributors' mean
        self._exchange(q)

    def finish_step(self, q: StepQuorum, loss: float | None) -> StepResult:
        """The two-phase commit: apply (optimizer step with the LR intervention, ledger, audit) only if
        every participant votes yes; else drop the step (the next begin_step retries it)."""
        self._phase("before_commit", q.step)
        committed = self.manager.should_commit()
        if committed:
            self._apply(q)
        else:
            self.progress.abort()
            self.compute.reset()
        return StepResult(q.step, q.quorum_id, tuple(p.replica_id for p in q.participants), committed,
                          loss, q.healed, self.progress.state.lineage)

    def _serve(self, q: StepQuorum) -> None:
        """Before the compute, the state after q.step commits: the catch-up snapshot (healthy replicas,
        when someone is behind) first, so the fetch overlaps the checkpoint write; then the persistent
        checkpoint (its writer: staged for a background write, or written here). Neither is redone for
        a retry on the same state."""
        key = (q.step, self.progress.state.lineage)
        if should_publish(q) and self._published != key:
            metadata = {"step": q.step, "loader_state": self.progress.state.to_dict(), "state": self.state.metadata(),
                        "compute_s": self._compute_s}  # how long the joiner should expect to wait for us
            tensors = self.state.tensors()
            self.catchup.publish(q.step, tensors, metadata, borrow=stable_names(self.state))
            self._snapshot_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
            self._published = key
        if self.checkpoints is not None:
            self.checkpoints.at_step(q, self.progress.state)

    def _compute_and_exchange(self, q: StepQuorum, *, trains: bool) -> float | None:
        """Forward/backward (unless behind) and the FTAR mean into .grad; a failure is a 'no' vote
        (in a sharded replica, a compute failure raises ShardedComputeError: see the module docstring)."""
        loss = None
        overlapped = self._start_overlap(q, trains)
        try:
            if trains:
                loss = self._compute(q)
            else:
                self.compute.zero_grads()  # behind this step: contributes zeros, receives the contributors' mean
        except BaseException as e:
            if overlapped:
                self.overlap.cancel()  # the ring is given up: peers fail their exchange at once
            if not isinstance(e, Exception):
                raise
            if self.manager.comm.world_size > 1:  # no reset first: it may wait on a collective of the peer's
                raise ShardedComputeError(f"replica {self.config.replica_id} rank {self.config.rank} step "
                                          f"{q.step}: {type(e).__name__}: {e}") from e
            self.compute.reset()
            self._fail_fast_on_repeat(q, e)
            self.manager.report_error(e)  # vote no without entering the exchange; the step is retried
            return None
        self._compute_failures = 0
        self._exchange(q, overlapped=overlapped)
        return loss

    def _start_overlap(self, q: StepQuorum, trains: bool) -> bool:
        """Start the exchange overlapped with backward when this step may (ftrun.train.overlap.may_overlap)."""
        if self.overlap is None:
            return False
        kept = self._kept is not None and self._kept[0] == (q.step, self.progress.state.lineage)
        if not may_overlap(trains=trains, healed=q.healed, num_behind=len(q.behind), kept=kept):
            return False
        self.overlap.start(q)
        return True

    def _fail_fast_on_repeat(self, q: StepQuorum, e: BaseException) -> None:
        """Raise UserCodeError when the compute failed on the retry too (module docstring, Failures)."""
        self._compute_failures += 1
        if self._compute_failures >= 2:
            log.error("replica %s rank %d step %d: the training code raised again on the retry; ending the "
                      "replica", self.config.replica_id, self.config.rank, q.step, exc_info=e)
            raise UserCodeError(f"replica {self.config.replica_id} step {q.step}: the training code raised "
                                f"on {self._compute_failures} attempts in a row: {type(e).__name__}: {e}") from e

    def _compute(self, q: StepQuorum) -> float:
        """This rank's gradient into the buffer: forward/backward, or the gradient kept from an attempt of
        the same step on the same state that a joiner's wait limit aborted (module docstring)."""
        key = (q.step, self.progress.state.lineage)
        if self._kept is not None and self._kept[0] == key:
            self.compute.restore_grads(self._kept[2])
            return self._kept[1]
        self._phase("forward", q.step)
        started = self.env.clock.now()
        loss = self._forward_backward(q.step)
        self._compute_s = self.env.clock.now() - started
        self._kept = (key, loss, self.compute.keep_grads()) if q.behind and not q.healed else None
        return loss

    def _exchange(self, q: StepQuorum, *, overlapped: bool = False) -> None:
        """The FTAR mean into .grad; a failure is a 'no' vote. In a step with a joiner, a healthy rank
        waits for it at most the wait limit (ftrun.catchup.wait) and reports how the wait ended.
        overlapped: the exchange started during backward (`_start_overlap`); only its last buckets are left."""
        limit = self.config.catchup.wait_limit
        setup_timeout = exchange_wait_s(num_behind=len(q.behind), healed=q.healed, wait_limit_s=limit)  # None
        # when overlapped: an overlapped step has nobody behind (ftrun.train.overlap.may_overlap)
        try:
            self._phase("exchange", q.step)
            if overlapped:
                self.overlap.finish()
            else:
                self.exchange.average(q, self.compute.grads, setup_timeout_s=setup_timeout)
            self.compute.scatter()
        except BaseException as e:  # a failed exchange: vote no, retry the step
            if overlapped:
                self.overlap.cancel()  # a no-op once finish() ran
            if not isinstance(e, Exception):
                raise
            self.compute.reset()
            self.manager.report_error(e, peer=isinstance(e, RecoverableError))  # a peer died or stalled
        if setup_timeout is not None:
            self._report_wait(q, limit)

    def _report_wait(self, q: StepQuorum, limit: float) -> None:
        x = self.exchange
        outcome = wait_outcome(waited_s=x.setup_s, joined=x.setup_ok, wait_limit_s=limit)
        predicted = None  # the paper's rule on estimates: this snapshot at the bandwidth of our last fetch
        last = self.last_fetch
        if last is not None and last.seconds > 0 and self._compute_s is not None:
            fetch_s = estimate_fetch_s(self._snapshot_bytes, last.num_bytes / last.seconds)
            predicted = should_wait(fetch_s, self._compute_s, limit).action.value
        log.info("replica %s step %d: %s", self.config.replica_id, q.step, outcome.reason)
        self._emit("catchup_wait", step=q.step, behind=list(q.behind), action=outcome.action.value,
                   stall_s=outcome.stall_s, wait_limit_s=limit, reason=outcome.reason, predicted=predicted)

    def _forward_backward(self, step: int) -> float:
        seed = None
        if self.config.rng_seed is not None:
            index = self.progress.state.index(self.config.replica_id)
            seed = step_seed(self.config.rng_seed, index, self.config.rank, step)
        return self.compute.forward_backward(step, lambda: self.progress.samples(self.config.rank), seed)

    def _apply(self, q: StepQuorum) -> None:
        """Commit: the optimizer step with the LR intervention, then the ledger, audit and loader_state."""
        layout = self.progress.state.layout
        self._unpublish()  # the snapshot serves the stable tensors in place: retired before they change
        self.compute.apply(lr_factor(self.config.lr.policy, num_healthy=q.num_contributors,
                                     num_total=layout.num_replicas))
        self._phase("after_commit", q.step)
        commit = self.progress.commit(writer=self.config.replica_id)
        if self._leader:
            self.audit.append(commit)
            if checkpoint_writer(q.participants) == self.config.replica_id:
                self.loader_store.save(self.progress.state)
        if not self._reserved and should_reserve(q, layout.num_replicas):  # a replica will join: its
            # snapshot's buffer now (for what it copies), with the optimizer's state
            self.catchup.reserve(self.state.tensors(), borrow=stable_names(self.state))
            self._reserved = True
        if self._fetch_prepared:  # its heal, if any, is done (and took the buffer): not kept for a later one
            self.catchup.release_fetch()
            self._fetch_prepared = False
        self._kept = None

    def _unpublish(self) -> None:
        """Stop serving the published snapshot (if any): its stable tensors are about to change."""
        if self._published is not None:
            self.catchup.retire(self._published[0])
            self._published = None

    # -- catch-up --------------------------------------------------------------------------------
    def heal(self, q: StepQuorum) -> None:
        """The Manager's heal hook: fetch the state after q.step commits from the healthy participants'
        same-rank catch-up endpoints and load it (model, optimizer, ledger). Raises CatchupError (no
        source, every source failed, timeout) or LoaderStateError/ValueError (a state that does not fit)."""
        sources = catchup_sources(q)
        if not sources:
            raise CatchupError(f"step {q.step}: no healthy participant of quorum {q.quorum_id} serves catch-up")
        if self.telemetry: self.telemetry.catchup_start(q.step, len(sources))
        try:
            result = self.catchup.fetch(q.step, sources)
        except BaseException:
            if self.telemetry: self.telemetry.catchup_end(q.step, 0, False)
            raise
        if self.telemetry: self.telemetry.catchup_end(q.step, result.num_bytes, True)
        self._phase("heal", q.step)
        self._unpublish()  # a snapshot this replica still serves lends the tensors the load overwrites
        self._load(q.step, result)
        self.last_fetch = replace(result, tensors={})  # its figures: the state keeps what it needs of the
        # buffer (a CPU optimizer's moments); the rest (a GPU state's whole host copy) goes now
        self._emit("catchup", step=q.step, num_bytes=result.num_bytes, seconds=result.seconds,
                   bytes_by_source=result.bytes_by_source, failures=list(result.failures))

    def _load(self, step: int, result: FetchResult) -> None:
        meta = result.metadata
        if meta.get("step") != step:
            raise CatchupError(f"asked for step {step}, the snapshot says step {meta.get('step')}")
        ledger = LoaderState.from_dict(meta.get("loader_state") or {})
        if ledger.step != step:
            raise LoaderStateError(f"snapshot of step {step} carries a loader_state at step {ledger.step}")
        compute_s = meta.get("compute_s")
        if isinstance(compute_s, (int, float)) and compute_s >= 0:
            # This step we compute nothing and wait in the exchange for the healthy replicas' compute,
            # which can be longer than ftar_timeout_s: the snapshot says how long theirs takes.
            self.exchange.joiner_wait_s = self.exchange.engine.config.timeout_s + 2 * float(compute_s)
        self.state.load(result.tensors, meta.get("state") or {})
        self.progress.heal(ledger)
        self.compute.reset()
        self._kept = None

    # -- helpers ---------------------------------------------------------------------------------
    def _phase(self, phase: str, step: int) -> None:
        if self._on_phase is not None:
            self._on_phase(phase, step)

    def _emit(self, kind: str, **fields: Any) -> None:
        if self._on_event is not None and self._leader:
            self._on_event({"event": kind, "t": self.env.clock.now(), "replica_id": self.config.replica_id,
                            "rank": self.config.rank, **fields})

    def close(self) -> None:
        """Leave the job: first wait for a checkpoint write in flight (it commits, or fails and leaves no
        manifest: never a torn checkpoint that looks complete), then the Manager (lighthouse link, replica
        comm). The caller closes engine and server."""
        try:
            if self.checkpoints is not None:
                self.checkpoints.wait()
        finally:
            self.manager.close()


def build(*, config: TrainerConfig, env: Env, compute: Compute, layout: DataLayout, replica_ids: tuple[str, ...],
          manager_config: ManagerConfig, comm: ReplicaComm, lighthouse: LighthouseClient | None,
          exchange: GradientExchange, catchup: CatchupService, loader_store: LoaderStateStore, audit: AuditLog,
          checkpointer: Checkpointer | None = None, on_event: EventFn | None = None,
          on_phase: PhaseFn | None = None, make_progress: ProgressFn = DataProgress,
          overlap: OverlapExchange | None = None, joining: bool = False) -> FaultTolerantTrainer:
    """Resume (the checkpointer's latest complete checkpoint, else step 0), make the Manager with this
    rank's endpoints ({"ftar", "catchup"}) and the trainer's heal hook, and wire the trainer. `catchup`
    must be started. Raises ValueError for a catch-up service that is not started, and whatever the
    checkpointer's `restore` raises. `make_progress(replica_id=, state=)` makes the rank's DataProgress
    (the emulator shares the identical ledger transitions of a replica's ranks). Raises CatchupUsageError,
    naming what is wrong, for a state the catch-up service cannot publish in a job of several replicas (one
    that restarts or starts late heals from it): at once, not after the steps committed until it is needed.
    `joining`: this replica will heal from its peers at its first quorum (a restart): the receive buffer of
    that fetch is made now, its pages faulted in, in the background, before the replica checks in and
    off its peers' critical path (a fresh one faults in as the bytes arrive, while they wait); its size is
    the state a peer publishes (TrainState.peer_shapes: the optimizer's state too, before its first step),
    worked out in that background task too (only shapes and param groups are taken here). The trainer drops
    it at its first commit if no heal took it."""
    if not catchup.url:
        raise ValueError("start the catch-up service before build(): its URL is this rank's catch-up endpoint")
    start = checkpointer.restore(layout, replica_ids) if checkpointer is not None else None
    if layout.num_replicas > 1:  # what the optimizer's first step adds is checked by the reserve (or publish)
        try:
            catchup.check(compute.state.tensors(), {"state": compute.state.metadata()})
        except CatchupUsageError as e:
            raise CatchupUsageError(f"replica {config.replica_id} rank {config.rank}: its state cannot be published "
                                    f"for a replica of the {layout.num_replicas} to heal from: {e}") from None
    prepare = joining and layout.num_replicas > 1
    if prepare:
        catchup.prepare_fetch(peer_shapes(compute.state))
    step, ledger = start if start is not None else (0, LoaderState.initial(layout, replica_ids))
    endpoints = encode_endpoints({"ftar": exchange.engine.addr, "catchup": catchup.url})
    trainer: FaultTolerantTrainer | None = None

    def heal(q: StepQuorum) -> None:
        assert trainer is not None, "the Manager heals only inside train_step"
        trainer.heal(q)

    manager = Manager(config=manager_config, env=env, comm=comm, replica_id=config.replica_id,
                      lighthouse=lighthouse, step=step, data_addr=endpoints, heal=heal,
                      on_event=on_event if comm.rank == 0 else None)
    if lighthouse is not None:  # a hung peer's notice ends every rank's blocked all-reduce at once
        lighthouse.on_peer_hung = lambda rid, qid: exchange.abort_for_hung_peer(rid, qid, manager.rank_ftar_addrs())
    trainer = FaultTolerantTrainer(
        config=config, env=env, compute=compute, progress=make_progress(replica_id=config.replica_id, state=ledger),
        manager=manager, exchange=exchange, catchup=catchup, loader_store=loader_store, audit=audit,
        checkpointer=checkpointer, checkpointed=(step, ledger.lineage) if step > 0 else None, on_event=on_event,
        on_phase=on_phase, overlap=overlap, fetch_prepared=prepare)
    return trainer
