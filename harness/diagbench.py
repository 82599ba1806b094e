"""`ftrun diagnose bench --profile P --scenarios N --seed S [--json]`: the root-cause analysis' accuracy on
emulated faults, one emulated job for the whole bench.

The job runs with telemetry on every rank and the real collector beside the lighthouse
(harness.run.diagnosis). A driver task runs N scenarios one after another, each a random kind, place and
phase (`draw`): it waits until every replica trains, waits a random fraction of a step (the phase:
compute or all-reduce), injects the fault (harness.run.faults' scenario forms), waits for the symptom
(a hang: the step is late; a killed rank: the job enters the next all-reduce, where its ring peers find
it gone, before the supervisor restarts its replica; a slow host or link: enough steps for the lag
history), collects every rank's telemetry over the modeled network and runs the real analysis
(ftrun.diagnose.analysis), scores the verdict (`score`: exact culprit, candidate set, or miss), releases
the fault and waits for the job to train again. Between scenarios, fault-free collections count false
positives (a verdict other than no_hang) and false evictions (the eviction rule would evict).
A slow link that no healthy transfer waits on is reported, not scored. Where the supervisor's crash detection
is shorter than a step (meta-98k: a 5 s poll in 20 s steps), a rank kill lands within it before the next
all-reduce (`kill_phase`): earlier, the supervisor sees the exit and stops the whole replica before any ring
waits on the rank, and the analysis sees a whole replica gone.

Pure parts (`draw`, `score`, `summarize`) are table-tested; `run_bench` drives the emulated job.
"""

from __future__ import annotations

import dataclasses
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ftrun.diagnose.summary import HIST_LEN
from harness.profile import Profile, hosts_per_replica
from harness.run import EmulatedJob, JobOptions
from harness.run.faults import CutBuilding, Hang, KillRank, SlowHostAt, SlowLink

KINDS = ("hang_rank", "hang_host", "slow_host", "slow_link", "cut_building", "kill_rank")
HANG_KINDS = ("hang_rank", "hang_host", "cut_building", "kill_rank")
SLOW_STEPS = 6  # steps a slow fault runs before collecting: a majority of the HIST_LEN (8) all-reduces


@dataclass(frozen=True)
class Shape:
    """What `draw` needs to know about the job."""

    replicas: int
    ranks_per_replica: int
    gpus_per_host: int
    buildings: int
    max_slow_factor: float  # a straggler past the ring's wait limit is a timeout, not a slow host
    # faults go on the first this-many hosts of each replica (0: every host). Folded FTAR runs only each
    # replica's first host's rings for real (harness.run.fold): faults there keep the other hosts
    # identical, so folding them stays exact
    fault_hosts: int = 0

    def __post_init__(self) -> None:
        if self.fault_hosts < 0:
            raise ValueError(f"Shape.fault_hosts must be >= 0 (0: every host), got {self.fault_hosts}")

    @property
    def hosts_per_replica(self) -> int:
        return hosts_per_replica(self.ranks_per_replica, self.gpus_per_host)

    @property
    def place_hosts(self) -> int:
        """Hosts per replica that faults may be placed on."""
        return min(self.fault_hosts, self.hosts_per_replica) if self.fault_hosts else self.hosts_per_replica

    @property
    def place_ranks(self) -> int:
        """Ranks per replica (the first ones) that rank faults may be placed on."""
        return min(self.ranks_per_replica, self.place_hosts * self.gpus_per_host)

    @property
    def num_hosts(self) -> int:
        return self.replicas * self.hosts_per_replica


