"""A multi-host job on one machine: network namespaces as hosts (ftrun.launch.netns).

Host 0 runs `ftrun lighthouse` (token from a 0600 file), hosts 1-3 run replicas r0-r2 of
ftrun.train.ft_worker, each binding and advertising its host's only address; every byte between them
crosses the bridge (with a rate cap, and netem delay where the kernel has it). The test supervises like
`ftrun launch`: it restarts a replica whose process died, on the same host. Scenarios, in one job:
- host kill: every process on r1's host is SIGKILLed; r1 restarts there and catches up across hosts;
- host cut off: r2's link goes down for longer than the heartbeat timeout, r0 and r1 go on without it,
  the link comes back and r2 heals from them across hosts (in place, or restarted after it gave up);
- at the end: every committed step bitwise identical across replicas, and exactly-once data.
A second test runs the README's torchrun recipe across hosts: one `torchrun --nproc-per-node 2` per host
(sharded replicas), r1's link cut and restored, r1 healing per rank from r0 across hosts. A third runs one
replica across two hosts (torchrun multi-node); a fourth checks that FTAR between hosts uses the network.
Skips when namespaces cannot be created (needs root / CAP_NET_ADMIN and iproute2).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Callable

import pytest

from ftrun.data.audit import audit, read_log
from ftrun.data.loader_state import LoaderState
from ftrun.env.base import EnvTimeout
from ftrun.env.real import RealEnv
from ftrun.launch.netns import NetnsHosts, NetnsLauncher
from ftrun.launch.supervisor import ReplicaProcesses
from ftrun.launch.worker_env import WorkerSpec
from ftrun.net import NetConfig, write_token_file
from tests.integration.test_ft_training import check_bitwise, check_exactly_once
from tests.integration.test_torchrun import _events

pytestmark = [pytest.mark.netns, pytest.mark.timeout(170)]

IDS = ("r0", "r1", "r2")
PORT = 29510
WORKER = ["-m", "ftrun.train.ft_worker", "--steps", "100000", "--step-time", "0.05", "--ftar-timeout", "3"]


@pytest.fixture
def hosts(netns_hosts):
    return netns_hosts(4, delay_ms=0.2, rate_mbit=1000)  # 0.2 ms per link and direction (a "rack"); 1 Gbit/s


class Job:
    """The lighthouse on host 0, replica i on host i + 1; `pump` feeds events and restarts crashed replicas."""

    def __init__(self, hosts: NetnsHosts, run_dir: Path) -> None:
        self.env, self.hosts, self.run_dir = RealEnv(), hosts, run_dir
        token_file = str(run_dir / "job.token")
        write_token_file(token_file, "netns-job-token")
        with open(run_dir / "lighthouse.log", "ab") as log:
            self.lighthouse = hosts.popen(0, [sys.executable, "-m", "ftrun.cli", "lighthouse", "--bind",
                                              f"{hosts[0].addr}:{PORT}", "--min-replicas", "2", "--join-timeout", "3"],
                                          env={**os.environ, "FTRUN_TOKEN_FILE": token_file}, stdout=log, stderr=log)
        self.events = self.env.queue()
        argv = WORKER + ["--stop-file", str(run_dir / "stop")]
        self.replicas = {rid: ReplicaProcesses(
            env=self.env, events=self.events, log_dir=str(run_dir), argv=argv, launcher=NetnsLauncher(hosts, i + 1),
            spec=WorkerSpec(replica_id=rid, replica_index=i, num_replicas=len(IDS), rank=0, ranks_per_replica=1,
                            incarnation=0, lighthouse=f"{hosts[0].addr}:{PORT}", token="netns-job-token",
                            store_addr="", store_port=0, run_dir=str(run_dir), net=NetConfig(bind_host=hosts[i + 1].addr)))
            for i, rid in enumerate(IDS)}
        self.log: list[dict] = []
        self._by_kind: dict[str, list[dict]] = defaultdict(list)
        self.exits: dict[tuple[str, int], int] = {}

    def start(self) -> None:
        for rep in self.replicas.values():
            rep.start()

    def pump(self, until: Callable[[], bool], timeout: float = 40.0) -> None:
        deadline = self.env.clock.now() + timeout
        while not until():
            if self.env.clock.now() > deadline:
                raise AssertionError(f"timed out; last events: {self.log[-6:]}\n{self.worker_logs()}")
            for rid, rep in self.replicas.items():  # restart a crashed replica on its host, as ftrun launch does
                code = rep.exited()[0]
                if code is not None and (rid, rep.spec.incarnation) not in self.exits:
                    rep.drain()  # its last events (a clean exit's "final") are queued before the exit is recorded
                    self.exits[(rid, rep.spec.incarnation)] = code
                    if code != 0:
                        rep.restart()
            try:
                while True:
                    ev = self.events.get(timeout=0.05)
                    self.log.append(ev)
                    self._by_kind[ev["event"]].append(ev)
            except EnvTimeout:
                pass

    def of(self, kind: str, rid: str | None = None, incarnation: int | None = None) -> list[dict]:
        return [e for e in self._by_kind[kind] if rid in (None, e["replica_id"]) and incarnation in (None, e["incarnation"])]

    def commits(self, rid: str | None = None, incarnation: int | None = None) -> list[dict]:
        return [e for e in self.of("step", rid, incarnation) if e["committed"]]

    def max_step(self) -> int:
        return max((e["step"] + 1 for e in self.commits()), default=0)

    def worker_logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-1200:]}" for p in sorted(self.run_dir.glob("*.log")))

    def finish(self) -> None:
        (self.run_dir / ".stop").write_text(str(self.max_step() + 3))
        os.replace(self.run_dir / ".stop", self.run_dir / "stop")
        self.pump(lambda: all(self.exits.get((r, rep.spec.incarnation)) == 0 for r, rep in self.replicas.items()))

    def close(self) -> None:
        for rep in self.replicas.values():
            rep.kill()
        self.lighthouse.kill()
        self.lighthouse.wait()


def test_training_across_namespace_hosts_survives_a_host_kill_and_a_cut_link(hosts, tmp_path):
    job = Job(hosts, tmp_path)
    try:
        job.start()
        job.pump(lambda: all(job.commits(r) for r in IDS), timeout=60)

        # host kill: every process on r1's host
        kill_at = job.max_step()
        killed = hosts.kill(2)
        assert killed, "r1's host ran no process"
        job.pump(lambda: bool(job.of("heal", "r1", 1)) and len(job.commits("r1", 1)) >= 3)
        assert job.exits[("r1", 0)] == -9
        heal = job.of("catchup", "r1", 1)[0]
        assert heal["num_bytes"] > 0
        # fetched over the bridge from the other replicas' hosts, at the addresses they advertised
        assert {_host(url) for url, n in heal["bytes_by_source"].items() if n} <= {hosts[1].addr, hosts[3].addr}

        # host cut off, longer than the heartbeat timeout (2 s): the others go on without it
        cut_at, r2_before = job.max_step(), len(job.of("heal", "r2"))
        hosts.cut(3)
        job.pump(lambda: len({e["step"] for e in job.commits() if e["step"] >= cut_at}) >= 5
                 and all(len([e for e in job.commits(r) if e["step"] >= cut_at]) >= 3 for r in ("r0", "r1")))
        assert not [e for e in job.commits("r2") if e["step"] >= cut_at + 2], "r2 committed while cut off"
        hosts.restore(3)
        job.pump(lambda: len(job.of("heal", "r2")) > r2_before
                 and len([e for e in job.commits("r2") if e["step"] > job.of("heal", "r2")[-1]["step"]]) >= 3)

        job.finish()
        steps = check_bitwise(job)
        report, final = check_exactly_once(job, finished=True)
        print(f"\n[netns] shaping: {hosts.shaping}; {steps} committed (step, lineage) pairs identical; "
              f"{len(report.trained)} batches trained exactly once; r1 healed {heal['num_bytes']} bytes in "
              f"{heal['seconds']:.3f}s across hosts; r2 after the cut: incarnations "
              f"{sorted({i for (r, i) in job.exits if r == 'r2'})}, exits {job.exits}; r0's longest gap between "
              f"commits after the host kill {_stall(job, kill_at):.2f}s, after the cut {_stall(job, cut_at):.2f}s")
    finally:
        job.close()


def _stall(job: Job, from_step: int, num_steps: int = 30) -> float:
    """r0's longest time between two consecutive commits over the steps after `from_step` (a figure)."""
    times = sorted(e["t"] for e in job.commits("r0") if from_step <= e["step"] < from_step + num_steps)
    return max((b - a for a, b in zip(times, times[1:])), default=0.0)


