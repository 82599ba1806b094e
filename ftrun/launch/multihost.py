"""`ftrun launch --hosts FILE --host-index I`: one job over the hosts a file lists.

Run the same command on every host, each with its own --host-index (the token in FTRUN_TOKEN_FILE, a
0600 file, or FTRUN_TOKEN, the same on every host):

    ftrun launch --hosts hosts.txt --host-index 0 --replicas 3 --steps 500 --json -m ftrun.train.ft_worker
    ftrun launch --hosts hosts.txt --host-index 1 --replicas 3 --steps 500 --json -m ftrun.train.ft_worker  # ...

The hosts file has one address per line (blank lines and # comments ignored); line I is host I. Host 0
runs the launcher and the lighthouse, bound at its address; every other host runs an agent (agent.py) at
its address and --agent-port, until the launcher says bye. Replicas are placed round-robin on hosts
1..N-1 (all on host 0 when the file lists one host), all ranks of a replica on one host, each rank
binding and advertising its host's address and meeting its replica's other ranks on a store the agent
opens on that host. The launcher follows every rank through its agent (remote.py) and copies their
stdout/stderr into OUT/logs and their audit files into OUT, so events.jsonl, metrics.jsonl, the
exactly-once audit and the report cover every host. Kills (--kill-every, ...) go through the agents.
"""

from __future__ import annotations

import argparse
import ipaddress
import os

from ftrun.env.admission import ListenLimits
from ftrun.env.real import RealEnv
from ftrun.env.real_store import bound_store
from ftrun.launch.agent import Agent
from ftrun.launch.job import Job
from ftrun.launch.host_faults import place_replicas
from ftrun.launch.procs import Launcher
from ftrun.launch.remote import RemoteLauncher
from ftrun.launch.worker_env import WorkerSpec, first_host_slots
from ftrun.net import NetConfig, load_token
from ftrun.quorum.service import Lighthouse


def parse_hosts(text: str, *, source: str = "hosts file") -> list[str]:
    """The addresses a hosts file lists, in order; ValueError naming the line that is wrong. Pure."""
    hosts = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if len(line.split()) != 1:
            raise ValueError(f"{source} line {n}: expected one address per line, got {raw.strip()!r}")
        try:
            if ipaddress.ip_address(line).is_unspecified:
                raise ValueError(f"{source} line {n}: {line} is not an address peers can reach")
        except ValueError as e:
            if "line" in str(e):
                raise
            if not all(part and part.replace("-", "").isalnum() for part in line.split(".")):
                raise ValueError(f"{source} line {n}: {line!r} is neither an IP address nor a host name") from None
        hosts.append(line)
    if not hosts:
        raise ValueError(f"{source} lists no host")
    if len(set(hosts)) != len(hosts):
        raise ValueError(f"{source} lists a host twice")
    return hosts


def hosts_problems(args: argparse.Namespace) -> list[str]:
    """What stops a --hosts launch from starting; [] when there is no --hosts."""
    if getattr(args, "hosts", None) is None:
        return [] if getattr(args, "host_index", None) is None else ["--host-index needs --hosts FILE"]
    out = []
    try:
        with open(args.hosts) as f:
            hosts = parse_hosts(f.read(), source=f"--hosts {args.hosts}")
    except (OSError, ValueError) as e:
        return [f"--hosts {args.hosts}: {getattr(e, 'strerror', None) or e}"]
    if args.host_index is None or not 0 <= args.host_index < len(hosts):
        out.append(f"--host-index must be 0..{len(hosts) - 1} (this host's line in {args.hosts}), "
                   f"got {args.host_index}")
    if args.netns_hosts is not None:
        out.append("--hosts and --netns-hosts: choose one")
    try:
        if load_token(os.environ) is None:
            out.append("--hosts: set FTRUN_TOKEN_FILE (a 0600 file) or FTRUN_TOKEN to the job token, the same on "
                       "every host")
    except ValueError as e:
        out.append(f"--hosts: {e}")
    return out