@dataclass(frozen=True)
class Scenario:
    index: int
    kind: str
    phase: float  # fraction of a step after a commit at which the fault is injected
    replica: int = -1  # hang_rank, kill_rank: rank `rank` of this replica
    rank: int = -1
    host: int = -1  # training host index (hang_host, slow_host; slow_link's sender)
    host_b: int = -1  # slow_link's receiver (the next replica's same host slot: a ring link)
    building: int = -1
    factor: float = 1.0

    def fault(self, cut_s: float = 0.0) -> Any:
        if self.kind == "hang_rank":
            return Hang(replica=self.replica, rank=self.rank)
        if self.kind == "hang_host":
            return Hang(host=str(self.host))
        if self.kind == "kill_rank":
            return KillRank(replica=self.replica, rank=self.rank)
        if self.kind == "slow_host":
            return SlowHostAt(host=str(self.host), factor=self.factor)
        if self.kind == "slow_link":
            return SlowLink(a=str(self.host), b=str(self.host_b), factor=self.factor)
        if self.kind == "cut_building":
            return CutBuilding(building=self.building, at_s=0.0, duration_s=cut_s)
        raise ValueError(f"unknown scenario kind {self.kind!r}")

    def place(self) -> str:
        return self.fault(1.0).describe().split(" time=")[0]


def chunk_positions(sc: Scenario, shape: Shape) -> frozenset[int]:
    """The ring positions (local ranks; ring k joins rank k of every replica) a scenario's fault stalls
    silently, which must run chunk by chunk where the job's rings are analytic (harness.run.ring_model): a
    hung rank's; a hung host's ranks; every position for a building cut (every ring crosses buildings).
    None for the others, which analytic rings show as they are: a slow host computes late (its ranks arrive
    late), a slowed link slows the modeled transfer and send busy time of its rings (the route's rate), and a
    killed rank closes its connections."""
    if sc.kind == "hang_rank":
        return frozenset({sc.rank})
    if sc.kind == "hang_host":
        first = (sc.host % shape.hosts_per_replica) * shape.gpus_per_host
        return frozenset(range(first, min(first + shape.gpus_per_host, shape.ranks_per_replica)))
    if sc.kind == "cut_building":
        return frozenset(range(shape.ranks_per_replica))
    return frozenset()


def kinds_for(shape: Shape) -> tuple[str, ...]:
    """The kinds this job can have: a building cut needs a second building (the lighthouse is in building 0)."""
    return tuple(k for k in KINDS if k != "cut_building" or shape.buildings > 1)


def draw(n: int, seed: int, shape: Shape) -> list[Scenario]:
    """N scenarios (pure, seeded): kinds round-robin over `kinds_for` in a shuffled order, places (on the
    first `shape.place_hosts` hosts of each replica) and phases uniform. A slow host's factor is uniform in
    [2, min(10, max_slow_factor)] (when max_slow_factor < 3: in its upper half); a slow link's in [4, 10]
    (the analysis calls a link slow at 3x the median send time of comparable links)."""
    if n < 0:
        raise ValueError(f"scenarios must be >= 0, got {n}")
    rng = random.Random(seed)
    kinds = list(kinds_for(shape))
    out = []
    for i in range(n):
        if i % len(kinds) == 0:
            rng.shuffle(kinds)
        kind = kinds[i % len(kinds)]
        s = Scenario(i, kind, round(rng.random(), 4))
        if kind in ("hang_rank", "kill_rank"):
            per = shape.place_ranks
            replica, rank = divmod(rng.randrange(shape.replicas * per), per)
            s = dataclasses.replace(s, replica=replica, rank=rank)
        elif kind in ("hang_host", "slow_host"):
            r, slot = divmod(rng.randrange(shape.replicas * shape.place_hosts), shape.place_hosts)
            s = dataclasses.replace(s, host=r * shape.hosts_per_replica + slot)
            if kind == "slow_host":
                hi = min(10.0, shape.max_slow_factor)
                lo = min(2.0, 1.0 + 0.5 * (hi - 1.0))
                s = dataclasses.replace(s, factor=round(rng.uniform(lo, hi), 2))
        elif kind == "slow_link":
            r, slot = rng.randrange(shape.replicas), rng.randrange(shape.place_hosts)
            b = ((r + 1) % shape.replicas) * shape.hosts_per_replica + slot
            s = dataclasses.replace(s, host=r * shape.hosts_per_replica + slot, host_b=b,
                                    factor=round(rng.uniform(4.0, 10.0), 2))
        elif kind == "cut_building":
            s = dataclasses.replace(s, building=rng.randrange(1, shape.buildings))
        out.append(s)
    return out


