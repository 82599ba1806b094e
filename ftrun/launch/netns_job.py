"""`ftrun launch --netns-hosts N`: a local rehearsal of a multi-host job, network namespaces as hosts.

    ftrun launch --netns-hosts 4 --replicas 3 --ranks-per-replica 2 --kill-every 5s --steps 300 --json \\
        -m ftrun.train.ft_worker --step-time 0.05

The launcher builds N hosts (netns.NetnsHosts: one namespace each, a veth on a bridge, one address,
`tc` shaping: netem delay inside and between "buildings" plus a rate cap where the kernel has netem,
else a tbf rate cap only; the report's `shaping` says which). The lighthouse listens on host 0: its
sockets and threads are created inside host 0's namespace (netns.in_netns), so only the namespaces can
reach it. Each replica lives on one of the other hosts (host_faults.place_replicas): its ranks are forked
by the zygote and setns'd into the host (or spawned with `ip netns exec`), bind and advertise the host's
address, and rendezvous on a store the launcher opens inside that host. Every byte between replicas and
to the lighthouse crosses the bridge; nothing goes to the machine's own interfaces.

Failures (`--kill-every` / `--kill-random-mean`) are drawn among `--host-faults` (host_faults.py):
replica kill, host kill (every process in the host's namespace: `ip netns pids`), host cut (link down
for --cut-for, then up). The JSON's `hosts` is N (1 for a one-box job); it adds `host_layout` (each host's namespace,
address, building, role), `shaping` and `faults` (per kind); `failures_injected`
counts faults, not replicas.
"""

from __future__ import annotations

import argparse

from ftrun.env.real_store import bound_store
from ftrun.launch.job import Job
from ftrun.launch.host_faults import HostFaultPlan, place_replicas
from ftrun.launch.netns import HostLauncher, NetnsConfig, NetnsHosts, available, in_netns
from ftrun.launch.procs import Launcher
from ftrun.launch.worker_env import WorkerSpec
from ftrun.net import NetConfig
from ftrun.quorum.service import Lighthouse


def netns_config(args: argparse.Namespace) -> NetnsConfig:
    """The namespaces `args` asks for (ValueError naming what is wrong)."""
    return NetnsConfig(num_hosts=args.netns_hosts, delay_ms=args.netns_delay * 1e3, rate_mbit=args.netns_rate or None,
                       buildings=min(args.netns_buildings, args.netns_hosts),
                       cross_delay_ms=args.netns_cross_delay * 1e3)


def netns_problems(args: argparse.Namespace) -> list[str]:
    """What stops a --netns-hosts job from starting (checked before anything is built)."""
    if getattr(args, "netns_hosts", None) is None:
        return []
    out = []
    try:
        netns_config(args)
    except ValueError as e:
        out.append(f"--netns-hosts {args.netns_hosts}: {e}")
    if args.kill_at:
        out.append("--kill-at with --netns-hosts: use --kill-every or --kill-random-mean (host faults are timed)")
    if not out:
        ok, why = available()
        if not ok:
            out.append(f"--netns-hosts: network namespaces cannot be created here (needs root and iproute2): {why}")
    return out


