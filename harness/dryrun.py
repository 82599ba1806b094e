"""An emulated dry run: the real control plane for every emulated rank, on the virtual-time engine.

What runs for real, per rank: the Lighthouse (on its own emulated host), each replica's check-in,
quorum and two-phase commit (ftrun.replica.Manager over the O(log N) TreeComm on the emulated network;
the leader holds a LighthouseClient), failure detection (a killed replica's connections drop) and
rejoin as behind. What is modeled: compute (the profile's step time), the cross-replica gradient
exchange (ring all-reduce time from the model's gradient bytes, the participants, NIC bandwidth and
latency; every ring is identical, so they are folded into this one formula), and catch-up (the state
shard's bytes at NIC bandwidth). The report says so.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from ftrun.config import LighthouseConfig, ManagerConfig, Timeouts
from ftrun.env.base import NetError, TaskKilled
from ftrun.quorum.client import LighthouseClient, QuorumError
from ftrun.quorum.service import Lighthouse
from ftrun.replica.comm import ReplicaCommError
from ftrun.replica.manager import Manager, ReplicaError, StepQuorum
from ftrun.replica.tree_comm import TreeComm
from harness.engine import EmulatedWorld
from harness.profile import Profile

LIGHTHOUSE_HOST = "lighthouse"


@dataclass(frozen=True)
class Kill:
    replica: int
    at_step: int


def timeouts_of(profile: Profile) -> Timeouts:
    t = profile.timeouts
    return Timeouts(heartbeat_interval_s=t.heartbeat_interval_s, heartbeat_timeout_s=t.failure_timeout_s,
                    join_timeout_s=t.join_timeout_s, connect_timeout_s=t.connect_timeout_s,
                    quorum_timeout_s=max(30.0, 10 * t.failure_timeout_s), commit_timeout_s=t.failure_timeout_s,
                    ftar_timeout_s=t.failure_timeout_s)


def scripted_kills(profile: Profile) -> list[Kill]:
    return [Kill(e.replica, e.at_step) for e in profile.failures.events
            if e.kind == "kill_replica" and e.at_step is not None and e.replica is not None]


class DryRun:
    """One emulated job. `run()` returns the event log (dicts with virtual times)."""

    def __init__(self, profile: Profile, *, seed: int | None = None, kills: list[Kill] | None = None,
                 progress=None) -> None:
        self.p, self.kills = profile, sorted(kills if kills is not None else scripted_kills(profile),
                                             key=lambda k: k.at_step)
        self.world = EmulatedWorld.from_profile(profile, seed=seed)
        self.topo = self.world.topology
        self.timeouts = timeouts_of(profile)
        self.token = secrets.token_hex(8)
        self.log: list[dict] = []
        self.max_step = 0
        self.progress = progress
        self._incarnation = [0] * profile.replicas
        self.ranks_alive = 0

    # -- the job -------------------------------------------------------------------------------
    def run(self) -> list[dict]:
        self.world.run_on(LIGHTHOUSE_HOST, self._main)
        return self.log

    def _main(self) -> None:
        env = self.world.host_env(LIGHTHOUSE_HOST)
        lighthouse = Lighthouse(env=env, token=self.token,
                                config=LighthouseConfig(min_replicas=self.p.train.min_replicas, timeouts=self.timeouts))
        self.lighthouse_addr = lighthouse.start()
        for r in range(self.p.replicas):
            self._start_replica(r)
        pending = list(self.kills)
        poll = min(0.05, self.p.train.step_compute_s / 4)
        while self.max_step < self.p.train.steps:
            env.clock.sleep(poll)
            while pending and self.max_step >= pending[0].at_step:
                kill = pending.pop(0)
                self._kill_replica(kill.replica)
                env.spawn(self._restart_later, kill.replica, name=f"scheduler-r{kill.replica}")
        self.world_lighthouse = lighthouse

    def _kill_replica(self, r: int) -> None:
        self._record({"event": "kill", "replica_id": f"r{r}", "step": self.max_step})
        for host in self.topo.replica_hosts(r):
            self.world.kill_host(host)

    def _restart_later(self, r: int) -> None:
        env = self.world.host_env(LIGHTHOUSE_HOST)
        sched = self.p.scheduler
        env.clock.sleep(sched.alloc_delay_warm_s + sched.process_start_s)  # replacement host, then launch
        self._incarnation[r] += 1
        self._record({"event": "restart", "replica_id": f"r{r}", "incarnation": self._incarnation[r]})
        self._start_replica(r)

    def _start_replica(self, r: int) -> None:
        n = self.p.ranks_per_replica
        envs = [self.world.host_env(self.topo.host_of(r, k)) for k in range(n)]
        listeners = [envs[k].net.listen("127.0.0.1:0") for k in range(n)]
        addrs = [ln.addr for ln in listeners]
        for k in range(n):
            envs[k].spawn(self._rank_main, r, k, envs[k], listeners[k], addrs, self._incarnation[r],
                          name=f"r{r}.{self._incarnation[r]}/rank{k}")

    # -- one emulated rank ---------------------------------------------------------------------
    def _rank_main(self, r: int, k: int, env, listener, addrs: list[str], incarnation: int) -> None:
        rid, manager = f"r{r}", None
        try:
            comm = TreeComm.build(env=env, rank=k, world_size=len(addrs), listener=listener, addrs=addrs,
                                  fanout=16, timeout_s=self.timeouts.replica_comm_s)
            client = LighthouseClient(env=env, addr=self.lighthouse_addr, token=self.token, replica_id=rid,
                                      timeouts=self.timeouts) if k == 0 else None
            manager = Manager(config=ManagerConfig(timeouts=self.timeouts), env=env, comm=comm, replica_id=rid,
                              lighthouse=client, heal=lambda q: env.clock.sleep(self._catchup_s()),
                              on_event=(lambda e: self._record({**e, "incarnation": incarnation})) if k == 0 else None)
            self._train(env, manager, k == 0)
        except (ReplicaError, ReplicaCommError, QuorumError, NetError) as e:
            # A peer of this replica died: like a crashing process, drop every connection (the leader's
            # lighthouse link included) so nobody waits on a zombie; the scheduler restarts the replica.
            self._record({"event": "rank_failed", "replica_id": rid, "rank": k, "error": str(e)[:200]})
        except TaskKilled:
            return  # this host was killed: its connections are already gone
        if manager is not None:
            manager.close()

    def _train(self, env, manager: Manager, leader: bool) -> None:
        while manager.step < self.p.train.steps:
            t0 = env.clock.now()
            q = manager.start_step()
            if leader:
                self._record({"event": "quorum_time", "replica_id": manager.replica_id,
                              "seconds": env.clock.now() - t0})
            env.clock.sleep(self.p.train.step_compute_s)  # shape-only compute
            env.clock.sleep(self._ftar_s(q))  # folded ring all-reduce, modeled
            if manager.should_commit() and leader and manager.step > self.max_step:
                self.max_step = manager.step
                if self.progress is not None:
                    self.progress.update(1)

    # -- models --------------------------------------------------------------------------------
    def _ftar_s(self, q: StepQuorum) -> float:
        n = q.num_participants
        if n < 2:
            return 0.0
        grad = self.p.model.grad_bytes_per_rank(self.p.ranks_per_replica)
        net = self.p.network
        hop_latency = net.latency_s(self.topo.hop_class(self.topo.host_of(0, 0), self.topo.host_of(1, 0)))
        return 2 * (n - 1) / n * grad / net.host_nic_bytes_per_s + 2 * (n - 1) * hop_latency

    def _catchup_s(self) -> float:
        # parameters and two optimizer moments of this rank's shard, at NIC bandwidth
        state = 3 * self.p.model.grad_bytes_per_rank(self.p.ranks_per_replica)
        return state / self.p.network.host_nic_bytes_per_s

    def _record(self, event: dict) -> None:
        self.log.append({**event, "t": self.world.now})