@dataclass(frozen=True)
class Truth:
    """What the verdict must name (ranks as collector keys "rNN/k", hosts as names)."""

    kinds: tuple[str, ...]  # verdict kinds that can name it exactly
    ranks: frozenset[str] = frozenset()  # exact: the verdict names exactly these ranks (when set)
    hosts: frozenset[str] = frozenset()  # exact: the verdict's hosts are these (or, with subset, within them)
    subset: bool = False  # exact when the verdict's hosts are a non-empty subset of `hosts`


def score(verdict: dict, truth: Truth) -> str:
    """"exact", "candidates" (a candidate set that contains a culprit), or "miss" (pure)."""
    ranks, hosts = set(verdict.get("ranks", ())), set(verdict.get("hosts", ()))
    if verdict.get("kind") in truth.kinds:
        if truth.ranks and ranks == truth.ranks:
            return "exact"
        if not truth.ranks and hosts and (hosts <= truth.hosts if truth.subset else hosts == truth.hosts):
            return "exact"
    if verdict.get("kind") == "candidates" and ((ranks & truth.ranks) or (hosts & truth.hosts)):
        return "candidates"
    return "miss"


KILL_WINDOW = (0.2, 0.8)  # of the crash detection time: a rank kill lands this long before the all-reduce (at
# least, at most): the latest leaves room for the bench's own timing error (a commit noticed up to a poll late)


def kill_phase(phase: float, detect_s: float, entry_s: float, period_s: float) -> float:
    """Where (in steps after a commit) a rank kill drawn at `phase` lands (pure). Where the supervisor's crash
    detection is shorter than a step, the kill lands between KILL_WINDOW[1] and KILL_WINDOW[0] x detect_s before
    the job next enters an all-reduce (`entry_s` after the commit), later for a later phase: the job then
    enters the all-reduce that waits on the dead rank before the supervisor sees the exit and stops the whole
    replica (after that no ring can single the rank out, and the job knows the culprit anyway). Else (ci-small)
    the drawn phase, unchanged. At meta-98k (a 5 s poll in 20 s steps) 4 s to 1 s before the all-reduce. (Up to the
    all-reduce itself, a kill drawn late in the window raced the entry: design-4k missed 3 of 23 kills, all drawn
    at phase 0.89-0.98.)"""
    if not 0 <= phase <= 1 or detect_s < 0 or entry_s < 0 or period_s <= 0:
        raise ValueError(f"kill_phase needs phase in [0, 1], detect_s >= 0, entry_s >= 0, period_s > 0; got {phase}, "
                         f"{detect_s}, {entry_s}, {period_s}")
    if detect_s >= period_s:
        return phase
    latest, earliest = KILL_WINDOW
    return max(0.0, entry_s - detect_s * (latest + (earliest - latest) * (1.0 - phase))) / period_s


