"""Time-to-train: a discrete-event simulation (SimPy) of one training job under failures, per scheme.

The job must do `train_horizon_h` of failure-free data-parallel work. Time is spent computing (progress
at `scheme.rate()`), saving checkpoints (every Tc of wall time, the last Ts of it blocking), stalled (a
masked failure, an FT-HSDP failure or rejoin) or restarting globally (a wipe-out: back to the last
checkpoint, then `global_restart_s`; a failure during the restart starts it over for CKPT-only, and
is masked in the fresh cycle for the schemes that can mask it). Group failures form a renewal process
with Weibull inter-arrival
times of mean `mtbf_s`; every duration but compute gets multiplicative normal jitter. The failure trail
depends only on the seed, so all schemes see the same failures (common random numbers).

Each scheme uses its availability-optimal period Tc* = Ts + sqrt(2 (Tf + Tr) Ts + Ts^2), Tf being its mean
time between wipe-outs: MTBF x E[F], with E[F] by Monte-Carlo on its own host sets, for replication and
SPARe; MTBF for CKPT-only; for FT-HSDP MTBF over the chance that a failure finds R - min_replicas
replicas already down (down replicas ~ Poisson(repair / MTBF)).

Reads no clock and does no I/O; deterministic for a profile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import simpy
from scipy.stats import poisson

from harness.analysis.sim.availability import (
    AvailabilityInputs,
    checkpoint_availability,
    ft_hsdp_effective_training_time,
    optimal_checkpoint_period,
)
from harness.analysis.sim.profile import TttProfile
from harness.analysis.sim.schemes import CkptOnly, FtHsdp, Replication, Spare
from harness.analysis.spare.montecarlo import failures_to_wipeout

FAILURE, REJOIN = "failure", "rejoin"
SCHEME_IDS = {"ckpt_only": 0, "rep": 1, "spare": 2, "ft_hsdp": 3}


@dataclass(frozen=True, kw_only=True)
class RunResult:
    """One simulated job. ttt_norm = wall / failure-free time; availability = compute time whose work
    was kept / wall; mean_depth = compute-time average of the stack depth."""

    scheme: str
    redundancy: int
    seed: int
    finished: bool
    wall_s: float
    ttt_norm: float
    availability: float
    mean_depth: float
    num_failures: int
    num_wipeouts: int
    period_s: float
    wipeout_interval_s: float
    theory_availability: float


class _Job:
    """One job's state and its SimPy processes (trainer, failure source, repairs)."""

    def __init__(self, profile: TttProfile, scheme, period_s: float, seed: int) -> None:
        self.env = simpy.Environment()
        self.p, self.scheme, self.period = profile, scheme, period_s
        sid = SCHEME_IDS[scheme.name]
        self.fail_rng = np.random.default_rng([seed, 0])
        self.jitter_rng = np.random.default_rng([seed, 1, sid, scheme.redundancy])
        self.target = profile.system.train_horizon_h * 3600.0
        self.wall_cap = self.target * profile.sweep.max_wall_factor
        self.progress = self.committed = 0.0
        self.since_ckpt = self.uncommitted = self.kept = self.depth_time = self.compute_time = 0.0
        self.stall_left, self.restarting, self.generation = 0.0, False, 0
        self.restart_left: float | None = None
        self.num_failures = self.num_wipeouts = 0
        self.proc = self.env.process(self._trainer())
        self.env.process(self._failures())

    def jitter(self, duration: float) -> float:
        sigma = self.p.failures.jitter_frac
        return duration * max(0.0, 1.0 + sigma * float(self.jitter_rng.standard_normal())) if sigma else duration

    def _wait(self, duration: float):
        """Wait `duration`; returns (elapsed, cause) with cause None or the interrupt's cause."""
        start = self.env.now
        try:
            yield self.env.timeout(max(duration, 0.0))
            return self.env.now - start, None
        except simpy.Interrupt as intr:
            return self.env.now - start, intr.cause

    def _failures(self):
        shape = self.p.failures.weibull_shape
        scale = self.p.failures.mtbf_s / math.gamma(1.0 + 1.0 / shape)
        while True:
            yield self.env.timeout(scale * float(self.fail_rng.weibull(shape)))
            if not self.proc.is_alive:
                return
            self.num_failures += 1
            self.proc.interrupt(FAILURE)

    def _repair(self, delay: float, generation: int):
        yield self.env.timeout(delay)
        # A global restart since the failure brought every replica back already.
        if generation == self.generation and self.proc.is_alive:
            self.proc.interrupt(REJOIN)

    def _on_event(self, cause: str) -> None:
        """Apply a failure or rejoin. During a global restart the scheme already holds the fresh cycle's
        state, so a failure then is masked like any other (the job comes back with that group down) unless
        it wipes out the fresh cycle too, which starts the restart over; CKPT-only always starts over."""
        if cause == REJOIN:
            stall = self.scheme.on_rejoin()
            if not self.restarting:  # a restart absorbs the rejoin's stall
                self.stall_left += self.jitter(stall)
            return
        effect = self.scheme.on_failure()
        if effect.wipe_out:
            if not self.restarting:
                self.num_wipeouts += 1
            self.progress, self.since_ckpt, self.uncommitted = self.committed, 0.0, 0.0
            self.stall_left, self.restarting, self.restart_left = 0.0, True, None
            self.scheme.reset()
            self.generation += 1
            return
        if not self.restarting:
            self.stall_left += self.jitter(effect.stall_s)
        if effect.repair_s is not None:
            self.env.process(self._repair(self.jitter(effect.repair_s), self.generation))

    def _trainer(self):
        save = self.p.system.checkpoint_save_s
        while self.progress < self.target and self.env.now < self.wall_cap:
            if self.restarting:
                if self.restart_left is None:
                    self.restart_left = self.jitter(self.p.system.global_restart_s)
                elapsed, cause = yield from self._wait(self.restart_left)
                if cause is None:
                    self.restarting, self.restart_left = False, None
                else:
                    self.restart_left -= elapsed
                    self._on_event(cause)  # a wipe-out resets restart_left: the restart starts over
            elif self.stall_left > 0:
                elapsed, cause = yield from self._wait(self.stall_left)
                self.stall_left = max(0.0, self.stall_left - elapsed) if cause else 0.0
                if cause:
                    self._on_event(cause)
            elif self.since_ckpt >= self.period - save:
                yield from self._save(save)
            else:
                yield from self._compute(save)

    def _compute(self, save: float):
        rate, depth = self.scheme.rate(), self.scheme.depth()
        to_finish = (self.target - self.progress) / rate
        duration = min(self.period - save - self.since_ckpt, to_finish)
        elapsed, cause = yield from self._wait(duration)
        self.progress = min(self.target, self.progress + elapsed * rate)
        self.since_ckpt += elapsed
        if cause is None:
            # Land exactly on the bound that ended the segment: a float residue would loop forever on
            # zero-length waits once `now` is large.
            if duration == to_finish:
                self.progress = self.target
            else:
                self.since_ckpt = self.period - save
        self.compute_time += elapsed
        self.uncommitted += elapsed
        self.depth_time += elapsed * depth
        if cause:
            self._on_event(cause)

    def _save(self, save: float):
        """Blocking save; masked failures meanwhile stall after it, a wipe-out loses it."""
        remaining = self.jitter(save)
        while True:
            elapsed, cause = yield from self._wait(remaining)
            if cause is None:  # ran to the end (not `remaining -= elapsed`: float residue would loop)
                break
            remaining -= elapsed
            self._on_event(cause)
            if self.restarting:
                return
        self.committed, self.kept, self.uncommitted = self.progress, self.kept + self.uncommitted, 0.0
        self.since_ckpt = 0.0

    def run(self) -> tuple[bool, float]:
        self.env.run(until=self.proc)
        self.kept += self.uncommitted  # the work done since the last checkpoint is kept at the end
        return self.progress >= self.target, self.env.now


