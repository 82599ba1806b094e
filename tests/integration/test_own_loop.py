"""`ftrun launch` on examples/own_loop.py (the user's own loop, ftrun.train.own) with killed replicas.

Checks what the port promises: identical parameters and identical registered state (scheduler, EMA:
the step events' user_state_hash) on every replica at every step, restarted replicas among them
after catching up, exactly-once data (the audit over every replica's ledger records; the sampler
itself refuses a commit whose batch was not wholly consumed), and the custom metrics in
metrics.jsonl. One case is 3 replicas x 1 rank with two kills, one 2 replicas x 2 ranks (FSDP2
inside each replica) with a kill. The example runs through own_loop_worker.py, which only slows the
steps while a replica is missing, so that every victim is back before the job ends. The timeouts are
generous: on a loaded machine the launcher's start (zygote) and report (plots) dominate.
"""

from __future__ import annotations

import json

import pytest

from tests.integration.test_launch import launch

WORKER = "tests/integration/own_loop_worker.py"  # examples/own_loop.py, slowed while a replica is missing


def events_of(out) -> list[dict]:
    return [json.loads(line) for line in open(out / "events.jsonl")]


def check_identical_and_exactly_once(f: dict, out, *, kills: int, victims: set[str]) -> None:
    assert f["complete"], f["incomplete_reasons"]
    assert f["failures_injected"] == kills and f["restarts"] == kills and f["crashes"] == 0
    assert f["replicas_identical"] and f["identity_checks"] > 0
    assert f["user_state_identical"] is True and f["user_state_checks"] > 0
    assert f["duplicate_batches"] == 0 and f["skipped_batches"] == 0 and f["audit_problems"] == 0
    events = events_of(out)
    for victim in victims:  # the restarted incarnation healed (registered state too) and then agreed
        assert any(e["event"] == "catchup" and e["replica_id"] == victim and e["incarnation"] >= 1 for e in events)
        later = [e for e in events if e["event"] == "step" and e.get("committed") and e["replica_id"] == victim
                 and e["incarnation"] >= 1 and e.get("user_state_hash")]
        assert later, f"{victim} committed no step after its restart"
    finals = [e for e in events if e["event"] == "final"]
    for rank in {e["rank"] for e in finals}:
        at_end = [e for e in finals if e["rank"] == rank and e["step"] == f["steps_reached"]]
        assert len({(e["param_hash"], e["user_state_hash"]) for e in at_end}) == 1, at_end
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert all("lr" in r for r in rows[1:]) and any("val_loss" in r for r in rows)  # job.log_metrics


@pytest.mark.timeout(300)
def test_own_loop_three_replicas_two_kills(tmp_path):
    f = launch(tmp_path, "--replicas", "3", "--steps", "90", "--kill-at", "step=15,replica=r1",
               "--kill-at", "step=50,replica=r2", "--restart-delay", "0.2s", "--timeout", "200s",
               WORKER, timeout=280)
    check_identical_and_exactly_once(f, tmp_path, kills=2, victims={"r1", "r2"})
    assert f["steps_reached"] >= 90 and f["batches_trained"] > 90


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_own_loop_fsdp2_two_by_two_with_a_kill(tmp_path):
    f = launch(tmp_path, "--replicas", "2", "--ranks-per-replica", "2", "--min-replicas", "1", "--steps", "40",
               "--kill-at", "step=10,replica=r1", "--restart-delay", "0.2s", "--timeout", "200s",
               WORKER, timeout=280)
    check_identical_and_exactly_once(f, tmp_path, kills=1, victims={"r1"})
    assert f["identity_checks"] >= 2  # both ranks' shards compared