def pick(plan: list[Scenario], only: str | None) -> list[Scenario]:
    """The scenarios `--only` names (comma-separated 0-based indexes into the drawn plan; None: all), in plan
    order (pure)."""
    if only is None:
        return plan
    try:
        want = {int(x) for x in only.split(",") if x.strip()}
    except ValueError:
        raise ValueError(f"--only takes comma-separated scenario indexes, got {only!r}") from None
    bad = sorted(k for k in want if not 0 <= k < len(plan))
    if not want or bad:
        raise ValueError(f"--only names scenario indexes in [0, {len(plan)}) of the drawn plan, got {only!r}")
    return [sc for sc in plan if sc.index in want]


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def summarize(results: list[dict], fault_free: list[dict], analysis_s: list[float],
              telemetry: dict[str, Any]) -> dict[str, Any]:
    """The bench's figures (pure): see the issue's keys."""
    n = len(results)
    exact = sum(1 for r in results if r["score"] == "exact")
    by_kind: dict[str, dict[str, int]] = {}
    for r in results:
        k = by_kind.setdefault(r["kind"], {"n": 0, "exact": 0, "candidates": 0})
        k["n"] += 1
        if r["score"] != "miss":
            k[r["score"]] += 1
    return {"scenarios": n, "accuracy": round(exact / n, 4) if n else None,
            "candidate_hits": sum(1 for r in results if r["score"] == "candidates"),
            "false_positive_runs": sum(1 for f in fault_free if f["kind"] != "no_hang"),
            "false_positives": [f for f in fault_free if f["kind"] != "no_hang"][:20],
            "false_evictions": sum(1 for f in fault_free if f["evicted"]),
            "fault_free_runs": len(fault_free),
            "analysis_s_p50": percentile(analysis_s, 0.5), "analysis_s_p99": percentile(analysis_s, 0.99),
            "telemetry_bytes_per_rank": telemetry.get("telemetry_bytes_per_rank"),
            "by_kind": by_kind,
            "misses": [{"seed": r["seed"], "index": r["index"], "kind": r["kind"], "place": r["place"],
                        "phase": r["phase"], "phase_name": r.get("phase_name"), "verdict": r["verdict_kind"], "reason": r["reason"][:200]}
                       for r in results if r["score"] != "exact"],
            **{k: v for k, v in telemetry.items() if k != "telemetry_bytes_per_rank"}}


