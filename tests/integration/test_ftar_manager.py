"""FTAR inside the replica step: a peer dying mid-exchange becomes a failed commit, never a crash."""

from __future__ import annotations

import numpy as np

from ftrun.config import LighthouseConfig, ManagerConfig, Timeouts
from ftrun.env.real import RealEnv
from ftrun.ftar.cpu_kernels import CpuKernels
from ftrun.ftar.engine import FtarConfig, FtarEngine
from ftrun.ftar.ring import RecoverableError
from ftrun.quorum.client import LighthouseClient
from ftrun.quorum.service import Lighthouse
from ftrun.replica.comm import LocalComm
from ftrun.replica.endpoints import encode_endpoints
from ftrun.replica.manager import Manager
from ftrun.train.exchange import GradientExchange

T = Timeouts(heartbeat_interval_s=0.05, heartbeat_timeout_s=1.0, join_timeout_s=0.3, quorum_timeout_s=10.0)


class DyingKernels(CpuKernels):
    """Kernels that drop the replica's connections (its process "dies") inside the n-th reduce."""

    def __init__(self):
        super().__init__()
        self.die_at, self.reduces, self.on_death = None, 0, None

    def reduce(self, *args):
        self.reduces += 1
        if self.die_at is not None and self.reduces == self.die_at:
            self.on_death()
        return super().reduce(*args)


class Replica:
    def __init__(self, env, lh, rid):
        self.kernels = DyingKernels()
        self.engine = FtarEngine(env=env, kernels=self.kernels, token="t",
                                 config=FtarConfig(chunk_bytes=1 << 16, num_chunks=2, timeout_s=10.0))
        self.client = LighthouseClient(env=env, addr=lh.addr, token="t", replica_id=rid, timeouts=T)
        self.client.connect()  # live before anyone asks, so the first quorum has all three
        self.manager = Manager(config=ManagerConfig(timeouts=T), env=env, comm=LocalComm(), replica_id=rid,
                               lighthouse=self.client, data_addr=encode_endpoints({"ftar": self.engine.addr}))
        self.exchange = GradientExchange(engine=self.engine, rank=0)
        self.value = float(rid[1:]) + 1.0  # this replica's "gradient"
        self.log = []

    def step(self, size):
        q = self.manager.start_step()
        grads = np.full(size, self.value, np.float32)
        try:
            self.exchange.average(q, grads)
        except RecoverableError as e:
            self.manager.report_error(e)
        committed = self.manager.should_commit()
        self.log.append((q.quorum_id, [p.replica_id for p in q.participants], committed, float(grads[0])))


def test_peer_death_mid_exchange_is_a_failed_commit_then_training_goes_on():
    env = RealEnv()
    lh = Lighthouse(env=env, config=LighthouseConfig(min_replicas=2, timeouts=T), token="t")
    lh.start()
    reps = [Replica(env, lh, f"r{i}") for i in range(3)]

    def steps(rep, sizes):
        for size in sizes:
            rep.step(size)

    big = 4 << 20  # 16 MB of float32: the victim dies after a few chunks of it

    def die():
        reps[2].engine._links.close()  # the victim's process "dies": its ring connections and lighthouse link drop
        reps[2].client.close()

    reps[2].kernels.on_death = die
    reps[2].kernels.die_at = 1_000_000  # armed below, once the first (small) step is done
    survivors = [env.spawn(steps, r, [1000, big, 1000], name=r.manager.replica_id) for r in reps[:2]]

    def victim_steps():
        reps[2].step(1000)
        reps[2].kernels.die_at = reps[2].kernels.reduces + 3
        reps[2].step(big)

    victim = env.spawn(victim_steps, name="r2")
    for t in survivors:
        assert t.join(30.0)
        assert t.exception is None, t.exception  # a healthy replica never crashes
    victim.join(30.0)
    for rep in reps[:2]:
        first, failed, retried = rep.log
        assert first == (first[0], ["r0", "r1", "r2"], True, 2.0)  # mean of 1, 2, 3
        assert failed[2] is False  # the big step's commit was refused
        assert retried[1] == ["r0", "r1"] and retried[2] is True and retried[0] > failed[0]
        assert retried[3] == 1.5  # mean of 1, 2 among the survivors
    assert reps[0].manager.step == reps[1].manager.step == 2
    for rep in reps[:2]:
        rep.manager.close()
        rep.engine.close()
    lh.stop()


def test_a_healing_replica_contributes_zeros_and_does_not_dilute_the_mean():
    env = RealEnv()
    lh = Lighthouse(env=env, config=LighthouseConfig(min_replicas=2, timeouts=T), token="t")
    lh.start()
    reps = [Replica(env, lh, f"r{i}") for i in range(3)]
    reps[0].manager.step = reps[1].manager.step = 5  # r2 (step 0) is behind: it heals and sends zeros
    tasks = [env.spawn(r.step, 1000, name=r.manager.replica_id) for r in reps]
    for t in tasks:
        assert t.join(30.0) and t.exception is None, t.exception
    for rep in reps:
        quorum_id, participants, committed, value = rep.log[0]
        assert participants == ["r0", "r1", "r2"] and committed
        assert value == 1.5  # mean of r0's 1 and r1's 2; r2's 3 is not trained this step
    assert {r.manager.step for r in reps} == {6}
    for rep in reps:
        rep.manager.close()
        rep.engine.close()
    lh.stop()
