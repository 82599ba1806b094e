"""`ftrun emulate`: the default run (ci-small, one replica kill and its rejoin) end to end, its report
and files, determinism, and the emulated runtime's behaviour around the failure."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import cli
from harness.profile import apply_overrides, load_profile
from harness.run import JobOptions, Kill, parse_inject, split_faults

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"steps_committed", "get_quorum_p50_ms", "get_quorum_p99_ms", "stall_per_failure_s", "rejoin_stall_s",
        "effective_training_time", "wall_s", "peak_rss_mb", "ranks"}


def ci_small(*overrides):
    return apply_overrides(load_profile("ci-small"), list(overrides))


@pytest.mark.timeout(120)
def test_default_run_kills_a_replica_and_it_rejoins(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "ftrun.cli", "emulate", "--json", "--no-progress", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=110, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    f = json.loads(proc.stdout.strip().splitlines()[-1])
    assert KEYS <= f.keys()
    assert f["profile"] == "ci-small" and f["ranks"] == 32 and f["complete"] and f["steps_done"] == 10
    assert f["injected"] == ["kill replica=1 step=3 at=0 hosts=relaunch"] and f["kills"] == f["num_failures"] == 1
    parts = f["participants_per_step"]
    assert parts[:3] == [4, 4, 4] and min(parts) == 3 and parts[-1] == 4  # a dip, then the rejoin
    assert f["steps_committed"]["r1"] < 10 and f["unexpected_errors"] == []
    # killed at the step boundary: the survivors lose no work, only the quorum and ring rebuild
    assert 0 < f["stall_per_failure_s"] < f["step_time_s"] and f["detection_s"] < 0.01
    assert f["rejoin_s"] > 0 and f["rejoin_stall_s"] is not None
    assert 0.5 < f["effective_training_time"] < 1.0
    assert f["get_quorum_p50_ms"] <= f["get_quorum_p99_ms"] < 1000
    assert "stall per failure" in proc.stdout and "get_quorum p50" in proc.stdout
    for name in ("report.png", "quorum_latency.png", "events.jsonl", "trace.json", "report.json"):
        assert (tmp_path / name).stat().st_size > 0
    trace = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    names = {e["name"] for e in trace}
    assert {"ftrun::replica::start_step", "ftrun::ftar::all_reduce", "ftrun::replica::should_commit",
            "ftrun::train::forward_backward", "kill", "restart", "step 2"} <= names
    assert any(n.startswith("quorum ") for n in names)  # the lighthouse's decisions, as in `ftrun launch`'s trace


def _figures(seed, **options):
    profile = ci_small()
    kills = (Kill(1, at_step=3),)
    f, job = cli.execute(profile, JobOptions(steps=profile.train.steps, kills=kills, seed=seed, **options))
    return {k: v for k, v in f.items() if k not in ("wall_s", "cpu_s", "peak_rss_mb")}, job


def test_same_seed_same_report():
    a, _ = _figures(3)
    b, _ = _figures(3)
    assert a == b


def test_every_rank_runs_the_real_manager_and_the_engine_shows_it():
    f, job = _figures(0)
    # check-in, decision broadcasts and commit votes for all 32 ranks; FTAR chunks on the lead rings
    assert f["engine"]["frames"] > 1000 and f["engine"]["tasks_spawned"] > 32 * 2
    assert f["shape_propagations"] == 1  # one layout, shapes propagated once for all ranks
    assert len(job.recorder.start_step_s) >= 32 * 8  # every rank of every live replica, every step


def test_a_kill_mid_step_breaks_the_ring_and_the_survivors_retrain_the_step():
    profile = ci_small()
    f, job = cli.execute(profile, JobOptions(steps=8, kills=(parse_inject("kill replica=2 step=3 at=0.5"),)))
    assert f["complete"] and f["unexpected_errors"] == []
    aborted = {e["replica_id"] for e in job.recorder.events if e["event"] == "abort"}
    assert aborted == {"r0", "r1", "r3"}  # every survivor's all-reduce failed: nobody half-applied the step
    step = f["step_time_s"]
    assert 0.9 * step < f["stall_per_failure_s"] <= step + f["detection_s"] + 0.05  # one step + detection


def test_a_joiner_waits_out_a_step_longer_than_the_ftar_timeout():
    """Found by the crusoe-300 scale run: a healed replica enters the all-reduce at once and waits for the
    healthy replicas to finish computing. With 3 s steps and a 2 s FTAR timeout it used to time out on
    every rejoin attempt (it dropped out, came back behind, and failed again)."""
    profile = apply_overrides(ci_small(), ["train.step_compute_s=3"])
    f, job = cli.execute(profile, JobOptions(steps=8, kills=(parse_inject("kill replica=2 step=2"),)))
    assert f["complete"] and f["unexpected_errors"] == [] and f["replicas_consistent"]
    assert f["participants_per_step"][-1] == 4 and f["steps_committed"]["r2"] >= 4
    assert not [e for e in job.recorder.events if e["event"] == "abort"]  # nobody's step failed
    assert f["rejoin_stall_s"] <= 0.1


def test_the_emulated_job_runs_the_profiles_checkpoint_and_catchup_configs():
    """[checkpoint] and [catchup] are the runtime's configs: the emulated trainer writes checkpoints at that
    cadence (none without the table) and fetches the joiner's state in shards of that size."""
    kill = (parse_inject("kill replica=1 step=2"),)
    f, job = cli.execute(ci_small("checkpoint.every_steps=3", "catchup.max_shard_bytes=65536"),
                         JobOptions(steps=7, kills=kill))
    assert f["complete"] and f["checkpoints_committed"] == 2 and f["catchup_fetches"] == 1  # steps 3 and 6
    assert job.catchup_config.max_shard_bytes == 65536 and job.catchup_config.timeouts == job.timeouts
    f, job = cli.execute(ci_small("checkpoint=none"), JobOptions(steps=7, kills=kill))
    assert f["complete"] and f["checkpoints_committed"] == 0 and f["catchup_fetches"] == 1
    assert job.catchup_config.max_shard_bytes != 65536  # no [catchup]: about 8 shards per rank


