"""Step efficiency to expect for a kill rate. Pure.

Step efficiency E = committed replica-steps / (R x steps), over the steady part of a run (from the first
step all R replicas committed). Without failures every replica commits every step: E = 1.

A kill costs the victim the steps the job commits while it is away. It is away for
    D = t_restart + t_rejoin + t_step
        t_restart: kill -> the new incarnation is ready (restart delay + process start-up),
        t_rejoin:  ready -> admitted to a quorum and healed to the job's step (quorum wait, catch-up),
        t_step:    the step that was in flight when it died, lost (survivors retry and commit it without
                   it; the victim's first step after healing is committed, so it is not lost)
which is the time from the kill to the victim's first commit again. The survivors keep stepping at
t_step per step, so a kill costs about D / t_step replica-steps. With one kill every T seconds (the
mean interval: --kill-every T, or --kill-random-mean T), the job commits T / t_step steps of R replicas
per interval, hence

    E_theory = 1 - (D / t_step) / (R * T / t_step) = 1 - D / (R * T)

It assumes the job steps at a steady rate. It does not while the whole job stalls (failure
detection, the aborted commit, waiting for a quorum, an FTAR timeout): a stall costs wall time but no
step efficiency, since nobody commits. So D and T are measured in *stepping time*, wall time less the
job-wide stalls (RunStats.stalls): D = mean over kills of the victim's downtime outside stalls, and
T = (steady wall time - stall time) / kills. At --kill-every 30s stalls are a small correction; in a
soak with a kill every second they are most of the downtime.
"""

from __future__ import annotations

FORMULA = ("E = 1 - D/(R*T); D = restart + rejoin + lost step (kill -> first commit again), D and T in "
           "stepping time (less job-wide stalls)")


def theoretical_efficiency(*, num_replicas: int, kill_interval_s: float, downtime_s: float) -> float:
    """E_theory for R replicas, one kill every `kill_interval_s` seconds costing `downtime_s` each."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if not kill_interval_s > 0 or downtime_s < 0:
        raise ValueError(f"need kill_interval_s > 0 and downtime_s >= 0, got {kill_interval_s}, {downtime_s}")
    return max(0.0, 1.0 - downtime_s / (num_replicas * kill_interval_s))


def realized_interval(*, num_kills: int, window_s: float) -> float | None:
    """The mean time between the kills that happened in a window (a kill the guard deferred is late)."""
    return window_s / num_kills if num_kills > 0 and window_s > 0 else None
