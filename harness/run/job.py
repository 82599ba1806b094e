"""An emulated FT-HSDP job: the real lighthouse, every replica's every rank, failures and restarts.

    job = EmulatedJob(profile, JobOptions(steps=10, kills=(Kill(1, at_step=3),)))
    job.run(progress=lambda step: ...)        # returns when the job has trained `steps` steps
    job.recorder                              # what happened (harness.run.record), for harness.report

Hosts: the lighthouse and the job's supervisor run on their own emulated hosts; replica r's ranks run on
the topology's hosts (rank k on host k // gpus_per_host). The supervisor injects kills (world.kill_host on
every host of the replica), notices a dead replica at its next poll, asks the mock scheduler for hosts
(relaunch: warm delay; replace: spares) and starts a new incarnation there, which waits out the
process start time, checks in, is found behind, catches up and trains on.

Other faults (harness.run.faults): a lighthouse kill kills the lighthouse host and, after its down
time, starts a new Lighthouse on the same address from the state the first one persisted (the same
mock local disk); a building cut goes to the world's fabric (harness.engine.net); a straggler host and
a slow fetch are looked up by the rank tasks (compute_extra_s, slowed_heal).

The whole run happens inside `shadow.active(profile)`: the FTAR kernels come from importing
`ftrun.ftar.cuda_kernels`, which the shadow loader maps to mocks.ftar_kernels.
"""

from __future__ import annotations

import contextlib
import math
import random
import secrets
from dataclasses import replace
from typing import Any, Callable

import shadow
from ftrun.catchup.config import CatchupConfig
from ftrun.catchup.manifest import align_up, ceil_div
from ftrun.config import LighthouseConfig, Timeouts
from ftrun.data.sampler import DataLayout
from ftrun.env.base import EnvTimeout
from ftrun.quorum.service import Lighthouse
from ftrun.replica.tree_comm import TreeComm
from harness.engine import EmulatedWorld
from harness.engine.net import EmuConnection
from harness.profile import Profile
from harness.run.fold import Mirror
from harness.run.diagnosis import DIAGNOSIS_HOST, JobDiagnosis, ScenarioFaults
from harness.run.faults import SCENARIO_FAULTS, CutBuilding, Kill, KillLighthouse, SlowFetch, SlowHost, check_faults
from harness.run.cpu_queue import wait_growth
from harness.run.job_fold import JobFolding
from harness.run.options import JobOptions
from harness.run.ring_model import RingBoard
from harness.run.rank import rank_main
from harness.run.record import Recorder
from harness.run.ledger import audit_figures
from mocks.compute import ShapeCache, ShapeOnlyState
from mocks.scheduler import MockScheduler, NoCapacity
from mocks.storage import MockObjectStore

LIGHTHOUSE_HOST = "lighthouse"
SUPERVISOR_HOST = "supervisor"
ADAM_STATE_BYTES = 8  # two fp32 moments per parameter, next to the parameter itself


def timeouts_of(profile: Profile) -> Timeouts:
    """The job's timeouts: the profile's [timeouts], the runtime's own config (nothing derived or renamed)."""
    return profile.timeouts


def catchup_config_of(profile: Profile, state_bytes_per_rank: int) -> CatchupConfig:
    """The job's catch-up config: the profile's [catchup] (the runtime's CatchupConfig) with the job's timeouts;
    without one, a rank's state in about 8 shards, as the fetch plan spreads them (wait limit: the FTAR timeout)."""
    if profile.catchup is not None:
        return replace(profile.catchup, timeouts=timeouts_of(profile))
    return CatchupConfig(max_shard_bytes=max(64, align_up(ceil_div(state_bytes_per_rank, 8))),
                         timeouts=timeouts_of(profile))


def start_skew(mean_s: float, key: str) -> float:
    """An exponential draw of mean `mean_s` from a generator seeded by `key` (deterministic); 0 when `mean_s` is 0.
    Pure."""
    if not mean_s:
        return 0.0
    return -mean_s * math.log(1.0 - random.Random(key).random())


