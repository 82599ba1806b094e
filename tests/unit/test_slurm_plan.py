"""The Slurm path's pure parts: batch scripts, the SLURM_* mapping, incarnations, the step decision."""

from __future__ import annotations

import argparse
import os
import shlex

import pytest

from ftrun.launch import slurm
from ftrun.launch.slurm_plan import (SLURM_HELP, SlurmJobPlan, StepAction, incarnation, lighthouse_script,
                                     replica_script, resolve_host, srun_command, step_decision, task_environ)
from ftrun.launch.worker_env import WorkerSpec


def _plan(**kw) -> SlurmJobPlan:
    base = dict(replicas=3, ranks_per_replica=4, command=("/venv/bin/python", "-m", "ftrun.train.ft_worker",
                                                             "--steps", "10"),
                python="/venv/bin/python", run_dir="/shared/run", token_file="/shared/run/token", workdir="/home/u")
    return SlurmJobPlan(**{**base, **kw})


def _sbatch_options(script: str) -> list[str]:
    return [line.split(" ", 1)[1] for line in script.splitlines() if line.startswith("#SBATCH ")]


def _exports(script: str) -> dict[str, str]:
    out = {}
    for line in script.splitlines():
        if line.startswith("export "):
            key, _, value = line[len("export "):].partition("=")
            out[key] = shlex.split(value)[0]
    return out


def test_replica_script_is_one_requeueable_job_of_the_replicas_ranks():
    script = replica_script(_plan(partition="gpu", time_limit="1-00:00:00",
                                  sbatch_args=("--gpus-per-task=1",)), 2)
    assert script.startswith("#!/bin/bash\n")
    assert _sbatch_options(script) == [
        "--job-name=ftrun-r2", "--nodes=1", "--ntasks=4", "--requeue", "--open-mode=append",
        "--output=/shared/run/slurm/r2-%j.out", "--chdir=/home/u", "--partition=gpu", "--time=1-00:00:00",
        "--gpus-per-task=1"]
    assert _exports(script) == {
        "FTRUN_REPLICA_ID": "r2", "FTRUN_NUM_REPLICAS": "3", "FTRUN_TOKEN_FILE": "/shared/run/token",
        "FTRUN_RUN_DIR": "/shared/run", "FTRUN_SLURM_MAX_RESTARTS": "3", "FTRUN_SLURM_MAX_REQUEUES": "1",
        "FTRUN_BIND_HOST": "@node",
        "FTRUN_SLURM_LIGHTHOUSE_FILE": "/shared/run/slurm/lighthouse.addr"}
    assert "unset FTRUN_TOKEN\n" in script  # only the 0600 file carries the token
    last = shlex.split(script.strip().splitlines()[-1])
    assert last == ["exec", "/venv/bin/python", "-m", "ftrun.launch.slurm", "replica", "--done-file",
                    "/shared/run/slurm/r2.done", "--", "/venv/bin/python", "-m", "ftrun.train.ft_worker",
                    "--steps", "10"]


def test_an_existing_lighthouse_means_no_lighthouse_job():
    plan = _plan(lighthouse="10.0.0.1:29510")
    assert _exports(replica_script(plan, 0))["FTRUN_LIGHTHOUSE"] == "10.0.0.1:29510"
    assert "FTRUN_SLURM_LIGHTHOUSE_FILE" not in _exports(replica_script(plan, 0))
    with pytest.raises(ValueError, match="existing lighthouse"):
        lighthouse_script(plan)


def test_lighthouse_script_waits_for_every_replica():
    script = lighthouse_script(_plan(min_replicas=2))
    assert "--ntasks=1" in _sbatch_options(script) and "--requeue" in _sbatch_options(script)
    words = shlex.split(script.strip().splitlines()[-1])
    assert words[words.index("--min-replicas") + 1] == "2"
    assert [words[i + 1] for i, w in enumerate(words) if w == "--done-file"] == [
        f"/shared/run/slurm/r{i}.done" for i in range(3)]
    assert _exports(script) == {"FTRUN_TOKEN_FILE": "/shared/run/token", "FTRUN_BIND_HOST": "@node"}


def test_arguments_with_shell_characters_stay_one_word():
    plan = _plan(command=("/venv/bin/python", "/home/u/train.py", "--name", "a b; rm -rf $HOME"))
    assert shlex.split(replica_script(plan, 0).strip().splitlines()[-1])[-1] == "a b; rm -rf $HOME"


@pytest.mark.parametrize("kw, what", [
    (dict(replicas=0), "--replicas"), (dict(ranks_per_replica=0), "--ranks-per-replica"),
    (dict(nodes_per_replica=5), "every node needs a rank"), (dict(max_restarts=-1), "--max-restarts"),
    (dict(max_requeues=-1), "--max-requeues"),
    (dict(min_replicas=4), "--min-replicas"), (dict(partition="gpu\n#SBATCH --x"), "--partition"),
    (dict(time_limit="1h"), "--time"), (dict(command=()), "no training script"),
    (dict(sbatch_args=("-N 2",)), "--sbatch-arg"), (dict(sbatch_args=("--a=1\n--b",)), "--sbatch-arg"),
    (dict(run_dir="relative"), "absolute"), (dict(run_dir="/with space"), "whitespace"),
])
def test_bad_plans_name_what_is_wrong(kw, what):
    with pytest.raises(ValueError, match=what):
        _plan(**kw)
    with pytest.raises(ValueError, match="outside"):
        replica_script(_plan(), 3)