def _host(url: str) -> str:
    return url.rpartition("://")[2].rpartition(":")[0]


    return out


def test_one_torchrun_per_host_with_sharded_replicas_heals_across_a_cut_link(hosts, tmp_path):
    """r0 and r1 as `torchrun --standalone --nproc-per-node 2` on hosts 1 and 2 (torchrun's store and the
    replica's gloo groups inside the host; FTAR and catch-up across hosts): r1's link is cut, r0 goes on,
    the link comes back and r1 heals per rank from r0; identical shards and exactly-once data at the end."""
    token_file = str(tmp_path / "job.token")
    write_token_file(token_file, "netns-torchrun-token")
    base = {**{k: v for k, v in os.environ.items() if not k.startswith("FTRUN_")}, "FTRUN_TOKEN_FILE": token_file,
            "OMP_NUM_THREADS": "1"}
    procs, outs = [], [tmp_path / "r0.out", tmp_path / "r1.out"]
    with open(tmp_path / "lighthouse.log", "ab") as log:
        procs.append(hosts.popen(0, [sys.executable, "-m", "ftrun.cli", "lighthouse", "--bind", f"{hosts[0].addr}:{PORT}",
                                     "--min-replicas", "1", "--join-timeout", "3"], env=base, stdout=log, stderr=log,
                                 start_new_session=True))
    try:
        for i in range(2):
            env = {**base, "FTRUN_REPLICA_ID": f"r{i}", "FTRUN_NUM_REPLICAS": "2", "FTRUN_LIGHTHOUSE": f"{hosts[0].addr}:{PORT}",
                   "FTRUN_BIND_HOST": hosts[i + 1].addr, "FTRUN_RUN_DIR": str(tmp_path)}
            with open(outs[i], "wb") as out, open(tmp_path / f"r{i}.err", "wb") as err:
                procs.append(hosts.popen(i + 1, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                 "--nproc-per-node", "2", "--max-restarts", "2", *WORKER,
                                                 "--stop-file", str(tmp_path / "stop")],
                                         env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True))
        events = lambda i: _events(outs[i])  # noqa: E731
        commits = lambda i: [e for e in events(i) if e["event"] == "step" and e["committed"]]  # noqa: E731

        def wait(cond, what: str, timeout: float = 60.0) -> None:
            env = RealEnv()
            deadline = env.clock.now() + timeout
            while not cond():
                failed = [p.poll() for p in procs[1:] if p.poll() not in (None, 0)]
                if env.clock.now() > deadline or failed:
                    raise AssertionError(f"{what}: timed out or a torchrun failed {failed}\n"
                                         f"{(tmp_path / 'r1.err').read_text()[-2000:]}")
                env.clock.sleep(0.2)

        wait(lambda: len({e["step"] for e in commits(1) if e["participants"] == ["r0", "r1"]}) >= 3, "both replicas train",
             timeout=120)
        cut_at, heals_before = max(e["step"] for e in commits(0)), len([e for e in events(1) if e["event"] == "catchup"])
        hosts.cut(2)
        wait(lambda: len({e["step"] for e in commits(0) if e["step"] > cut_at and e["participants"] == ["r0"]}) >= 5,
             "r0 goes on alone")
        hosts.restore(2)
        wait(lambda: len([e for e in events(1) if e["event"] == "catchup"]) > heals_before, "r1 heals after the cut")
        heal = [e for e in events(1) if e["event"] == "catchup"][-1]
        healed_at = heal["step"]
        assert heal["num_bytes"] > 0 and {_host(u) for u, n in heal["bytes_by_source"].items() if n} == {hosts[1].addr}
        wait(lambda: len({e["step"] for e in commits(1) if e["step"] > healed_at}) >= 2, "r1 commits after healing")
        stop = max(e["step"] for e in commits(0) + commits(1)) + 3
        (tmp_path / ".stop").write_text(str(stop))
        os.replace(tmp_path / ".stop", tmp_path / "stop")
        assert [p.wait(timeout=60) for p in procs[1:]] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    finals = {(i, e["rank"]): e for i in range(2) for e in events(i) if e["event"] == "final"}
    assert sorted(finals) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(finals[(0, r)]["param_hash"] == finals[(1, r)]["param_hash"] for r in (0, 1)), "replicas diverged"
    final = LoaderState.from_dict(finals[(0, 0)]["loader_state"])
    assert final.step == stop and len({json.dumps(e["loader_state"], sort_keys=True) for e in finals.values()}) == 1
    records = [r for path in sorted(tmp_path.glob("audit-*.jsonl")) for r in read_log(path.read_bytes())[0]]
    report = audit(records, final=final)
    assert report.ok, report.summary()
    print(f"\n[netns torchrun] shaping: {hosts.shaping}; cut at step {cut_at}, r1 healed to step {healed_at}; "
          f"{len(report.trained)} batches trained exactly once; final step {stop}")


