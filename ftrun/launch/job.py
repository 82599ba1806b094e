"""One `ftrun launch` job on this machine: the lighthouse, replicas, the kill plan, restarts, the event log and
its stats (`Job`), and the loop that drives it with a progress bar (`run_job`). netns_job.NetnsJob and
multihost's job place parts of it elsewhere by overriding its placement hooks."""

from __future__ import annotations

import argparse
import functools
import json
import os
import secrets
import signal
import sys
from dataclasses import replace
from typing import Callable
from tqdm import tqdm
from ftrun.config import LighthouseConfig, Timeouts
from ftrun.diagnose.monitor import Monitor
from ftrun.env.base import EnvTimeout, NetError
from ftrun.env.real import RealEnv
from ftrun.env.real_store import bound_store
from ftrun.launch.checks import unfired_kills
from ftrun.launch.crashes import CrashLog, summarize_stderr
from ftrun.launch.faults import KillPlan
from ftrun.launch.inject import Action, InjectPlan
from ftrun.launch.interrupts import Interrupts
from ftrun.launch.procs import Launcher
from ftrun.launch.report import JobResult
from ftrun.launch.stats import RunStats
from ftrun.launch.supervisor import ReplicaProcesses
from ftrun.launch.worker_env import WorkerSpec
from ftrun.quorum.http import StatusServer
from ftrun.quorum.service import Lighthouse

FINISH_GRACE_S = 5.0  # after the job's last step: how long replicas get to exit by themselves


