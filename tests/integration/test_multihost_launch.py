"""`ftrun launch --hosts FILE --host-index I` across network namespaces as hosts (root; skips cleanly
where namespaces cannot be created): the same command on each host, host 0 runs the job, hosts 1 and 2
run agents with their own output folders. Checks that the job completes with a kill injected through an
agent, and that the launcher's folder gathered every host's rank logs and audit files (the report's
exactly-once audit covers every host). Traffic only between the namespaces' own addresses."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ftrun.net import write_token_file
from tests.integration.test_launch import ROOT

pytestmark = [pytest.mark.netns, pytest.mark.timeout(240)]


def test_a_hosts_file_job_gathers_every_hosts_logs_and_audit(netns_hosts, tmp_path):
    hosts = netns_hosts(3, rate_mbit=1000)
    hosts_file = tmp_path / "hosts.txt"
    hosts_file.write_text("# three namespaces\n" + "".join(f"{h.addr}\n" for h in hosts.hosts))
    token_file = str(tmp_path / "job.token")
    write_token_file(token_file, "multihost-token")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("FTRUN_")}, "FTRUN_TOKEN_FILE": token_file,
           "PYTHONPATH": ROOT}
    common = ["--hosts", str(hosts_file), "--replicas", "2", "--min-replicas", "1", "--steps", "40", "--no-progress",
              "--kill-at", "step=10,replica=r1", "-m", "ftrun.train.ft_worker", "--step-time", "0.05",
              "--ftar-timeout", "3"]
    cli = [sys.executable, "-m", "ftrun.cli", "launch"]
    procs = []
    try:
        for i in (1, 2):
            with open(tmp_path / f"agent{i}.log", "wb") as log:
                argv = [*cli, "--host-index", str(i), "--out", str(tmp_path / f"agent{i}"), *common]
                procs.append(hosts.popen(i, argv, env=env, stdout=log, stderr=log, cwd=ROOT, start_new_session=True))
        job = hosts.popen(0, [*cli, "--host-index", "0", "--out", str(tmp_path / "job"), "--json", *common], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)
        procs.append(job)
        out, err = job.communicate(timeout=200)
        assert job.returncode == 0, out[-3000:] + err[-3000:]
        assert [p.wait(timeout=30) for p in procs[:2]] == [0, 0], "agents did not exit after the job"
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    f = json.loads(out.strip().splitlines()[-1])
    assert f["complete"] and f["hosts"] == 3 and f["failures_injected"] == 1
    assert [h["replicas"] for h in f["host_layout"]] == [[], ["r0"], ["r1"]]
    assert f["replicas_identical"] and f["duplicate_batches"] == 0 and f["skipped_batches"] == 0
    job_dir = tmp_path / "job"
    assert f["restarts"] >= 1
    # every byte a rank wrote on its host is in the launcher's folder
    for i in (1, 2):
        written = [p for p in (tmp_path / f"agent{i}" / "job" / "logs").iterdir() if p.stat().st_size]
        assert written
        for p in written:
            assert (job_dir / "logs" / p.name).read_bytes() == p.read_bytes(), p.name
    audits = sorted(p.name for p in job_dir.glob("audit-*.jsonl"))
    assert audits and set(audits) == {p.name for i in (1, 2) for p in (tmp_path / f"agent{i}" / "job").glob("audit-*")}
    # the ranks ran on their hosts: the agents' folders hold their own replica's logs only
    assert {p.name.split(".")[0] for p in (tmp_path / "agent1" / "job" / "logs").iterdir()} == {"r0"}
    assert {p.name.split(".")[0] for p in (tmp_path / "agent2" / "job" / "logs").iterdir()} == {"r1"}