def read_hosts(path: str) -> list[str]:
    with open(path) as f:
        return parse_hosts(f.read(), source=f"--hosts {path}")


def run_agent(args: argparse.Namespace, out: str, limits: ListenLimits) -> int:
    """This host's agent (--host-index > 0): serve the launcher until it says bye; its listener capped by `limits`."""
    hosts = read_hosts(args.hosts)
    agent = Agent(env=RealEnv(net_limits=limits), token=load_token(os.environ),
                  bind=f"{hosts[args.host_index]}:{args.agent_port}", out=out,
                  fork_server=args.start_method == "fork-server")
    print(f"ftrun launch: host {args.host_index} agent at {agent.addr}, files in {out}", flush=True)
    agent.serve()
    return 0


class MultiHostJob(Job):
    """Job with the lighthouse on host 0's address and each replica's ranks on its host, through agents."""

    def __init__(self, env, args, out, launcher, *, inject, say, hosts: list[str]) -> None:
        self.host_addrs = hosts
        self.lighthouse_host, self.placement = place_replicas(args.replicas, len(hosts))
        self.first_slots = first_host_slots(self.placement, args.ranks_per_replica)
        job = os.path.basename(os.path.normpath(out)) or "job"
        self.remotes = {i: RemoteLauncher(env, f"{hosts[i]}:{args.agent_port}", load_token(os.environ), job=job,
                                          run_dir=out) for i in sorted(set(self.placement.values())) if i != 0}
        argv = (["-m", args.script] if args.module else [args.script]) + list(args.script_args)
        ready = [env.spawn(remote.prepare, argv, name="agent-prepare") for remote in self.remotes.values()]
        for task in ready:  # every host's zygote loads at once, before any replica starts
            task.join(200.0)
        super().__init__(env, args, out, launcher, inject=inject, say=say)

    def job_token(self) -> str:
        return load_token(os.environ)

    def make_lighthouse(self, bind: str = "") -> Lighthouse:
        return super().make_lighthouse(bind=f"{self.host_addrs[0]}:0")

    def spec(self, i: int) -> WorkerSpec:
        host = self.placement[f"r{i}"]
        return WorkerSpec(replica_id=f"r{i}", replica_index=i, num_replicas=self.args.replicas, rank=0,
                          ranks_per_replica=self.args.ranks_per_replica, incarnation=0, lighthouse=self.lighthouse.addr,
                          token=self.token, store_addr="", store_port=0,
                          run_dir=self.out, max_steps=self.args.steps, net=NetConfig(bind_host=self.host_addrs[host]),
                          host_slot=self.first_slots[f"r{i}"])

    def replica_store(self, rid: str) -> tuple[str, int]:
        host = self.placement[rid]
        if host != 0:
            return self.host_addrs[host], self.remotes[host].store_port(rid)
        self.stores[rid] = bound_store(self.host_addrs[0], timeout_s=60)
        return self.host_addrs[0], self.stores[rid].port

    def launcher_for(self, rid: str, launcher: Launcher) -> Launcher:
        host = self.placement[rid]
        return launcher if host == 0 else self.remotes[host]

    def close(self) -> None:
        super().close()
        for remote in self.remotes.values():
            remote.close()  # the last bytes every host wrote

    def host_figures(self) -> dict:
        return {"hosts": len(self.host_addrs), "host_layout": [
            {"index": i, "addr": addr, "lighthouse": i == self.lighthouse_host,
             "replicas": sorted(r for r, h in self.placement.items() if h == i)}
            for i, addr in enumerate(self.host_addrs)]}


def job_factory(hosts: list[str], made: list[MultiHostJob]):
    def make(env, args, out, launcher, *, inject, say):
        job = MultiHostJob(env, args, out, launcher, inject=inject, say=say, hosts=hosts)
        made.append(job)
        return job
    return make


def say_bye(jobs: list[MultiHostJob]) -> None:
    """The job is over: every agent kills what it still runs and exits."""
    told = set()
    for job in jobs:
        for i, remote in job.remotes.items():
            if i in told:
                remote.client.close()
            else:
                told.add(i)
                remote.bye()