# -- the driver (inside the emulated job) ----------------------------------------------------------------
@dataclass
class _Bench:
    job: EmulatedJob
    scenarios: list[Scenario]
    fault_free: int
    seed: int
    results: list[dict] = field(default_factory=list)
    ff: list[dict] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    unscored: list[dict] = field(default_factory=list)
    progress: bool = False
    drawn: int = 0  # scenarios drawn (more than `scenarios` under --only), for the progress lines
    healthy_input: Any = None
    _entry_s: float | None = None  # commit to the next all-reduce entry, where rank kills need it (kill_phase)
    wall0: float = field(default_factory=time.monotonic)

    @property
    def clock(self) -> Any:
        return self.job.world.clock

    def run(self, job: EmulatedJob) -> None:
        p = job.profile
        self._period = p.train.step_compute_s * 1.2
        self.rng = random.Random(self.seed + 1)
        try:
            self._warm_up()
            n = len(self.scenarios)
            for i, sc in enumerate(self.scenarios):
                while len(self.ff) < self.fault_free * i // max(n, 1):
                    self._fault_free()
                self._scenario(sc)
            while len(self.ff) < self.fault_free:
                self._fault_free()
        finally:
            job.finish()

    # -- waiting on the job ------------------------------------------------------------------------
    def _commit_times(self) -> list[float]:
        return sorted(t for _, t in self.job.last_commit.values())

    def _healthy(self) -> bool:
        job = self.job
        live = [inc for inc in job._incarnations if inc is not None and inc.alive]
        if len(live) < job.profile.replicas or len(job.last_commit) < job.profile.replicas:
            return False
        return all(job.last_commit[inc.replica][0] >= job.max_step for inc in live)

    def _wait_steps(self, k: int, limit_s: float) -> bool:
        """Wait until the job committed k more steps with every replica in them; False at the limit."""
        clock, start = self.clock, self.job.max_step
        deadline = clock.now() + limit_s
        while clock.now() < deadline:
            if self.job.max_step >= start + k and self._healthy():
                return True
            clock.sleep(self._period / 8)
        return False

    def _warm_up(self) -> None:
        self._wait_steps(3, 100 * self._period + 600)
        self._measure_period()
        if self._detect_s() < self._period:  # rank kills aim at the next all-reduce (kill_phase)
            self._entry_s = self._measure_entry()
        if self.job.diagnosis.diagnose()["kind"] == "no_hang":  # a baseline of healthy wire times (not scored)
            self.healthy_input = self.job.diagnosis.collector.last_input[0]

    def _measure_period(self) -> None:
        """A healthy step's duration (`_period`): the mean over two steps after the warm-up."""
        t0, s0 = self.clock.now(), self.job.max_step
        self._wait_steps(2, 40 * self._period + 600)
        if self.job.max_step > s0:
            self._period = (self.clock.now() - t0) / (self.job.max_step - s0)

    def _measure_entry(self) -> float:
        """Seconds from a commit (as `_after_commit` sees it) to the job's next entry into an all-reduce."""
        self._after_commit(0.0)
        t0, entries = self.clock.now(), self.job.ftar_entries
        deadline = t0 + 4 * self._period
        while self.job.ftar_entries == entries and self.clock.now() < deadline:
            self.clock.sleep(self._period / 256)
        return self.clock.now() - t0

    def _after_commit(self, frac: float) -> None:
        """Wait for the next commit, then `frac` of a step."""
        s = self.job.max_step
        deadline = self.clock.now() + 10 * self._period
        while self.job.max_step == s and self.clock.now() < deadline:
            self.clock.sleep(self._period / 256)  # a commit noticed within 0.4% of a step (kill_phase)
        self.clock.sleep(frac * self._period)

    # -- one scenario --------------------------------------------------------------------------------
    def _truth(self, sc: Scenario) -> Truth:
        job, topo = self.job, self.job.topology
        hosts = topo.training_hosts
        if sc.kind in ("hang_rank", "kill_rank"):
            return Truth(("hang",), ranks=frozenset({f"{job.replica_id(sc.replica)}/{sc.rank}"}))
        if sc.kind in ("hang_host", "slow_host"):
            kinds = ("hang",) if sc.kind == "hang_host" else ("slow_host", "slow_rank")
            return Truth(kinds, hosts=frozenset({hosts[sc.host]}))
        if sc.kind == "slow_link":
            return Truth(("slow_link",), hosts=frozenset({hosts[sc.host], hosts[sc.host_b]}), subset=True)
        inside = frozenset(h for h in hosts if topo.location(h).building == sc.building)
        return Truth(("hang",), hosts=inside, subset=True)

    def _chunk_rings(self, sc: Scenario | None) -> None:
        """With analytic rings: run the rings the scenario's fault stalls chunk by chunk (None: none)."""
        board = self.job.ring_board
        if board is not None:
            board.chunk_positions = chunk_positions(sc, shape_of(self.job.profile)) if sc else frozenset()

    def _scenario(self, sc: Scenario) -> None:
        job, diag = self.job, self.job.diagnosis
        if not self._healthy():
            self._wait_steps(1, 200 * self._period + 600)
        self._chunk_rings(sc)  # before the next commit: every all-reduce after it runs in its mode
        phase = self._inject_phase(sc)
        self._after_commit(phase)
        timeout = job.timeouts.ftar_timeout_s
        cut_s = max(2.0 * timeout, 4 * self._period)
        t_inject, step0 = self.clock.now(), job.max_step
        killed = job._incarnations[sc.replica] if sc.kind == "kill_rank" else None
        job.scenario.apply(sc.fault(cut_s))
        verdicts = []
        if sc.kind == "kill_rank":  # collect as the job enters the next all-reduce (the ring peers find the rank
            entries = job.ftar_entries  # gone), before the supervisor restarts its replica
            deadline = t_inject + 2 * self._period
            while job.ftar_entries == entries and self.clock.now() < deadline:
                self.clock.sleep(self._period / 256)
            self.clock.sleep(self._period / 256)
        supervisor_first = killed is not None and not killed.alive  # it stopped the replica before the collection
        if sc.kind in HANG_KINDS:
            deadline = t_inject + 2 * self._period + timeout
            poll = max(self._period / 8, 0.05)
            while self.clock.now() < deadline:
                late = self.clock.now() - max(self._commit_times(), default=t_inject) > 1.1 * self._period
                if sc.kind == "kill_rank" or late or job.max_step > step0:
                    v = diag.diagnose()
                    verdicts.append(v)
                    if v["kind"] in ("hang", "candidates"):
                        break
                self.clock.sleep(poll)
        else:
            self._wait_steps(SLOW_STEPS, 40 * self._period * sc.factor + 600)
            for _ in range(3):
                v = diag.diagnose()
                verdicts.append(v)
                if v["kind"] != "no_hang":
                    break
                self.clock.sleep(self._period / 2)
        v = verdicts[-1] if verdicts else {"kind": "none", "reason": "no collection before the deadline",
                                           "ranks": [], "hosts": []}
        job.scenario.release()
        if sc.kind == "slow_link" and v["kind"] == "no_hang":
            why = self._undetectable_link(sc.factor)
            if why:  # no wire time to compare (the analysis cannot see it): not scored, reported
                self._unscored(sc, v, why, settle=HIST_LEN + 1)
                self._chunk_rings(None)
                return
        result = score(v, self._truth(sc))
        self.results.append({"seed": self.seed, "index": sc.index, "kind": sc.kind, "place": sc.place(),
                             "phase": round(phase, 4), "score": result,
                             "phase_name": "compute" if phase * self._period < job.profile.train.step_compute_s
                             else "all-reduce", "verdict_kind": v["kind"],
                             "reason": v["reason"], "verdict_hosts": v.get("hosts", [])[:8],
                             "verdict_ranks": v.get("ranks", [])[:8], "collections": len(verdicts),
                             "polls": [x["kind"] for x in verdicts][-6:], "supervisor_first": supervisor_first,
                             "detect_s": round(self.clock.now() - t_inject, 3)})
        self._progress(sc, result, v)
        job.recorder.event({"event": "diagbench_scenario", "t": self.clock.now(), "step": job.max_step,
                            **{k: v for k, v in self.results[-1].items() if k != "reason"}})
        # after a slow fault, its lag stays in the analysis' history (HIST_LEN all-reduces): let it age out
        settle = HIST_LEN + 1 if sc.kind in ("slow_host", "slow_link") else 2
        if not self._wait_steps(settle, 200 * self._period + 600):
            self.skipped.append(f"scenario {sc.index}: the job did not train again in time")
        self._chunk_rings(None)

    def _detect_s(self) -> float:
        """How soon the supervisor sees a rank's process exit."""
        s = self.job.profile.scheduler
        return s.crash_detect_s if s.crash_detect_s is not None else s.poll_interval_s

    def _inject_phase(self, sc: Scenario) -> float:
        if sc.kind != "kill_rank" or self._entry_s is None:
            return sc.phase
        return kill_phase(sc.phase, self._detect_s(), self._entry_s, self._period)

    def _unscored(self, sc: Scenario, v: dict, why: str, settle: int) -> None:
        """A scenario the analysis cannot be asked about (reported with its verdict, not scored)."""
        self.unscored.append({"index": sc.index, "kind": sc.kind, "place": sc.place(), "phase": sc.phase, "why": why,
                              "verdict": v["kind"], "verdict_ranks": v.get("ranks", [])[:4]})
        self._progress(sc, "unscored", v)
        self._wait_steps(settle, 200 * self._period + 600)

    def _progress(self, sc: Scenario, result: str, v: dict) -> None:
        if self.progress:
            print(f"[{sc.index + 1}/{self.drawn or len(self.scenarios)}] {sc.place()} phase {sc.phase:.2f}: {result} ({v['kind']}) "
                  f"t={self.clock.now():.1f}s wall {time.monotonic() - self.wall0:.0f}s", file=sys.stderr, flush=True)

    def _undetectable_link(self, factor: float) -> str:
        """Why a slow link is beyond what the analysis can see, from the last fault-free collection; "" if
        it should be seen. The analysis' link test is relative (a link's send busy time against the median
        of comparable links, ftrun.diagnose.link), so any factor over link_factor counts, except where
        healthy sends never wait on the wire (the socket buffer absorbs a whole all-reduce): a median busy
        time of 0 leaves nothing to compare with."""
        snap = self.healthy_input
        if snap is None:
            return ""
        h = snap.hist
        busy = h["busy"][(h["cid"] >= 0) & (h["sent_bytes"] > 0)]
        if not busy.size or float(np.median(busy)) > 0:
            return ""
        return (f"healthy sends never wait on the wire (median send busy time 0 s over {busy.size} all-reduce "
                f"transfers: the socket buffer absorbs them), so a {factor:g}x link has no wire time to compare")

    def _fault_free(self) -> None:
        if not self._healthy():
            self._wait_steps(1, 200 * self._period + 600)
        self._after_commit(self.rng.random())
        v = self.job.diagnosis.diagnose()
        if v["kind"] == "no_hang":
            self.healthy_input = self.job.diagnosis.collector.last_input[0]
        self.ff.append({"kind": v["kind"], "evicted": bool(v["eviction"]["replicas"]), "reason": v["reason"][:200],
                        "t": round(self.clock.now(), 3)})