RING_PROBE = """
import sys, numpy as np
from ftrun.env.real import RealEnv
from ftrun.ftar.cpu_kernels import CpuKernels
from ftrun.ftar.engine import FtarEngine
me, ring = int(sys.argv[1]), sys.argv[2].split(",")
engine = FtarEngine(env=RealEnv(), kernels=CpuKernels(), token="t", bind=ring[me])
engine.reconfigure(epoch=1, ring=ring, index=me, timeout=30)
buf = np.full(1 << 18, me + 1, np.float32)
engine.all_reduce(buf)
print(",".join(engine.transports), float(buf.min()), float(buf.max()), flush=True)
engine.close()
"""


def test_ftar_between_namespace_hosts_goes_over_the_network_and_within_a_host_through_shared_memory(hosts):
    """Namespaces share the machine's memory, but a ring link between two hosts must use the network
    they were given (the one shaped and cut), while two ranks on one host still share memory."""
    ring = [f"{hosts[1].addr}:4100", f"{hosts[1].addr}:4101", f"{hosts[2].addr}:4100"]
    on_host = [1, 1, 2]
    procs = [hosts.popen(on_host[i], [sys.executable, "-c", RING_PROBE, str(i), ",".join(ring)], stdout=subprocess.PIPE,
                         text=True) for i in range(3)]
    got = [p.communicate(timeout=60)[0].split() for p in procs]
    assert [g[0] for g in got] == ["socket,shared", "shared,socket", "socket,socket"]  # (from previous, to next)
    assert all(g[1:] == ["6.0", "6.0"] for g in got)