class NetnsJob(Job):
    """Job with the lighthouse, stores and ranks placed on namespace hosts, and host faults."""

    def __init__(self, env, args, out, launcher, *, inject, say, hosts: NetnsHosts) -> None:
        self.hosts = hosts
        self.lighthouse_host, self.placement = place_replicas(args.replicas, len(hosts))
        self.cut_until: dict[int, float] = {}  # host -> when its link comes back
        self.faults: dict[str, int] = {}  # kind -> how many were injected
        super().__init__(env, args, out, launcher, inject=inject, say=say)
        if self.plan is not None:
            self.plan = HostFaultPlan(placement=self.placement, protected_hosts=frozenset({self.lighthouse_host}),
                                      every_s=args.kill_every, random_mean_s=args.kill_random_mean,
                                      kinds=tuple(args.host_faults), min_up=self.min_up, seed=args.seed)

    def make_lighthouse(self, bind: str = "") -> Lighthouse:
        host = self.hosts[self.lighthouse_host]
        with in_netns(host.namespace):  # its listener and threads live in host 0's network
            return super().make_lighthouse(bind=f"{host.addr}:0")

    def spec(self, i: int) -> WorkerSpec:
        h = self.hosts[self.placement[f"r{i}"]]
        return WorkerSpec(replica_id=f"r{i}", replica_index=i, num_replicas=self.args.replicas, rank=0,
                          ranks_per_replica=self.args.ranks_per_replica, incarnation=0, lighthouse=self.lighthouse.addr,
                          token=self.token, store_addr="", store_port=0, run_dir=self.out,
                          max_steps=self.args.steps, net=NetConfig(bind_host=h.addr),
                          host_slot=i * self.args.ranks_per_replica)  # the namespaces share this machine's GPUs

    def replica_store(self, rid: str) -> tuple[str, int]:
        h = self.hosts[self.placement[rid]]
        with in_netns(h.namespace):  # the replica's rendezvous store, reachable only on its host
            self.stores[rid] = bound_store(h.addr, timeout_s=60)
        return h.addr, self.stores[rid].port

    def launcher_for(self, rid: str, launcher: Launcher) -> Launcher:
        i = self.placement[rid]
        return HostLauncher(launcher, self.hosts[i].namespace,
                            {"GLOO_SOCKET_IFNAME": self.hosts.config.veth(i)[1]})  # FSDP's gloo group: the host's link

    def tick(self) -> None:
        now = self.env.clock.now()
        for host, at in list(self.cut_until.items()):
            if now >= at:
                del self.cut_until[host]
                self.hosts.restore(host)
                self.record({"event": "fault_end", "kind": "host_cut", "host": host, "t": now})
        super().tick()

    def inject_due(self, now: float, up: list[str]) -> None:
        cut = {r for r, h in self.placement.items() if h in self.cut_until}
        fault = self.plan.due(now, [r for r in up if r not in cut], [r for r in self.healthy() if r not in cut])
        if fault is None:
            return
        self.faults[fault.kind] = self.faults.get(fault.kind, 0) + 1
        self.record({"event": "fault", "kind": fault.kind, "host": fault.host, "replicas": list(fault.replicas),
                     "t": now, "step": self.stats.max_step})
        if fault.kind == "host_cut":
            self.hosts.cut(fault.host)
            self.cut_until[fault.host] = now + self.args.cut_for
            return
        for rid in fault.replicas:
            if rid in up:
                self.kill(rid, "injected", fault=fault.kind, host=fault.host)
        if fault.kind == "host_kill":
            self.hosts.kill(fault.host)  # and anything else running there

    host_cuts = True  # an injected host loss (`--inject "cut replica=R ..."`) cuts the replica's host off the network

    def cut_host(self, rid: str, cut: bool) -> None:
        host = self.placement[rid]
        if cut:
            self.hosts.cut(host)
            self.cut_until.setdefault(host, float("inf"))  # restored by the plan's uncut (or at close)
        elif self.cut_until.pop(host, None) is not None:
            self.hosts.restore(host)

    def close(self) -> None:
        for host in list(self.cut_until):
            self.cut_until.pop(host)
            try:
                self.hosts.restore(host)
            except Exception:  # noqa: BLE001 - the namespaces go away with the job anyway
                pass
        super().close()

    def host_figures(self) -> dict:
        return {"hosts": len(self.hosts), "host_layout": [{"index": h.index, "namespace": h.namespace, "addr": h.addr,
                           "building": self.hosts.config.building(h.index),
                           "lighthouse": h.index == self.lighthouse_host,
                           "replicas": sorted(r for r, i in self.placement.items() if i == h.index)}
                          for h in self.hosts.hosts],
                "shaping": self.hosts.shaping, "faults": dict(self.faults)}


def job_factory(hosts: NetnsHosts):
    """What run_job builds for --netns-hosts: a NetnsJob on `hosts`."""
    def make(env, args, out, launcher, *, inject, say):
        return NetnsJob(env, args, out, launcher, inject=inject, say=say, hosts=hosts)
    return make


def open_hosts(args: argparse.Namespace) -> NetnsHosts:
    hosts = NetnsHosts(netns_config(args))
    return hosts.__enter__()