def test_incarnations_grow_with_step_restarts_and_requeues_and_never_repeat():
    seen = [incarnation(restarts, attempt, 3) for restarts in range(4) for attempt in range(4)]
    assert seen == list(range(16))
    assert incarnation(0, 0, 0) == 0 and incarnation(2, 0, 0) == 2
    for bad in ((0, 4, 3), (-1, 0, 3), (0, -1, 3), (0, 0, -1)):
        with pytest.raises(ValueError):
            incarnation(*bad)


@pytest.mark.parametrize("returncode, attempt, stopping, requeues, action, reason", [
    (0, 0, False, 0, StepAction.DONE, "exited 0"),
    (0, 3, True, 0, StepAction.DONE, "exited 0"),
    (137, 0, False, 0, StepAction.RESTART, "restart 1 of 3"),
    (1, 2, False, 0, StepAction.RESTART, "restart 3 of 3"),
    (1, 3, False, 0, StepAction.REQUEUE, "requeue 1 of 1"),  # restarts used up: a new allocation
    (1, 3, False, 1, StepAction.FAIL, "all 3 restarts and 1 requeues used"),
    (143, 0, True, 0, StepAction.FAIL, "stops or requeues"),  # scancel / requeue from outside: Slurm decides
    (143, 3, True, 0, StepAction.FAIL, "stops or requeues"),
])
def test_step_decision(returncode, attempt, stopping, requeues, action, reason):
    decision = step_decision(returncode, attempt, 3, stopping=stopping, requeues=requeues, max_requeues=1)
    assert decision.action is action and reason in decision.reason
    assert step_decision(1, 3, 3, stopping=False).action is StepAction.FAIL  # no requeues by default


SLURM_TASK = {"FTRUN_REPLICA_ID": "r1", "FTRUN_NUM_REPLICAS": "3", "FTRUN_TOKEN": "tok",
              "FTRUN_SLURM_MAX_RESTARTS": "3", "FTRUN_SLURM_ATTEMPT": "1", "SLURM_RESTART_COUNT": "2",
              "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
              "SLURM_JOB_ID": "4242", "SLURMD_NODENAME": "node07", "MASTER_ADDR": "node06", "MASTER_PORT": "40123",
              "FTRUN_LIGHTHOUSE": "10.0.0.1:29510", "FTRUN_BIND_HOST": "@node", "FTRUN_RUN_DIR": "/shared/run"}


def test_slurm_task_maps_onto_the_torchrun_names_worker_spec_reads():
    extra = task_environ(SLURM_TASK)
    assert extra == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "GROUP_RANK": "1",
                     "TORCHELASTIC_RESTART_COUNT": str(2 * 4 + 1), "MASTER_ADDR": "node06", "MASTER_PORT": "40123",
                     "TORCHELASTIC_USE_AGENT_STORE": "True", "FTRUN_LIGHTHOUSE": "10.0.0.1:29510", "FTRUN_BIND_HOST": "node07", "FTRUN_SLURM_JOB_ID": "4242"}
    spec = WorkerSpec.from_environ({**SLURM_TASK, **extra})
    assert (spec.replica_id, spec.replica_index, spec.num_replicas) == ("r1", 1, 3)
    assert (spec.rank, spec.ranks_per_replica, spec.incarnation) == (5, 8, 9)
    assert (spec.store_addr, spec.store_port, spec.lighthouse) == ("node06", 40123, "10.0.0.1:29510")
    assert spec.net.bind_host == "node07" and spec.run_dir == "/shared/run"


def test_a_first_run_has_no_restart_count_and_an_explicit_bind_host_stays():
    env = {**SLURM_TASK, "FTRUN_SLURM_ATTEMPT": "0", "FTRUN_BIND_HOST": "10.1.2.3"}
    del env["SLURM_RESTART_COUNT"]
    extra = task_environ(env)
    assert extra["TORCHELASTIC_RESTART_COUNT"] == "0" and extra["FTRUN_BIND_HOST"] == "10.1.2.3"


@pytest.mark.parametrize("drop, what", [
    ("FTRUN_REPLICA_ID", "FTRUN_REPLICA_ID"), ("FTRUN_NUM_REPLICAS", "FTRUN_NUM_REPLICAS"),
    ("SLURM_PROCID", "SLURM_PROCID is not set"), ("SLURM_NTASKS", "SLURM_NTASKS"),
    ("MASTER_ADDR", "MASTER_ADDR"), ("FTRUN_SLURM_ATTEMPT", "FTRUN_SLURM_ATTEMPT"),
    ("FTRUN_LIGHTHOUSE", "FTRUN_LIGHTHOUSE"), ("SLURMD_NODENAME", "SLURMD_NODENAME"),
])
def test_missing_settings_name_what_to_set(drop, what):
    env = {k: v for k, v in SLURM_TASK.items() if k != drop}
    with pytest.raises(ValueError, match=what):
        task_environ(env)