def test_a_replica_spanning_two_hosts_trains_in_step_with_one_on_a_single_host(netns_hosts, tmp_path):
    """r0's two ranks on hosts 1 and 2 (torchrun multi-node: its store on host 1, the replica's gloo
    groups across the bridge: FTRUN_BIND_HOST for ftrun's control group, GLOO_SOCKET_IFNAME for FSDP's),
    r1's two ranks on host 3: the same shard of both replicas ends bitwise identical."""
    hosts = netns_hosts(4)
    token_file = str(tmp_path / "job.token")
    write_token_file(token_file, "netns-multinode-token")
    base = {**{k: v for k, v in os.environ.items() if not k.startswith("FTRUN_")}, "FTRUN_TOKEN_FILE": token_file,
            "OMP_NUM_THREADS": "1", "FTRUN_NUM_REPLICAS": "2", "FTRUN_LIGHTHOUSE": f"{hosts[0].addr}:{PORT}",
            "FTRUN_RUN_DIR": str(tmp_path)}
    worker, torchrun = ["-m", "ftrun.train.ft_worker", "--steps", "8"], [sys.executable, "-m", "torch.distributed.run"]
    procs = [hosts.popen(0, [sys.executable, "-m", "ftrun.cli", "lighthouse", "--bind", f"{hosts[0].addr}:{PORT}",
                             "--min-replicas", "2"], env=base, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)]
    outs = {}
    try:
        for node, host in enumerate((1, 2)):
            env = {**base, "FTRUN_REPLICA_ID": "r0", "FTRUN_BIND_HOST": hosts[host].addr,
                   "GLOO_SOCKET_IFNAME": hosts.config.veth(host)[1]}
            argv = [*torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node), "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"{hosts[1].addr}:29400", "--rdzv-id", "r0", "--local-addr", hosts[host].addr,
                    *(["--rdzv-conf", "is_host=1"] if node == 0 else []), *worker]
            outs[("r0", node)] = tmp_path / f"r0.{node}.out"
            with open(outs[("r0", node)], "wb") as out, open(tmp_path / f"r0.{node}.err", "wb") as err:
                procs.append(hosts.popen(host, argv, env=env, stdout=out, stderr=err, start_new_session=True))
        outs[("r1", 0)] = tmp_path / "r1.out"
        with open(outs[("r1", 0)], "wb") as out, open(tmp_path / "r1.err", "wb") as err:
            procs.append(hosts.popen(3, [*torchrun, "--standalone", "--nproc-per-node", "2", *worker],
                                     env={**base, "FTRUN_REPLICA_ID": "r1", "FTRUN_BIND_HOST": hosts[3].addr},
                                     stdout=out, stderr=err, start_new_session=True))
        codes = [p.wait(timeout=150) for p in procs[1:]]
        assert codes == [0, 0, 0], (tmp_path / "r0.1.err").read_text()[-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    finals = {(rid, e["rank"]): e for (rid, _), path in outs.items() for e in _events(path) if e["event"] == "final"}
    assert sorted(finals) == [("r0", 0), ("r0", 1), ("r1", 0), ("r1", 1)]
    assert all(e["step"] == 8 for e in finals.values())
    assert all(finals[("r0", r)]["param_hash"] == finals[("r1", r)]["param_hash"] for r in (0, 1)), "replicas diverged"
