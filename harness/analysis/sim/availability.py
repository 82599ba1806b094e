"""Closed forms for training availability: effective training time under failures (FT-HSDP paper §3,
§6.1) and the availability-optimal checkpoint period (SPARe paper Eq. 1-2, after Saxena et al.).

Effective training time (ETT) is the long-run share of wall time that trains at full-job throughput.
With one failure every F seconds (on average):

- synchronous recovery stalls the whole job S_sync per failure:    ETT = 1 - S_sync / F
- FT-HSDP stalls the whole job S = S_fail + S_rejoin per failure (detecting the failure and re-training
  the step, then the rejoin's first step); for the rest of the repair, (T_repair - S), the job trains
  without the failed replica at (R-1)/R of its throughput, so each failure costs S + (T_repair - S)/R:
                                                                     ETT = 1 - S/F - (T_repair - S)/(R F)
  This is the paper's (F - T_repair + (T_repair - S)(R-1)/R) / F rewritten as an expected loss per failure.
  It is exact while each repair ends before the next failure (T_repair <= F, the paper's case). When
  repairs overlap, other failures' stalls fall inside a degraded window and the two losses are counted
  twice, so the form is pessimistic (`repairs_overlap` says when; the time-to-train simulation has no such
  shortcut). Paper inputs (F = 18 min, S_sync = 10 min, S = 3 min, T_repair = 10 min, R = 12):
  8/18 = 44% and (8 + 7*11/12)/18 = 80%.

Pure; no I/O (`inputs_from_report` takes an already-parsed JSON object).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

# Keys an emulator report (or any JSON object) may carry, each in seconds except num_replicas. They are
# read from the top level or, if present, from a top-level "availability" object.
REPORT_KEYS = (
    "failure_interval_s", "sync_stall_s", "stall_per_failure_s", "rejoin_stall_s", "num_replicas", "repair_s",
)


@dataclass(frozen=True, kw_only=True)
class AvailabilityInputs:
    """Inputs of the effective-training-time model. Defaults are the FT-HSDP paper's (seed §3, §6.1).

    Args:
        failure_interval_s: mean time between failures of the whole job (seed: 18 minutes at 100K GPUs).
        sync_stall_s: whole-job stall per failure with synchronous recovery (seed: about 10 minutes).
        stall_per_failure_s: FT-HSDP whole-job stall when a replica fails (detect, rebuild FTAR, re-train
            the step). The seed's total is about 3 minutes, of which the rejoin is 100 s; 80 s is the rest.
        rejoin_stall_s: FT-HSDP whole-job stall when the repaired replica rejoins (seed: about 100 s).
        num_replicas: R, FT-HSDP replicas (seed: 12).
        repair_s: time from a failure until the replica trains again (seed: about 10 minutes).

    Raises:
        ValueError: a non-positive interval or replica count, a negative duration, or a non-finite value.
    """

    failure_interval_s: float = 18 * 60.0
    sync_stall_s: float = 10 * 60.0
    stall_per_failure_s: float = 80.0
    rejoin_stall_s: float = 100.0
    num_replicas: int = 12
    repair_s: float = 10 * 60.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{f.name} must be a finite number, got {value!r}")
            if value < 0:
                raise ValueError(f"{f.name} must be >= 0, got {value}")
        if self.failure_interval_s <= 0:
            raise ValueError(f"failure_interval_s must be > 0, got {self.failure_interval_s}")
        if int(self.num_replicas) != self.num_replicas or self.num_replicas < 1:
            raise ValueError(f"num_replicas must be an integer >= 1, got {self.num_replicas}")

    @property
    def ft_stall_s(self) -> float:
        """FT-HSDP whole-job stall per failure: the failure's plus the rejoin's."""
        return self.stall_per_failure_s + self.rejoin_stall_s


def sync_effective_training_time(inputs: AvailabilityInputs) -> float:
    """ETT with synchronous recovery, in [0, 1]."""
    return max(0.0, 1.0 - inputs.sync_stall_s / inputs.failure_interval_s)


def ft_hsdp_effective_training_time(inputs: AvailabilityInputs) -> float:
    """ETT with FT-HSDP, in [0, 1]; a stall longer than the repair leaves no degraded time."""
    stall = inputs.ft_stall_s
    degraded = max(0.0, inputs.repair_s - stall)
    loss = stall + degraded / inputs.num_replicas
    return max(0.0, 1.0 - loss / inputs.failure_interval_s)


def repairs_overlap(inputs: AvailabilityInputs) -> bool:
    """True when a repair outlasts the mean failure interval (the ETT form is then pessimistic)."""
    return inputs.repair_s > inputs.failure_interval_s


def inputs_from_report(report: dict, fallback: AvailabilityInputs) -> tuple[AvailabilityInputs, dict[str, str]]:
    """Inputs from a parsed report, each missing key taken from `fallback`.

    Returns (inputs, source) where source[key] is "report" or "default".
    Raises:
        ValueError: the report is not an object, or a value is invalid (the message names the key).
    """
    if not isinstance(report, dict):
        raise ValueError("report must be a JSON object")
    nested = report.get("availability")
    scope = {**report, **nested} if isinstance(nested, dict) else report
    values, source = {}, {}
    for key in REPORT_KEYS:
        if key in scope and scope[key] is not None:
            values[key], source[key] = scope[key], "report"
        else:
            values[key], source[key] = getattr(fallback, key), "default"
    return AvailabilityInputs(**values), source


def optimal_checkpoint_period(failure_interval_s: float, restart_s: float, save_s: float) -> float:
    """Tc* = Ts + sqrt(2 (Tf + Tr) Ts + Ts^2), the period maximizing `checkpoint_availability`.

    (Setting dA/dTc = 0 gives Tc^2 - 2 Ts Tc - 2 Ts (Tf + Tr) = 0.) Returns inf when Tf is inf.
    """
    if min(failure_interval_s, save_s) <= 0 or restart_s < 0:
        raise ValueError("failure interval and save time must be > 0 and restart time >= 0")
    return save_s + math.sqrt(2.0 * (failure_interval_s + restart_s) * save_s + save_s ** 2)


def checkpoint_availability(failure_interval_s: float, restart_s: float, save_s: float, period_s: float) -> float:
    """A = (1 - Ts/Tc) * Tf / (Tf + Tr + Tc/2): the share of wall time doing work that is kept, when a
    system failure every Tf costs a restart Tr and half a period of lost work on average."""
    if period_s <= save_s:
        return 0.0
    if math.isinf(failure_interval_s):
        return 1.0 - save_s / period_s
    return (1.0 - save_s / period_s) * failure_interval_s / (failure_interval_s + restart_s + period_s / 2.0)