def shape_of(profile: Profile, fault_hosts: int = 0) -> Shape:
    compute = profile.train.step_compute_s
    return Shape(replicas=profile.replicas, ranks_per_replica=profile.ranks_per_replica,
                 gpus_per_host=profile.topology.gpus_per_host, buildings=profile.topology.buildings,
                 max_slow_factor=1.0 + 0.8 * profile.timeouts.ftar_timeout_s / compute,  # its ring peers wait
                 fault_hosts=fault_hosts)  # for its chunks under the FTAR timeout: a straggler later than that
    # is cut off (a failure, not slowness)


def run_bench(profile: Profile, *, scenarios: int, seed: int, fault_free: int,
              ftar_detail: str | None = None, fold_ranks: str = "auto", progress: bool = False,
              ftar_model: str = "auto", only: str | None = None) -> dict[str, Any]:
    """One emulated job, `scenarios` scenarios and `fault_free` fault-free collections; the figures.
    Folded FTAR (the default above 16K ranks) places the faults on each replica's first host, the one
    whose rings run for real (harness.run.fold); with rank folding (`fold_ranks`, JobOptions) each replica
    runs its first two hosts and serves the other ranks their reference lead's telemetry
    (harness.run.diag_mirror). `ftar_model` (JobOptions.ftar_model): with analytic rings the bench runs the
    rings each fault stalls chunk by chunk (chunk_positions). `only` (`pick`): run just those scenarios of
    the drawn plan."""
    if ftar_detail is None and profile.num_ranks <= 16384:
        ftar_detail = "full"  # every ring real, so every rank's telemetry is its own (folding mirrors leads)
    detail = ftar_detail or profile.emulation.ftar_detail
    shape = shape_of(profile, fault_hosts=1 if detail == "folded" else 0)
    plan = pick(draw(scenarios, seed, shape), only)
    wiring = "prewired" if profile.ranks_per_replica > 4096 else "connect"
    steps = 20 + len(plan) * (SLOW_STEPS + 6) + fault_free * 3  # more than the bench can use
    options = JobOptions(steps=steps, seed=seed, diagnose=True, trace=False, ftar_detail=ftar_detail,  # type: ignore
                         wiring=wiring, fold_ranks=fold_ranks, ftar_model=ftar_model,  # type: ignore[arg-type]
                         chunks_at_faults=True)
    wall0 = time.monotonic()
    job = EmulatedJob(profile, options)
    bench = _Bench(job, plan, fault_free, seed, progress=progress, drawn=scenarios)
    job.driver = bench.run
    job.run()
    diag = job.diagnosis
    out = summarize(bench.results, bench.ff, diag.analysis_s, diag.telemetry())
    out.update(profile=profile.name, ranks=profile.num_ranks, seed=seed, kinds=list(kinds_for(shape)),
               max_slow_factor=round(min(10.0, shape.max_slow_factor), 2), step_s=round(bench._period, 3),
               collections=len(diag.analysis_s), ranks_collected_max=max(diag.ranks_collected, default=0),
               collect_s_p50=percentile(diag.pull_s, 0.5), collect_s_p99=percentile(diag.pull_s, 0.99),
               detect_s_p50=percentile([r["detect_s"] for r in bench.results], 0.5),
               virtual_s=round(job.world.now, 1), wall_s=round(time.monotonic() - wall0, 1),
               ftar_detail=detail, cpu_charging=profile.emulation.cpu_charging,
               ranks_run_per_replica=len(job.ranks), ranks_per_replica=profile.ranks_per_replica,
               **{k: v for k, v in job.folding().items() if k in ("ftar_model", "analytic_all_reduces",
                                                                   "chunked_all_reduces")},
               ftar_chunk_mb=round(profile.ftar.engine.chunk_bytes / (1 << 20), 3),
               fault_places="each replica's first host" if shape.place_hosts < shape.hosts_per_replica
               else "every host",
               errors=job.recorder.errors[:10], stalled=bench.skipped[:10], unscored=bench.unscored,
               results=bench.results)
    return out


