"""The replica manager's quorum and two-phase commit, with ranks as threads on TreeComm."""

from __future__ import annotations

import pytest

from ftrun.config import LighthouseConfig, ManagerConfig, Timeouts
from ftrun.env.real import RealEnv
from ftrun.quorum.client import LighthouseClient
from ftrun.quorum.service import Lighthouse
from ftrun.replica.lifecycle import LifecycleError, Phase, transition
from ftrun.replica.manager import Manager, ReplicaGaveUp
from ftrun.replica.tree_comm import FlatComm, TreeComm

T = Timeouts(heartbeat_interval_s=0.05, heartbeat_timeout_s=1.0, join_timeout_s=0.3, quorum_timeout_s=5.0,
             commit_timeout_s=5.0)


def build_replica(env, lh, rid, num_ranks, *, step=0, max_retries=3, heal=None, events=None, comm_cls=TreeComm,
                  ask_ahead=False):
    """Managers for every rank of one replica (built concurrently, as separate processes would)."""
    listeners = [env.net.listen("127.0.0.1:0") for _ in range(num_ranks)]
    addrs = [ln.addr for ln in listeners]
    managers = [None] * num_ranks

    def make(rank):
        comm = comm_cls.build(env=env, rank=rank, world_size=num_ranks, listener=listeners[rank], addrs=addrs,
                              token="t", fanout=2, timeout_s=5.0)
        client = LighthouseClient(env=env, addr=lh.addr, token="t", replica_id=rid, timeouts=T) if rank == 0 else None
        if client is not None:
            client.connect()  # live before any replica asks, so the first quorum has every replica
        managers[rank] = Manager(config=ManagerConfig(max_retries=max_retries, timeouts=T, ask_ahead=ask_ahead),
                                 env=env, comm=comm,
                                 replica_id=rid, lighthouse=client, step=step, data_addr=f"{rid}/{rank}",
                                 heal=heal, on_event=events.append if events is not None else None)

    run_all(env, [lambda r=r: make(r) for r in range(num_ranks)])
    for ln in listeners:
        ln.close()
    return managers


def run_all(env, fns):
    results = [None] * len(fns)

    def call(i):
        results[i] = fns[i]()

    tasks = [env.spawn(call, i, name=f"t{i}") for i in range(len(fns))]
    for t in tasks:
        assert t.join(20.0), "task hung"
        if t.exception is not None:
            raise t.exception
    return results


def step_all(env, managers, fail=frozenset()):
    """One step on every rank; ranks in `fail` (as (replica, rank)) report an error."""
    def one(m):
        q = m.start_step()
        if (m.replica_id, m.comm.rank) in fail:
            m.report_error(RuntimeError("injected"))
        return q, m.should_commit()

    return run_all(env, [lambda m=m: one(m) for m in managers])


@pytest.fixture
def lighthouse():
    env = RealEnv()
    lh = Lighthouse(env=env, config=LighthouseConfig(min_replicas=2, timeouts=T), token="t")
    lh.start()
    yield env, lh
    lh.stop()


def test_all_ok_commits_and_one_failing_rank_aborts_its_replica(lighthouse):
    env, lh = lighthouse
    a, b = build_replica(env, lh, "a", 3), build_replica(env, lh, "b", 3)
    out = step_all(env, a + b)
    assert all(committed for _, committed in out) and all(m.step == 1 for m in a + b)
    q0 = out[0][0]
    assert [p.replica_id for p in q0.participants] == ["a", "b"]
    # each rank holds only its column of the address table: rank r of every participant
    assert [q.peer_addrs for q, _ in out] == [(f"a/{r}", f"b/{r}") for r in range(3)] * 2
    assert all(p.data_addrs == () for p in q0.participants)
    out = step_all(env, a + b, fail={("a", 2)})
    assert [c for _, c in out] == [False] * 3 + [True] * 3  # the whole replica a discards; b commits
    assert [m.step for m in a + b] == [1] * 3 + [2] * 3
    # a retries: it is behind now, heals to b's step, and its failure bumped the quorum id; with
    # min_replicas=2 that step has one contributor (b), so nobody commits it ...
    out = step_all(env, a + b)
    assert not any(c for _, c in out)
    assert out[0][0].quorum_id > q0.quorum_id and out[0][0].healed and out[0][0].num_contributors == 1
    assert {m.step for m in a + b} == {2}
    out = step_all(env, a + b)  # ... and both train it next
    assert all(c for _, c in out) and {m.step for m in a + b} == {3}


