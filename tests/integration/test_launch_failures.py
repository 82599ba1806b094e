"""`ftrun launch` when things go wrong: crash loops, user errors, diverged or short jobs, Ctrl-C.

Each test runs the CLI as a subprocess on a small fake training script (JSON event lines on stdout, no
torch, so a run takes seconds) and checks the exit status, the console and the --json figures, then that no
process of the run is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.integration.test_launch import ROOT, leftovers

FAKE = '''
import json, os, sys, time

steps = int(os.environ["FTRUN_MAX_STEPS"])
rid, inc = os.environ["FTRUN_REPLICA_ID"], int(os.environ["TORCHELASTIC_RESTART_COUNT"])
mode, step_s = sys.argv[1], float(sys.argv[2])
for step in range(steps):
    if mode == "short" and step == 5:
        sys.exit(0)  # a clean exit before the job's last step
    if mode == "user-error" and rid == "r1" and step == 3:
        {}["no such key"] + 1  # the same bug in every incarnation of r1, after it has committed
    if mode == "r1-broken" and rid == "r1":
        raise ImportError("r1 cannot load its data")  # fails to start, every time
    if mode == "r1-broken" and step == 5:
        events = os.path.join(os.environ["FTRUN_RUN_DIR"], "events.jsonl")
        deadline = time.monotonic() + 60  # r0 goes on once the launcher has given up on r1
        while '"gave_up"' not in open(events).read() and time.monotonic() < deadline:
            time.sleep(0.02)
    if mode == "stuck" and step == 3:
        raise RuntimeError(f"bad batch in {rid}")  # every replica, every time: the job never gets past step 3
    time.sleep(step_s)
    print(json.dumps({"event": "commit", "step": step + 1, "t": time.monotonic()}), flush=True)
    digest = rid if mode == "short" else "same"  # "short" also diverges: each replica its own state
    print(json.dumps({"event": "step", "step": step, "committed": True, "param_hash": digest, "loss": 1.0,
                      "t": time.monotonic()}), flush=True)
'''


def start(out, script, *args: str, script_args: tuple[str, ...] = ()) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ftrun.cli", "launch", "--out", str(out), "--json", "--no-progress",
                             *args, str(script), *script_args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, preexec_fn=_default_sigint)


def _default_sigint() -> None:
    """In the launcher's process before exec: SIGINT as a terminal's foreground job has it, whatever the
    test runner's own setting (a launcher started with SIGINT ignored keeps ignoring it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def finish(proc: subprocess.Popen, out, timeout: float = 90.0) -> tuple[int, str, str, dict]:
    """(exit status, stdout, stderr, figures) of a launch; asserts that nothing of the run was left running."""
    stdout, stderr = proc.communicate(timeout=timeout)
    left = leftovers(str(out))
    for p in left:
        p.kill()
    assert not left, f"processes left behind: {[p.pid for p in left]}"
    assert stdout.strip(), stderr[-3000:]
    return proc.returncode, stdout, stderr, json.loads(stdout.strip().splitlines()[-1])


def fake_script(tmp_path, body: str = FAKE):
    script = tmp_path / "fake_train.py"
    script.write_text(body)
    return script


@pytest.mark.timeout(120)
def test_a_crash_loop_at_startup_stops_after_n_same_failures_and_shows_the_cause(tmp_path):
    script = fake_script(tmp_path, "import json\nimport no_such_module_for_ftrun_tests\n")
    code, _, stderr, f = finish(start(tmp_path / "out", script, "--replicas", "2", "--steps", "10",
                                   "--restart-delay", "0.05s", "--max-startup-failures", "2"), tmp_path / "out")
    assert code == 1 and not f["complete"]
    [gave_up] = f["gave_up"]  # 2 replicas, a quorum needs 2: the job ends at the first one given up
    assert gave_up["count"] == 2 and gave_up["error"].startswith("ModuleNotFoundError")
    assert any(r.startswith("gave up on r") for r in f["incomplete_reasons"])
    assert "reached step 0 of 10" in f["incomplete_reasons"]
    # the cause, with the script's own traceback (not the zygote's frames), shown once however many crashes
    assert stderr.count("Traceback (most recent call last)") == 1, stderr
    assert "import no_such_module_for_ftrun_tests" in stderr and "zygote.py" not in stderr
    assert "crashed 2 times in a row with the same error" in stderr
    [err] = f["errors"]
    assert err["count"] >= 2 and "No module named 'no_such_module_for_ftrun_tests'" in err["error"]


