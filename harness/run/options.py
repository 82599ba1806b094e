"""What an emulated job runs: its options and its failure script, parsed from the CLI or the profile.

Kills are "kill replica=R step=S [at=F] [hosts=relaunch|replace]": when the job reaches step S (replica R
has committed S steps, or the job is past S), plus F x the step's compute time (default 0: at the step
boundary, before the next quorum;
at=0.5 kills mid-compute, so the survivors' all-reduce fails and they retrain the step), every host of
replica R dies (its processes are SIGKILLed: connections drop, peers see it at once).
hosts=relaunch (default): the hosts are healthy and the scheduler relaunches on them after the warm
delay; hosts=replace: the hosts are lost and the scheduler hands out spares (hot: warm delay, cold:
cold delay). "kill replica=R time=T" kills at virtual second T instead.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Literal

from harness.profile import Profile, weibull_scale_for_mean


@dataclass(frozen=True)
class Kill:
    replica: int
    at_step: int | None = None
    at_s: float | None = None
    at_fraction: float = 0.0  # of the step's compute time, after the step begins (at_step kills)
    hosts: Literal["relaunch", "replace"] = "relaunch"

    def __post_init__(self) -> None:
        if (self.at_step is None) == (self.at_s is None):
            raise ValueError("a kill needs exactly one of step= or time=")
        if self.replica < 0 or (self.at_step is not None and self.at_step < 0) or (self.at_s or 0) < 0:
            raise ValueError(f"negative replica, step or time in {self}")
        if not 0 <= self.at_fraction < 1:
            raise ValueError(f"at= must be in [0, 1), got {self.at_fraction}")
        if self.hosts not in ("relaunch", "replace"):
            raise ValueError(f"hosts= must be relaunch or replace, got {self.hosts!r}")

    def describe(self) -> str:
        when = f"step={self.at_step} at={self.at_fraction:g}" if self.at_step is not None else f"time={self.at_s:g}"
        return f"kill replica={self.replica} {when} hosts={self.hosts}"


_KILL = re.compile(r"\s*kill((?:\s+[a-z]+=\S+)+)\s*")


def parse_inject(text: str) -> Kill:
    """Parse one --inject value. Raises ValueError with the expected form."""
    m = _KILL.fullmatch(text)
    form = 'expected "kill replica=R step=S [at=F] [hosts=relaunch|replace]" or "kill replica=R time=T"'
    if not m:
        raise ValueError(f"bad --inject {text!r}: {form}")
    fields = dict(part.split("=", 1) for part in m.group(1).split())
    unknown = sorted(set(fields) - {"replica", "step", "time", "at", "hosts"})
    if unknown or "replica" not in fields:
        raise ValueError(f"bad --inject {text!r}: {form}")
    try:
        return Kill(replica=int(fields["replica"]),
                    at_step=int(fields["step"]) if "step" in fields else None,
                    at_s=float(fields["time"]) if "time" in fields else None,
                    at_fraction=float(fields.get("at", 0.0)), hosts=fields.get("hosts", "relaunch"))  # type: ignore[arg-type]
    except ValueError as e:
        raise ValueError(f"bad --inject {text!r}: {e}") from None


def kills_from_profile(profile: Profile, seed: int, horizon_s: float) -> list[Kill]:
    """The profile's failure model as kills: scripted kill_replica events as they are; periodic and MTBF
    failures drawn (seeded) up to `horizon_s` of virtual time, each on a uniformly chosen unprotected
    replica. Other scripted kinds (kill_host, hang_host, kill_lighthouse) are not emulated yet."""
    f = profile.failures
    if f.mode == "none":
        return []
    if f.mode == "scripted":
        return [Kill(e.replica, at_step=e.at_step, at_s=e.at_s) for e in f.events
                if e.kind == "kill_replica" and e.replica is not None]
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


@dataclass(frozen=True, kw_only=True)
class JobOptions:
    """How to run one emulated job (the profile says what the cluster and the model are).

    ftar_detail: "folded" runs the real FTAR engine on the rings of one representative host per
        replica (gpus_per_host rings; the others are identical and mirror their result and timing);
        "full" runs every ring (every rank). None: the profile's emulation.ftar_detail.
    comm: "tree" (TreeComm, O(log N)) or "flat" (FlatComm: every rank messages the leader).
    wiring: "connect" builds each replica's tree through the runtime's TreeComm.build (listen /
        connect / accept on the emulated network); "prewired" hands every rank its connections
        directly (the same collectives, without the connection setup) for very large replicas.
    """

    steps: int
    kills: tuple[Kill, ...] = ()
    seed: int = 0
    ftar_detail: Literal["folded", "full"] | None = None
    comm: Literal["tree", "flat"] = "tree"
    wiring: Literal["connect", "prewired"] = "connect"
    fanout: int = 16
    trace: bool = True

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.ftar_detail not in (None, "folded", "full"):
            raise ValueError(f"ftar_detail must be folded or full, got {self.ftar_detail!r}")
        if self.comm not in ("tree", "flat") or self.wiring not in ("connect", "prewired"):
            raise ValueError(f"comm must be tree|flat and wiring connect|prewired, got {self.comm}, {self.wiring}")
        if self.fanout < 2:
            raise ValueError(f"fanout must be >= 2, got {self.fanout}")
