"""Pure parts of `ftrun launch`'s failure handling: what a crashed rank died of (from its stderr), the
crash-loop rule, why a finished job is incomplete, and which kill options never fired."""

from __future__ import annotations

import pytest

from ftrun.launch.checks import incomplete_reasons, unfired_kills
from ftrun.launch.crashes import CrashLog, ErrorSummary, summarize_stderr
from ftrun.launch.faults import KillAt, KillPlan

TB = """2026-11-23 18:00:00 WARNING ftrun.train: something earlier
Traceback (most recent call last):
  File "/x/train.py", line 3, in <module>
    loss = model(batch) + "a"
           ~~~~~~~~~~~~~^~~~~
TypeError: unsupported operand type(s) for +: 'Tensor' and 'str'
"""

CHAINED = """Traceback (most recent call last):
  File "a.py", line 1, in f
KeyError: 'k'

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "a.py", line 4, in <module>
RuntimeError: bad object at 0x7f3a2c
2026-11-23 18:00:01 INFO ftrun.train: shutting down
"""


@pytest.mark.parametrize("text,code,error,detail_starts", [
    (TB, 1, "TypeError: unsupported operand type(s) for +: 'Tensor' and 'str'", "Traceback (most recent call last):"),
    (CHAINED, 1, "RuntimeError: bad object at 0x...", "Traceback (most recent call last):\n  File \"a.py\", line 4"),
    ("/usr/bin/python: No module named nosuch\n", 1, "/usr/bin/python: No module named nosuch", "/usr/bin/python"),
    ("", -9, "killed by SIGKILL, nothing on stderr", ""),
    ("\n\n", 3, "exit code 3, nothing on stderr", ""),
    ("2026-11-23 18:47:13,612 ERROR ftrun.train: replica r1 gives up\n", 1, "ERROR ftrun.train: replica r1 gives up",
     "2026-11-23"),
    ("Traceback (most recent call last):\n  File \"a.py\", line 1\n", 1, "File \"a.py\", line 1", "Traceback"),
])
def test_summarize_stderr(text, code, error, detail_starts):
    s = summarize_stderr(text, code)
    assert s.error == error and s.detail.startswith(detail_starts)
    if "Traceback" in text:
        assert "shutting down" not in s.detail and "something earlier" not in s.detail


def test_repeated_log_lines_are_collapsed():
    lines = [f"2026-11-23 18:49:36,{i:03d} WARNING ftrun.commit: step 3: bad operand" for i in range(11)]
    text = "\n".join(["first"] + lines + ["2026-11-23 18:49:37,000 ERROR ftrun.train: gives up"]) + "\n"
    s = summarize_stderr(text, 1)
    assert s.error == "ERROR ftrun.train: gives up"
    assert s.detail.splitlines() == ["first", lines[0] + "  [repeated 11 times]",
                                     "2026-11-23 18:49:37,000 ERROR ftrun.train: gives up"]
    assert summarize_stderr("x\nx\n", 1) == ErrorSummary("x", "x  [repeated 2 times]")


def test_a_long_traceback_is_clipped_in_the_middle():
    frames = "".join(f'  File "m.py", line {i}, in f{i}\n    f{i + 1}()\n' for i in range(200))
    s = summarize_stderr("Traceback (most recent call last):\n" + frames + "RecursionError: too deep\n", 1)
    lines = s.detail.splitlines()
    assert len(lines) <= 42 and lines[0].startswith("Traceback") and lines[-1] == "RecursionError: too deep"
    assert any("lines left out" in line for line in lines)


def crash(log, rid, error, started=False, job_step=0):
    return log.crashed(rid, rank=0, incarnation=0, exit_code=1, summary=ErrorSummary(error, "tb " + error),
                       started=started, job_step=job_step)