class Incarnation:
    """One start of one replica: its hosts, Envs, wiring, and how many of its ranks are still running."""

    def __init__(self, job: "EmulatedJob", replica: int, number: int, hosts: tuple[str, ...]) -> None:
        p, world = job.profile, job.world
        self.replica, self.number, self.hosts = replica, number, hosts
        self.replica_id = job.replica_id(replica)
        self.world_size = p.ranks_per_replica
        self.ranks = job.ranks  # the ranks it runs (all, or the represented ones: harness.run.fold); tree index i runs ranks[i]
        gpus = p.topology.gpus_per_host
        host_envs = [world.host_env(h) for h in hosts]
        self.envs = [host_envs[k // gpus] for k in self.ranks]  # by tree index
        self.mirror = Mirror(self.envs[0], job._num_leads, job._mirror_reference()) if job.folded else None
        self.tree_extra_s = job.tree_extra_s(hosts)  # per tree pass: the full tree's latency the run ranks' lacks
        self.listeners: list[Any] = []
        self.addrs: list[str] = []
        self.prewired: list[tuple[Any, list[Any]]] | None = None
        if job.options.wiring == "prewired":
            self.prewired = _prewire(world, self.envs, [hosts[k // gpus] for k in self.ranks], job.options.fanout)
        else:
            self.listeners = [env.net.listen("127.0.0.1:0") for env in self.envs]
            self.addrs = [ln.addr for ln in self.listeners]
        self.live = len(self.ranks)
        self.tasks: dict[int, Any] = {}  # rank -> its root task (its process: harness.engine freeze / kill_process)
        self.ledgers: dict = {}  # the ranks' shared ledger transitions (harness.run.seams.FoldedProgress)
        # a straggler among its hosts: (host index, factor, from step), or None
        self.straggler = job.straggler_on(hosts)
        self.alive = True  # False once killed or failed (its ranks may still be unwinding)
        self.completed = False  # its leader committed the last step
        self.has_committed = False  # its leader committed a step (until then it is catching up)


def _prewire(world: EmulatedWorld, envs: list[Any], rank_hosts: list[str], fanout: int) -> list[tuple[Any, list[Any]]]:
    """Each tree index's (parent, children) tree connections, made directly instead of by listen/connect;
    rank_hosts[i]: the host of tree index i."""
    fab = world.fabric
    n = len(envs)
    links: list[tuple[Any, list[Any]]] = [(None, []) for _ in range(n)]
    for rank in range(1, n):
        parent = (rank - 1) // fanout
        child_host, parent_host = fab.net_host(rank_hosts[rank]), fab.net_host(rank_hosts[parent])
        up, down = EmuConnection.pair(fab, child_host, parent_host, f"{parent_host.name}:tree{parent}")
        links[rank] = (up, links[rank][1])
        links[parent][1].append(down)
    assert all(len(ch) == len(TreeComm.children_of(r, n, fanout)) for r, (_, ch) in enumerate(links))
    return links


def rank_cpu_at(cpu_step_s: float, ring_cpu_s: float, replicas: int) -> float:
    """A rank's CPU seconds per step with `replicas` replicas up, from its CPU per step measured with 2 (`cpu_step_s`)
    and its all-reduce's CPU rise from 1 replica to 2 (`ring_cpu_s`): cpu_step_s + ring_cpu_s x (2 (R - 1) / R - 1), as
    a ring all-reduce of R ranks sends and receives 2 (R - 1) / R of each rank's gradient, 1 of it at 2 replicas; 0
    with no replica up. Pure."""
    return cpu_step_s + ring_cpu_s * (2 * (replicas - 1) / replicas - 1) if replicas >= 1 else 0.0


class EmulatedJob(JobFolding):
    def __init__(self, profile: Profile, options: JobOptions) -> None:
        self.profile, self.options = profile, options
        self.folded = (options.ftar_detail or profile.emulation.ftar_detail) == "folded"
        self.world = EmulatedWorld.from_profile(profile, seed=options.seed)
        self.topology = self.world.topology
        check_faults(options.injected, replicas=profile.replicas, ranks_per_replica=profile.ranks_per_replica,
                     buildings=profile.topology.buildings, hosts=self.topology.training_hosts)
        self.timeouts = timeouts_of(profile)
        self.token = secrets.token_hex(8)
        self.recorder = Recorder(spans=options.trace)
        self.shapes = ShapeCache(options.script.shapes if options.script is not None else None)
        shapes = self.shapes.get(profile.model, profile.ranks_per_replica)
        self.state_bytes_per_rank = shapes.grad_bytes_per_rank + shapes.params_per_rank * ADAM_STATE_BYTES
        self.shape_state = ShapeOnlyState(shapes)  # shared by every rank: it holds no values
        self.rng = random.Random(options.seed)
        self.replica_ids = tuple(self.replica_id(r) for r in range(profile.replicas))
        self.data_layout = DataLayout(dataset_size=profile.num_ranks * (options.steps + 1), num_replicas=profile.replicas,
                                      ranks_per_replica=profile.ranks_per_replica, batch_size_per_rank=1,
                                      seed=options.seed)
        env = self.world.host_env(SUPERVISOR_HOST)  # the stores' calls wait on whichever task makes them
        self.storage = MockObjectStore.local_disk(env)  # loader_state and audit logs: files next to the job
        self.storage.write_latency_s = profile.storage.local_write_latency_s
        self.storage.append_latency_s = profile.storage.local_append_latency_s
        self.storage.read_latency_s = profile.storage.local_read_latency_s
        self.checkpoint_storage = MockObjectStore.remote(env)  # persistent checkpoints: an object store
        self.checkpoint_storage.write_latency_s = profile.storage.checkpoint_write_latency_s
        self.checkpoint_storage.bandwidth = profile.storage.checkpoint_bandwidth_bytes_per_s
        self.ftar_config = replace(profile.ftar.engine, timeout_s=self.timeouts.ftar_timeout_s, transport="socket")
        self.mirror_timeout_s = 10 * (self.timeouts.ftar_timeout_s + self.timeouts.catchup_timeout_s
                                      + profile.train.step_compute_s + profile.train.first_step_extra_s)
        self.catchup_config = catchup_config_of(profile, self.state_bytes_per_rank)
        self.finished = False
        self.max_step = 0
        self.lighthouse_addr = ""
        self._incarnations: list[Incarnation | None] = [None] * profile.replicas
        self._num_starts = [0] * profile.replicas
        self._progress: Callable[[int], None] | None = None
        self._cuda_kernels: Any = None
        self._notices: Any = None
        self._pending_step_kills = sorted((k for k in options.injected if isinstance(k, (Kill, KillLighthouse))
                                           and k.at_step is not None and not getattr(k, "in_ftar", False)),
                                          key=lambda k: k.at_step)  # type: ignore
        self._ftar_kills = [k for k in options.kills if k.in_ftar]
        gpus = profile.topology.gpus_per_host
        self._slow_hosts = {self.topology.host_of(f.replica, f.rank): f for f in options.faults
                            if isinstance(f, SlowHost)}
        self._slow_fetch = {f.replica: f for f in options.faults if isinstance(f, SlowFetch)}
        self._num_leads = self._lead_count()
        if self.folded:  # only each replica's lead hosts send FTAR traffic: scale the zone links to match
            self.world.fabric.model.zone_share = self._lead_hosts() / profile.hosts_per_replica
        self.ranks = self._represented_ranks()
        self.ring_board = RingBoard() if self._analytic_rings() else None
        self._ring_costs: dict[tuple, float] = {}  # ring_cost's, shared by every rank (few distinct rings)
        self.lighthouse: Lighthouse | None = None
        self._lighthouses: list[Lighthouse] = []  # every start, for the quorum history
        self._lighthouse_storage: MockObjectStore | None = None  # its disk: survives a restart
        self._lighthouse_down = False
        self.scheduler: MockScheduler | None = None
        self._in_step_kills: list[Kill] = []  # mid-step kills waiting for their replica's next step to begin
        self._restart_kills: list[Kill] = []  # step kills that fell due while their replica was down or restarting
        self._commit_gaps: list[float] = []
        # per count of replicas up: the recent step periods less the CPU floor's charge (ftar_overhead_s), and what
        # each all-reduce charges with that many up to keep the step at the CPU floor
        self._floor_gaps: dict[int, list[float]] = {}
        self._floor_s: dict[int, float] = {}
        self._up_at_commit: dict[int, int] = {}  # replica -> the replicas up at its last commit
        self._participants: dict[tuple, int] = {}  # (replica, incarnation, rank) -> its last all-reduce's participants
        self.diagnosis = JobDiagnosis(self) if options.diagnose else None
        self.scenario = ScenarioFaults(self)
        self.driver: Callable[["EmulatedJob"], None] | None = None  # a task run beside the job (diagnose bench)
        self.last_commit: dict[int, tuple[int, float]] = {}  # replica -> (step, virtual time) of its last commit
        self.ftar_entries = 0  # leaders' entries into an all-reduce (a driver's phase signal)

    # -- names and models ------------------------------------------------------------------------
    def replica_id(self, replica: int) -> str:
        return f"r{replica:0{len(str(self.profile.replicas - 1))}d}"

    def kernels(self) -> Any:
        """FTAR kernels for one rank: the CUDA kernels as the shadow loader maps them, charging the
        profile's measured kernel throughput (ftar.kernel_*_gb_s) where it has one."""
        kernels = self._cuda_kernels.CudaKernels()
        ftar = self.profile.ftar
        if ftar.kernel_reduce_gb_s > 0:
            kernels.reduce_bw = ftar.kernel_reduce_gb_s * 1e9
            kernels.reduce_copy_bw = 0.75 * kernels.reduce_bw
        if ftar.kernel_copy_gb_s > 0:
            kernels.copy_bw = ftar.kernel_copy_gb_s * 1e9
        return kernels

    def jitter_s(self, replica: int, step: int) -> float:
        j = self.profile.train.step_jitter
        if not j:
            return 0.0
        return self.profile.train.step_compute_s * random.Random(f"{self.options.seed}/{replica}/{step}").uniform(-j, j)

    def start_skew_s(self, replica: int, rank: int, n: int | str) -> float:
        """A rank's late start of a step (train.rank_start_skew_s, with the replicas up as `_skew_mean`: an exponential
        draw of that mean, seeded by the job's seed, replica, rank and `n`, 0 without one): rank 0's after each quorum
        decision (n: its quorum id and step), the others' before their compute of step n."""
        t = self.profile.train
        return start_skew(self._skew_mean(t.rank_start_skew_s, burst_s=t.step_compute_s),
                          f"{self.options.seed}/{replica}/{rank}/{n}")

    def retry_cpu_s(self, rank: tuple, quorum: Any) -> float:
        """A rank's (its (replica, incarnation, rank)) extra CPU in the step it retries after a replica of its quorum
        died (train.rank_retry_cpu_s): in its first all-reduce of fewer participants than its last one; else 0."""
        last = self._participants.get(rank)
        self._participants[rank] = quorum.num_participants
        return self.profile.train.rank_retry_cpu_s if last is not None and quorum.num_participants < last else 0.0

    def exchange_skew_s(self, replica: int, rank: int, quorum: Any) -> float:
        """A rank's late wake from the cross-replica all-reduce of `quorum` (a StepQuorum; train.rank_exchange_skew_s,
        with the replicas up as `_skew_mean`: an exponential draw of that mean, seeded by the job's seed, replica, rank,
        quorum id and step), 0 when the all-reduce had no peer to wait for (one participant) or without one."""
        if quorum.num_participants < 2:
            return 0.0
        t = self.profile.train
        return start_skew(self._skew_mean(t.rank_exchange_skew_s, burst_s=t.step_bookkeeping_s),
                          f"{self.options.seed}/{replica}/{rank}/x{quorum.quorum_id}/{quorum.step}")

    def _skew_mean(self, measured_s: float, *, burst_s: float = 0.0) -> float:
        """The mean of a late start or wake (train.rank_start_skew_s or rank_exchange_skew_s, `measured_s`) with the
        replicas up now (never fewer than 2). Both are measured with 2 replicas up (`ftrun calibrate SCRIPT`'s
        2-replica run, which its 1-replica step's calibration takes as is); more rank processes wake on the shared
        CPUs with more up (real runs' spreads against their restep's 2-replica one: 1.3-2.7x at 3 and 4 replicas,
        benchmarks/results/fidelity.md). train.shared_cpu_model "replicas": R / 2 of it. "queue": it plus half the
        growth of a rank's wait for a CPU per step, its CPU work per step (train.rank_cpu_step_s) x the finite-source
        queue's `wait_growth` from the measuring run's ranks to the live ones (the queue says how long a step waits,
        not where: the emulator charges it at its two wake-ups, the start and the wake from the all-reduce, half
        each): a measured skew is kept as it is, whatever load it met, and only what more ranks add is modeled (with
        fewer live ranks than the measuring run's, e.g. a profile measured on 2-rank replicas emulating 1-rank ones, the
        queue's negative growth is not taken: it could take the mean below 0). Either way at least `queued_wake_s` of
        the burst of CPU work the rank wakes for (`burst_s`: its compute for the start, its bookkeeping for the wake
        from the all-reduce)."""
        up = max(len(self._up()), 2)
        q = self._cpu_queue(up)
        mean = (measured_s * up / 2 if q is None
                else measured_s + self.rank_cpu_step_s(up) * max(wait_growth(*q), 0.0) / 2)
        return max(mean, self.queued_wake_s(burst_s))

    def queued_wake_s(self, burst_s: float) -> float:
        """The least mean late wake of a rank whose 2-replica calibration met no CPU queue but whose job now has more
        rank processes than cores: the 2-replica run measured on a core per rank (train.rank_cpu_share_ranks at most
        round(train.shared_cpu_cores)) reads ~0.1 ms, while with more live ranks than cores a rank that wakes
        together with the others (at a quorum decision, or at the end of the all-reduce) finds the cores taken by
        their bursts of `burst_s` and waits for one: the ranks' starts then spread by about one burst, {0, 0, b} at
        3 x 1 on 2 cores, whose median pairwise spread b an exponential of mean b / ln 2 gives (how the calibration
        reads a spread as a mean). Real 3 x 1 and 4 x 1 runs: late wakes 1.9-2.0 ms from the all-reduce, 3.1 ms at the
        start, against bookkeeping 1.3 ms and compute 1.35-1.8 ms. 0 otherwise: without those measurements, or where
        the calibration run already had more ranks than cores (its measured spreads hold the queue; 2-rank replicas
        on 2 cores)."""
        t = self.profile.train
        cores = round(t.shared_cpu_cores)
        if not cores or not t.rank_cpu_share_ranks or t.rank_cpu_share_ranks > cores:
            return 0.0
        return burst_s / math.log(2) if self._live_ranks() > cores else 0.0

    def _cpu_queue(self, up: int) -> tuple[float, int, int, float] | None:
        """The CPU queue's arguments with `up` replicas up (train.shared_cpu_model "queue", with the measuring run's
        busy share train.rank_cpu_share of its train.rank_cpu_share_ranks processes, their CPU work per step
        train.rank_cpu_step_s and train.shared_cpu_cores measured): (u, processes then, live ranks now, cores); None
        otherwise."""
        t = self.profile.train
        if (t.shared_cpu_model == "queue" and t.shared_cpu_cores and t.rank_cpu_share and t.rank_cpu_share_ranks
                and t.rank_cpu_step_s):
            return (t.rank_cpu_share, round(t.rank_cpu_share_ranks), up * self.profile.ranks_per_replica,
                    t.shared_cpu_cores)
        return None

    # -- running ---------------------------------------------------------------------------------
    def run(self, progress: Callable[[int], None] | None = None) -> Recorder:
        """Run the job to completion in virtual time. Returns the recorder."""
        self._progress = progress
        with contextlib.nullcontext() if shadow.is_active() else shadow.active(self.profile):  # a script's is on
            from ftrun.ftar import cuda_kernels  # shadowed: mocks.ftar_kernels under the real name

            self._cuda_kernels = cuda_kernels
            self.world.run_on(SUPERVISOR_HOST, self._supervise)
        for n, lh in enumerate(self._lighthouses):  # membership changes and quorums, as each lighthouse saw them
            for h in lh.history:
                self.recorder.event({**h, "event": f"lighthouse_{h['event']}", "lighthouse": n})
        return self.recorder

    def _supervise(self) -> None:
        env = self.world.host_env(SUPERVISOR_HOST)
        self._start_lighthouse()
        self.scheduler = MockScheduler(env=env, config=self.profile.scheduler,
                                       hot_spares=self.topology.hot_spare_hosts,
                                       cold_spares=self.topology.cold_spare_hosts)
        self._notices = env.queue()
        if self.diagnosis is not None:
            self.diagnosis.start()
            if self.options.diagnose_interval_s:
                self.world.host_env(DIAGNOSIS_HOST).spawn(self.diagnosis.monitor, self.options.diagnose_interval_s,
                                                          name="diagnosis-monitor")
        for r in range(self.profile.replicas):
            self._start(r, self.topology.replica_hosts(r))
        for k in self.options.kills:
            if k.at_s is not None:
                env.spawn(self._kill_at_time, k, name=f"inject-{k.describe()}")
        for f in self.options.faults:
            if isinstance(f, KillLighthouse) and f.at_s is not None:
                env.spawn(self._lighthouse_outage, f, name=f"inject-{f.describe()}")
            elif isinstance(f, CutBuilding):
                self.world.cut_building(f.building, f.at_s, f.end_s)
                env.spawn(self._record_cut, f, name=f"inject-{f.describe()}")
            elif isinstance(f, SCENARIO_FAULTS):
                env.spawn(self.scenario.at, f, name=f"inject-{f.describe()}")
        if self.driver is not None:
            env.spawn(self.driver, self, name="driver")
        self._event_loop(env)

    def _start_lighthouse(self) -> None:
        """Start a lighthouse process on its host: at the job's start, and again after a kill, on the same
        address and with the same disk (so it reloads the quorum state the previous one persisted, where
        storage.lighthouse_persists; without, it writes none and a decision waits for no write)."""
        lh_env = self.world.host_env(LIGHTHOUSE_HOST)
        if self._lighthouse_storage is None:
            self._lighthouse_storage = MockObjectStore.local_disk(lh_env)
        storage = self._lighthouse_storage if self.profile.storage.lighthouse_persists else None
        self.lighthouse = Lighthouse(env=lh_env, token=self.token, storage=storage,
                                     config=LighthouseConfig(min_replicas=self.profile.train.min_replicas,
                                                             timeouts=self.timeouts),
                                     bind=self.lighthouse_addr or "127.0.0.1:0")
        self._lighthouses.append(self.lighthouse)
        self.lighthouse_addr = self.lighthouse.start()

    def _event_loop(self, env: Any) -> None:
        deadline = None
        while True:
            live = [inc for inc in self._incarnations if inc is not None and inc.live > 0]
            if self.finished and not live:
                return
            if self.finished and deadline is None:  # grace for the last quorum's other replicas to commit
                deadline = env.clock.now() + self.profile.train.step_compute_s + self.timeouts.join_timeout_s
            try:
                kind, inc = self._notices.get(timeout=None if deadline is None else max(deadline - env.clock.now(), 0))
            except EnvTimeout:
                for inc in live:  # tear down what is still running once the job is over
                    self._kill(inc, "teardown")
                deadline = float("inf")
                continue
            if kind == "failed" and inc.alive and not self.finished:
                self._kill(inc, "failed")
                env.spawn(self._recover, inc, "relaunch", name=f"recover-{inc.replica_id}")

    def _start(self, replica: int, hosts: tuple[str, ...]) -> None:
        number = self._num_starts[replica]
        self._num_starts[replica] += 1
        inc = Incarnation(self, replica, number, tuple(hosts))
        self._incarnations[replica] = inc
        self._record("start", inc)
        inc.tasks = {rank: inc.envs[i].spawn(rank_main, self, inc, i, name=f"{inc.replica_id}.{number}/rank{rank}")
                     for i, rank in enumerate(inc.ranks)}

    def _kill(self, inc: Incarnation, why: str) -> None:
        """Kill every host of the incarnation; the calling task's own host last (that raises TaskKilled)."""
        inc.alive = False
        self._record("kill" if why == "injected" else why, inc)
        current = self.world.sched.current
        own = current.host.name if current is not None else None
        for host in sorted(inc.hosts, key=lambda h: h == own):
            self.world.kill_host(host)

    def _recover(self, inc: Incarnation, hosts_mode: str) -> None:
        env = self.world.host_env(SUPERVISOR_HOST)
        poll, detect = self.profile.scheduler.poll_interval_s, self.profile.scheduler.crash_detect_s
        now = env.clock.now()
        if detect is not None:  # a measured crash detection (the supervisor sees its child exit)
            env.clock.sleep(detect)
        else:
            env.clock.sleep(poll - now % poll if now % poll else poll)  # noticed at the supervisor's next poll
        if self.finished:
            return
        self._record("noticed", inc)
        try:
            alloc = (self.scheduler.relaunch(inc.hosts) if hosts_mode == "relaunch"
                     else self.scheduler.replace(len(inc.hosts)))
        except NoCapacity as e:
            self._record("no_capacity", inc, reason=str(e))
            return
        self._record("allocated", inc, allocation=alloc.kind, delay_s=alloc.delay_s, reason=alloc.reason)
        if not self.finished:
            self._start(inc.replica, alloc.hosts)

    # -- failure injection -----------------------------------------------------------------------
    def _inject(self, kill: Kill) -> None:
        inc = self._incarnations[kill.replica]
        if inc is None or not inc.alive or self.finished:
            self.recorder.event({"event": "kill_skipped", "t": self.world.now, "what": kill.describe(),
                                 "why": "replica not running" if not self.finished else "job finished"})
            return
        self.world.host_env(SUPERVISOR_HOST).spawn(self._recover, inc, kill.hosts, name=f"recover-{inc.replica_id}")
        self._kill(inc, "injected")

    def _rank_died(self, inc: Incarnation) -> None:
        """A rank's process crashed (kill replica=R rank=K): the supervisor notices it exit, as it notices a replica's
        (crash_detect_s, else its next poll), kills what is left of the incarnation and restarts it."""
        env = self.world.host_env(SUPERVISOR_HOST)
        detect = self.profile.scheduler.crash_detect_s
        env.clock.sleep(detect if detect is not None else self.profile.scheduler.poll_interval_s)
        if inc.alive and not self.finished:
            self._kill(inc, "rank_died")
            env.spawn(self._recover, inc, "relaunch", name=f"recover-{inc.replica_id}")

    def finish(self) -> None:
        """End the job now (a driver's run is over): ranks stop after their step, the supervisor tears down."""
        self.finished = True
        self.scenario.release()
        self._notices.put(("finished", None))

    def _kill_at_time(self, kill: Kill) -> None:
        env = self.world.host_env(SUPERVISOR_HOST)
        env.clock.sleep(max(kill.at_s - env.clock.now(), 0.0))  # type: ignore[operator]
        self._inject(kill)

    def _kill_in_step(self, kill: Kill, step: int) -> None:
        """F x the victim's compute of `step` as modeled now (its contention and straggling too: what a real
        rank's own timed compute is) from now, as `ftrun launch --inject` times a mid-step kill."""
        env = self.world.host_env(SUPERVISOR_HOST)
        inc = self._incarnations[kill.replica]
        extra = (self.jitter_s(kill.replica, step) + self.compute_extra_s(inc, 0, step) if inc is not None else 0.0)
        env.clock.sleep(kill.at_fraction * (self.profile.train.step_compute_s + extra + self.contention_extra_s()
                                            + self.replica_compute_extra_s()))
        self._inject(kill)

    def _lighthouse_outage(self, fault: KillLighthouse) -> None:
        """Kill the lighthouse (at its time, or F x a step after the job reached its step) and restart it."""
        env = self.world.host_env(SUPERVISOR_HOST)
        wait = (fault.at_s - env.clock.now() if fault.at_s is not None
                else fault.at_fraction * self.profile.train.step_compute_s)
        env.clock.sleep(max(wait, 0.0))
        if self.finished or self._lighthouse_down:
            self.recorder.event({"event": "kill_skipped", "t": self.world.now, "what": fault.describe(),
                                 "why": "job finished" if self.finished else "lighthouse already down"})
            return
        self._lighthouse_down = True
        self.recorder.event({"event": "lighthouse_kill", "t": self.world.now, "step": self.max_step,
                             "what": fault.describe()})
        self.world.kill_host(LIGHTHOUSE_HOST)
        env.clock.sleep(fault.down_s)
        self._start_lighthouse()
        self._lighthouse_down = False
        self.recorder.event({"event": "lighthouse_restart", "t": self.world.now, "step": self.max_step,
                             "quorum_id": self.lighthouse.status()["quorum_id"]})

    def _record_cut(self, cut: CutBuilding) -> None:
        env = self.world.host_env(SUPERVISOR_HOST)
        for what, at in (("cut_start", cut.at_s), ("cut_end", cut.end_s)):
            env.clock.sleep(max(at - env.clock.now(), 0.0))
            self.recorder.event({"event": what, "t": self.world.now, "step": self.max_step, "building": cut.building})

    # -- stragglers and slow fetches (looked up by rank tasks; never block) ----------------------
    def straggler_on(self, hosts: tuple[str, ...]) -> tuple[int, float, int] | None:
        """(host index, factor, from step) of a slow host among `hosts`, or None."""
        for i, h in enumerate(hosts):
            f = self._slow_hosts.get(h)
            if f is not None:
                return i, f.factor, f.from_step
        return None

    def compute_extra_s(self, inc: Incarnation, rank: int, step: int) -> float:
        """Extra compute time of `rank` at `step` on a straggler host: (factor - 1) x a step. Folded,
        the first host's leads carry the replica's straggler wherever it is (a second, reference lead host
        under diagnose stays healthy, as the hosts it stands for): either way the job's step waits for the
        slowest ring of the replica."""
        if self.scenario.slow_hosts:
            gpus = self.profile.topology.gpus_per_host
            mine = inc.hosts if self._num_leads is not None else (inc.hosts[rank // gpus],)
            factor = max((self.scenario.slow_hosts.get(h, 1.0) for h in mine), default=1.0)
            if factor > 1 and (self._num_leads is None or rank < gpus):
                return (factor - 1.0) * self.profile.train.step_compute_s
        s = inc.straggler
        if s is None or step < s[2]:
            return 0.0
        gpus = self.profile.topology.gpus_per_host
        on_it = rank < gpus if self._num_leads is not None else rank // gpus == s[0]
        return (s[1] - 1.0) * self.profile.train.step_compute_s if on_it else 0.0

    def contention_extra_s(self) -> float:
        """Extra compute time of a step while the job's ranks share the machine's CPUs (train.shared_cpu_cores,
        c): each live rank keeps a CPU busy for its compute and bookkeeping, a fraction u of the job's recent step
        period, so the ranks ask for N x u cores; beyond c, compute stretches by N x u / c. 0 when ranks have
        CPUs of their own."""
        t = self.profile.train
        if not t.shared_cpu_cores:
            return 0.0
        live = self._live_ranks()
        gaps = sorted(self._commit_gaps)
        busy = t.step_compute_s + t.step_bookkeeping_s
        u = min(1.0, busy / gaps[len(gaps) // 2]) if gaps else 1.0
        return t.step_compute_s * max(0.0, live * u / t.shared_cpu_cores - 1.0)

    def ftar_overhead_s(self) -> float:
        """The all-reduce's measured overhead while more than one replica is up (seams.OverheadExchange charges
        it after the modeled ring): ftar.sync_overhead_s is measured with 2 replicas; with R up it is R / 2 of
        that (each replica's rank wakes for its ring steps on the shared CPUs: more replicas, more wake-ups). Plus,
        on shared CPUs, what the recent steps fell short of the CPU floor (`cpu_floor_period_s`): a real rank waits
        for a CPU throughout its step, but most of that wait shows in its all-reduce (real 3 x 1: compute 1.8 ms
        of a 15 ms step, the all-reduce phase 7.7 ms), and a mid-step kill, timed on the compute, stays where it was."""
        return self._per_replica_up(self.profile.ftar.sync_overhead_s) + self._floor_s.get(len(self._up()), 0.0)

    def cpu_floor_period_s(self) -> float:
        """The shortest step period the shared CPUs allow with the ranks up now: N live ranks each use
        `rank_cpu_step_s` of CPU per step, and a synchronous job keeps train.rank_cpu_share x
        train.rank_cpu_share_ranks cores busy, U (measured in `ftrun calibrate SCRIPT`'s 2-replica run). Where that
        run had a core per rank (rank_cpu_share_ranks at most round(train.shared_cpu_cores)) a step takes at least
        N x rank_cpu_step_s / U: the busy cores stay as measured (1-rank replicas on 2 cores: 1.17-1.42 at 2 replicas,
        1.18-1.35 at 3, 1.26-1.44 at 4). Where it already had more ranks than cores, what it left idle is the job's
        own (the waits every rank shares: the quorum, the ring's hops), the same core-seconds per step with more ranks,
        whose CPU fills the rest: the step takes at least (N x rank_cpu_step_s + I) / shared_cpu_cores, I = that run's
        idle core-seconds per step (2-rank replicas: U 1.37-1.52 at 2 replicas, 1.46-1.62 at 3, 1.52-1.68 at 4, where
        the busy cores held put the step 10-16% long; benchmarks/results/fidelity.md). 0 when not measured,
        when the ranks have CPUs of their own (no shared_cpu_cores) or with one replica up."""
        t = self.profile.train
        busy = t.rank_cpu_share * t.rank_cpu_share_ranks
        up = len(self._up())
        if not (t.shared_cpu_cores and t.rank_cpu_step_s and busy) or up < 2:
            return 0.0
        work = self._live_ranks() * self.rank_cpu_step_s(up)
        if t.rank_cpu_share_ranks <= round(t.shared_cpu_cores):
            return work / busy
        idle = max(t.rank_cpu_share_ranks * t.rank_cpu_step_s * (t.shared_cpu_cores / busy - 1.0), 0.0)
        return (work + idle) / t.shared_cpu_cores

    def _charge_floor(self, up: int, period_s: float) -> None:
        """What each all-reduce charges with `up` replicas up: the median shortfall from the CPU floor
        (`cpu_floor_period_s`) of their recent step periods with that many up, as they were without that charge.
        Kept per count of replicas up, so the steps after a kill or a rejoin pay the floor of the replicas up then, as
        a real rank does (from the first time that many were up), not a charge worked out from the steps of those up
        before: real 3 x 1 runs with 2 replicas left took 2.9-4.7 ms from a quorum to its commit from the retry on,
        and the emulator 1.7-2.5 ms for the next 6 steps with one history of every step
        (benchmarks/results/fidelity.md)."""
        gaps = self._floor_gaps[up] = (self._floor_gaps.get(up, []) + [period_s - self._floor_s.get(up, 0.0)])[-20:]
        floor = self.cpu_floor_period_s()
        self._floor_s[up] = max(0.0, floor - sorted(gaps)[len(gaps) // 2]) if floor else 0.0

    def rank_cpu_step_s(self, replicas: int) -> float:
        """A rank's CPU seconds per step with `replicas` replicas up (`rank_cpu_at`, from train.rank_cpu_step_s and
        train.rank_ring_cpu_s). Real ranks of 1-rank replicas, all-reduce CPU per step 0.05 / 1.13-1.30 / 1.44-1.47 /
        1.67-1.77 ms at 1 / 2 / 3 / 4 replicas, which this puts at 1.49-1.72 at 3 and 1.67-1.93 at 4
        (benchmarks/results/fidelity.md). Pure."""
        t = self.profile.train
        return rank_cpu_at(t.rank_cpu_step_s, t.rank_ring_cpu_s, replicas)

    def replica_compute_extra_s(self) -> float:
        """The compute a step gains from the other replicas up (train.replica_compute_extra_s, measured with 2
        replicas: R / 2 of it with R up, as the all-reduce's overhead): their ranks compute on the same CPUs."""
        return self._per_replica_up(self.profile.train.replica_compute_extra_s)

    def _per_replica_up(self, at_two_s: float) -> float:
        """`at_two_s`, measured with 2 replicas up, scaled to the replicas up now (R / 2; 0 with one). The same with
        train.shared_cpu_model "queue" (R / 2 times the queue's slowdown of a burst of CPU work as well overshot: 4 x 1
        step 1.25 against 1.04, benchmarks/results/fidelity.md)."""
        up = len(self._up())
        return at_two_s * up / 2 if up > 1 else 0.0

    def _up(self) -> list[Incarnation]:
        """The replicas' live incarnations."""
        return [inc for inc in self._incarnations if inc is not None and inc.alive]

    def _live_ranks(self) -> int:
        """The rank processes of the live incarnations."""
        return sum(inc.world_size for inc in self._up())

    def slow_fetch(self) -> tuple[float, float] | None:
        """(factor, delay_s) of the slow fetch fault in force now (F x the modeled transfer, plus D), or None. As
        `ftrun launch --inject` applies it: every catch-up source serves slowly while the fault's replica is catching
        up (up, and no commit since its start), so a fetch meets it whichever replica makes it (a replica starting
        late while that one has not committed yet, too)."""
        for replica, f in self._slow_fetch.items():
            inc = self._incarnations[replica]
            if inc is not None and inc.alive and not inc.has_committed:
                return f.factor, f.delay_s
        return None

    def data_figures(self) -> dict[str, Any]:
        """The exactly-once audit over every leader's records, catch-up and checkpoint figures."""
        return audit_figures(self.storage, self.checkpoint_storage, self.recorder.events,
                             self.profile.ranks_per_replica)

    # -- called from rank tasks (never block) ----------------------------------------------------
    def committed(self, inc: Incarnation, step: int) -> None:
        """A leader committed: its replica has trained `step` steps."""
        now, last = self.world.now, self.last_commit.get(inc.replica)
        up, up_before = len(self._up()), self._up_at_commit.get(inc.replica)
        self.last_commit[inc.replica], self._up_at_commit[inc.replica] = (step, now), up
        inc.has_committed = True
        if last is not None:
            self._commit_gaps = (self._commit_gaps + [now - last[1]])[-20:]  # the recent step period (contention)
        if last is not None and up_before == up:  # a step trained with as many replicas up as the floor's charge
            self._charge_floor(up, now - last[1])
        if step >= self.options.steps:
            inc.completed = True
            self.finished = True
        if step > self.max_step:
            self.max_step = step
            if self._progress is not None:
                self._progress(step)
        for kill in list(self._pending_step_kills):  # at its own commit of step S (or once the job is past S)
            if isinstance(kill, KillLighthouse):
                if self.max_step >= kill.at_step:  # type: ignore[operator]
                    self._pending_step_kills.remove(kill)
                    self.world.host_env(SUPERVISOR_HOST).spawn(self._lighthouse_outage, kill,
                                                               name=f"inject-{kill.describe()}")
                continue
            mine = kill.replica == inc.replica and step >= kill.at_step  # type: ignore[operator]
            if mine or self.max_step > kill.at_step:  # type: ignore[operator]
                self._pending_step_kills.remove(kill)
                victim = self._incarnations[kill.replica]
                if mine and kill.at_fraction == 0:
                    self._inject(kill)  # now, before its leader asks for the next quorum (kills this task too)
                elif mine:
                    self._in_step_kills.append(kill)  # F x a step's compute into its next step (step_started)
                elif kill.at_fraction > 0 and (victim is None or not victim.alive or not victim.has_committed):
                    # down or restarting: as `ftrun launch --inject` kills it, in its own step S or later, whichever
                    # incarnation runs it: the next one's first trained step (step_forward)
                    self._restart_kills.append(kill)
                else:
                    self.world.host_env(SUPERVISOR_HOST).spawn(self._kill_in_step, kill, self.max_step,
                                                               name=f"inject-{kill.describe()}")

    def step_started(self, inc: Incarnation, step: int) -> None:
        """A leader's step began (its quorum decided): a mid-step kill of its replica starts counting F x a
        step's compute from here, as `ftrun launch --inject` counts from the victim's quorum."""
        for kill in list(self._in_step_kills):
            if kill.replica == inc.replica and step >= kill.at_step:  # type: ignore[operator]
                self._in_step_kills.remove(kill)
                self.world.host_env(SUPERVISOR_HOST).spawn(self._kill_in_step, kill, step,
                                                           name=f"inject-{kill.describe()}")

    def step_forward(self, inc: Incarnation, step: int) -> None:
        """A leader's forward began: a step kill that fell due while its replica was down or restarting kills this
        incarnation here, F x a step's compute into it (a real restarted rank has timed no compute yet and dies in
        this first trained step's backward); one per step, another one waits for the next incarnation."""
        for kill in list(self._restart_kills):
            if kill.replica == inc.replica and step >= kill.at_step:  # type: ignore[operator]
                self._restart_kills.remove(kill)
                self.world.host_env(SUPERVISOR_HOST).spawn(self._kill_in_step, kill, step,
                                                           name=f"inject-{kill.describe()}")
                break

    def entering_ftar(self, inc: Incarnation, step: int) -> None:
        """A leader enters the all-reduce of `step`: fire the at=ftar kills due for its replica."""
        self.ftar_entries += 1
        for kill in [k for k in self._ftar_kills if k.replica == inc.replica and step >= k.at_step]:  # type: ignore
            self._ftar_kills.remove(kill)
            self.world.host_env(SUPERVISOR_HOST).spawn(self._inject, kill, name=f"inject-{kill.describe()}")

    def leader_event(self, inc: Incarnation, event: dict) -> None:
        self.recorder.event({**event, "incarnation": inc.number})

    def rank_failed(self, inc: Incarnation, rank: int, error: BaseException, unexpected: bool = False) -> None:
        if unexpected:
            self.recorder.errors.append(f"{inc.replica_id}.{inc.number} rank {rank}: {type(error).__name__}: {error}")
        if inc.alive and not self.finished:
            self._notices.put(("failed", inc))

    def rank_exited(self, inc: Incarnation, rank: int, ok: bool) -> None:
        inc.live -= 1
        if inc.live == 0:
            self._notices.put(("exited", inc))

    def _record(self, what: str, inc: Incarnation, **fields: Any) -> None:
        self.recorder.event({"event": what, "t": self.world.now, "replica_id": inc.replica_id,
                             "incarnation": inc.number, "step": self.max_step, **fields})
