"""One emulated rank: the real FaultTolerantTrainer (ftrun.train.trainer), built with the emulator's seams.

    trainer = build(...)                      # the same build a real rank runs (ftrun.train.wiring)
    while not done: trainer.train_step()      # quorum, catch-up, compute, FTAR, 2PC, ledger, audit, LR

Everything is the runtime's own code (Manager, TreeComm / FlatComm, LighthouseClient, FtarEngine,
GradientExchange, the catch-up fetch protocol and server over env.net, DataProgress, the audit log,
checkpoint writer election, the LR intervention) except what the emulator supplies through seams:
the Env (its host's), shape-only compute with the job's timing effects (harness.run.seams), shape-only
catch-up payloads and snapshots, the mock object store for loader_state / audit / checkpoints, and the
folding of identical rings (harness.run.fold). This module only wires and records.
"""

from __future__ import annotations

from typing import Any

from ftrun.catchup.net_transport import NetCatchup
from ftrun.checkpoint.policy import CheckpointConfig
from ftrun.config import ManagerConfig
from ftrun.data.audit import AuditLog
from ftrun.data.loader_state import LoaderStateStore
from ftrun.env.base import EnvTimeout, NetError, TaskKilled
from ftrun.ftar.engine import FtarEngine
from ftrun.quorum.client import LighthouseClient, QuorumError
from ftrun.quorum.decide import Decision
from ftrun.replica.comm import ReplicaCommError
from ftrun.replica.manager import ReplicaError
from ftrun.replica.tree_comm import FlatComm, TreeComm
from ftrun.train.exchange import GradientExchange
from ftrun.train.lr import LRConfig
from ftrun.train.trainer import FaultTolerantTrainer, StepResult, TrainerConfig, build
from harness.run.fold import FoldedComm, LeadCatchup, LeadExchange, MirrorCatchup, MirrorExchange
from harness.run.ring_model import AnalyticFtarEngine
from harness.run.rank_view import RankIncarnation, RankJob
from harness.run.seams import (EmulatedCompute, FoldedProgress, ObjectStoreCheckpointer, OverheadExchange,
                               ShapePayloads, ShapeSnapshotStore, TimedCatchup)


# What ends a rank of a broken replica: its own collective or quorum failed, or its lead rank is gone.
REPLICA_DOWN = (ReplicaError, ReplicaCommError, QuorumError, NetError, EnvTimeout)