def test_bad_values_name_the_variable():
    with pytest.raises(ValueError, match="SLURM_PROCID='x'"):
        task_environ({**SLURM_TASK, "SLURM_PROCID": "x"})
    with pytest.raises(ValueError, match="outside SLURM_NTASKS"):
        task_environ({**SLURM_TASK, "SLURM_PROCID": "8"})
    assert SLURM_HELP in str(pytest.raises(ValueError, task_environ, {"SLURM_PROCID": "0"}).value)
    assert resolve_host("10.0.0.2", {}) == "10.0.0.2"


def test_srun_runs_every_task_of_the_allocation_through_the_mapping():
    cmd = srun_command({"SLURM_NTASKS": "8", "SLURM_JOB_NUM_NODES": "2"}, ["/venv/bin/python", "t.py"],
                       "/venv/bin/python")
    assert cmd == ["srun", "--kill-on-bad-exit=1", "--ntasks=8", "--nodes=2", "/venv/bin/python", "-m",
                   "ftrun.launch.slurm", "task", "--", "/venv/bin/python", "t.py"]
    with pytest.raises(ValueError, match="SLURM_NTASKS"):
        srun_command({}, ["x"], "/p")


def _submit_args(tmp_path, **kw) -> argparse.Namespace:
    base = dict(replicas=2, ranks_per_replica=2, nodes_per_replica=1, partition=None, time_limit=None, max_restarts=3,
                max_requeues=1, min_replicas=None, run_dir=str(tmp_path / "run"), bind_host="@node", lighthouse=None, sbatch_arg=[],
                dry_run=True, json=True, module=True, script="ftrun.train.ft_worker", script_args=["--steps", "5"],
                slurm_command="submit")
    return argparse.Namespace(**{**base, **kw})


def test_submit_dry_run_writes_the_scripts_and_a_0600_token(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("FTRUN_TOKEN_FILE", raising=False)
    monkeypatch.setenv("FTRUN_TOKEN", "the-job-token")
    assert slurm.run(_submit_args(tmp_path)) == 0
    run = tmp_path / "run"
    assert sorted(p.name for p in (run / "slurm").glob("*.sbatch")) == ["lighthouse.sbatch", "r0.sbatch", "r1.sbatch"]
    assert (run / "token").read_text().strip() == "the-job-token"
    assert os.stat(run / "token").st_mode & 0o777 == 0o600
    for p in (run / "slurm").glob("*.sbatch"):
        assert "the-job-token" not in p.read_text()
    assert '"submitted": false' in capsys.readouterr().out.strip().splitlines()[-1]


def test_submit_refuses_a_readable_token_file(tmp_path, monkeypatch, capsys):
    token = tmp_path / "tok"
    token.write_text("t\n")
    os.chmod(token, 0o644)
    monkeypatch.setenv("FTRUN_TOKEN_FILE", str(token))
    assert slurm.run(_submit_args(tmp_path)) == 2
    assert "chmod 600" in capsys.readouterr().err


def test_submit_without_sbatch_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("FTRUN_TOKEN_FILE", raising=False)
    monkeypatch.setattr(slurm, "SBATCH", str(tmp_path / "no-sbatch"))
    assert slurm.run(_submit_args(tmp_path, dry_run=False)) == 1
    assert "sbatch not found" in capsys.readouterr().err


def test_task_wrapper_without_slurm_names_what_to_set(monkeypatch, capsys):
    for k in list(os.environ):
        if k.startswith(("SLURM", "FTRUN_")):
            monkeypatch.delenv(k)
    assert slurm.run(argparse.Namespace(slurm_command="task", command=["--", "true"])) == 2
    assert "FTRUN_REPLICA_ID" in capsys.readouterr().err


def test_a_rank_under_plain_srun_names_what_to_set():
    with pytest.raises(ValueError, match="started by Slurm without ftrun's replica settings") as e:
        WorkerSpec.from_environ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "7"})
    assert SLURM_HELP in str(e.value)


def test_cli_bad_flags_exit_2_naming_the_flag(tmp_path, monkeypatch, capsys):
    from ftrun.cli import main

    monkeypatch.delenv("FTRUN_TOKEN_FILE", raising=False)
    argv = ["slurm", "submit", "--replicas", "0", "--ranks-per-replica", "2", "--run-dir", str(tmp_path / "run"),
            "--dry-run", "-m", "ftrun.train.ft_worker"]
    assert main(argv) == 2
    assert "--replicas must be >= 1" in capsys.readouterr().err
    assert main([*argv[:3], "2", *argv[4:-2], str(tmp_path / "missing.py")]) == 2
    assert "not found" in capsys.readouterr().err
