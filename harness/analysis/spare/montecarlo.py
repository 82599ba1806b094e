"""Monte-Carlo of SPARe under random independent group failures (SPARe paper §4.1, App. C).

Each trial fails groups one at a time in a uniformly random order until the first wipe-out (a type with
no surviving host). Figures:

- mean failures to the first wipe-out, E[F] (F counts the failure that wipes out), against the
  asymptotic closed form Gamma(1 + 1/r) * N^(1 - 1/r) (Thm 4.1) and its finite-N version (+ 1/2, below);
- mean all-reduce stack depth per step: one step per failure interval (failures evenly spaced in steps),
  depth K*(k) after k failures, averaged over all steps of all trials (sum of depths / sum of F);
- optionally, with the full controller run failure by failure, the patch rate: the share of masked
  failures after which the committed stacks no longer cover every type (phase 0 fails), so the failed
  step must recompute the lost shards.

Deterministic for a seed (numpy Generator streams spawned from one SeedSequence). Pure; no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from harness.analysis.spare.controller import covers_at_depth, decide
from harness.analysis.spare.layout import SpareLayout

# Elements (trials x groups x redundancy) processed per vectorized chunk: bounds memory near 160 MB.
_CHUNK_ELEMS = 20_000_000


def closed_form_failures(num_groups: int, redundancy: int) -> float:
    """Thm 4.1: E[F] ~ Gamma(1 + 1/r) * N^(1 - 1/r), the large-N limit."""
    return math.gamma(1.0 + 1.0 / redundancy) * num_groups ** (1.0 - 1.0 / redundancy)


def finite_closed_form_failures(num_groups: int, redundancy: int) -> float:
    """Thm 4.1 plus its first finite-N correction, 1/2.

    E[F] = sum_{k>=0} P(F > k) with P(F > k) ~ exp(-k^r / N^(r-1)); Thm 4.1 replaces the sum by the integral
    over k in [0, inf), and the Euler-Maclaurin formula says the sum exceeds that integral by f(0)/2 = 1/2
    (f'(0) = 0 for r >= 2). At N = 200, r = 2 that half failure is 4% of E[F].
    """
    return closed_form_failures(num_groups, redundancy) + 0.5


def exact_mean_failures_r2(num_groups: int) -> float:
    """Exact E[F] for r = 2 with the ruler (0, 1): type s lives on groups s and s+1, so a wipe-out is two
    neighbours failed on the N-cycle, and P(F > k) = N/(N-k) * C(N-k, k) / C(N, k) (no two of k failed
    groups adjacent on the cycle)."""
    n = num_groups
    total = 0.0
    for k in range(0, n // 2 + 1):
        log_p = math.log(n / (n - k)) + _log_comb(n - k, k) - _log_comb(n, k)
        total += math.exp(log_p)
    return total


def _log_comb(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def failures_to_wipeout(hosts: np.ndarray, num_trials: int, rng: np.random.Generator) -> np.ndarray:
    """F for `num_trials` independent uniformly random failure orders (vectorized).

    A random failure order is the sort order of i.i.d. uniform failure times u_g. Type s is wiped out at
    time max_k u[hosts[s, k]], the first wipe-out at the least of those, and F is the number of groups
    failed by then (including the one that wipes out).

    Args:
        hosts: (N, w) host sets (row s: the groups hosting type s).
    Returns:
        int64 array of length num_trials.
    """
    num_groups = hosts.shape[0]
    chunk = max(1, _CHUNK_ELEMS // (num_groups * hosts.shape[1]))
    out = []
    for start in range(0, num_trials, chunk):
        times = rng.random((min(chunk, num_trials - start), num_groups))
        wiped_at = times[:, hosts[:, 0]]
        for k in range(1, hosts.shape[1]):
            np.maximum(wiped_at, times[:, hosts[:, k]], out=wiped_at)
        first = wiped_at.min(axis=1)
        out.append(np.count_nonzero(times <= first[:, None], axis=1))
    return np.concatenate(out).astype(np.int64)


def wipeout_index(hosts: np.ndarray, order: np.ndarray) -> int:
    """F for one failure order (order[i] = the i-th group to fail)."""
    position = np.empty(order.size, dtype=np.int64)
    position[order] = np.arange(order.size)
    return int(position[hosts].max(axis=1).min()) + 1


def depth_sum(layout: SpareLayout, order: np.ndarray, num_failures: int) -> int:
    """Sum over k = 0..F-1 of K*(k), the least free-reordering depth after the first k failures of `order`.

    K*(0) = 1 and K*(k) >= 2 for k >= 1 (capacity); K*(k) never decreases because survivors only shrink,
    so for each depth K = 2..r-1 a binary search finds how many k in [1, F-1] are still coverable at K.
    This gives the same depths as running `decide` failure by failure (the controller's phase 1 returns
    exactly K*), with O(r log F) matchings instead of F.
    """
    n = num_failures - 1
    total = 1 + 2 * n
    feasible_upto = 0
    for depth in range(2, layout.redundancy):
        cap = layout.num_groups - -(-layout.num_groups // depth)  # most failures leaving K*survivors >= N
        lo, hi = feasible_upto, min(n, cap)
        while lo < hi:  # largest k in [lo, hi] coverable at `depth`; k = lo is known coverable (or 0)
            mid = (lo + hi + 1) // 2
            alive = np.ones(layout.num_groups, dtype=bool)
            alive[order[:mid]] = False
            if covers_at_depth(layout, alive, depth):
                lo = mid
            else:
                hi = mid - 1
        feasible_upto = lo
        total += n - feasible_upto
        if feasible_upto == n:
            break
    return total


@dataclass(frozen=True, kw_only=True)
class ControllerTrace:
    """One trial with the full controller: depth in each failure interval, and patches needed."""

    num_failures: int
    depths: tuple[int, ...]  # depths[k] = committed depth after k failures, k = 0..F-1
    num_patches: int  # masked failures whose committed stacks no longer covered every type
    num_moved: int  # slots moved by phase 2 over the trial


def controller_trial(layout: SpareLayout, order: np.ndarray) -> ControllerTrace:
    """Fail groups in `order`, running the controller after each failure, until the first wipe-out."""
    stacks, depth = layout.initial_stacks(), 1
    alive = np.ones(layout.num_groups, dtype=bool)
    depths, patches, moved = [1], 0, 0
    for count, group in enumerate(order, start=1):
        alive[group] = False
        decision = decide(layout, stacks, alive, depth)
        if decision.wipe_out:
            return ControllerTrace(num_failures=count, depths=tuple(depths), num_patches=patches, num_moved=moved)
        patches += decision.phase != 0
        moved += decision.num_moved
        stacks, depth = decision.stacks, decision.depth
        depths.append(depth)
    raise AssertionError("every group failed without a wipe-out")


@dataclass(frozen=True, kw_only=True)
class MonteCarloConfig:
    """One Monte-Carlo cell.

    Args:
        num_groups: N.
        redundancy: r.
        num_trials: trials for E[F] (vectorized; cheap).
        num_stack_trials: trials for the mean stack depth (O(r log F) matchings each).
        num_controller_trials: trials run failure by failure through the full controller (patch rate;
            one matching-plus-assignment per failure, about 2 ms each at N = 1000).
        seed: seed of the SeedSequence the three streams are spawned from.

    Raises:
        ValueError: counts out of range (the layout checks N and r).
    """

    num_groups: int
    redundancy: int
    num_trials: int = 2000
    num_stack_trials: int = 50
    num_controller_trials: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_trials < 1:
            raise ValueError(f"num_trials must be >= 1, got {self.num_trials}")
        if self.num_stack_trials < 0 or self.num_controller_trials < 0:
            raise ValueError("num_stack_trials and num_controller_trials must be >= 0")


@dataclass(frozen=True, kw_only=True)
class MonteCarloResult:
    """Figures of one cell (see the module docstring for definitions)."""

    num_groups: int
    redundancy: int
    num_trials: int
    mean_failures: float
    stderr_failures: float
    closed_form: float
    finite_closed_form: float
    mean_stack: float | None
    patch_rate: float | None
    controller_mean_stack: float | None

    def as_dict(self) -> dict:
        return {
            "n": self.num_groups, "r": self.redundancy, "trials": self.num_trials,
            "mean_failures": self.mean_failures, "stderr_failures": self.stderr_failures,
            "closed_form": self.closed_form, "finite_closed_form": self.finite_closed_form,
            "rel_err": self.mean_failures / self.closed_form - 1.0,
            "rel_err_finite": self.mean_failures / self.finite_closed_form - 1.0,
            "mean_stack": self.mean_stack, "patch_rate": self.patch_rate,
            "controller_mean_stack": self.controller_mean_stack,
        }


def run_monte_carlo(config: MonteCarloConfig) -> MonteCarloResult:
    """Run one (N, r) cell; same config, same result."""
    layout = SpareLayout(num_groups=config.num_groups, redundancy=config.redundancy)
    f_rng, stack_rng, ctl_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(config.seed).spawn(3))
    failures = failures_to_wipeout(layout.hosts, config.num_trials, f_rng)
    mean_stack = None
    if config.num_stack_trials:
        depth_total = failure_total = 0
        for _ in range(config.num_stack_trials):
            order = stack_rng.permutation(config.num_groups)
            count = wipeout_index(layout.hosts, order)
            depth_total += depth_sum(layout, order, count)
            failure_total += count
        mean_stack = depth_total / failure_total
    patch_rate = controller_mean_stack = None
    if config.num_controller_trials:
        traces = [controller_trial(layout, ctl_rng.permutation(config.num_groups))
                  for _ in range(config.num_controller_trials)]
        masked = sum(t.num_failures - 1 for t in traces)
        patch_rate = sum(t.num_patches for t in traces) / max(masked, 1)
        controller_mean_stack = sum(sum(t.depths) for t in traces) / sum(t.num_failures for t in traces)
    return MonteCarloResult(
        num_groups=config.num_groups, redundancy=config.redundancy, num_trials=config.num_trials,
        mean_failures=float(failures.mean()),
        stderr_failures=float(failures.std(ddof=1) / math.sqrt(failures.size)) if failures.size > 1 else 0.0,
        closed_form=closed_form_failures(config.num_groups, config.redundancy),
        finite_closed_form=finite_closed_form_failures(config.num_groups, config.redundancy),
        mean_stack=mean_stack, patch_rate=patch_rate, controller_mean_stack=controller_mean_stack,
    )
