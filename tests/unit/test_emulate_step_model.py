"""The emulator's step model against the real runtime's: what it charges around a commit, an abort and the
all-reduce (the terms `ftrun calibrate` measures and `ftrun fidelity` compares)."""

from __future__ import annotations

import pytest

from harness.cli import build_profile, execute
from harness.run import JobOptions, Kill


def _leader_events(job, replica_id: str) -> list[dict]:
    return sorted((e for e in job.recorder.events if e.get("replica_id") == replica_id and e.get("rank", 0) == 0),
                  key=lambda e: e["t"])


@pytest.mark.timeout(120)
def test_the_scripts_bookkeeping_follows_a_commit_but_not_an_abort():
    bookkeeping = 0.5
    profile = build_profile("ci-small", [f"train.step_bookkeeping_s={bookkeeping}"], steps=8, cpu_charging=False)
    f, job = execute(profile, JobOptions(steps=8, kills=(Kill(1, at_step=3, at_fraction=0.5),)))
    assert f["complete"]
    ev = _leader_events(job, "r0")
    after_commit = [b["t"] - a["t"] for a, b in zip(ev, ev[1:]) if a["event"] == "commit" and b["event"] == "quorum"]
    after_abort = [b["t"] - a["t"] for a, b in zip(ev, ev[1:]) if a["event"] == "abort" and b["event"] == "quorum"]
    assert after_commit and min(after_commit) >= bookkeeping
    assert after_abort and max(after_abort) < bookkeeping  # the aborted step did no per-step work after it
    first_quorum = next(e["t"] for e in ev if e["event"] == "quorum")
    assert first_quorum < bookkeeping  # nor did the first step, which followed no commit


def _quorum_to_commit(job) -> float:
    from statistics import median

    from harness.calibrate import quorum_to_commit_s

    return median(quorum_to_commit_s([e for e in job.recorder.events if e.get("rank", 0) == 0]))


@pytest.mark.timeout(120)
def test_the_all_reduce_overhead_is_measured_at_2_replicas_and_scales_with_the_replicas_up():
    overhead = 0.2
    spans = {}
    for replicas in (2, 4):
        overrides = [f"ftar.sync_overhead_s={overhead}", f"replicas={replicas}", "train.shared_cpu_cores=0"]
        f, job = execute(build_profile("ci-small", overrides, steps=4, cpu_charging=False), JobOptions(steps=4))
        assert f["complete"]
        spans[replicas] = _quorum_to_commit(job)
    assert spans[4] - spans[2] == pytest.approx(overhead * (4 / 2 - 1), abs=0.02)  # the modeled ring is ~free
