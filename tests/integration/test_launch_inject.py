"""`ftrun launch --inject` end to end on ftrun.train.ft_worker: a mid-step crash with a slow fetch (the restarted
replica's catch-up is served slowly: its fetch takes at least the delay), and a hang that is resumed (SIGSTOP,
SIGCONT; the job completes with identical replicas). Real processes, a minute or more each on 2 cores: `slow`."""

from __future__ import annotations

import json

import pytest

from tests.integration.test_launch import launch

WORKER = ["-m", "ftrun.train.ft_worker", "--step-time", "0.05"]


def events(out) -> list[dict]:
    return [json.loads(line) for line in open(out / "events.jsonl")]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_mid_step_crash_and_a_slow_fetch(tmp_path):
    f = launch(tmp_path, "--replicas", "3", "--steps", "24", "--min-replicas", "1", "--restart-delay", "0.2s",
               "--inject", "kill replica=1 step=6 at=0.5", "--inject", "slow fetch replica=1 delay=0.6",
               *WORKER, timeout=280)
    assert f["complete"] and f["failures_injected"] == 1 and f["restarts"] == 1, f
    ev = events(tmp_path)
    kill = next(e for e in ev if e["event"] == "kill")
    assert kill["replica_id"] == "r1" and kill["fault"] == "kill replica=1 step=6 at=0.5"
    rejoin = [e for e in ev if e["event"] == "catchup" and e["replica_id"] == "r1" and e["incarnation"] == 1]
    assert rejoin and rejoin[0]["seconds"] >= 0.6, rejoin
    assert any(e["event"] == "slow_fetch" and e["active"] for e in ev)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_hang_stops_the_replica_and_sigcont_resumes_it(tmp_path):
    f = launch(tmp_path, "--replicas", "2", "--steps", "30", "--min-replicas", "1", "--no-diagnose",
               "--inject", "hang replica=1 step=5 duration=1", *WORKER, timeout=280)
    assert f["complete"] and f["replicas_identical"], f
    ev = events(tmp_path)
    hang = next(e for e in ev if e["event"] == "hang")
    end = next(e for e in ev if e["event"] == "fault_end")
    assert hang["replica_id"] == end["replica_id"] == "r1" and hang["how"] == "stop" and end["how"] == "resume"
    assert 1.0 <= end["t"] - hang["t"] < 3.0
    # r1 was stopped: it made no progress in the second it was stopped
    assert not any(e["event"] == "commit" and e["replica_id"] == "r1" and hang["t"] + 0.1 < e["t"] < end["t"]
                   for e in ev)
