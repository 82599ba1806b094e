"""Root-cause diagnosis inside an emulated job: telemetry on every rank, a collector on the modeled
network, and the scenario faults (harness.run.faults: hang, host loss, slow host, slow link, rank kill, release)
applied to the running job, so one job runs many scenarios one after another.

- `JobDiagnosis`: a `Collector` (ftrun.diagnose.collect, the real one) on its own host beside the
  lighthouse, and for every rank a `Recorder` attached to its real FtarEngine, TreeComm, lighthouse
  client and trainer, served by a real `TelemetryServer` on the rank's host (one per rank process: a hung
  rank's server hangs with it). With rank folding, the ranks not run are served with their reference lead's
  rows, one server per mirrored host (harness.run.diag_mirror). `diagnose()` pulls every server over the
  emulated transport (its cost is in modeled time) and runs the real analysis; `telemetry()` reports the
  buffers' bytes and fill.
- `ScenarioFaults`: applies and releases scenario faults. A hang freezes the rank's process (or the
  host) in the engine (harness.engine.core: freeze / thaw); a slow host adds (X - 1) x a step's compute
  to the ranks on it; a slow link slows the route between two hosts both ways (Fabric.slow_link); a
  rank kill crashes the rank's process (its connections reset) and the supervisor restarts the replica
  once it notices; a release undoes every hang and slowness.
"""

from __future__ import annotations

import time
from typing import Any

from ftrun.diagnose.attach import attach
from ftrun.diagnose.collect import Collector, CollectorConfig, DiagnoseError, RankInfo, TelemetryServer
from ftrun.diagnose.model import AnalysisConfig
from ftrun.diagnose.act import EvictionConfig
from ftrun.diagnose.telemetry import DEFAULT_CAPACITY, RECORD
from harness.run.diag_mirror import MirrorTelemetry
from harness.run.faults import CutBuilding, Hang, HostLoss, KillRank, Release, SlowHostAt, SlowLink, resolve_host

DIAGNOSIS_HOST = "diagnosis"
TELEMETRY_BUDGET_BYTES = 1 << 30  # every emulated rank's buffer together (this machine's memory, not a rank's)
MIRROR_CAPACITY = 1024  # a folded mirror records tree and quorum only