def test_a_checkpoint_write_longer_than_the_ftar_timeout_no_longer_drops_the_writer():
    """design-4k's step-47 stall in small: the writer's checkpoint (339,456 B per rank at 100 kB/s, ~3.4 s)
    outlasts ci-small's 2 s FTAR timeout. Written inside the step (async_write=false), the other replicas
    give up on the writer, drop it, and the retried step's new writer is dropped the same way; written in
    the background, every replica trains every step and the checkpoint commits while they do."""
    def job(async_write):
        profile = ci_small("checkpoint.every_steps=3", f"checkpoint.async_write={async_write}", "failures.mode=none",
                           "storage.checkpoint_bandwidth_bytes_per_s=1e5", "storage.checkpoint_stage_bytes_per_s=1e6")
        f, job = cli.execute(profile, JobOptions(steps=8))
        assert f["complete"] and f["unexpected_errors"] == []
        return f, [e for e in job.recorder.events if e["event"].startswith("checkpoint") or e["event"] == "abort"]

    f, events = job("false")
    assert min(f["participants_per_step"]) == 3 and f["steps_committed"]["r0"] == 8  # r0 dropped at step 3
    dropped = [(e["replica_id"], e["step"]) for e in events if e["event"] == "abort"]
    assert {("r1", 3), ("r2", 3), ("r3", 3)} <= set(dropped)  # their FTAR timed out on the writer r0 ...
    assert ("checkpoint", "r1", 3) in [(e["event"], e["replica_id"], e["step"]) for e in events]  # ... then on r1

    f, events = job("true")
    assert f["participants_per_step"] == [4] * 8 and not [e for e in events if e["event"] == "abort"]
    assert [(e["event"], e["replica_id"], e["step"]) for e in events] == [
        ("checkpoint_staged", "r0", 3), ("checkpoint_skipped", "r0", 6), ("checkpoint", "r0", 3)]
    staged, _, written = events
    assert staged["seconds"] == pytest.approx(339_456 / 1e6)  # the host copy, the only part the step waits for
    assert written["seconds"] > 2.0  # the write outlasts the FTAR timeout, off the step
    assert f["checkpoints_committed"] == 1


