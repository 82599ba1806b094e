"""What an emulated job runs: its options and its failure script, parsed from the CLI or the profile.

The faults and their --inject syntax are in harness.run.faults (the one fault grammar, ftrun.faultspec). From
a profile: its scripted `[failures] events` (fault specs in the same grammar, e.g. "kill replica=1 step=3",
"cut replica=1 rank=0 time=5 duration=2"), or replica kills drawn from its periodic / MTBF failure model.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Literal

from harness.profile import Profile, weibull_scale_for_mean
from harness.run.faults import (CutBuilding, Fault, Hang, HostLoss, Kill, KillLighthouse, SlowFetch, SlowHost, SlowLink,
                                check_faults, parse_inject)

__all__ = ["CutBuilding", "Fault", "JobOptions", "Kill", "KillLighthouse", "SlowFetch", "SlowHost",
           "check_faults", "faults_from_profile", "kills_from_profile", "parse_inject", "split_faults"]


def kills_from_profile(profile: Profile, seed: int, horizon_s: float) -> list[Kill]:
    """The profile's failure model as replica kills: its scripted replica kills; periodic and MTBF failures
    drawn (seeded) up to `horizon_s` of virtual time, each on a uniformly chosen unprotected replica. Scripted
    faults of other kinds are left out (see faults_from_profile)."""
    f = profile.failures
    if f.mode == "none":
        return []
    if f.mode == "scripted":
        return [k for k in map(parse_inject, f.events) if isinstance(k, Kill)]
    rng = random.Random(seed)
    candidates = [r for r in range(profile.replicas) if r not in f.protected_replicas]
    if not candidates:
        return []
    kills, t = [], 0.0
    while True:
        if f.mode == "periodic":
            t += f.interval_s + rng.uniform(-f.interval_jitter_s, f.interval_jitter_s)
        else:
            mean = f.cluster_mtbf_s(profile.replicas * profile.hosts_per_replica)
            t += (rng.expovariate(1.0 / mean) if f.distribution == "exponential"
                  else rng.weibullvariate(weibull_scale_for_mean(mean, f.weibull_shape), f.weibull_shape))
        if t >= horizon_s:
            return kills
        for r in rng.sample(candidates, min(f.replicas_per_failure, len(candidates))):
            kills.append(Kill(r, at_s=round(t, 6)))


def faults_from_profile(profile: Profile, seed: int, horizon_s: float) -> list[Fault]:
    """kills_from_profile plus the profile's other scripted faults."""
    faults: list[Fault] = list(kills_from_profile(profile, seed, horizon_s))
    if profile.failures.mode == "scripted":
        faults += [f for f in map(parse_inject, profile.failures.events) if not isinstance(f, Kill)]
    return faults


def split_faults(faults: tuple[Fault, ...] | list[Fault]) -> tuple[tuple[Kill, ...], tuple[Fault, ...]]:
    """(replica kills, every other fault), as JobOptions takes them."""
    return (tuple(f for f in faults if isinstance(f, Kill)), tuple(f for f in faults if not isinstance(f, Kill)))


RING_STALLS = (CutBuilding, HostLoss, Hang, SlowLink)  # faults that stall a ring without closing it
ANALYTIC_RINGS_ABOVE = 256  # ftar_model="auto": emulated ranks above which rings are analytic
FOLD_RANKS_ABOVE = 256  # fold_ranks="auto": ranks per replica above which a replica runs its represented ranks


