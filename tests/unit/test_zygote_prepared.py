"""The zygote's prepared spares (zygote --prepare, ftrun.launch.zygote_child): a spare runs the script up
to claim() with the job's first request's argv and environment less the identity variables, then takes a
later request with the same non-identity part and becomes that rank (identity, stdio, FTRUN_FORKED_AT);
a request that differs elsewhere gets a plain child; a script that ends before claiming turns preparing
off. A plain script (no torch): fast."""

from __future__ import annotations

import json
import os

import pytest

from ftrun.env.real import RealEnv
from ftrun.launch.procs import ForkServer
from ftrun.launch.worker_env import IDENTITY_VARS
from ftrun.launch.zygote_child import template_of
from tests.unit.test_zygote_spares import zygote_family

SCRIPT = '''
import json, os, sys
from ftrun.launch.zygote_child import claim
before = {"pid": os.getpid(), "rank": os.environ.get("RANK")}  # what a prepared spare ran before its claim
if sys.argv[1:] != ["noclaim"]:
    mark = os.path.join(os.environ["MARKS"], f"{os.getpid()}.prepared")
    with open(mark + ".tmp", "w") as f:
        f.write(json.dumps(before))
    os.rename(mark + ".tmp", mark)  # whole or absent: the test polls for it
    claimed = claim()
else:
    claimed = None
print(json.dumps({"before": before, "claimed": claimed, "rank": os.environ.get("RANK"), "tag": os.environ["TAG"],
                  "argv": sys.argv[1:], "forked_at": os.environ.get("FTRUN_FORKED_AT")}), flush=True)
'''


def test_template_drops_only_the_identity_variables():
    req = {"id": 1, "argv": ["-m", "w"], "cwd": "/x", "stdout": "a.out", "stderr": "a.log",
           "env": {"RANK": "3", "MASTER_PORT": "9", "FTRUN_REPLICA_ID": "r1", "FTRUN_TOKEN": "t", "PATH": "/bin"}}
    assert template_of(req) == {"argv": ["-m", "w"], "cwd": "/x", "env": {"FTRUN_TOKEN": "t", "PATH": "/bin"}}
    other = {**req, "env": {**req["env"], "RANK": "0", "FTRUN_REPLICA_ID": "r2", "FTRUN_FORKED_AT": "1.0"}}
    assert template_of(other) == template_of(req)  # another rank of the same job: the same template
    assert {"RANK", "LOCAL_RANK", "FTRUN_REPLICA_ID", "TORCHELASTIC_RESTART_COUNT", "FTRUN_HOST_SLOT"} <= IDENTITY_VARS
    assert "FTRUN_TOKEN" not in IDENTITY_VARS and "FTRUN_NUM_REPLICAS" not in IDENTITY_VARS


class Job:
    def __init__(self, tmp_path, server: ForkServer, script) -> None:
        self.tmp, self.server, self.script, self.n = tmp_path, server, script, 0

    def start(self, argv: list[str], tag: str, rank: str):
        self.n += 1
        out = self.tmp / f"{self.n}.out"
        env = {**os.environ, "TAG": tag, "RANK": rank, "MARKS": str(self.tmp / "marks")}
        h = self.server.start([str(self.script), *argv], env=env, cwd=str(self.tmp), stdout=str(out),
                              stderr=str(self.tmp / f"{self.n}.log"))
        assert h.wait(30) == 0, (self.tmp / f"{self.n}.log").read_text()
        return h, json.loads(out.read_text().splitlines()[0])

    def prepared_pids(self, used: set[int]) -> set[int]:
        return {int(p.split(".")[0]) for p in os.listdir(self.tmp / "marks") if p.endswith(".prepared")} - used


def wait_for(env: RealEnv, what, timeout: float = 30.0):
    deadline = env.clock.now() + timeout
    while not (got := what()) and env.clock.now() < deadline:
        env.clock.sleep(0.05)
    return got


def make_server(tmp_path) -> tuple[RealEnv, ForkServer, Job, str]:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    os.makedirs(tmp_path / "marks")
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    env = RealEnv()
    server = ForkServer(env=env, script=str(script), module=False, cwd=str(tmp_path),
                        log_path=str(tmp_path / "zygote.log"), run_dir=run_dir, spares=1, prepared_spares=True)
    assert server.fallback_reason is None
    return env, server, Job(tmp_path, server, script), run_dir


@pytest.mark.timeout(60)
def test_a_prepared_spare_is_claimed_by_a_matching_request_and_becomes_its_rank(tmp_path):
    env, server, job, run_dir = make_server(tmp_path)
    try:
        first, out = job.start(["x"], tag="job", rank="0")  # the template: served by a plain spare
        assert out["claimed"] is False and out["rank"] == "0"
        used = {first.pid}
        prepared = wait_for(env, lambda: job.prepared_pids(used))  # refilled after the pause: prepared
        assert len(prepared) == 1
        pid = prepared.pop()
        before = json.loads((tmp_path / "marks" / f"{pid}.prepared").read_text())
        assert before == {"pid": pid, "rank": None}  # it ran the script without the identity variables
        h, out = job.start(["x"], tag="job", rank="5")  # another rank of the same job
        assert h.pid == pid and out["claimed"] is True
        assert out["rank"] == "5" and out["tag"] == "job" and out["argv"] == ["x"] and float(out["forked_at"]) > 0
        used.add(pid)
        h, out = job.start(["x"], tag="another job", rank="1")  # differs beyond identity: not prepared
        assert out["claimed"] is False and out["tag"] == "another job" and out["before"]["rank"] == "1"
    finally:
        server.close()
    assert zygote_family(run_dir) == []


@pytest.mark.timeout(60)
def test_a_script_that_never_claims_turns_preparing_off(tmp_path):
    env, server, job, run_dir = make_server(tmp_path)
    try:
        job.start(["noclaim"], tag="job", rank="0")  # the template: a script that ends without claim()
        log = tmp_path / "zygote.log"
        assert wait_for(env, lambda: "plain spares from now on" in log.read_text())
        _, out = job.start(["noclaim"], tag="job", rank="1")  # still served, by a plain child
        assert out["claimed"] is None and out["rank"] == "1"
    finally:
        server.close()
    assert zygote_family(run_dir) == []
