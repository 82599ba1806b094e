"""Run one chaos schedule with real processes and collect what the invariants need.

`ScheduleRun(schedule, ...).run()` starts an in-process lighthouse (state dir under the schedule's
folder, heartbeat and join timeouts of 1 s) and R replicas x K ranks of `ftrun.train.ft_worker` through
the launcher machinery (ReplicaProcesses over a Launcher: forked from the chaos run's zygote), a few
ms of compute per step. It supervises them as `ftrun launch` does (a crashed replica restarts after
RESTART_DELAY_S; once the job has committed its last step nothing restarts, and replicas not done
after FINISH_GRACE_S are stopped) and injects the schedule's faults as the job reaches their steps:

- kill / stop / slow: an entry in the job's fault file (the worker's one grammar, ftrun.train.inject),
  restricted to the replica's incarnation that will run that step; the rank announces it on stdout
  ({"event": "fault"}) before acting, and a stopped rank gets SIGCONT after `seconds`. In the catch-up
  phase the driver first SIGKILLs the replica so that its next incarnation heals.
- lighthouse: `Lighthouse.stop()` (connections dropped), a new one `seconds` later on the same address
  and state dir.
- joiner: that replica starts once the job reaches the step.
- corrupt: a byte of the loader_state slot is flipped in place.
- partition (only with `hosts`, a netns.NetnsHosts of replicas + 1 hosts): the lighthouse lives on host 0
  (its sockets and threads made inside host 0's namespace, as netns_job does), replica ri's ranks on host
  i + 1 (netns.HostLauncher, binding and advertising the host's address, with a rendezvous store on that
  host); the fault takes the replica's host link down and brings it up `seconds` later.

Afterwards it tears everything down and looks for what was left behind: processes whose environment
names this schedule's run dir, /dev/shm files named after one of its rank processes.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import secrets
import signal
from contextlib import nullcontext

from ftrun.chaos.invariants import Observation
from ftrun.chaos.schedule import PROCESS_KINDS, Fault, Schedule
from ftrun.config import LighthouseConfig, Timeouts
from ftrun.data.audit import read_log
from ftrun.data.loader_state import DataError, LoaderStateStore
from ftrun.env.base import EnvTimeout
from ftrun.env.real import RealEnv
from ftrun.launch.netns import HostLauncher, NetnsHosts, in_netns
from ftrun.launch.procs import Launcher
from ftrun.launch.supervisor import ReplicaProcesses
from ftrun.launch.worker_env import WorkerSpec
from ftrun.net import NetConfig
from ftrun.quorum.service import Lighthouse
from ftrun.storage import FileStorage
from ftrun.train.inject import DieAt

WORKER = "ftrun.train.ft_worker"
RESTART_DELAY_S = 0.3
FINISH_GRACE_S = 2.0  # after the goal (or the last SIGCONT): how long the other replicas get to finish
STEP_TIME_S = 0.02
LIGHTHOUSE_BIND_TRIES = 20  # 0.1 s apart


class ScheduleRun:
    def __init__(self, schedule: Schedule, *, env: RealEnv, launcher: Launcher, workdir: str,
                 timeout_s: float = 120.0, step_time_s: float = STEP_TIME_S, hosts: NetnsHosts | None = None) -> None:
        self.s, self.env, self.launcher, self.timeout_s = schedule, env, launcher, timeout_s
        if hosts is not None and len(hosts) < schedule.replicas + 1:
            raise ValueError(f"ScheduleRun needs {schedule.replicas + 1} namespace hosts, got {len(hosts)}")
        if hosts is None and any(f.kind == "partition" for f in schedule.faults):
            raise ValueError("a schedule with partition faults needs namespace hosts (hosts=)")
        self.hosts = hosts
        self._cut_until: dict[int, float] = {}  # host -> when its link comes back
        self.run_dir = os.path.join(os.path.abspath(workdir), f"schedule-{schedule.seed}-{schedule.index}")
        self.step_time_s = step_time_s
        self.events: list[dict] = []
        self.faults_injected = 0
        self.partitions_injected = 0
        self._armed: list[str] = []  # fault-file entries
        self._pending = [f for f in schedule.faults if f.kind != "joiner"]
        self._joiner = schedule.joiner
        self._max_step = 0  # steps committed by the job (highest committed step + 1)
        self._resume: list[tuple[float, int]] = []  # (when, pid) to SIGCONT
        self._restart_at: dict[str, float] = {}
        self._done: set[str] = set()
        self._pids: set[int] = set()
        self._lighthouse_back_at: float | None = None
        self._goal_at: float | None = None
        self._lighthouses: list[Lighthouse] = []  # every incarnation of it: their histories hold the rewinds
        self._last_resume = 0.0
        self.t_goal: float | None = None  # seconds from start to the job's last step (for progress lines)

    # -- setup and teardown -------------------------------------------------------------------------
    def _lighthouse(self, bind: str) -> Lighthouse:
        """A lighthouse on `bind` over the schedule's state dir (a restart retries its address for 2 s)."""
        config = LighthouseConfig(min_replicas=self.s.min_replicas,
                                  timeouts=Timeouts(heartbeat_timeout_s=1.0, join_timeout_s=1.0))
        for attempt in range(LIGHTHOUSE_BIND_TRIES):
            lh = Lighthouse(env=self.env, token=self.token, storage=self.lh_storage, bind=bind, config=config)
            try:
                with self._on_host(0):  # with hosts: its listener and threads live in host 0's network
                    lh.start()
                self._lighthouses.append(lh)
                break
            except OSError:
                if attempt == LIGHTHOUSE_BIND_TRIES - 1:
                    raise
                self.env.clock.sleep(0.1)
        return lh

    def _on_host(self, i: int):
        return in_netns(self.hosts[i].namespace) if self.hosts is not None else nullcontext()

    def _replica(self, i: int, argv: list[str], store) -> ReplicaProcesses:
        """Replica ri: on the machine's loopback, or (with hosts) on host i + 1 with its own store there."""
        spec = WorkerSpec(replica_id=f"r{i}", replica_index=i, num_replicas=self.s.replicas, rank=0,
                          ranks_per_replica=self.s.ranks_per_replica, incarnation=0, lighthouse=self.lh_addr,
                          token=self.token, store_addr="127.0.0.1", store_port=store.port if store else 0,
                          run_dir=self.run_dir, max_steps=self.s.steps)
        launcher = self.launcher
        if self.hosts is not None:
            h = self.hosts[i + 1]
            port = 0
            if self.s.ranks_per_replica > 1:
                from ftrun.env.real_store import bound_store
                with in_netns(h.namespace):  # the replica's rendezvous store, reachable only on its host
                    self._stores.append(bound_store(h.addr, timeout_s=60))
                port = self._stores[-1].port
            spec = dataclasses.replace(spec, store_addr=h.addr, store_port=port, net=NetConfig(bind_host=h.addr))
            ifname = self.hosts.config.veth(i + 1)[1]  # FSDP's gloo group: the host's link
            launcher = HostLauncher(self.launcher, h.namespace, {"GLOO_SOCKET_IFNAME": ifname})
        return ReplicaProcesses(env=self.env, events=self.queue, log_dir=self.run_dir, argv=argv, launcher=launcher,
                                spec=spec)

    def run(self) -> Observation:
        os.makedirs(self.run_dir)
        self.token = secrets.token_hex(16)
        self.lh_storage = FileStorage(os.path.join(self.run_dir, "lighthouse"))
        bind = f"{self.hosts[0].addr}:0" if self.hosts is not None else "127.0.0.1:0"
        self.lighthouse: Lighthouse | None = self._lighthouse(bind)
        self.lh_addr = self.lighthouse.addr
        store = None
        self._stores: list = []
        if self.s.ranks_per_replica > 1 and self.hosts is None:
            from ftrun.env.real_store import bound_store
            store = bound_store("127.0.0.1", timeout_s=60)
        self.queue = self.env.queue()
        self.fault_file = os.path.join(self.run_dir, "faults.json")
        argv = ["-m", WORKER, "--step-time", str(self.step_time_s), "--ftar-timeout", "2",
                "--fault-file", self.fault_file]
        self.replicas = {f"r{i}": self._replica(i, argv, store) for i in range(self.s.replicas)}
        self._started: set[str] = set()
        self._t0 = self.env.clock.now()
        timed_out = False
        try:
            for rid in self.replicas:
                if self._joiner is None or rid != self._joiner.replica:
                    self._start(rid)
            deadline = self._t0 + self.timeout_s
            while not self._finished():
                if self.env.clock.now() > deadline:
                    timed_out = True
                    break
                self._tick()
        except BaseException:
            self._teardown()
            if self.lighthouse is not None:
                self.lighthouse.stop()
            raise
        self._teardown()
        obs = self._observe(timed_out)
        del store
        self._stores.clear()
        return obs

    def _start(self, rid: str) -> None:
        rep = self.replicas[rid]
        if rid in self._started:
            rep.restart()  # the next incarnation
        else:
            rep.start()
        self._started.add(rid)
        self._pids.update(p.pid for p in rep.procs)

    def _restore_links(self, now: float | None = None) -> None:
        """Bring back every cut link (those due by `now`; all when None)."""
        for host, at in list(self._cut_until.items()):
            if now is None or now >= at:
                del self._cut_until[host]
                assert self.hosts is not None
                self.hosts.restore(host)
                self._last_resume = self.env.clock.now()  # the replica gets its grace from here
                self.events.append({"event": "chaos_end", "fault": f"partition of host {host} healed",
                                    "t": self.env.clock.now(), "step": self._max_step})

    def _teardown(self) -> None:
        self._restore_links()
        for _, pid in self._resume:
            _signal(pid, signal.SIGCONT)
        for rep in self.replicas.values():
            rep.kill()
        for rep in self.replicas.values():
            rep.drain()
        self._pull(0.0)
        if self.lighthouse is None and self._lighthouse_back_at is not None:
            self.lighthouse = self._lighthouse(self.lh_addr)

    # -- the supervision loop -----------------------------------------------------------------------
    def _finished(self) -> bool:
        """The job reached its goal and every replica is done, or the stragglers had their grace: from the
        goal, or from the last resumed stop, whichever is later."""
        if self._goal_at is None:
            return False
        running = [r for r in self._started if r not in self._done]
        since = max(self._goal_at, self._last_resume)
        return not running or (not self._resume and not self._cut_until
                               and self.env.clock.now() - since > FINISH_GRACE_S)

    def _tick(self) -> None:
        self._pull(0.05)
        now = self.env.clock.now()
        for when, pid in [r for r in self._resume if r[0] <= now]:
            _signal(pid, signal.SIGCONT)
            self._resume.remove((when, pid))
            self._last_resume = now
        self._restore_links(now)
        if self._lighthouse_back_at is not None and now >= self._lighthouse_back_at:
            self._lighthouse_back_at = None
            self.lighthouse = self._lighthouse(self.lh_addr)
        for rid, rep in self.replicas.items():
            if rid not in self._started or rid in self._done or rid in self._restart_at:
                continue
            codes = rep.exited()
            if all(c is None for c in codes):
                continue
            if all(c == 0 for c in codes) or self._goal_at is not None:
                if any(c is None for c in codes):
                    continue  # its other ranks are finishing
                self._done.add(rid)
            elif any(c not in (None, 0) for c in codes):
                rep.kill()
                self._restart_at[rid] = now + RESTART_DELAY_S
        for rid, at in list(self._restart_at.items()):
            if self._goal_at is not None:
                del self._restart_at[rid]
                self._done.add(rid)
            elif now >= at:
                del self._restart_at[rid]
                self._start(rid)
        if self._goal_at is None:
            self._inject(now)

    def _pull(self, wait: float) -> None:
        while True:
            try:
                ev = self.queue.get(timeout=wait)
            except EnvTimeout:
                return
            wait = 0.0
            self._record(ev)

    def _record(self, ev: dict) -> None:
        self.events.append(ev)
        kind = ev.get("event")
        if kind == "step" and ev.get("committed"):
            self._max_step = max(self._max_step, ev["step"] + 1)
            if self._max_step >= self.s.steps and self._goal_at is None:
                self._goal_at = self.env.clock.now()
                self.t_goal = self._goal_at - self._t0
        elif kind == "fault":
            self.faults_injected += 1
            if ev.get("action") == "stop":
                rep = self.replicas[ev["replica_id"]]
                if rep.spec.incarnation == ev["incarnation"] and ev["rank"] < len(rep.procs):
                    self._resume.append((self.env.clock.now() + float(ev.get("seconds", 1.0)),
                                         rep.procs[ev["rank"]].pid))

    # -- faults -------------------------------------------------------------------------------------
    def _inject(self, now: float) -> None:
        if self._joiner is not None and self._max_step >= self._joiner.step:
            self._driver_fault(self._joiner)
            self._start(self._joiner.replica)
            self._joiner = None
        for f in list(self._pending):
            if f.kind in PROCESS_KINDS and self._max_step >= f.step - 1:
                self._pending.remove(f)
                self._arm(f)
            elif f.kind not in PROCESS_KINDS and self._max_step >= f.step:
                self._pending.remove(f)
                if f.kind == "lighthouse" and self.lighthouse is not None:
                    self._driver_fault(f)
                    self.lighthouse.stop()
                    self.lighthouse = None
                    self._lighthouse_back_at = now + f.seconds
                elif f.kind == "corrupt":
                    self._corrupt(f)
                elif f.kind == "partition":
                    self._partition(f, now)

    def _arm(self, f: Fault) -> None:
        rid = f.replica
        assert rid is not None and f.phase is not None
        if rid not in self._started:
            return  # a joiner not there yet: the fault never happens
        rep = self.replicas[rid]
        incarnation = rep.spec.incarnation + (1 if rid in self._restart_at else 0)
        if f.phase == "heal" and rid not in self._restart_at:
            self._driver_fault(f, "kill before catch-up")
            rep.kill()
            self._restart_at[rid] = self.env.clock.now() + RESTART_DELAY_S
            incarnation += 1
        plan = DieAt(phase=f.phase, step=f.step, replica=rid, incarnation=incarnation, rank=f.rank, action=f.kind,
                     seconds=f.seconds)
        self._armed.append(plan.encode())
        _write_atomic(self.fault_file, json.dumps({"die_at": ";".join(self._armed)}))

    def _driver_fault(self, f: Fault, what: str | None = None) -> None:
        self.faults_injected += 1
        self.events.append({"event": "chaos", "fault": what or f.describe(), "t": self.env.clock.now(),
                            "step": self._max_step})

    def _partition(self, f: Fault, now: float) -> None:
        assert self.hosts is not None and f.replica is not None
        host = int(f.replica[1:]) + 1
        if f.replica not in self._started or host in self._cut_until:
            return  # a joiner not there yet, or already cut: the fault never happens
        self._driver_fault(f)
        self.partitions_injected += 1
        self.hosts.cut(host)
        self._cut_until[host] = now + f.seconds

    def _corrupt(self, f: Fault) -> None:
        path = os.path.join(self.run_dir, "loader_state", f"slot-{f.rank}")
        try:
            with open(path, "r+b") as fh:
                data = fh.read()
                if not data:
                    return
                at = len(data) // 2
                fh.seek(at)
                fh.write(bytes([data[at] ^ 0x5A]))
        except FileNotFoundError:
            return
        self._driver_fault(f)

    # -- what was left ------------------------------------------------------------------------------
    def _observe(self, timed_out: bool) -> Observation:
        records, problems = [], []
        for path in sorted(glob.glob(os.path.join(self.run_dir, "audit-*.jsonl"))):
            with open(path, "rb") as fh:
                data = fh.read()
            try:
                recs, probs = read_log(data, name=os.path.basename(path))
            except DataError as e:
                recs, probs = [], [str(e)]
            records += recs
            problems += probs
        try:
            disk, disk_error = LoaderStateStore(storage=FileStorage(self.run_dir)).load(), None
        except DataError as e:  # no slot readable: a finding of the loader_state check, not a driver error
            disk, disk_error = None, str(e)
        down = []
        lh = self.lighthouse
        try:
            if lh is None:
                raise OSError("not running")
            lh.status()
            with self._on_host(0):
                self.env.net.connect(lh.addr, 5.0).close()  # it still accepts connections
        except Exception as e:  # noqa: BLE001 (any failure means the service is not up)
            down.append(f"lighthouse: {e}")
        finally:
            if lh is not None:
                lh.stop()
        return Observation(steps=self.s.steps, events=self.events, audit_records=records, audit_problems=problems,
                           disk_ledger=(disk.step, disk.lineage) if disk is not None else None, disk_error=disk_error,
                           services_down=down, leaked_processes=leaked_processes(self.run_dir),
                           leaked_shm=leaked_shm(self._pids), timed_out=timed_out,
                           rewinds=sorted({h["quorum_id"] for lh in self._lighthouses for h in lh.history
                                           if h["event"] == "quorum" and h.get("rewind")}))


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)  # the workers read the whole plan or the previous one


def leaked_processes(run_dir: str) -> list[str]:
    """Live (not zombie) processes whose environment names `run_dir` as FTRUN_RUN_DIR."""
    marker = f"FTRUN_RUN_DIR={run_dir}\0".encode()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker not in f.read() + b"\0":
                    continue
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.append(f"pid {entry} (state {state})")
    return out


def leaked_shm(pids: set[int]) -> list[str]:
    """/dev/shm files named after one of `pids` (ftrun-...-{pid}-...)."""
    from ftrun.ftar.shm import SHM_DIR
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    return sorted(n for n in names if n.startswith("ftrun-") and any(p.isdigit() and int(p) in pids
                                                                     for p in n.split("-")))