def format_table(out: dict[str, Any]) -> str:
    lines = [f"diagnose bench {out['profile']} ({out['ranks']} ranks), seed {out['seed']}: {out['scenarios']} scenarios, "
             f"{out['fault_free_runs']} fault-free collections, {out['virtual_s']} virtual s in {out['wall_s']} s wall",
             f"  FTAR {out['ftar_detail']} ({out['ftar_chunk_mb']:g} MB chunks), CPU charging "
             f"{'on' if out['cpu_charging'] else 'off'}, faults on {out['fault_places']}, ranks run per replica "
             f"{out['ranks_run_per_replica']} of {out['ranks_per_replica']}",
             f"  accuracy (exact culprit)  {out['accuracy']}",
             f"  candidate-set hits        {out['candidate_hits']}",
             f"  false positive runs       {out['false_positive_runs']} (false evictions {out['false_evictions']})",
             f"  analysis p50 / p99        {_fmt(out['analysis_s_p50'])} / {_fmt(out['analysis_s_p99'])} s",
             f"  collection p50 / p99      {_fmt(out['collect_s_p50'])} / {_fmt(out['collect_s_p99'])} modeled s",
             f"  telemetry bytes per rank  {out['telemetry_bytes_per_rank']}",
             "  kind            n  exact  candidates"]
    for kind, k in sorted(out["by_kind"].items()):
        lines.append(f"  {kind:<14} {k['n']:>3} {k['exact']:>6} {k['candidates']:>11}")
    for m in out["misses"][:20]:
        lines.append(f"  not exact: #{m['index']} {m['kind']} {m['place']} phase {m['phase']}: {m['verdict']}: "
                     f"{m['reason'][:120]}")
    return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def cli_run(args: Any) -> int:
    """`ftrun diagnose bench` (ftrun.diagnose.cli parses the arguments)."""
    import json
    from pathlib import Path

    from ftrun.cli import UsageError, emit_json
    from harness.cli import build_profile

    if args.scenarios < 0 or (args.fault_free is not None and args.fault_free < 0):
        raise UsageError("--scenarios and --fault-free must be >= 0")
    profile = build_profile(args.profile, args.overrides, steps=None, cpu_charging=args.cpu_charging)
    ff = args.scenarios // 2 if args.fault_free is None else args.fault_free
    try:
        pick(draw(args.scenarios, args.seed, shape_of(profile)), args.only)  # a bad --only fails before the job
    except ValueError as e:
        raise UsageError(str(e)) from None
    out = run_bench(profile, scenarios=args.scenarios, seed=args.seed, fault_free=ff, progress=True,
                    ftar_detail=args.ftar_detail, fold_ranks=args.fold_ranks,
                    ftar_model=args.ftar_model, only=args.only)
    results = out.pop("results")
    if args.out:
        d = Path(args.out)
        d.mkdir(parents=True, exist_ok=True)
        (d / "diagbench.json").write_text(json.dumps({**out, "results": results}, indent=1, default=float))
    print(format_table(out))
    if args.json:
        emit_json(out)
    return 0
