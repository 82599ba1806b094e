"""Loss parity: frequent replica failures (sqrt LR intervention, the default) end at the no-failure loss.

`ftrun launch --baseline` first trains 3 replicas of ftrun.train.ft_worker for 400 steps without failures,
then the same job (same seed, model, data) with a replica SIGKILLed every second (a dozen kills, ~8% of
the replica-steps lost). Both are compared at the same number of batches trained -- the failure run's
total, since failed replicas train no batches -- on the mean loss over the last 60 batches (20 steps of
3 replicas), as the paper compares runs by tokens seen (§6.2, Figures 8-9: "we do not observe a
distinguishable difference between the baseline and the different settings of FT-HSDP"; failures cause
short fluctuations and sqrt intervention flattens them).

Tolerance: |loss - baseline| <= 0.06 nats (5% of the ~1.24 final loss). Why: a step's loss is the mean of
the replicas' 8x16-token batch losses, whose step-to-step standard deviation here is ~0.05-0.065, so a
20-step window mean has a standard error of ~0.012-0.015 and the difference of two such means ~0.02;
0.06 is 3 standard errors, loose enough for run-to-run noise (kill timing changes which replicas train
which batches) and tight enough to catch a real divergence: the loss starts at ~3.47, a skipped or
doubled LR after failures or lost/duplicated batches shows up as a far larger gap.
"""

from __future__ import annotations

import pytest

from tests.integration.test_launch import launch

TOLERANCE = 0.06
STEPS = 400


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_loss_with_frequent_failures_matches_the_no_failure_baseline(tmp_path):
    f = launch(tmp_path, "--replicas", "3", "--steps", str(STEPS), "--kill-every", "1s", "--restart-delay", "0.2s",
               "--baseline", "--timeout", "100s", "-m", "ftrun.train.ft_worker", "--step-time", "0.02", timeout=115)
    print(f"\nloss parity: {f['final_loss']:.4f} with {f['failures_injected']} kills vs baseline "
          f"{f['baseline_final_loss']:.4f} at {f['batches_at_final_loss']:.0f} batches "
          f"(baseline's own end {f['baseline_end_loss']:.4f}); efficiency {f['step_efficiency']:.3f}")
    assert f["complete"] and f["baseline_steps_reached"] >= STEPS
    assert f["failures_injected"] >= 5, "not frequent failures"
    assert f["batches_at_final_loss"] <= 0.97 * 3 * STEPS, "failures should have cost batches"
    assert f["replicas_identical"] and f["baseline_replicas_identical"]
    assert (f["duplicate_batches"], f["skipped_batches"]) == (0, 0)
    assert f["final_loss"] < 1.6 and f["baseline_final_loss"] < 1.6, "the model should have learned (from ~3.47)"
    assert abs(f["final_loss"] - f["baseline_final_loss"]) <= TOLERANCE