@dataclass(frozen=True, kw_only=True)
class JobOptions:
    """How to run one emulated job (the profile says what the cluster and the model are).

    ftar_detail: "folded" runs the real FTAR engine on the rings of one representative host per
        replica (gpus_per_host rings; the others are identical and mirror their result and timing);
        "full" runs every ring (every rank). None: the profile's emulation.ftar_detail.
    comm: "tree" (TreeComm, O(log N)) or "flat" (FlatComm: every rank messages the leader).
    fold_ranks: with folded rings, whether a replica runs only its represented ranks (the leads and every
        fault target; harness.run.fold.represented_ranks) instead of every rank: "on", "off", or "auto" (on
        above FOLD_RANKS_ABOVE ranks per replica). Under diagnose the leads are two hosts and the ranks not
        run are served their reference lead's telemetry (harness.run.job_fold, harness.run.diag_mirror).
    ftar_model: "chunks" runs each all-reduce's schedule chunk by chunk; "analytic" models each ring's all-reduce
        as one timed wait per rank (harness.run.ring_model: crashes and aborts still end it); "auto": analytic
        above ANALYTIC_RINGS_ABOVE ranks. Analytic needs a job without faults that stall a ring silently
        (a silent host, a hang, a building cut, a slow link) and without diagnose, unless chunks_at_faults
        (see needs_chunk_rings).
    wiring: "connect" builds each replica's tree through the runtime's TreeComm.build (listen /
        connect / accept on the emulated network); "prewired" hands every rank its connections
        directly (the same collectives, without the connection setup) for very large replicas.
    """

    steps: int
    kills: tuple[Kill, ...] = ()
    faults: tuple[Fault, ...] = ()  # every other injected fault (lighthouse kill, straggler, slow fetch, cut)
    seed: int = 0
    ftar_detail: Literal["folded", "full"] | None = None
    fold_ranks: Literal["auto", "on", "off"] = "auto"
    ftar_model: Literal["auto", "chunks", "analytic"] = "auto"
    comm: Literal["tree", "flat"] = "tree"
    wiring: Literal["connect", "prewired"] = "connect"
    fanout: int = 16
    trace: bool = True
    diagnose: bool = False  # root-cause telemetry on every rank and a collector (harness.run.diagnosis)
    diagnose_interval_s: float | None = None  # with diagnose: run the monitor every this many seconds
    # with diagnose: the driver that injects faults (the diagnose bench) names the ring positions around each
    # fault that must run chunk by chunk (RingBoard.chunk_positions), so the other rings may be analytic
    chunks_at_faults: bool = False
    script: Any = None  # a training script's model (mocks.script.ScriptModel): its shapes replace the profile's [model]

    @property
    def needs_chunk_rings(self) -> bool:
        """Whether every all-reduce must run chunk by chunk: a fault that stalls a ring without closing it
        (RING_STALLS) needs the chunks a peer waits on; so does diagnose, unless its driver runs the rings
        around each fault it injects chunk by chunk (chunks_at_faults): analytic rings record the telemetry
        the analysis reads of a healthy ring (harness.run.ring_model)."""
        return (self.diagnose and not self.chunks_at_faults) or any(isinstance(f, RING_STALLS) for f in self.faults)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.ftar_detail not in (None, "folded", "full"):
            raise ValueError(f"ftar_detail must be folded or full, got {self.ftar_detail!r}")
        if self.fold_ranks not in ("auto", "on", "off"):
            raise ValueError(f"fold_ranks must be auto, on or off, got {self.fold_ranks!r}")
        if self.fold_ranks == "on" and self.ftar_detail == "full":
            raise ValueError("fold_ranks=on needs folded rings (ftar_detail=folded)")
        if self.ftar_model not in ("auto", "chunks", "analytic"):
            raise ValueError(f"ftar_model must be auto, chunks or analytic, got {self.ftar_model!r}")
        if self.chunks_at_faults and not self.diagnose:
            raise ValueError("chunks_at_faults is for diagnose runs whose driver injects the faults")
        if self.ftar_model == "analytic" and self.needs_chunk_rings:
            raise ValueError("ftar_model=analytic needs a job without diagnose and without faults that stall a ring "
                             "silently (cut, hang, slow link): those need ftar_model=chunks")
        if self.comm not in ("tree", "flat") or self.wiring not in ("connect", "prewired"):
            raise ValueError(f"comm must be tree|flat and wiring connect|prewired, got {self.comm}, {self.wiring}")
        if self.fanout < 2:
            raise ValueError(f"fanout must be >= 2, got {self.fanout}")
        if not all(isinstance(k, Kill) for k in self.kills) or any(isinstance(f, Kill) for f in self.faults):
            raise ValueError("replica kills go in kills=, every other fault in faults= (see split_faults)")

    @property
    def injected(self) -> tuple[Fault, ...]:
        return (*self.kills, *self.faults)
