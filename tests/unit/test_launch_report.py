"""`ftrun launch`'s figures from a run folder: a duplicated or skipped batch in the audit files, or an
unreadable audit file, makes the job incomplete (and the launcher's exit status 1) instead of crashing."""

from __future__ import annotations

import argparse
import os

from ftrun.data.audit import encode_record
from ftrun.launch.report import JobResult, job_figures
from ftrun.launch.stats import RunStats
from tests.unit.test_launch_stats import _chain

ARGS = argparse.Namespace(kill_every=None, kill_random_mean=None)


def write_audit(run_dir, batches_by_step) -> None:
    """Two replicas' attempt and commit records for the given (position, batch id) pairs, step by step."""
    records = _chain(batches_by_step)
    (run_dir / "audit-r0-0.jsonl").write_bytes(b"".join(encode_record(r) for r in records))


def figures_of(run_dir, num_steps=2) -> dict:
    stats = RunStats(2)
    for step in range(num_steps):
        for rid in ("r0", "r1"):
            stats.add({"event": "commit", "replica_id": rid, "incarnation": 0, "rank": 0, "step": step + 1,
                       "t": float(step)})
    f = job_figures(JobResult(stats, 1.0, str(run_dir), goal=num_steps), None, args=ARGS, start_method="spawn")
    assert os.path.exists(run_dir / "metrics.jsonl") and os.path.exists(run_dir / "report.png")
    return f


def test_exactly_once_data_and_every_step_reached_is_complete(tmp_path):
    write_audit(tmp_path, [((0, 10), (0, 20)), ((1, 11), (1, 21))])
    f = figures_of(tmp_path)
    assert f["complete"] and f["incomplete_reasons"] == [] and f["duplicate_batches"] == 0


def test_a_duplicated_and_a_skipped_batch_make_the_job_incomplete(tmp_path):
    write_audit(tmp_path, [((0, 10), (0, 20)), ((1, 10), (2, 21))])  # batch 10 twice; r1 skipped position 1
    f = figures_of(tmp_path)
    assert not f["complete"]
    assert f["incomplete_reasons"] == ["1 batch(es) duplicated", "1 batch(es) skipped"]


def test_an_unreadable_audit_file_is_an_audit_problem_not_a_crash(tmp_path):
    (tmp_path / "audit-r0-0.jsonl").write_bytes(b'{"kind": "attempt", "replica": 3}\n')
    f = figures_of(tmp_path)
    assert not f["complete"] and f["audit_problems"] == 1 and "1 audit problem(s)" in f["incomplete_reasons"]