def test_a_writer_killed_mid_write_leaves_no_manifest_and_the_next_writer_takes_over():
    """r0 stages the checkpoint of step 3 and is killed at step 5, its write (~2.4 s) still running: no
    manifest for step 3; the quorum without r0 elects r1, whose checkpoint of step 6 commits."""
    profile = ci_small("checkpoint.every_steps=3", "failures.mode=none",
                       "storage.checkpoint_bandwidth_bytes_per_s=1.4e5")
    f, job = cli.execute(profile, JobOptions(steps=9, kills=(parse_inject("kill replica=0 step=5"),)))
    assert f["complete"] and f["unexpected_errors"] == []
    events = [(e["event"], e["replica_id"], e["step"]) for e in job.recorder.events
              if e["event"].startswith("checkpoint")]
    assert events == [("checkpoint_staged", "r0", 3), ("checkpoint_staged", "r1", 6), ("checkpoint", "r1", 6)]
    manifests = [k for k in job.checkpoint_storage.keys() if k.endswith("manifest.json")]
    assert manifests == ["ckpt/step-00000006/manifest.json"]


def test_full_ftar_detail_runs_every_ring():
    f, job = _figures(0, ftar_detail="full")
    assert f["complete"] and f["ftar"].startswith("full") and f["unexpected_errors"] == []
    folded, _ = _figures(0)
    assert f["engine"]["frames"] > folded["engine"]["frames"]  # four rings per replica instead of one host's two


def test_a_lost_host_set_is_replaced_from_spares():
    profile = ci_small("spares.hot_spare_hosts=4", "topology.buildings=3")
    kills = (parse_inject("kill replica=2 step=2 hosts=replace"),)
    f, job = cli.execute(profile, JobOptions(steps=8, kills=kills))
    assert f["complete"] and job.scheduler.history[0].kind == "hot"
    restarted = [e for e in job.recorder.events if e["event"] == "allocated"]
    assert restarted and restarted[0]["allocation"] == "hot"


@pytest.mark.timeout(120)
def test_a_host_lost_for_good_ends_with_the_job():
    """`cut` without duration=: the replica's hosts stay silent; the others train on and the job ends
    (its frozen tasks die at the teardown, as a stopped process dies of SIGKILL)."""
    kills, faults = split_faults([parse_inject("cut replica=1 step=3")])
    f, job = cli.execute(ci_small(), JobOptions(steps=10, kills=kills, faults=faults))
    assert f["steps_done"] == 10 and f["replicas_consistent"] and f["unexpected_errors"] == []
    assert f["steps_committed"]["r1"] == 3 and f["steps_committed"]["r0"] == 10


def test_a_kill_by_time_and_a_cold_allocation():
    profile = ci_small("spares.cold_spare_hosts=4", "topology.buildings=3")
    kills = (parse_inject("kill replica=0 time=1.2 hosts=replace"),)
    f, job = cli.execute(profile, JobOptions(steps=12, kills=kills))
    assert f["complete"] and job.scheduler.history[0].kind == "cold"


def test_parse_inject():
    k = parse_inject("kill replica=3 step=5")
    assert (k.replica, k.at_step, k.at_fraction, k.hosts) == (3, 5, 0.0, "relaunch")
    assert parse_inject("kill replica=3 step=5 at=0.5").at_fraction == 0.5
    assert parse_inject(" kill replica=0 time=2.5 ").at_s == 2.5
    for bad in ("kill replica=1", "kill step=3", "explode replica=1 step=2", "kill replica=1 step=2 at=1.5",
                "kill replica=1 step=2 when=now"):
        with pytest.raises(ValueError):
            parse_inject(bad)


def test_sweep_prints_latency_against_scale(capsys):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--sweep", "ranks=16,64", "--steps", "2", "--no-progress", "--json"])
    assert cli.run(args) == 0
    out = capsys.readouterr().out
    rows = json.loads(out.strip().splitlines()[-1])["sweep"]
    assert [r["ranks"] for r in rows] == [16, 64] and all(r["get_quorum_p50_ms"] > 0 for r in rows)
    assert cli.parse_sweep("ranks=1k,98k") == [1000, 98000]
    assert cli.sweep_layout(load_profile("meta-98k"), 98000) == 8192


def test_emulate_runs_a_script_under_the_shadow_loader(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("import torch\nfrom ftrun.ftar.cuda_kernels import CudaKernels\n"
                      "print('gpus', torch.cuda.device_count(), type(CudaKernels()).__module__)\n")
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.run(parser.parse_args([str(script), "--profile", "meta-98k"])) == 0
    assert "gpus 8 ftrun.ftar.cuda_kernels" in capsys.readouterr().out
