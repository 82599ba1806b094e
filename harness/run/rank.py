"""One emulated rank: the same loop a real rank runs (compare ftrun/launch/demo_worker.py), on its host's Env.

    q = manager.start_step()                  # leader: lighthouse round trip; all: decision over the tree
    compute.forward_backward()                # shape-only (mocks.compute): the profile's step time
    exchange.average(q, grads)                # real FTAR engine on ShapeOnly buffers
    manager.should_commit()                   # 2PC vote over the tree

With folded FTAR, a rank that is not one of its replica's lead ranks (dataplane.py) replaces the middle
two lines by one wait for its lead's outcome: same virtual time, same error, one resume instead of two.

Everything here is the runtime's own code (Manager, TreeComm / FlatComm, LighthouseClient,
FtarEngine, GradientExchange) except what the emulator must supply: the Env, the shape-only compute,
buffers and kernels, the catch-up transfer model, and the folding of identical rings (dataplane.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ftrun.config import ManagerConfig
from ftrun.env.base import EnvTimeout, NetError, TaskKilled
from ftrun.ftar.engine import FtarEngine
from ftrun.ftar.ring import RecoverableError
from ftrun.quorum.client import LighthouseClient, QuorumError
from ftrun.quorum.decide import Decision
from ftrun.replica.comm import ReplicaCommError
from ftrun.replica.endpoints import encode_endpoints
from ftrun.replica.manager import Manager, ReplicaError
from ftrun.replica.tree_comm import FlatComm, TreeComm
from ftrun.train.exchange import GradientExchange
from harness.run.dataplane import MirroredCall, ShapeCatchupServer, shape_only_heal
from mocks.compute import ShapeOnlyCompute

if TYPE_CHECKING:
    from harness.run.job import EmulatedJob, Incarnation

# What ends a rank of a broken replica: its own collective or quorum failed, or its lead rank is gone.
REPLICA_DOWN = (ReplicaError, ReplicaCommError, QuorumError, NetError, EnvTimeout)


class TimedLighthouseClient(LighthouseClient):
    """The real client; records each round trip (ask -> decision) for the report."""

    def __init__(self, *, job: "EmulatedJob", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._job = job

    def quorum(self, step: int, **kwargs: Any) -> Decision:
        t_ask = self.env.clock.now()
        decision = super().quorum(step, **kwargs)
        self._job.recorder.leader_asked(decision.quorum_id, decision.max_step, t_ask, self.env.clock.now())
        return decision


def rank_main(job: "EmulatedJob", inc: "Incarnation", rank: int) -> None:
    """Task body of one rank of one replica incarnation."""
    env = inc.envs[rank]
    lead = inc.mirror is None or rank < inc.mirror.num_leads
    ok = False
    try:
        if inc.number > 0:  # start python, import, init state; warm up before checking in (paper §5)
            train = job.profile.train
            env.clock.sleep(job.profile.scheduler.process_start_s
                            + (train.first_step_extra_s if train.warmup_before_checkin else 0.0))
        _train(job, inc, rank, env, lead)
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


def _comm(job: "EmulatedJob", inc: "Incarnation", rank: int, env: Any) -> TreeComm:
    timeout = job.timeouts.replica_comm_s  # ranks wait in the broadcast while the leader waits for a quorum
    if inc.prewired is not None:
        parent, children = inc.prewired[rank]
        return TreeComm(rank=rank, world_size=inc.world_size, parent=parent, children=children, timeout_s=timeout,
                        fanout=job.options.fanout)
    cls = FlatComm if job.options.comm == "flat" else TreeComm
    listener = inc.listeners[rank]
    try:
        return cls.build(env=env, rank=rank, world_size=inc.world_size, listener=listener, addrs=inc.addrs,
                         fanout=job.options.fanout, timeout_s=timeout)
    finally:
        listener.close()  # the tree is wired; nothing else connects here
        inc.listeners[rank] = None


class _Rank:
    """What one rank holds: its Manager, its slice of the data plane, its compute. Built by `_setup`."""

    def __init__(self, **parts: Any) -> None:
        self.__dict__.update(parts)


def _setup(job: "EmulatedJob", inc: "Incarnation", rank: int, env: Any, lead: bool) -> _Rank:
    """Wire the rank as a real one would: replica comm, FTAR engine and catch-up server (leads only),
    the leader's lighthouse client, the Manager with its heal hook, shape-only compute."""
    leader, now, rec = rank == 0, env.clock.now, job.recorder
    comm = _comm(job, inc, rank, env)
    engine = FtarEngine(env=env, kernels=job.kernels(), token=job.token, config=job.ftar_config) if lead else None
    server = ShapeCatchupServer(env) if lead else None
    endpoints = encode_endpoints({"ftar": engine.addr, "catchup": server.addr}) if engine and server else ""
    client = TimedLighthouseClient(job=job, env=env, addr=job.lighthouse_addr, token=job.token,
                                   replica_id=inc.replica_id, timeouts=job.timeouts) if leader else None
    if client is not None:
        client.connect()  # counted live from the start, so the first quorum waits for this replica
    heal_call = MirroredCall(inc.mirror, rank, "heal", job.mirror_timeout_s)
    heal_fn = job.slowed_heal(inc, env, shape_only_heal(env=env, rank=rank, state_bytes=job.state_bytes_per_rank,
                                                        timeout_s=job.timeouts.catchup_timeout_s))
    r = _Rank(leader=leader, lead=lead, decided_at=0.0)

    def heal(q) -> None:
        t0 = r.decided_at = now()  # the decision has arrived; catching up is not part of get_quorum
        heal_call(heal_fn, q)
        if leader:
            rec.span(inc.replica_id, inc.number, "ftrun::catchup::heal", t0, now())

    p = job.profile
    r.manager = Manager(config=ManagerConfig(timeouts=job.timeouts), env=env, comm=comm, replica_id=inc.replica_id,
                        lighthouse=client, data_addr=endpoints, heal=heal,
                        on_event=(lambda e: job.leader_event(inc, e)) if leader else None)
    r.compute = ShapeOnlyCompute(env=env, model=p.model, ranks_per_replica=p.ranks_per_replica, cache=job.shapes,
                                 step_time_s=p.train.step_compute_s)
    r.grads = r.compute.grad_buffer()
    joiner_wait = job.timeouts.ftar_timeout_s + 2 * p.train.step_compute_s  # the others compute, then the timeout
    r.exchange = (GradientExchange(engine=engine, rank=rank, joiner_wait_s=joiner_wait)
                  if engine is not None else None)
    r.ftar_call = MirroredCall(inc.mirror, rank, "ftar", job.mirror_timeout_s)
    return r


