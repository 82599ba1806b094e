"""The wait for a CPU that N rank processes sharing c cores meet: the finite-source queue (the machine-interference
or "machine repairman" model, M/M/c//N). Pure: no I/O.

Each of the N processes alternates between a burst of CPU work (mean S) and a time it needs no CPU (blocked in a
socket wait, mean Z); a runnable process is served at rate min(n, c) / n of a core when n are runnable (c may be
fractional: a machine's effective cores for ranks, `train.shared_cpu_cores`). The number runnable is a birth-death
chain on 0..N with birth rate (N - n) / Z and death rate min(n, c) / S; its stationary law gives
- u, a process's busy share: its CPU time over wall time, sum_n p_n min(n, c) / N (what the ranks' phase events
  measure: their `cpu` over their `t`), and
- d, the mean extra time a burst spends runnable but not served, in bursts: L / (sum_n p_n min(n, c)) - 1 (Little's
  law: L the mean number runnable), the same for first-come-first-served cores and for processor sharing.
The shape depends on x = Z / S only, so one measured u at N processes fixes x (`think_ratio`), and the wait at
another N follows per unit of CPU work: `wait_growth`, how much more a second of CPU work waits at N than at the
calibration point (what a rank's late wake-ups grow by, times its CPU work per step). Unlike an open queue (M/M/c),
the chain is stable at any N: N processes can never ask for more than N cores, however busy each one is.
"""

from __future__ import annotations

import functools
import math

_X_LO, _X_HI = 1e-9, 1e9  # bounds of the think ratio's bisection (log-spaced)


def _check(n: int, cores: float) -> None:
    if n < 1 or cores <= 0:
        raise ValueError(f"a CPU queue needs n >= 1 processes and cores > 0, got n={n}, cores={cores}")


def busy_share_and_wait(x: float, n: int, cores: float) -> tuple[float, float]:
    """(u, d) of n processes of think ratio x = Z / S sharing `cores` (module docstring). Pure."""
    _check(n, cores)
    if x <= 0:
        raise ValueError(f"the think ratio Z / S must be > 0, got {x}")
    logs = [0.0]  # log p_j up to a constant: p_{j+1} / p_j = (n - j) / (x min(j + 1, c))
    for j in range(n):
        logs.append(logs[-1] + math.log((n - j) / (x * min(j + 1, cores))))
    top = max(logs)
    p = [math.exp(v - top) for v in logs]
    total = sum(p)
    served = sum(pj * min(j, cores) for j, pj in enumerate(p)) / total
    runnable = sum(pj * j for j, pj in enumerate(p)) / total
    return served / n, max(runnable / served - 1.0, 0.0)


@functools.lru_cache(maxsize=256)
def think_ratio(u: float, n: int, cores: float) -> float:
    """The x = Z / S at which n processes on `cores` are each busy a share u of the time (u decreases with x); the
    bounds' x where u is outside what the chain can give (u at or above min(n, c) / n: every process always
    runnable). Pure."""
    _check(n, cores)
    if not 0 < u <= 1:
        raise ValueError(f"a busy share must be in (0, 1], got {u}")
    lo, hi = math.log(_X_LO), math.log(_X_HI)
    for _ in range(100):
        mid = (lo + hi) / 2
        if busy_share_and_wait(math.exp(mid), n, cores)[0] > u:
            lo = mid
        else:
            hi = mid
    return math.exp((lo + hi) / 2)


@functools.lru_cache(maxsize=1024)
def wait_growth(u: float, n_cal: int, n: int, cores: float) -> float:
    """The extra wait for a CPU per second of CPU work with n rank processes up over that at the calibration point
    (n_cal processes, each busy a measured share u): d(x, n, c) - d(x, n_cal, c), x from u at n_cal (negative with
    fewer processes than there). A rank whose step does C seconds of CPU work waits C x d of it runnable (Little's law
    over the chain), so its step's wait grows by C x this. Pure."""
    x = think_ratio(u, n_cal, cores)
    return busy_share_and_wait(x, n, cores)[1] - busy_share_and_wait(x, n_cal, cores)[1]
