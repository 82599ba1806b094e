"""Every script in examples/ runs unchanged under the shadow loader at profile scale (`ftrun emulate SCRIPT
--profile ci-small --inject "kill replica=3 step=5" --json`), as written and with `--script-args "--device
cuda"` (its tensors for the GPU made on the host, shadow.cuda_tensors): its imports of torch (dynamo and
inductor included) see the torch.cuda shim, its `ftrun.train` calls reach mocks.train_api, and its model, built on
meta (ft.train) or traced for one step (its own loop), trains on every one of the profile's 32 emulated
ranks through the real trainer: the killed replica restarts, catches up from its peers and rejoins, and the
exactly-once audit over every leader's records is clean."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# own_loop_plain.py is the plain-PyTorch "before" of own_loop.py (the port diff): it starts no ftrun job.
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py") if p.name != "own_loop_plain.py")
# Enough steps for the killed replica to come back: own_loop.py's tiny MLP models ~6 ms steps at ci-small's
# FLOP rate (checkpoint writes are off the step since they went asynchronous), and a restart takes about 1 s of
# modeled time (detection, allocation, process start): 300 steps are ~1.9 modeled s.
STEPS = 300


def emulate(script: Path, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ftrun.cli", "emulate", str(script), "--profile", "ci-small",
                           "--no-progress", *extra], capture_output=True, text=True, timeout=170, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def trained_with_a_kill(script: Path, tmp_path: Path, script_args: str) -> tuple[dict, list[dict], str]:
    """Run `script` with `script_args` and a kill of replica 3 at step 5; check that every emulated rank
    trained and the killed replica rejoined. Returns (figures, the script's event lines, its stderr)."""
    out = emulate(script, tmp_path, "--steps", str(STEPS), "--inject", "kill replica=3 step=5", "--json",
                  "--script-args", script_args)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "under the shadow loader" in out.stderr and "torch.cuda shimmed" in out.stderr
    assert "ftrun.train.api -> mocks.train_api" in out.stderr
    f = json.loads(out.stdout.strip().splitlines()[-1])
    assert f["profile"] == "ci-small" and f["ranks"] == 32 and f["steps_done"] == STEPS and f["complete"]
    assert f["replicas_consistent"] and f["quorum_history_consistent"] and not f["unexpected_errors"]
    # the script's own model, not the profile's: its FSDP2 shards over 8 ranks and its FLOPs
    s = f["script"]
    assert s["api"] in ("train", "wrap") and s["num_params"] > 0 and s["flops_per_step_per_rank"] > 0
    assert s["num_params"] / 8 <= s["params_per_rank"] < s["num_params"]
    assert s["step_time_from"] == "script FLOPs / profile FLOP rate" and f["step_time_s"] >= s["step_compute_s"]
    # the kill, the restart and the rejoin
    assert f["kills"] == 1 and f["num_failures"] == 1
    assert 5 <= f["steps_committed"]["r3"] < STEPS and f["rejoin_s"] is not None
    assert f["participants_per_step"][5] == 3 and f["participants_per_step"][-1] == 4
    assert f["catchup_fetches"] >= 1 and f["catchup_bytes"] > 0 and f["catchup_sources"] >= 1
    # the exactly-once audit over every leader's records, and checkpoints to the mock object store
    assert f["exactly_once"] and f["audit_problems"] == 0
    assert f["audit_batches"] > 0 and f["duplicate_batches"] == 0 and f["skipped_batches"] == 0
    assert f["checkpoints_committed"] >= 1
    # the script saw the job's outcome through its API: its "final" event carries the steps committed
    events = [json.loads(line) for line in out.stdout.splitlines() if line.startswith('{"event"')]
    assert [e["step"] for e in events if e["event"] == "final"] == [STEPS]
    return f, events, out.stderr


@pytest.mark.timeout(180)
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("script", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_trains_every_emulated_rank_and_the_killed_replica_rejoins(script, device, tmp_path):
    trained_with_a_kill(script, tmp_path, f"--device {device}")


@pytest.mark.timeout(180)
def test_a_gpu_users_loop_trains_every_emulated_rank_and_the_killed_replica_rejoins(tmp_path):
    """tests/integration/gpu_user_loop.py: seeding of every GPU, TF32, the device's properties, the model built
    under `with torch.device("cuda:N")`, a generator on the GPU, pinned batches copied non_blocking, bf16
    autocast, CUDA events timing the step and peak memory statistics, all answered on the host."""
    f, events, stderr = trained_with_a_kill(Path(__file__).with_name("gpu_user_loop.py"), tmp_path, "--device cuda")
    assert "gpu_user_loop: Emulated H100 (shape-only), 80 GiB" in stderr  # the modeled device's properties
    assert f["script"]["api"] == "wrap"
    # its metrics after the job: the shim's device did no work and allocated nothing
    [metrics] = [e for e in events if e["event"] == "metrics"]
    assert metrics["step"] == STEPS and metrics["step_ms"] == 0.0 and metrics["peak_mem_mib"] == 0.0


@pytest.mark.timeout(120)
def test_a_bad_inject_is_refused_by_name(tmp_path):
    out = emulate(EXAMPLES[0], tmp_path, "--steps", "3", "--inject", "kill replica=9 step=1")
    assert out.returncode != 0
    assert "--inject" in out.stderr and "replica" in out.stderr


@pytest.mark.timeout(120)
def test_script_args_reach_the_script_and_size_its_model(tmp_path):
    llama = ROOT / "examples" / "train_llama_tiny.py"
    sizes = []
    for extra in ((), ("--script-args", "--dim 128 --layers 4")):
        out = emulate(llama, tmp_path, "--steps", "2", "--json", *extra)
        assert out.returncode == 0, out.stderr[-3000:]
        s = json.loads(out.stdout.strip().splitlines()[-1])["script"]
        sizes.append((s["num_params"], s["flops_per_step_per_rank"], s["step_compute_s"]))
    (n0, f0, t0), (n1, f1, t1) = sizes
    assert n1 > 4 * n0 and f1 > 4 * f0 and t1 / t0 == pytest.approx(f1 / f0)  # compute time follows the FLOPs


def test_there_are_examples():
    assert EXAMPLES


@pytest.mark.timeout(180)
def test_an_fsdp2_script_on_its_own_cuda_mesh_trains_every_emulated_rank_and_the_killed_replica_rejoins(tmp_path):
    """tests/integration/fsdp2_mesh_loop.py: init_device_mesh("cuda", (replicas, ranks per replica),
    ("replicate", "shard")), fully_shard of its blocks and root on it, new_group(backend="nccl"), is_cuda
    branches, record_stream and torch.accelerator, all answered on the host; its traced step is one rank's
    whole FSDP2 step (the one-rank mesh gathers the whole model), so its FLOPs are one rank's."""
    script = Path(__file__).with_name("fsdp2_mesh_loop.py")
    f, events, stderr = trained_with_a_kill(script, tmp_path, "--device cuda")
    assert "fsdp2_mesh_loop: cuda x 2, mesh {'replicate': 4, 'shard': 8}" in stderr
    s = f["script"]
    assert s["api"] == "wrap" and s["num_params"] == 15041 and s["params_per_rank"] == 1937  # dim-0 shards of 8
    dim, hidden, depth, micro = 32, 64, 3, 16
    matmul = dim * hidden + depth * hidden * hidden + hidden  # the Linear weights
    # forward 2 FLOPs per weight and sample; backward twice that, less the input layer's input gradient
    assert s["flops_per_step_per_rank"] == 6 * micro * matmul - 2 * micro * dim * hidden
    [metrics] = [e for e in events if e["event"] == "metrics"]
    assert metrics["step"] == STEPS and metrics["loss"] > 0


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mesh", ["default", "direct"])
def test_a_torchrun_style_fsdp2_script_trains_every_emulated_rank_and_the_killed_replica_rejoins(tmp_path, mesh):
    """tests/integration/torchrun_fsdp2_loop.py: init_process_group("nccl") from the launcher's environment,
    torch.cuda.set_device(LOCAL_RANK), and fully_shard with no mesh (FSDP2's default mesh) or on a DeviceMesh
    ("cuda", ranks) built directly; the script checks that RANK / LOCAL_RANK / WORLD_SIZE / LOCAL_WORLD_SIZE
    agree with its job.spec. Its traced step is one rank's whole FSDP2 step, as on an explicit mesh."""
    f, events, stderr = trained_with_a_kill(Path(__file__).with_name("torchrun_fsdp2_loop.py"), tmp_path,
                                            f"--mesh {mesh}")
    assert f"torchrun_fsdp2_loop: rank 0 of 1 (gloo), cuda:0, {mesh} mesh" in stderr
    s = f["script"]
    assert s["api"] == "wrap" and s["num_params"] == 10497 and s["params_per_rank"] == 1369  # dim-0 shards of 8
    dim, hidden, depth, micro = 32, 64, 2, 16
    matmul = dim * hidden + depth * hidden * hidden + hidden
    assert s["flops_per_step_per_rank"] == 6 * micro * matmul - 2 * micro * dim * hidden
    [metrics] = [e for e in events if e["event"] == "metrics"]
    assert metrics["step"] == STEPS and metrics["loss"] > 0