def test_the_same_futile_crash_n_times_in_a_row_is_a_crash_loop():
    log = CrashLog(max_startup_failures=3)
    rows = [  # replica, error, its incarnation had committed, job step -> (show, futile in a row, give up)
        ("r0", "E1", False, 0, (True, 1, False)),
        ("r1", "E1", False, 0, (False, 1, False)),  # shown once per job, whichever replica
        ("r0", "E1", False, 0, (False, 2, False)),
        ("r0", "E2", False, 0, (True, 1, False)),  # another error starts the count again
        ("r0", "E2", False, 0, (False, 2, False)),
        ("r0", "E2", True, 7, (False, 0, False)),  # it ran and the job got further: not futile
        ("r0", "E2", True, 7, (False, 1, False)),  # it ran, but the job is no further than at its last crash
        ("r0", "E2", True, 7, (False, 2, False)),
        ("r0", "E2", False, 9, (False, 3, True)),  # failed to start (the others went on): futile
    ]
    for rid, error, started, step, expected in rows:
        v = crash(log, rid, error, started, step)
        assert (v.show, v.futile, v.give_up) == expected, (rid, error, started, step)
    assert [(e.error, e.count, e.replica_id) for e in log.errors.values()] == [("E1", 3, "r0"), ("E2", 6, "r0")]
    assert log.errors["E1"].as_json()["detail"] == "tb E1"


def test_a_commit_resets_the_count_only_once_the_job_gets_further():
    log = CrashLog(max_startup_failures=2)
    assert crash(log, "r0", "E", job_step=5).futile == 1
    log.committed("r0", 5)  # re-committing steps the job already had (restarted from scratch) is no progress
    assert crash(log, "r0", "E", started=True, job_step=5).give_up
    log = CrashLog(max_startup_failures=2)
    assert crash(log, "r0", "E", job_step=5).futile == 1
    log.committed("r0", 6)
    assert crash(log, "r0", "E", job_step=6).futile == 1
    with pytest.raises(ValueError, match="max_startup_failures"):
        CrashLog(max_startup_failures=0)


GOOD = {"steps_reached": 10, "replicas_identical": True, "num_divergences": 0, "duplicate_batches": 0,
        "skipped_batches": 0, "audit_problems": 0, "interrupted": False, "gave_up": [], "timed_out": False}


@pytest.mark.parametrize("change,reason", [
    ({}, None),
    ({"duplicate_batches": None, "skipped_batches": None, "audit_problems": None}, None),  # no audit files
    ({"steps_reached": 9}, "reached step 9 of 10"),
    ({"replicas_identical": False, "num_divergences": 4}, "replicas diverged (4 param_hash mismatches)"),
    ({"duplicate_batches": 2}, "2 batch(es) duplicated"),
    ({"skipped_batches": 1}, "1 batch(es) skipped"),
    ({"audit_problems": 3}, "3 audit problem(s)"),
    ({"interrupted": True}, "interrupted"),
    ({"timed_out": True}, "--timeout expired"),
    ({"gave_up": [{"replica_id": "r1", "count": 3}]},
     "gave up on r1 after 3 crashes in a row with the same error and no progress (a crash loop)"),
])
def test_incomplete_reasons(change, reason):
    assert incomplete_reasons({**GOOD, **change}, goal=10) == ([] if reason is None else [reason])


def test_kill_options_that_never_fired_are_named():
    plan = KillPlan(at_steps=[KillAt(5, "r1"), KillAt(50)], every_s=10.0, min_up=2)
    plan.start(0.0)
    assert plan.due(1.0, 5, ["r0", "r1"]) is None  # killing r1 would leave 1 < min_up healthy
    assert plan.due(1.0, 6, ["r0", "r1", "r2"]) == "r1"
    assert plan.pending == [KillAt(50)] and plan.num_timed_kills == 0
    warnings = unfired_kills(pending=plan.pending, every_s=10.0, random_mean_s=None,
                             num_timed_kills=plan.num_timed_kills, max_kills=3, num_kills=1)
    assert [w.split(" never")[0].split(":")[0] for w in warnings] == ["--kill-at step=50", "--kill-every 10s",
                                                                      "--max-kills 3"]
    assert plan.due(10.0, 7, ["r0", "r1", "r2"]) is not None and plan.num_timed_kills == 1
    assert unfired_kills(pending=[], every_s=10.0, random_mean_s=None, num_timed_kills=1, max_kills=1,
                         num_kills=1) == []