class TimedLighthouseClient(LighthouseClient):
    """The real client; records each round trip (ask -> decision; with ask-ahead, collect -> decision)
    for the report. Then the leader's start delay (train.rank_start_skew_s): a real leader process wakes for the
    decision late on a machine its job oversubscribes, and its quorum event and step start after that."""

    def __init__(self, *, job: RankJob, replica: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._job, self._replica = job, replica

    def quorum(self, step: int, **kwargs: Any) -> Decision:
        t_ask = self.env.clock.now()
        decision = super().quorum(step, **kwargs)
        return self._woke(decision, t_ask)

    def collect(self) -> Decision:
        """Ask-ahead's reply (ftrun.replica.ask_ahead): its request went out at the last commit, so the
        round is timed from when start_step needs the decision: what the step waits for it."""
        t_need = self.env.clock.now()
        return self._woke(super().collect(), t_need)

    def _woke(self, decision: Decision, t0: float) -> Decision:
        self._job.recorder.leader_asked(decision.quorum_id, decision.max_step, t0, self.env.clock.now())
        if skew := self._job.start_skew_s(self._replica, 0, f"{decision.quorum_id}/{decision.max_step}"):
            self.env.clock.sleep(skew)
        return decision


def rank_main(job: RankJob, inc: RankIncarnation, index: int) -> None:
    """Task body of one rank of one replica incarnation: rank inc.ranks[index], tree index `index`."""
    rank, env = inc.ranks[index], inc.envs[index]
    lead = inc.mirror is None or rank < inc.mirror.num_leads
    ok = False
    try:
        if inc.number > 0:  # start python, import, init state; warm up before checking in (paper §5)
            train = job.profile.train
            env.clock.sleep(job.profile.scheduler.process_start_s
                            + (train.first_step_extra_s if train.warmup_before_checkin else 0.0))
        elif job.profile.scheduler.first_start_s:  # the job's own start, replica by replica (a real launcher's)
            env.clock.sleep(job.profile.scheduler.first_start_s[inc.replica])
        _train(job, inc, rank, index, env, lead)
        ok = True
    except TaskKilled:
        raise
    except REPLICA_DOWN as e:
        job.rank_failed(inc, rank, e)
    except Exception as e:  # a bug: recorded, shown in the report, and the replica restarts
        job.rank_failed(inc, rank, e, unexpected=True)
    finally:
        if lead and inc.mirror is not None and not ok:
            inc.mirror.poison(ReplicaError(f"lead rank {rank} of {inc.replica_id} is gone"))
        job.rank_exited(inc, rank, ok)


def _comm(job: RankJob, inc: RankIncarnation, index: int, env: Any) -> Any:
    """The replica's comm among the ranks it runs (tree index `index`); a FoldedComm that adds, with rank folding,
    the full tree's latency (harness.run.fold), and with more than one rank, what a real collective costs per pass
    (network.replica_collective_pass_s)."""
    comm = _tree(job, inc, index, env)
    pass_s = job.profile.network.replica_collective_pass_s if len(inc.ranks) > 1 else 0.0
    return FoldedComm(comm, env, inc.tree_extra_s, pass_s) if inc.tree_extra_s or pass_s else comm


def _tree(job: RankJob, inc: RankIncarnation, index: int, env: Any) -> TreeComm:
    timeout = job.timeouts.replica_comm_s  # ranks wait in the broadcast while the leader waits for a quorum
    size = len(inc.ranks)
    if inc.prewired is not None:
        parent, children = inc.prewired[index]
        return TreeComm(rank=index, world_size=size, parent=parent, children=children, timeout_s=timeout,
                        fanout=job.options.fanout)
    cls = FlatComm if job.options.comm == "flat" else TreeComm
    listener = inc.listeners[index]
    try:
        return cls.build(env=env, rank=index, world_size=size, listener=listener, addrs=inc.addrs, token=job.token,
                         fanout=job.options.fanout, timeout_s=timeout)
    finally:
        listener.close()  # build closed it already, unless it failed before accepting
        inc.listeners[index] = None


class _Marks:
    """When this rank passed the phases of its current step (virtual seconds)."""

    __slots__ = ("quorum", "started", "exchange", "commit", "decided", "stepped")

    def __init__(self) -> None:
        self.quorum = self.started = self.exchange = self.commit = self.decided = 0.0
        self.stepped = False  # whether this rank has ended a step (committed or aborted)


def _compute(job: RankJob, inc: RankIncarnation, rank: int, env: Any, lead: bool) -> EmulatedCompute:
    p, train = job.profile, job.profile.train
    restarted = inc.number > 0
    extra_first = 0.0 if train.warmup_before_checkin else train.first_step_extra_s
    return EmulatedCompute(
        env=env, model=p.model, ranks_per_replica=p.ranks_per_replica, cache=job.shapes,
        step_time_s=train.step_compute_s, rng=job.rng, state=job.shape_state, lead=lead,
        extra_s=lambda step: (job.jitter_s(inc.replica, step) + job.compute_extra_s(inc, rank, step)
                              + (job.start_skew_s(inc.replica, rank, step) if rank else 0.0)  # rank 0's: at its quorum
                              + job.contention_extra_s() + job.replica_compute_extra_s()),
        first_extra_s=extra_first if restarted else 0.0,
        first_batch_s=train.first_batch_s if restarted else 0.0)


def _data_plane(job: RankJob, inc: RankIncarnation, rank: int, env: Any, lead: bool,
                marks: _Marks) -> tuple[Any, Any]:
    """(exchange, catch-up service): real FTAR and catch-up on leads, mirrors of them elsewhere."""
    leader, mirror = rank == 0, inc.mirror

    def fetched(t0: float, t1: float) -> None:
        marks.decided = t0  # the decision has arrived; catching up is not part of get_quorum
        if leader:
            job.recorder.span(inc.replica_id, inc.number, "ftrun::catchup::heal", t0, t1)

    if not lead:
        exchange = MirrorExchange(mirror=mirror, rank=rank, ftar_config=job.ftar_config, timeout_s=job.mirror_timeout_s)
        return exchange, TimedCatchup(MirrorCatchup(mirror=mirror, rank=rank, timeout_s=job.mirror_timeout_s), env,
                                      on_fetch=fetched)
    engine = (FtarEngine(env=env, kernels=job.kernels(), token=job.token, config=job.ftar_config)
              if job.ring_board is None else
              AnalyticFtarEngine(board=job.ring_board, cost=job.ring_cost(env.host), position=rank, env=env,
                                 kernels=job.kernels(), token=job.token, config=job.ftar_config))
    joiner_wait = job.timeouts.ftar_timeout_s + 2 * job.profile.train.step_compute_s  # others compute, then timeout
    exchange: Any = OverheadExchange(GradientExchange(engine=engine, rank=rank, joiner_wait_s=joiner_wait), env,
                                     job.ftar_overhead_s, lambda q: job.exchange_skew_s(inc.replica, rank, q),
                                     lambda q: job.retry_cpu_s((inc.replica, inc.number, rank), q))
    net = NetCatchup(env=env, token=job.token, config=job.catchup_config, payloads=ShapePayloads(),
                     store=lambda on_change: ShapeSnapshotStore(max_shard_bytes=job.catchup_config.max_shard_bytes,
                                                                on_change=on_change))
    catchup: Any = TimedCatchup(net, env, on_fetch=fetched, slow=job.slow_fetch,
                                extra_s=job.profile.train.catchup_fetch_extra_s)
    if mirror is not None:
        exchange, catchup = LeadExchange(exchange, mirror, rank), LeadCatchup(catchup, mirror, rank)
    return exchange, catchup


def _build(job: RankJob, inc: RankIncarnation, rank: int, index: int, env: Any, lead: bool,
           marks: _Marks) -> FaultTolerantTrainer:
    leader, p = rank == 0, job.profile
    comm = _comm(job, inc, index, env)
    client = TimedLighthouseClient(job=job, replica=inc.replica, env=env, addr=job.lighthouse_addr, token=job.token,
                                   replica_id=inc.replica_id, timeouts=job.timeouts) if leader else None
    if client is not None:
        client.connect()  # counted live from the start, so the first quorum waits for this replica
    exchange, catchup = _data_plane(job, inc, rank, env, lead, marks)
    checkpointer = (ObjectStoreCheckpointer(storage=job.checkpoint_storage, state_bytes=job.state_bytes_per_rank,
                                            clock=env.clock, stage_bytes_per_s=p.storage.checkpoint_stage_bytes_per_s)
                    if p.checkpoint is not None and leader else None)
    key = f"audit/{inc.replica_id}-{inc.number}.jsonl"
    audit = AuditLog((lambda data: job.storage.append(key, data)) if leader else _no_audit)  # a log file's append
    bookkeeping = p.train.step_bookkeeping_s

    def on_phase(phase: str, step: int) -> None:
        if phase == "quorum" and bookkeeping and lead and marks.stepped:
            # the script's own per-step work between a step's end and the next quorum request (measured after a
            # commit; a real rank's loop pays it after an aborted attempt too: its step event, hooks, wake-ups)
            env.clock.charge(bookkeeping)
            env.clock.sleep(bookkeeping)
        if phase in ("quorum", "started", "exchange"):
            setattr(marks, phase, env.clock.now())
        elif phase == "before_commit":
            marks.commit = env.clock.now()
        if phase == "exchange" and leader:
            job.entering_ftar(inc, step)
        elif phase == "started" and leader:
            job.step_started(inc, step)
        elif phase == "forward" and leader:
            job.step_forward(inc, step)

    config = TrainerConfig(replica_id=inc.replica_id, rank=rank, rng_seed=None, lr=LRConfig(policy=p.train.lr_intervention),
                           checkpoint=p.checkpoint or CheckpointConfig(), catchup=job.catchup_config)
    trainer = build(config=config, env=env, compute=_compute(job, inc, rank, env, lead), layout=job.data_layout,
                 replica_ids=job.replica_ids, manager_config=ManagerConfig(timeouts=job.timeouts), comm=comm,
                 lighthouse=client, exchange=exchange, catchup=catchup,
                 loader_store=LoaderStateStore(storage=job.storage), audit=audit, checkpointer=checkpointer,
                 on_event=(lambda e: job.leader_event(inc, e)) if leader else None, on_phase=on_phase,
                 make_progress=lambda **kw: FoldedProgress(cache=inc.ledgers, **kw))
    if job.diagnosis is not None:
        job.diagnosis.attach(inc, rank, env, exchange=exchange, comm=comm, client=client, trainer=trainer)
    return trainer


def _no_audit(data: bytes) -> None:
    """Ranks other than the leader write no audit records (the trainer appends on the leader only)."""


def _train(job: RankJob, inc: RankIncarnation, rank: int, index: int, env: Any, lead: bool) -> None:
    marks = _Marks()
    trainer = _build(job, inc, rank, index, env, lead, marks)
    leader = rank == 0
    trainer.manager.final_step = job.options.steps  # no early quorum request after the last step
    while trainer.step < job.options.steps and not job.finished:
        r = trainer.train_step()
        marks.stepped = True
        job.recorder.rank_started_step(r.quorum_id, r.step, marks.quorum, marks.decided if r.healed else marks.started)
        if leader:
            _leader_spans(job, inc, r, (marks.quorum, marks.started, marks.exchange, marks.commit, env.clock.now()))
            if r.committed:
                job.committed(inc, trainer.step)
    if trainer.checkpoints is not None:
        trainer.checkpoints.wait()  # a write still in flight commits, as a real rank's close waits for it


def _leader_spans(job: RankJob, inc: RankIncarnation, r: StepResult, t: tuple[float, ...]) -> None:
    work = "ftrun::catchup::zero_grad_step" if r.healed else "ftrun::train::forward_backward"
    names = ("ftrun::replica::start_step", work, "ftrun::ftar::all_reduce", "ftrun::replica::should_commit")
    for name, a, b in zip(names, t, t[1:]):
        job.recorder.span(inc.replica_id, inc.number, name, a, b)