def _train(job: "EmulatedJob", inc: "Incarnation", rank: int, env: Any, lead: bool) -> None:
    r = _setup(job, inc, rank, env, lead)
    train = job.profile.train
    manager, now = r.manager, env.clock.now
    extra_first = 0.0 if train.warmup_before_checkin else train.first_step_extra_s
    first = True
    while manager.step < job.options.steps and not job.finished:
        t0 = now()
        q = manager.start_step()
        t1 = now()
        job.recorder.rank_started_step(q.quorum_id, q.step, t0, r.decided_at if q.healed else t1)
        restarted_first = first and inc.number > 0
        first = False
        if lead and q.healed:
            # Caught up this step: it trains nothing and contributes a zero gradient (paper §4.3), entering
            # the all-reduce at once, where it waits for the others. Its first batch loads meanwhile.
            env.clock.sleep(train.first_batch_s if restarted_first else 0.0)
        elif lead:
            extra = (extra_first + train.first_batch_s) if restarted_first else 0.0  # the first-step effect
            r.compute.forward_backward(extra_s=extra + job.jitter_s(inc.replica, q.step)
                                       + job.compute_extra_s(inc, rank, q.step))
        t2 = now()
        if r.leader:
            job.entering_ftar(inc, q.step)
        try:  # a mirroring rank waits out its lead's compute and exchange in this one call
            r.ftar_call(r.exchange.average if r.exchange is not None else None, q, r.grads)
        except RecoverableError as e:
            manager.report_error(e, peer=True)  # a peer died or stalled: not this replica's own failure
        t3 = now()
        committed = manager.should_commit()
        if r.leader:
            _leader_spans(job, inc, q.healed, (t0, t1, t2, t3, now()))
            if committed:
                job.committed(inc, manager.step)


def _leader_spans(job: "EmulatedJob", inc: "Incarnation", healed: bool, t: tuple[float, ...]) -> None:
    work = "ftrun::catchup::zero_grad_step" if healed else "ftrun::train::forward_backward"
    names = ("ftrun::replica::start_step", work, "ftrun::ftar::all_reduce", "ftrun::replica::should_commit")
    for name, a, b in zip(names, t, t[1:]):
        job.recorder.span(inc.replica_id, inc.number, name, a, b)