def wipeout_interval_s(profile: TttProfile, scheme: str, redundancy: int) -> float:
    """Tf, the mean time between wipe-outs used for the checkpoint period (see the module docstring)."""
    mtbf = profile.failures.mtbf_s
    if scheme == "ckpt_only" or (scheme in ("rep", "spare") and redundancy == 1):
        return mtbf
    if scheme == "ft_hsdp":
        cfg = profile.ft_hsdp
        rho = cfg.repair_s / mtbf
        p_fatal = float(poisson.sf(cfg.num_replicas - cfg.min_replicas - 1, rho))
        return mtbf / p_fatal if p_fatal > 0 else math.inf
    cls = Replication if scheme == "rep" else Spare
    hosts = cls(profile.system, redundancy, np.random.default_rng(0)).hosts
    rng = np.random.default_rng([profile.seed, 2, SCHEME_IDS[scheme], redundancy])
    return mtbf * float(failures_to_wipeout(hosts, profile.sweep.mc_trials, rng).mean())


def make_scheme(profile: TttProfile, scheme: str, redundancy: int, seed: int):
    """The scheme object for one run (its own random stream for picking failed groups)."""
    rng = np.random.default_rng([seed, 3, SCHEME_IDS[scheme], redundancy])
    if scheme == "ft_hsdp":
        return FtHsdp(profile.ft_hsdp, rng)
    if scheme == "ckpt_only" or redundancy == 1:
        return CkptOnly(profile.system, rng)
    return (Replication if scheme == "rep" else Spare)(profile.system, redundancy, rng)


def simulate(profile: TttProfile, scheme: str, redundancy: int, seed: int,
             wipeout_interval: float | None = None) -> RunResult:
    """Simulate one job; `wipeout_interval` (Tf) is computed when not given."""
    tf = wipeout_interval_s(profile, scheme, redundancy) if wipeout_interval is None else wipeout_interval
    system = profile.system
    period = optimal_checkpoint_period(tf, system.global_restart_s, system.checkpoint_save_s)
    job = _Job(profile, make_scheme(profile, scheme, redundancy, seed), period, seed)
    finished, wall = job.run()
    theory = checkpoint_availability(tf, system.global_restart_s, system.checkpoint_save_s, period)
    if scheme == "ft_hsdp":  # stalls and degraded replicas, which Eq. 2 does not see
        cfg = profile.ft_hsdp
        theory *= ft_hsdp_effective_training_time(AvailabilityInputs(
            failure_interval_s=profile.failures.mtbf_s, stall_per_failure_s=cfg.stall_per_failure_s,
            rejoin_stall_s=cfg.rejoin_stall_s, num_replicas=cfg.num_replicas, repair_s=cfg.repair_s))
    return RunResult(
        scheme=scheme, redundancy=redundancy, seed=seed, finished=finished, wall_s=wall,
        ttt_norm=wall / job.target if finished else math.inf, availability=job.kept / wall if wall else 0.0,
        mean_depth=job.depth_time / job.compute_time if job.compute_time else 0.0,
        num_failures=job.num_failures, num_wipeouts=job.num_wipeouts, period_s=period,
        wipeout_interval_s=tf, theory_availability=theory,
    )
