"""A short soak: `ftrun launch` with random kills of whole replicas of the real FT-HSDP worker.

4 replicas of ftrun.train.ft_worker (real quorum, HTTP catch-up, FTAR, 2PC, sqrt LR intervention, audit
files); a replica is SIGKILLed every 0.8 s on average (exponential) until 25 kills were injected, and
the launcher restarts each from its zygote; kills may hit a replica that is still restarting or healing,
but never leave fewer than 2 healthy replicas. Then the job stops through the worker's stop file. The
run must end complete with every batch trained exactly once (audit over all replicas' audit files) and
every committed step bitwise identical in every replica that committed it. benchmarks/soak.py runs the
same with 1,000 kills.
"""

from __future__ import annotations

import pytest

from tests.integration.test_launch import launch

KILLS = 25


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_short_soak_keeps_data_exactly_once_and_replicas_identical(tmp_path):
    stop = str(tmp_path / "stop")
    f = launch(tmp_path, "--replicas", "4", "--min-replicas", "2", "--steps", "100000", "--max-kills", str(KILLS),
               "--kill-random-mean", "0.8s", "--restart-delay", "0.1s", "--stop-file", stop, "--timeout", "100s",
               "-m", "ftrun.train.ft_worker", "--step-time", "0.02", "--stop-file", stop, "--ftar-timeout", "5",
               timeout=115)
    print(f"\nshort soak: {f['failures_injected']} kills, {f['steps_reached']} steps, "
          f"{f['steps_committed']}/{f['steps_total']} replica-steps, efficiency {f['step_efficiency']:.3f} "
          f"(theory {f['theoretical_efficiency']:.3f}), {f['identity_checks']} identity checks, {f['wall_s']:.0f}s")
    assert f["complete"] and f["failures_injected"] >= KILLS and f["crashes"] == 0
    assert f["restarts"] >= KILLS and f["events_after_kill"] == 0  # every killed rank really died
    assert (f["duplicate_batches"], f["skipped_batches"], f["audit_problems"]) == (0, 0, 0), f["audit"]
    # Every committed step is compared in at least two replicas (min_replicas=2), whatever the throughput.
    assert f["replicas_identical"] and f["identity_checks"] >= f["steps_reached"] // 2 > 0, f["divergences"]
    assert f["steps_goal"] < 100000  # it ended through the stop file, not the step limit
