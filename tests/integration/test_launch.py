"""`ftrun launch` end to end: real replica processes, injected kills, restarts, the report, no leftovers.

Each test runs the CLI as a subprocess (as a user would) and checks its --json figures and files, then
that no process of the run is left (psutil: processes whose command line or environment names the
run's folder; forked ranks carry the zygote's command line, which does).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def leftovers(run_dir: str) -> list[psutil.Process]:
    """Live processes that belong to the run in `run_dir`."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(run_dir in arg for arg in p.info["cmdline"] or []) or p.environ().get("FTRUN_RUN_DIR") == run_dir:
                if p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def python_path() -> str:
    """PYTHONPATH for a subprocess: this checkout first, then the caller's (e.g. a folder of extra wheels)."""
    return os.pathsep.join([ROOT] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))


def launch(out, *args: str, timeout: float = 100.0) -> dict:
    """Run `ftrun launch --json --out OUT ARGS`; returns its figures; asserts that nothing was left running."""
    proc = subprocess.run([sys.executable, "-m", "ftrun.cli", "launch", "--out", str(out), "--json", "--no-progress",
                           *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": python_path()})
    left = leftovers(str(out))
    for p in left:
        p.kill()
    assert not left, f"processes left behind: {[p.pid for p in left]}"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(180)
def test_launch_kills_at_a_step_restarts_and_reports(tmp_path):
    f = launch(tmp_path, "--replicas", "3", "--ranks-per-replica", "1", "--steps", "60", "--kill-at",
               "step=8,replica=r1", "--min-replicas", "2", "--timeout", "90s", "-m", "ftrun.train.ft_worker",
               "--step-time", "0.1", timeout=160)
    assert f["complete"] and f["steps_reached"] >= 60 and f["start_method"] == "fork-server"
    assert f["failures_injected"] == 1 and f["restarts"] == 1 and f["crashes"] == 0
    assert 0.8 < f["step_efficiency"] < 1
    assert (f["duplicate_batches"], f["skipped_batches"]) == (0, 0)  # the one trainer's exactly-once audit
    assert os.path.getsize(tmp_path / "report.png") > 10_000
    events = [json.loads(line) for line in open(tmp_path / "events.jsonl")]
    kill = next(e for e in events if e["event"] == "kill")
    assert kill["replica_id"] == "r1" and kill["step"] >= 8
    assert any(e["event"] == "commit" and e["replica_id"] == "r1" and e["incarnation"] == 1 for e in events), \
        "the restarted replica rejoined and committed"
    # each replica's rank on its own host slot (its GPU with --device cuda), the restarted one on its old one
    assert sorted((e["replica_id"], e["incarnation"], e["host_slot"]) for e in events if e["event"] == "ready") == \
        [("r0", 0, 0), ("r1", 0, 1), ("r1", 1, 1), ("r2", 0, 2)]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(len(rows))) and len(rows) >= 60
    assert any(len(r["replicas_committed"]) == 2 for r in rows) and rows[-1]["replicas_committed"] == ["r0", "r1", "r2"]


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_launch_two_ranks_per_replica_with_kill_every(tmp_path):
    """3 replicas x 2 ranks (FSDP2 inside each replica), a kill every 4 s: efficiency near its theory."""
    f = launch(tmp_path, "--replicas", "3", "--ranks-per-replica", "2", "--steps", "150", "--kill-every", "4s",
               "--restart-delay", "0.2s", "--timeout", "100s", "-m", "ftrun.train.ft_worker", "--step-time", "0.05",
               timeout=160)  # the real trainer's start and report take tens of seconds on a loaded 2-core box
    assert f["complete"] and f["failures_injected"] >= 2 and f["crashes"] == 0
    assert f["theoretical_efficiency"] is not None
    assert abs(f["step_efficiency"] - f["theoretical_efficiency"]) < 0.08, f
    logs = sorted(os.listdir(tmp_path / "logs"))
    assert "r0.0.1.out" in logs and "r0.0.1.log" in logs  # every rank's stdout and stderr are kept


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_launch_ft_worker_checks_state_and_data_with_spawn(tmp_path):
    """The real FT-HSDP worker under the spawn launcher: identical state and exactly-once data after kills."""
    f = launch(tmp_path, "--replicas", "3", "--steps", "120", "--kill-at", "step=30,replica=r0", "--kill-at",
               "step=70", "--start-method", "spawn", "--timeout", "100s", "-m", "ftrun.train.ft_worker",
               "--step-time", "0.02")
    assert f["complete"] and f["start_method"] == "spawn" and f["failures_injected"] == 2
    assert f["replicas_identical"] and f["identity_checks"] > 100  # ~2 per step; fewer while one restarts
    assert (f["duplicate_batches"], f["skipped_batches"], f["audit_problems"]) == (0, 0, 0)
    assert f["final_loss"] is not None and f["final_loss"] < 3.0


FAKE_SCRIPT = '''
import json, os, sys
import helper_mod  # noqa: F401  (the zygote preloads the script's imports)

steps = int(os.environ["FTRUN_MAX_STEPS"])
assert sys.argv[1:] == ["--flag", "x"], sys.argv
rid, inc = os.environ["FTRUN_REPLICA_ID"], int(os.environ["TORCHELASTIC_RESTART_COUNT"])
for step in range(steps):
    print(json.dumps({"event": "commit", "step": step + 1, "t": float(step), "pid": os.getpid()}), flush=True)
'''


SLOT_SCRIPT = '''
import json, os, time
from ftrun.launch.worker_env import WorkerSpec
from ftrun.train.device import resolve_device

spec = WorkerSpec.from_environ(os.environ)  # as init_from_env reads it
print(json.dumps({"event": "ready", "t": 0.0, "step": 0, "host_slot": spec.device_slot, "local_rank": os.environ["LOCAL_RANK"],
                  "torchrun_rank": os.environ["RANK"], "world_size": os.environ["WORLD_SIZE"],
                  "cuda": str(resolve_device("cuda", slot=spec.device_slot, device_count=4))}), flush=True)
# The job is complete when every replica's rank 0 has committed its steps, and the launcher then stops the
# other ranks: rank 0 commits only once its replica's other rank has said it is ready (a marker file).
marker = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"ready-{spec.replica_id}-{spec.rank}")
open(marker, "w").close()
if spec.rank == 0:
    other = marker[:-1] + "1"
    deadline = time.monotonic() + 30.0
    while not os.path.exists(other) and time.monotonic() < deadline:
        time.sleep(0.01)
for step in range(int(os.environ["FTRUN_MAX_STEPS"])):
    print(json.dumps({"event": "commit", "step": step + 1, "t": float(step)}), flush=True)
'''


@pytest.mark.timeout(60)
def test_launch_gives_every_rank_on_the_host_its_own_slot(tmp_path):
    """3 replicas x 2 ranks on one host: six ranks, slots 0..5 (replica by replica), so "cuda" on a 4-GPU host
    is cuda:0..3 then cuda:0..1, where every replica used to take cuda:0 and cuda:1; LOCAL_RANK is the slot too
    (torchrun's meaning: the process's place among those started on the host) and RANK the rank inside the
    replica (torchrun's names describe the replica's world)."""
    script = tmp_path / "slots.py"
    script.write_text(SLOT_SCRIPT)
    f = launch(tmp_path / "out", "--replicas", "3", "--ranks-per-replica", "2", "--steps", "3", "--timeout", "40s",
               str(script))
    assert f["complete"]
    ready = [json.loads(line) for line in open(tmp_path / "out" / "events.jsonl")]
    got = sorted((e["replica_id"], e["rank"], e["torchrun_rank"], e["world_size"], e["local_rank"], e["host_slot"],
                  e["cuda"]) for e in ready if e["event"] == "ready")
    assert got == [("r0", 0, "0", "2", "0", 0, "cuda:0"), ("r0", 1, "1", "2", "1", 1, "cuda:1"),
                   ("r1", 0, "0", "2", "2", 2, "cuda:2"), ("r1", 1, "1", "2", "3", 3, "cuda:3"),
                   ("r2", 0, "0", "2", "4", 4, "cuda:0"), ("r2", 1, "1", "2", "5", 5, "cuda:1")]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("threaded", [False, True])
def test_launch_runs_a_script_path_forked_or_spawned_when_fork_is_unsafe(tmp_path, threaded):
    """A plain script (not -m) runs forked from the zygote with its argv and environment; if loading its
    imports starts a thread, forking is unsafe and the launcher falls back to spawning."""
    (tmp_path / "helper_mod.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
        if threaded else "VALUE = 1\n")
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_SCRIPT)
    f = launch(tmp_path / "out", "--replicas", "2", "--steps", "20", "--timeout", "40s", str(script), "--flag", "x")
    assert f["complete"] and f["steps_reached"] == 20 and f["step_efficiency"] == 1.0
    assert f["start_method"] == ("spawn (fallback)" if threaded else "fork-server")