def test_behind_replica_heals_through_the_hook(lighthouse):
    env, lh = lighthouse
    healed = []
    events = []
    a = build_replica(env, lh, "a", 2, step=7)
    b = build_replica(env, lh, "b", 2, step=0, heal=healed.append, events=events)
    out = step_all(env, a + b)  # one contributor < min_replicas=2: healed, not committed
    assert not any(c for _, c in out) and {m.step for m in a + b} == {7}
    assert len(healed) == 2 and healed[0].step == 7 and healed[0].healed
    out = step_all(env, a + b)
    assert all(c for _, c in out) and {m.step for m in a + b} == {8}
    assert [e["event"] for e in events if e["rank"] == 0] == ["quorum", "heal", "abort", "quorum", "commit"]
    assert events[0]["replica_id"] == "b" and "quorum_id" in events[0]


def test_gives_up_after_max_retries(lighthouse):
    env, lh = lighthouse
    a, b = build_replica(env, lh, "a", 1, max_retries=1), build_replica(env, lh, "b", 1, max_retries=1)
    step_all(env, a + b, fail={("a", 0)})
    with pytest.raises(ReplicaGaveUp, match="max_retries=1"):
        step_all(env, a + b, fail={("a", 0)})
    assert a[0].phase is Phase.FAILED


def test_flat_and_tree_comm_agree(lighthouse):
    env, lh = lighthouse
    a = build_replica(env, lh, "a", 5, comm_cls=FlatComm)
    b = build_replica(env, lh, "b", 5)
    out = step_all(env, a + b)
    assert all(c for _, c in out)
    gathered = run_all(env, [lambda m=m: m.comm.all_gather_bytes(bytes([m.comm.rank])) for m in a])
    assert gathered == [[bytes([r]) for r in range(5)]] * 5


@pytest.mark.parametrize("world_size,fanout", [(1, 2), (2, 2), (13, 2), (40, 3), (9, 16)])
def test_tree_gather_and_scatter_reach_the_right_ranks(world_size, fanout):
    """Gather lands every rank's bytes at the root in rank order; scatter gives rank r exactly chunk r,
    through subtrees of every shape (deep binary trees, partial last levels, a flat fan)."""
    env = RealEnv()
    listeners = [env.net.listen("127.0.0.1:0") for _ in range(world_size)]
    addrs = [ln.addr for ln in listeners]
    comms = run_all(env, [lambda r=r: TreeComm.build(env=env, rank=r, world_size=world_size, listener=listeners[r],
                                                     addrs=addrs, token="t", fanout=fanout, timeout_s=10)
                                for r in range(world_size)])
    try:
        gathered = run_all(env, [lambda c=c: c.gather_bytes(b"x" * c.rank) for c in comms])
        assert gathered[0] == [b"x" * r for r in range(world_size)] and gathered[1:] == [None] * (world_size - 1)
        chunks = [f"to-{r}".encode() for r in range(world_size)]
        got = run_all(env, [lambda c=c: c.scatter_bytes(chunks if c.rank == 0 else None) for c in comms])
        assert got == chunks
        assert run_all(env, [lambda c=c: c.all_reduce_int([c.rank], "sum") for c in comms])[0] == [sum(range(world_size))]
    finally:
        for c, ln in zip(comms, listeners):
            c.close()
            ln.close()


def test_lifecycle_table_rejects_illegal_transitions():
    assert transition(Phase.IDLE, "start") is Phase.QUORUM
    assert transition(Phase.TRAINING, "fail") is Phase.FAILED
    with pytest.raises(LifecycleError, match="'commit' is not allowed in phase training"):
        transition(Phase.TRAINING, "commit")


def test_a_failed_heal_fails_the_replica_cleanly(lighthouse):
    from ftrun.replica.manager import ReplicaError

    env, lh = lighthouse

    def broken_heal(q):
        raise ConnectionError("every source is gone")

    a = build_replica(env, lh, "a", 1, step=3)
    b = build_replica(env, lh, "b", 1, step=0, heal=broken_heal)
    results = {}

    def one(m):
        try:
            m.start_step()
            results[m.replica_id] = "ok"
        except ReplicaError as e:
            results[m.replica_id] = str(e)

    run_all(env, [lambda m=m: one(m) for m in a + b])
    assert results["a"] == "ok" and "healing replica b to step 3 failed: every source is gone" in results["b"]
    assert b[0].phase is Phase.FAILED


def test_failures_a_peer_caused_do_not_spend_the_own_budget(lighthouse):
    env, lh = lighthouse
    a, b = build_replica(env, lh, "a", 1, max_retries=1), build_replica(env, lh, "b", 1, max_retries=1)

    def peer_failed(m):
        m.start_step()
        m.report_error(ConnectionError("the ring peer left"), peer=True)
        return m.should_commit()

    for _ in range(3):  # three failed commits in a row, all caused by a peer: more than max_retries=1
        assert run_all(env, [lambda m=m: peer_failed(m) for m in a + b]) == [False, False]
    assert all(m.step == 0 and m.phase is Phase.IDLE for m in a + b)
    out = step_all(env, a + b)
    assert all(c for _, c in out) and {m.step for m in a + b} == {1}