class Job:
    """One running job: lighthouse, replicas, the kill plan, restarts, the event log and its stats."""

    def __init__(self, env: RealEnv, args: argparse.Namespace, out: str, launcher: Launcher, *, inject: bool,
                 say: Callable[[str], None]) -> None:
        self.env, self.args, self.out, self.inject, self.say = env, args, out, inject, say
        self.min_up = args.min_replicas or args.replicas // 2 + 1
        self.stores: dict = {}  # replica -> its running incarnation's store (replica_store)
        self.token = self.job_token()
        self.lighthouse = self.make_lighthouse()
        os.makedirs(os.path.join(out, "logs"), exist_ok=True)
        _write_private(os.path.join(out, "token"), self.token)
        with open(os.path.join(out, "lighthouse"), "w") as f:
            f.write(self.lighthouse.addr + "\n")
        self.stats = RunStats(args.replicas)
        self.events = env.queue()
        self.monitor = self.make_monitor()
        self.status_server = self.make_status_server()
        self.event_log = open(os.path.join(out, "events.jsonl"), "w", buffering=1)  # line by line: tail -f works
        argv = (["-m", args.script] if args.module else [args.script]) + list(args.script_args)
        faults = list(getattr(args, "inject", None) or []) if inject else []
        self.fault_file = os.path.join(out, "faults.json") if faults else None
        self.injected = InjectPlan(faults, self_kill=True) if inject else None
        self._plan_written: dict | None = None  # what the fault file holds now
        self._self_killed: dict[str, float] = {}  # replica -> when its rank announced the planned self-kill
        self._quorum_at: dict[str, tuple[int, float]] = {}  # replica -> (step, t) of its running rank 0's quorum
        self._committed_at: dict[str, tuple[int, float]] = {}  # ... and of its latest commit
        self._q2c: list[float] = []  # recent quorum-to-commit times (the --inject at= unit)
        self.replicas = {f"r{i}": ReplicaProcesses(
            env=env, events=self.events, log_dir=os.path.join(out, "logs"), argv=argv,
            launcher=self.launcher_for(f"r{i}", launcher), new_store=functools.partial(self.replica_store, f"r{i}"),
            spec=replace(self._diagnosed(self.spec(i)), fault_file=self.fault_file))
            for i in range(args.replicas)}
        self.down_until: dict[str, float] = {}  # replica -> when to restart it
        self.done: set[str] = set()  # exited cleanly, or stopped at the end
        self.live: dict[str, int] = {rid: 0 for rid in self.replicas}  # replica -> incarnation running now
        self.last_commit: dict[str, int] = {}  # replica -> step count after its live incarnation's last commit
        self.crashes_in_a_row: dict[str, int] = {}  # replica -> crashes since it last committed
        self.quorum_of: dict[str, list[str]] = {}  # replica -> participants of its latest quorum
        self.finished_at: float | None = None
        self.stopping = False
        self.goal = args.steps  # the step the job ends at (earlier with --max-kills and --stop-file)
        self.steady = False  # every replica has committed a step
        self.closed = False
        self.crash_log = CrashLog(args.max_startup_failures)
        self.diagnosis: dict | None = None  # the monitor's report, once the job ended
        self.evicted: list[dict] = []  # the evictions acted on (the monitor's notices for running incarnations)
        self.gave_up: list[dict] = []  # replicas in a crash loop, no longer restarted
        self.too_few = False  # the replicas not given up cannot make a quorum: the job ends
        self.plan = KillPlan(every_s=args.kill_every, random_mean_s=args.kill_random_mean,
                             at_steps=list(args.kill_at), min_up=self.min_up, seed=args.seed) if inject else None

    # -- what a subclass (netns_job.NetnsJob) places elsewhere ------------------------------------------
    def job_token(self) -> str:
        return secrets.token_hex(16)

    def make_lighthouse(self, bind: str = "127.0.0.1:0") -> Lighthouse:
        lighthouse = Lighthouse(env=self.env, token=self.token, bind=bind, config=LighthouseConfig(
            min_replicas=self.min_up, timeouts=Timeouts()))
        lighthouse.start()
        return lighthouse

    def spec(self, i: int) -> WorkerSpec:
        """Replica i's rank 0 (its store: replica_store, at every start)."""
        return WorkerSpec(replica_id=f"r{i}", replica_index=i, num_replicas=self.args.replicas, rank=0,
                          ranks_per_replica=self.args.ranks_per_replica, incarnation=0, lighthouse=self.lighthouse.addr,
                          token=self.token, store_addr="", store_port=0, run_dir=self.out,
                          max_steps=self.args.steps, host_slot=i * self.args.ranks_per_replica)  # all on this host

    def replica_store(self, rid: str) -> tuple[str, int]:
        """(addr, port) of a fresh rendezvous store for the next incarnation of replica `rid`, which only its
        ranks use (MASTER_ADDR/PORT, worker_env); the previous incarnation's (its ranks are gone) is dropped."""
        store = bound_store("127.0.0.1", timeout_s=60)  # loopback only: the store has no authentication
        self.stores[rid] = store  # a TCPStore has no close(): dropping the last reference frees its port
        return "127.0.0.1", store.port

    def launcher_for(self, rid: str, launcher: Launcher) -> Launcher:
        return launcher

    def make_monitor(self) -> Monitor | None:
        """The diagnosis monitor beside the lighthouse, on its host; None with --no-diagnose, or where that
        address cannot be listened on from here (a lighthouse inside a namespace host)."""
        if getattr(self.args, "no_diagnose", False):
            return None
        host = self.lighthouse.addr.rpartition(":")[0]
        monitor = Monitor(env=self.env, token=self.token, lighthouse=self.lighthouse, bind=f"{host}:0",
                          on_evict=self._on_evict_notice,
                          on_verdict=lambda v: self.events.put({"event": "verdict", **v}))
        try:
            monitor.start()
        except (OSError, NetError) as e:
            self.say(f"ftrun launch: no diagnosis: cannot listen beside the lighthouse on {host}: {e}")
            return None
        return monitor

    def make_status_server(self) -> StatusServer | None:
        """The lighthouse's status page beside it (OUT/status holds its URL; the token is in OUT/token); None
        where that address cannot be listened on from here (a lighthouse inside a namespace host)."""
        host = self.lighthouse.addr.rpartition(":")[0]
        server = StatusServer(env=self.env, lighthouse=self.lighthouse, token=self.token, bind=f"{host}:0")
        try:
            url = server.start()
        except (OSError, RuntimeError) as e:
            self.say(f"ftrun launch: no status page: cannot listen beside the lighthouse on {host}: {e}")
            return None
        with open(os.path.join(self.out, "status"), "w") as f:
            f.write(url + "/\n")
        return server

    def _diagnosed(self, spec: WorkerSpec) -> WorkerSpec:
        return spec if self.monitor is None else replace(spec, diagnose=self.monitor.addr)

    def inject_due(self, now: float, up: list[str]) -> None:
        """Inject the failure due now, if any (up: replicas running, not done)."""
        victim = self.plan.due(now, self.stats.max_step, up, self.healthy())
        if victim is not None:
            self.kill(victim, "injected")

    def start(self) -> None:
        if self.inject and self.args.stop_file and os.path.exists(self.args.stop_file):
            os.remove(self.args.stop_file)  # a previous run's: it would stop the new one at once
        for rep in self.replicas.values():
            rep.start()

    def close(self) -> None:
        """Stop the lighthouse and every rank (idempotent); the event log stays open until the stats are in."""
        if not self.closed:
            self.closed = True
            if self.monitor is not None:
                self.monitor.stop()
            if self.status_server is not None:
                self.status_server.stop()
            self.lighthouse.stop()
        for rep in self.replicas.values():
            rep.kill()

    def record(self, ev: dict) -> None:
        self.event_log.write(json.dumps(ev) + "\n")
        self.stats.add(ev)
        rid, kind = ev.get("replica_id"), ev.get("event")
        current = rid in self.live and ev.get("incarnation") == self.live[rid]  # not a killed incarnation's late line
        if kind == "evict_notice":
            self._evict(ev)
        elif kind == "fault" and ev.get("action") == "kill" and current and self.injected is not None:
            self._self_killed.setdefault(rid, ev.get("t", self.env.clock.now()))  # a planned self-kill (--inject)
        elif kind == "quorum" and current:
            self.quorum_of[rid] = list(ev.get("participants", []))
            if ev.get("rank", 0) == 0 and "t" in ev:
                self._quorum_at[rid] = (ev["step"], ev["t"])
        elif kind == "commit" and current and ev.get("rank", 0) == 0:
            self.last_commit[rid] = ev["step"]
            if "t" in ev:
                q = self._quorum_at.get(rid)
                if q is not None and q[0] == ev["step"] - 1:
                    self._q2c = (self._q2c + [ev["t"] - q[1]])[-50:]
                self._committed_at[rid] = (ev["step"], ev["t"])
            self.crashes_in_a_row.pop(rid, None)
            self.crash_log.committed(rid, self.stats.max_step)
            if ev["step"] >= self.goal and self.finished_at is None:
                self._finish(rid)
        if not self.steady and self.stats.steady_step is not None:
            self.steady = True
            if self.plan is not None:
                self.plan.start(self.env.clock.now())  # kill clocks start once every replica has joined
            if self.injected is not None:
                self.injected.start(self.env.clock.now())
            self.record({"event": "steady", "t": self.env.clock.now(), "step": self.stats.steady_step})

    def _on_evict_notice(self, entry: dict) -> None:
        """The monitor's eviction (its own task): handed to the main loop through the event queue."""
        self.events.put({"event": "evict_notice", **entry})

    def _evict(self, ev: dict) -> None:
        """Kill the evicted incarnation (a restart follows), unless it is already gone or the job is over."""
        rid, inc = ev.get("replica_id"), ev.get("incarnation")
        if self.live.get(rid) != inc or rid in self.down_until or self.finished_at is not None or rid in self.done:
            self.record({"event": "evict_ignored", "replica_id": rid, "incarnation": inc, "t": self.env.clock.now(),
                         "why": "not the running incarnation"})
            return
        self.evicted.append({"replica_id": rid, "incarnation": inc, "t": self.env.clock.now(),
                             "noticed_t": ev.get("t"), "reason": ev.get("reason"), "ranks": ev.get("ranks"),
                             "silent": ev.get("silent")})
        self.record({"event": "evict", **self.evicted[-1]})
        self.lighthouse.evict((rid,), str(ev.get("reason")))  # its peers' next quorum does not wait for it
        self.kill(rid, "evicted", verdict=ev.get("verdict"))

    def healthy(self) -> list[str]:
        """Replicas holding the job's state: their running incarnation committed the job's last step (or the
        one before: the others may be a step ahead). Fresh or healing replicas are not, whatever they say."""
        return [r for r, step in self.last_commit.items() if step >= self.stats.max_step - 1]

    def _finish(self, rid: str) -> None:
        """The job committed its last step: stop replicas that were not in that step's quorum.

        They cannot finish (the others exit) and must not go on alone from an older state."""
        self.finished_at = self.env.clock.now()
        final_quorum = set(self.quorum_of.get(rid, self.replicas))
        for other in self.replicas:
            if other not in final_quorum and other not in self.done:
                self.replicas[other].kill()
                self.done.add(other)
                self.down_until.pop(other, None)

    def _end_early(self) -> None:
        """After --max-kills: once every replica is back, tell the script to stop a few steps later."""
        if self.args.stop_file is None or self.stopping or len(self.healthy()) < len(self.replicas):
            return
        self.stopping = True
        self.goal = min(self.stats.max_step + 3, self.args.steps)
        tmp = self.args.stop_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(self.goal))
        os.replace(tmp, self.args.stop_file)  # the script reads the whole number or nothing
        self.record({"event": "stop", "t": self.env.clock.now(), "step": self.goal})

    def kill(self, rid: str, why: str, **extra: object) -> None:
        now, rep = self.env.clock.now(), self.replicas[rid]
        rep.kill()
        self.live.pop(rid, None)
        self.last_commit.pop(rid, None)
        self._committed_at.pop(rid, None)
        self._quorum_at.pop(rid, None)
        backoff = 2 ** min(self.crashes_in_a_row.get(rid, 0), 6)  # a replica that keeps crashing waits longer
        self.down_until[rid] = now + self.args.restart_delay * backoff
        self.record({"event": "kill", "replica_id": rid, "incarnation": rep.spec.incarnation, "t": now, "why": why,
                     "step": self.stats.max_step, **extra})

    def tick(self) -> None:
        now = self.env.clock.now()
        for rid, at in list(self.down_until.items()):
            if now >= at:
                del self.down_until[rid]
                self.replicas[rid].restart()
                self.live[rid] = self.replicas[rid].spec.incarnation
                self.record({"event": "restart", "replica_id": rid, "t": now,
                             "incarnation": self.replicas[rid].spec.incarnation})
        for rid, rep in self.replicas.items():
            codes = rep.exited()
            if rid in self.down_until or rid in self.done or all(c is None for c in codes):
                continue
            crashed = any(c not in (None, 0) for c in codes)
            if self.finished_at is not None or (not crashed and all(c == 0 for c in codes)):
                self.done.add(rid)
            elif crashed:
                self._on_crash(rid, codes)
                if self.too_few:
                    return  # the job ends
        if self.injected is not None and self.finished_at is None and not self.too_few:
            self.inject_faults(now)
        if self.plan is None or self.finished_at is not None or self.too_few:
            return  # the job reached its goal: no more injected failures
        if self.args.max_kills is not None and self.stats.num_kills >= self.args.max_kills:
            self._end_early()
            return
        self.inject_due(now, [r for r in self.replicas if r not in self.down_until and r not in self.done])

    # -- --inject: crashes, hangs, host losses, slow fetches ------------------------------------------------
    host_cuts = False  # a host loss cuts the replica's host off the network (NetnsJob), else stops its ranks

    def inject_faults(self, now: float) -> None:
        """Carry out the --inject actions due now, and keep the fault file's slow fetch current."""
        up = {r for r in self.replicas if r not in self.down_until and r not in self.done}
        q2c = sorted(self._q2c)
        compute_s = q2c[len(q2c) // 2] if q2c else None
        for action in self.injected.due(now, self.stats.max_step, compute_s, up, self.host_cuts, self._committed_at,
                                        self._quorum_at):
            self.act(action, now)
        if self.fault_file is not None:
            catching_up = {r for r in self.live if r not in self.last_commit and r not in self.down_until}
            slow = self.injected.slow_fetch_for(catching_up)
            text = "" if slow is None else f"kind=slow,factor={slow.factor!r},delay={slow.delay_s!r}"
            die_at = ";".join(f"phase=backward,step={f.at_step},replica={f.replica_id},incarnation={self.live[f.replica_id]},"
                              f"at={f.at_fraction!r}" for f in self.injected.self_kills() if f.replica_id in self.live)
            plan = {"catchup": text, "die_at": die_at}
            if plan != self._plan_written:
                if self._plan_written is None or text != self._plan_written["catchup"]:
                    self.record({"event": "slow_fetch", "t": now, "replica_id": slow.replica_id if slow else None,
                                 "active": slow is not None, "fault": text})
                self._plan_written = plan
                tmp = self.fault_file + ".tmp"
                with open(tmp, "w") as f:
                    json.dump(plan, f)
                os.replace(tmp, self.fault_file)  # the ranks reload it before each step

    def act(self, action: Action, now: float) -> None:
        f = action.fault
        rid = f.replica_id
        common = {"replica_id": rid, "incarnation": self.replicas[rid].spec.incarnation, "t": now,
                  "step": self.stats.max_step, "fault": f.describe()}
        if action.what == "crash":
            self.kill(rid, "injected", fault=f.describe())
            return
        if action.what in ("cut", "uncut"):
            self.cut_host(rid, action.what == "cut")
        else:
            ranks = range(self.args.ranks_per_replica) if f.rank is None else [f.rank]
            sig = signal.SIGSTOP if action.what == "stop" else signal.SIGCONT
            for r in ranks:
                _signal_group(self.replicas[rid].procs[r].pid, sig)
        kind = "hang" if action.what in ("stop", "cut") else "fault_end"
        self.record({"event": kind, **common, "kind": f.kind, "ranks": None if f.rank is None else [f.rank],
                     "how": action.what})

    def cut_host(self, rid: str, cut: bool) -> None:
        """Cut the host of `rid` off the network (cut=False: restore it). Only where hosts are namespaces."""
        raise NotImplementedError("a host cut needs --netns-hosts")

    def _on_crash(self, rid: str, codes: list[int | None]) -> None:
        """A rank of `rid` exited with an error: stop the replica's other ranks and take in what they wrote,
        show what it died of (the first time the job sees that error), then restart the whole replica, or end
        the job if the replica is in a crash loop."""
        rep = self.replicas[rid]
        rep.kill()
        rep.drain()
        self.pull_events()  # its last commits, if any, decide whether it had started
        if rid in self._self_killed and self.injected is not None:
            t = self._self_killed.pop(rid)
            f = self.injected.self_killed(rid)
            if f is not None:  # the --inject crash, carried out by the rank itself: not a crash of the replica
                self.kill(rid, "injected", fault=f.describe(), t=t)
                return
        started = rid in self.last_commit
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        summaries = {r: summarize_stderr(rep.stderr_tail(r), codes[r]) for r in failed}
        rank = next((r for r in failed if "Traceback" in summaries[r].detail), failed[0])
        summary, inc = summaries[rank], rep.spec.incarnation
        verdict = self.crash_log.crashed(rid, rank=rank, incarnation=inc, exit_code=codes[rank], summary=summary,
                                         started=started, job_step=self.stats.max_step)
        if verdict.show:
            self.say(f"ftrun launch: {rid} rank {rank} (incarnation {inc}) exited with {codes[rank]}"
                     f"{'' if started else ' before its first commit'}: {summary.error}"
                     + "".join(f"\n  | {line}" for line in summary.detail.splitlines()
                               if summary.detail.strip() != summary.error))
        if verdict.give_up:
            self._give_up(rid, inc, verdict.futile, summary.error)
            return
        self.crashes_in_a_row[rid] = self.crashes_in_a_row.get(rid, 0) + 1
        self.kill(rid, f"rank exited with {codes}", error=summary.error)  # a crash: the whole replica restarts

    def _give_up(self, rid: str, inc: int, count: int, error: str) -> None:
        """Stop restarting a replica in a crash loop; end the job if the others cannot make a quorum."""
        self.gave_up.append({"replica_id": rid, "incarnation": inc, "count": count, "error": error,
                             "step": self.stats.max_step})
        self.done.add(rid)
        self.last_commit.pop(rid, None)
        self.record({"event": "gave_up", "t": self.env.clock.now(), **self.gave_up[-1]})
        left = len(self.replicas) - len(self.gave_up)
        self.too_few = left < self.min_up
        self.say(f"ftrun launch: {rid} crashed {count} times in a row with the same error ({error}), each time "
                 f"before its first commit or with the job still at step {self.stats.max_step}: a crash loop. Not "
                 f"restarting it (--max-startup-failures {self.args.max_startup_failures}); "
                 + (f"stopping the job ({left} replica(s) left, fewer than {self.min_up})." if self.too_few else
                    f"the job goes on with {left} replica(s) and will not count as complete.")
                 + f" Rank logs: {self.out}/logs")

    def pull_events(self) -> None:
        """Record every event already delivered."""
        while True:
            try:
                self.record(self.events.get(timeout=0.0))
            except EnvTimeout:
                return

    def kill_warnings(self) -> list[str]:
        if self.plan is None:
            return []
        unfired = [f"--inject {f.describe()!r} never fired (the job never reached it with the replica up)"
                   for f in (self.injected.pending if self.injected is not None else [])]
        return unfired + unfired_kills(pending=self.plan.pending, every_s=self.args.kill_every,
                             random_mean_s=self.args.kill_random_mean, num_timed_kills=self.plan.num_timed_kills,
                             max_kills=self.args.max_kills, num_kills=self.stats.num_kills)

    def host_figures(self) -> dict:
        """Figures about where the job ran (NetnsJob: its hosts); none for a one-box job."""
        return {}

    def running(self) -> bool:
        if len(self.done) == len(self.replicas) or self.too_few:
            return False
        return self.finished_at is None or self.env.clock.now() - self.finished_at < FINISH_GRACE_S


def run_job(env: RealEnv, args: argparse.Namespace, out: str, launcher: Launcher, *, inject: bool,
            label: str, stop: Interrupts, make_job: Callable[..., Job] = Job) -> JobResult:
    bar = tqdm(total=args.steps, desc=label, unit="step", file=sys.stderr, dynamic_ncols=True,
               disable=args.no_progress)
    job = make_job(env, args, out, launcher, inject=inject, say=lambda text: tqdm.write(text, file=sys.stderr))
    started = env.clock.now()
    deadline = started + args.timeout if args.timeout is not None else float("inf")
    try:
        if stop.signal is None:
            job.start()
        while job.running() and stop.signal is None and env.clock.now() < deadline:
            job.tick()
            due = job.injected.next_at() if job.injected is not None else None
            wait = 0.05 if due is None else min(0.05, max(due - env.clock.now(), 0.001))  # an armed --inject fault
            try:
                ev = job.events.get(timeout=wait)
            except EnvTimeout:
                continue
            job.record(ev)
            if ev.get("event") in ("commit", "step"):
                _progress(bar, job)
        timed_out = job.running() and stop.signal is None
        job.close()  # then take in what the ranks wrote before they exited ("final" events)
        for rep in job.replicas.values():
            rep.drain()
        job.pull_events()
    finally:
        bar.close()
        job.close()
        job.event_log.close()
    if job.monitor is not None:
        job.diagnosis = {**job.monitor.report(), "evicted": job.evicted}
    return JobResult(job.stats, env.clock.now() - started, out, job.goal, stop_signal=stop.signal,
                     timed_out=timed_out, gave_up=job.gave_up,
                     errors=[e.as_json() for e in job.crash_log.errors.values()], warnings=job.kill_warnings(),
                     extra=job.host_figures(), diagnosis=job.diagnosis,
                     lighthouse_history=list(job.lighthouse.history))


def _progress(bar: tqdm, job: Job) -> None:
    s = job.stats
    if s.max_step > bar.n:
        bar.update(min(s.max_step, bar.total) - bar.n)
    row = s.rows.get(s.max_step - 1)
    committed, total = s.efficiency()
    bar.set_postfix(replicas=len(row.committed) if row else 0, committed=f"{100 * committed / max(total, 1):.1f}%",
                    loss=f"{row.loss:.3f}" if row and row.loss is not None else "-", kills=s.num_kills, refresh=False)


def _signal_group(pid: int, sig: int) -> None:
    """Send `sig` to the process group `pid` leads (a rank and its children), or to the process; gone: no-op."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _write_private(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an older file of the same name keeps its mode otherwise
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
