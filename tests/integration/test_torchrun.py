"""One real `torchrun` per replica plus a lighthouse (the README recipe), with the pinned torch.

Two replicas of 2 ranks each (FSDP2 inside, over torchrun's store); r1's ranks SIGKILL themselves at
step 3, torchrun restarts its worker group (TORCHELASTIC_RESTART_COUNT=1 = incarnation 1), and r1 heals
from r0 across the catch-up servers. At the end both replicas hold identical parameters per rank and the exactly-once audit holds.
Plain torchrun without ftrun's replica settings fails with the message that names what to set.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftrun.config import LighthouseConfig
from ftrun.data.audit import audit, read_log
from ftrun.data.loader_state import LoaderState
from ftrun.env.real import RealEnv
from ftrun.launch.worker_env import TORCHRUN_HELP
from ftrun.net import write_token_file
from ftrun.quorum.service import Lighthouse

pytestmark = pytest.mark.timeout(150)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
WORKER = ["-m", "ftrun.train.ft_worker", "--steps", "100000", "--step-time", "0.05", "--ftar-timeout", "3"]


def _events(path: Path) -> list[dict]:
    out = []
    for line in path.read_bytes().split(b"\n"):
        if line.startswith(b"{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # a line torn by two ranks writing at once
    return out


def _since_restart(events: list[dict]) -> list[dict]:
    """The events after the worker group's second start (rank 0's second "ready"): incarnation 1's."""
    readies = [i for i, e in enumerate(events) if e["event"] == "ready" and e["rank"] == 0]
    return events[readies[1]:] if len(readies) > 1 else []


def _wait(cond, procs, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
            raise AssertionError(f"{what}: timed out or a torchrun failed ({[p.poll() for p in procs]})")
        time.sleep(0.2)


def _killpg(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture
def lighthouse():
    # min_replicas=2: r0 waits for r1's restart, so r1 heals from it (the test ends at a step both reach)
    lh = Lighthouse(env=RealEnv(), config=LighthouseConfig(min_replicas=2), token="torchrun-token")
    lh.start()
    yield lh
    lh.stop()


@pytest.mark.torchrun  # ~65 s on 2 shared cores (6 processes importing torch, then 2 again): `make test-multihost`
def test_one_torchrun_per_replica_restarts_count_as_incarnations(lighthouse, tmp_path):
    token_file = str(tmp_path / "token")
    write_token_file(token_file, "torchrun-token")
    procs, outs = [], []
    try:
        for i in range(2):
            env = {**os.environ, "FTRUN_REPLICA_ID": f"r{i}", "FTRUN_NUM_REPLICAS": "2", "FTRUN_LIGHTHOUSE": lighthouse.addr,
                   "FTRUN_TOKEN_FILE": token_file, "FTRUN_RUN_DIR": str(tmp_path), "OMP_NUM_THREADS": "1",
                   "FTRUN_DIE_AT": "step=3,phase=exchange,replica=r1,incarnation=0"}
            env.pop("FTRUN_TOKEN", None)
            outs.append(tmp_path / f"r{i}.out")
            with open(outs[-1], "wb") as out, open(tmp_path / f"r{i}.err", "wb") as err:
                procs.append(subprocess.Popen([*TORCHRUN, "--nproc-per-node", "2", "--max-restarts", "1", *WORKER,
                                               "--stop-file", str(tmp_path / "stop")], env=env, stdout=out, stderr=err,
                                              stdin=subprocess.DEVNULL, start_new_session=True))
        heals = lambda: [e for e in _since_restart(_events(outs[1])) if e["event"] == "catchup"]  # noqa: E731
        _wait(lambda: bool(heals()), procs, 100, "r1 restarted by torchrun and caught up")
        assert (tmp_path / "audit-r1-1.jsonl").exists(), "torchrun's restart is incarnation 1"
        commits = lambda: [e for e in _events(outs[0]) + _events(outs[1]) if e["event"] == "step" and e["committed"]]  # noqa: E731
        healed_at = heals()[-1]["step"]
        _wait(lambda: len({e["step"] for e in commits() if e["step"] > healed_at}) >= 2, procs, 30, "commits after healing")
        stop = max(e["step"] for e in commits()) + 3
        (tmp_path / ".stop").write_text(str(stop))
        os.replace(tmp_path / ".stop", tmp_path / "stop")
        assert [p.wait(timeout=60) for p in procs] == [0, 0], (tmp_path / "r1.err").read_text()[-3000:]
    finally:
        for p in procs:
            _killpg(p)
    finals = {(i, e["rank"]): e for i in range(2) for e in _events(outs[i]) if e["event"] == "final"}
    assert sorted(finals) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    brief = {k: (e["step"], e["param_hash"][:12]) for k, e in finals.items()}
    for rank in (0, 1):  # the same shard of every replica is bitwise identical
        assert finals[(0, rank)]["param_hash"] == finals[(1, rank)]["param_hash"], brief
    assert len({json.dumps(e["loader_state"], sort_keys=True) for e in finals.values()}) == 1
    final = LoaderState.from_dict(finals[(0, 0)]["loader_state"])
    assert final.step == stop and final.layout.num_replicas == 2 and final.layout.ranks_per_replica == 2
    records = [r for path in sorted(tmp_path.glob("audit-*.jsonl")) for r in read_log(path.read_bytes())[0]]
    assert {p.name for p in tmp_path.glob("audit-r1-*.jsonl")} == {"audit-r1-0.jsonl", "audit-r1-1.jsonl"}
    report = audit(records, final=final)
    assert report.ok, report.summary()


def test_plain_torchrun_without_replica_settings_fails_with_what_to_set(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTRUN_")}
    done = subprocess.run([*TORCHRUN, "--nproc-per-node", "1", *WORKER[:2], "--steps", "1"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert TORCHRUN_HELP in done.stdout + done.stderr
    assert not list(tmp_path.glob("audit-*")), "it must not train"