def capacity_for(num_ftar_ranks: int) -> int:
    """Records per rank's buffer: the paper's 1 MB where the job's buffers fit in TELEMETRY_BUDGET_BYTES,
    less at scale (the figures report what each rank's buffer held)."""
    return max(1024, min(DEFAULT_CAPACITY, TELEMETRY_BUDGET_BYTES // max(num_ftar_ranks, 1) // RECORD.itemsize))


class JobDiagnosis:
    def __init__(self, job: Any) -> None:
        p = job.profile
        self.job = job
        ftar_ranks = p.replicas * (job._num_leads or p.ranks_per_replica)
        self.capacity = capacity_for(ftar_ranks)
        t = job.timeouts
        self.config = CollectorConfig(
            pull_timeout_s=1.0,
            analysis=AnalysisConfig(),
            eviction=EvictionConfig(wait_limit_s=t.ftar_timeout_s))
        self.collector: Collector | None = None
        self.addr = ""
        self.recorders: dict[str, Any] = {}  # rank key -> its Recorder (the latest incarnation's)
        self.servers: dict[str, TelemetryServer] = {}
        self.analysis_s: list[float] = []
        self.pull_s: list[float] = []  # modeled seconds per collection (pull every rank over the network)
        self.rounds = 0
        self.mirrors: MirrorTelemetry | None = None  # the ranks not run (rank folding: harness.run.diag_mirror)
        self.ranks_collected: list[int] = []  # ranks known to the collector, per collection

    def start(self) -> None:
        env = self.job.world.host_env(DIAGNOSIS_HOST)
        self.collector = Collector(env=env, token=self.job.token, config=self.config)
        self.collector.timer = time.perf_counter  # the analysis' wall time (virtual time stands still in it)
        self.addr = self.collector.start()
        if len(self.job.ranks) < self.job.profile.ranks_per_replica:
            self.mirrors = MirrorTelemetry(self.job, self.addr)

    def attach(self, inc: Any, rank: int, env: Any, *, exchange: Any, comm: Any, client: Any,
               trainer: Any) -> None:
        """Telemetry on one rank (called by the rank's own task, so its server is in its process)."""
        engine = getattr(exchange, "engine", None)
        lead = hasattr(type(engine), "telemetry")
        rec = attach(env.clock, engine=engine if lead else None,
                     comm=comm if hasattr(type(comm), "telemetry") else None, lighthouse=client, trainer=trainer,
                     capacity=self.capacity if lead else min(self.capacity, MIRROR_CAPACITY))
        key = f"{inc.replica_id}/{rank}"
        info = RankInfo(key, inc.replica, rank, inc.hosts[rank // self.job.profile.topology.gpus_per_host],
                        inc.number)
        server = TelemetryServer(env=env, token=self.job.token, ranks={info: rec})
        server.start()
        self.recorders[key], self.servers[key] = rec, server
        if self.mirrors is not None:
            self.mirrors.attached(inc, rank, rec)
        try:
            server.register(self.addr, timeout=self.job.timeouts.connect_timeout_s)
        except DiagnoseError:
            pass  # counted: the rank is then unknown to the collector (diagnosis never stops training)

    def diagnose(self) -> dict:
        """One collection and analysis (call from a task in the world); the verdict dict, with the
        collector's analysis input kept in `collector.last_input`."""
        assert self.collector is not None
        t0 = self.collector.env.clock.now()
        out = self.collector.diagnose()
        self.ranks_collected.append(out["num_ranks"])
        self.analysis_s.append(self.collector.last_analysis_s)
        self.pull_s.append(self.collector.env.clock.now() - t0)
        return out

    def monitor(self, interval_s: float) -> None:
        """Task body (`emulate --diagnose`): diagnose every `interval_s` until the job finishes; every verdict
        other than no_hang, and every change of verdict, goes into the job's events (report and trace)."""
        clock, last = self.job.world.clock, None
        while not self.job.finished:
            clock.sleep(interval_s)
            if self.job.finished:
                return
            v = self.diagnose()
            self.rounds += 1
            key = (v["kind"], tuple(v["ranks"]))
            if v["kind"] != "no_hang" or key != last:
                self.job.recorder.event(verdict_event(v, self.job.world.now, self.job.max_step))
            last = key

    def telemetry(self) -> dict[str, Any]:
        """Bytes each rank's buffer holds, and how full the fullest got per step."""
        recs = list(self.recorders.values())
        if not recs:
            return {"telemetry_bytes_per_rank": 0}
        steps = max(self.job.max_step, 1)
        return {"telemetry_bytes_per_rank": max(r.nbytes for r in recs),
                "telemetry_records_per_step_max": round(max(r.written for r in recs) / steps, 1),
                "telemetry_buffer_steps_min": round(min(r.capacity / max(r.written / steps, 1e-9) for r in recs
                                                        if r.written), 1) if any(r.written for r in recs) else None,
                "telemetry_ranks": len(recs), **self._mirror_figures()}

    def _mirror_figures(self) -> dict[str, Any]:
        m = self.mirrors
        if m is None:
            return {}
        return {"telemetry_mirrored_ranks_per_replica": m.ranks_served,
                "telemetry_mirror_servers": m.servers_started,
                "telemetry_mirror_register_failures": m.register_failures,
                "telemetry_mirror_summaries": {"served": m.cache.served, "computed": m.cache.computed}}


def verdict_event(v: dict, t: float, step: int) -> dict:
    """A verdict as a job event (report.json's events, the Perfetto trace's instant events)."""
    return {"event": "diagnosis", "t": t, "step": step, "kind": v["kind"], "reason": v["reason"],
            "ranks": v["ranks"][:16], "hosts": v["hosts"][:16], "replicas": v["replicas"],
            "collectives": v["collectives"][:8], "eviction": v["eviction"]["replicas"],
            "num_answered": v["num_answered"], "num_ranks": v["num_ranks"],
            "edges": v.get("edges", [])[:32]}  # the wait-for graph (waiter -> waited on), as the status page draws


def figures(diag: "JobDiagnosis", events: list[dict]) -> dict[str, Any]:
    """The emulate report's `diagnosis` figures."""
    verdicts = [e for e in events if e["event"] == "diagnosis"]
    pull = sorted(diag.pull_s)
    ana = sorted(diag.analysis_s)
    return {"rounds": diag.rounds, "verdicts": verdicts[-50:],
            "non_clear_verdicts": sum(1 for e in verdicts if e["kind"] != "no_hang"),
            "collect_s_p50": pull[len(pull) // 2] if pull else None,
            "analysis_s_p50": ana[len(ana) // 2] if ana else None, **diag.telemetry()}


class ScenarioFaults:
    """Applies scenario faults to the running job; `release()` undoes every hang and slowness."""

    def __init__(self, job: Any) -> None:
        self.job = job
        self.hosts = job.topology.training_hosts
        self.slow_hosts: dict[str, float] = {}
        self._frozen: list[tuple[str, Any]] = []  # (host, proc or None)
        self._links: list[tuple[str, str]] = []

    def incarnation(self, replica: int) -> Any:
        inc = self.job._incarnations[replica]
        if inc is None:
            raise ValueError(f"replica {replica} is not running")
        return inc

    def rank_place(self, replica: int, rank: int) -> tuple[Any, str]:
        """(incarnation, host) of rank `rank` of replica `replica`."""
        inc = self.incarnation(replica)
        return inc, inc.hosts[rank // self.job.profile.topology.gpus_per_host]

    def freeze(self, replica: int, rank: int | None, whole_hosts: bool) -> None:
        """Stop rank `rank` of the replica (its host's processes: whole_hosts), or every host of the replica."""
        world = self.job.world
        if rank is None:
            for host in self.incarnation(replica).hosts:
                world.freeze(host)
                self._frozen.append((host, None))
            return
        inc, host = self.rank_place(replica, rank)
        proc = None if whole_hosts else inc.tasks[rank].proc
        world.freeze(host, proc)
        self._frozen.append((host, proc))

    def apply(self, fault: Any) -> None:
        """Apply now (from a task in the world)."""
        job, world = self.job, self.job.world
        job.recorder.event({"event": "fault", "t": world.now, "step": job.max_step, "fault": fault.describe()})
        if isinstance(fault, Hang):
            if fault.replica is not None:
                self.freeze(fault.replica, fault.rank, whole_hosts=False)
            else:
                host = resolve_host(fault.host, self.hosts)
                world.freeze(host)
                self._frozen.append((host, None))
        elif isinstance(fault, HostLoss):
            self.freeze(fault.replica, fault.rank, whole_hosts=True)
        elif isinstance(fault, SlowHostAt):
            self.slow_hosts[resolve_host(fault.host, self.hosts)] = fault.factor
        elif isinstance(fault, SlowLink):
            a, b = resolve_host(fault.a, self.hosts), resolve_host(fault.b, self.hosts)
            world.fabric.slow_link(a, b, fault.factor)
            self._links.append((a, b))
        elif isinstance(fault, KillRank):
            inc, host = self.rank_place(fault.replica, fault.rank)
            world.kill_process(host, inc.tasks[fault.rank].proc)
            world.host_env("supervisor").spawn(job._rank_died, inc, name=f"notice-{inc.replica_id}")
        elif isinstance(fault, CutBuilding):
            now = world.now
            world.cut_building(fault.building, now, now + fault.duration_s)
        elif isinstance(fault, Release):
            self.release()
        else:
            raise ValueError(f"not a scenario fault: {fault.describe()}")

    def release(self) -> None:
        world = self.job.world
        for host, proc in reversed(self._frozen):
            world.thaw(host, proc)
        for a, b in self._links:
            world.fabric.slow_link(a, b, 1.0)
        self._frozen, self._links = [], []
        self.slow_hosts.clear()

    def at(self, fault: Any) -> None:
        """Task body: apply `fault` at its time= (or once the job has committed its step=, plus at= x a step's
        compute) and release it after its duration= (--inject)."""
        clock = self.job.world.clock
        step = getattr(fault, "at_step", None)
        if step is None:
            clock.sleep(max(fault.at_s - clock.now(), 0.0))
        else:
            step_s = self.job.profile.train.step_compute_s
            while self.job.max_step < step and not self.job.finished:
                clock.sleep(step_s / 16)
            clock.sleep(fault.at_fraction * step_s)
        if self.job.finished:
            return
        self.apply(fault)
        duration = getattr(fault, "duration_s", None)
        if duration is not None and not isinstance(fault, CutBuilding):
            clock.sleep(duration)
            self.apply(Release(at_s=clock.now()))