@pytest.mark.timeout(120)
def test_crashing_at_the_same_step_again_and_again_is_a_crash_loop_too(tmp_path):
    """Each incarnation commits (restarted from scratch, without a checkpoint) and crashes at step 3 again:
    not a failure to start, but the job makes no progress."""
    code, _, stderr, f = finish(start(tmp_path / "out", fake_script(tmp_path), "--replicas", "2", "--steps", "20",
                                      "--restart-delay", "0.05s", "--max-startup-failures", "2",
                                      script_args=("stuck", "0.01")), tmp_path / "out")
    [gave_up] = f["gave_up"]
    assert code == 1 and gave_up["error"] in ("RuntimeError: bad batch in r0", "RuntimeError: bad batch in r1")
    assert gave_up["step"] == 3 and f["steps_reached"] == 3
    assert stderr.count("Traceback (most recent call last)") <= 2  # once per distinct error (one per replica)
    assert any("a crash loop" in r for r in f["incomplete_reasons"])


@pytest.mark.timeout(120)
def test_a_replica_in_a_crash_loop_is_given_up_while_the_others_finish_the_job(tmp_path):
    code, _, stderr, f = finish(start(tmp_path / "out", fake_script(tmp_path), "--replicas", "2", "--min-replicas",
                                      "1", "--steps", "20", "--restart-delay", "0.05s", "--max-startup-failures", "2",
                                      script_args=("r1-broken", "0.01")), tmp_path / "out")
    assert [(g["replica_id"], g["count"], g["error"]) for g in f["gave_up"]] == \
        [("r1", 2, "ImportError: r1 cannot load its data")]
    assert "the job goes on with 1 replica(s) and will not count as complete" in stderr
    assert f["steps_reached"] == 20 and f["incomplete_reasons"] == [
        "gave up on r1 after 2 crashes in a row with the same error and no progress (a crash loop)"]
    assert code == 1 and not f["complete"]


@pytest.mark.timeout(120)
def test_a_user_error_after_commits_is_shown_once_and_the_others_finish(tmp_path):
    code, _, stderr, f = finish(start(tmp_path / "out", fake_script(tmp_path), "--replicas", "2", "--min-replicas",
                                      "1", "--steps", "40", "--restart-delay", "0.05s", "--max-startup-failures", "1",
                                      script_args=("user-error", "0.05")), tmp_path / "out")
    [err] = f["errors"]
    assert err["error"] == "KeyError: 'no such key'" and err["replica_id"] == "r1"
    assert err["count"] >= 2, "r1 crashed again after its restart (and committed first: no crash loop)"
    assert stderr.count("Traceback (most recent call last)") == 1, stderr  # shown once, not per restart
    assert "exited with 1: KeyError: 'no such key'" in stderr
    assert f["gave_up"] == [] and f["crashes"] == err["count"]
    assert code == 0 and f["complete"] and f["steps_reached"] >= 40


@pytest.mark.timeout(120)
def test_diverged_replicas_a_short_run_and_an_unfired_kill_exit_non_zero(tmp_path):
    code, stdout, _, f = finish(start(tmp_path / "out", fake_script(tmp_path), "--replicas", "2", "--steps", "20",
                                      "--kill-every", "1h", script_args=("short", "0.01")), tmp_path / "out")
    assert code == 1 and f["complete"] is False
    assert f["replicas_identical"] is False and f["num_divergences"] >= 1
    reasons = f["incomplete_reasons"]
    assert "reached step 5 of 20" in reasons and any(r.startswith("replicas diverged") for r in reasons)
    [warning] = f["warnings"]
    assert warning.startswith("--kill-every 3600s never fired")
    assert "warning: --kill-every 3600s never fired" in stdout and "INCOMPLETE: " in stdout and f["errors"] == []


@pytest.mark.timeout(120)
def test_ctrl_c_stops_the_job_without_a_traceback_and_writes_the_partial_report(tmp_path):
    out = tmp_path / "out"
    proc = start(out, fake_script(tmp_path), "--replicas", "2", "--steps", "100000", script_args=("long", "0.01"))
    events = out / "events.jsonl"
    try:
        while not (events.exists() and events.read_text().count('"commit"') >= 10):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
    except BaseException:
        proc.kill()
        raise
    proc.send_signal(signal.SIGINT)
    code, stdout, stderr, f = finish(proc, out)
    assert code == 128 + signal.SIGINT and "Traceback" not in stdout + stderr and "SIGINT" in stderr
    assert f["interrupted"] and f["stop_signal"] == "SIGINT" and not f["complete"]
    assert "interrupted" in f["incomplete_reasons"] and f["steps_reached"] >= 5
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert len(rows) >= 5 and os.path.getsize(out / "report.png") > 10_000
