"""Diagnosis on the real path. `ftrun launch` (3 replicas x 2 ranks of ft_worker) with one rank
SIGSTOPped mid-training (rank 1 of r1: its leader stays alive, so without diagnosis its peers wait out
the FTAR timeout). The monitor beside the lighthouse names it, evicts its replica (killed and
restarted), the survivors commit again without waiting out the FTAR timeout, and the job completes;
`ftrun diagnose --lighthouse` answers with the live verdict. No timing is asserted here (see
benchmarks/diagnose_real.py for the figures). Also: the lighthouse's verdict channel and the gloo
collectives' telemetry."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from tests.integration.test_launch import ROOT, leftovers

ENV = {**os.environ, "PYTHONPATH": ROOT}


def events(out) -> list[dict]:
    try:
        with open(os.path.join(out, "events.jsonl")) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def wait_for(pred, out, proc, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        evs = events(out)
        found = pred(evs)
        if found:
            return found
        assert proc.poll() is None, f"ftrun launch exited ({proc.returncode}) before {what}"
        time.sleep(0.1)
    raise AssertionError(f"no {what} within {timeout}s; last events: {evs[-5:]}")


def diagnose(out) -> subprocess.CompletedProcess:
    addr = open(os.path.join(out, "lighthouse")).read().strip()
    return subprocess.run([sys.executable, "-m", "ftrun.cli", "diagnose", "--lighthouse", addr, "--token-file",
                           os.path.join(out, "token"), "--json"], capture_output=True, text=True, timeout=30,
                          cwd=ROOT, env=ENV)


@pytest.mark.timeout(150)
def test_a_sigstopped_rank_is_named_evicted_and_the_survivors_go_on(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "ftrun.cli", "launch", "--out", str(out), "--json", "--no-progress",
           "--replicas", "3", "--ranks-per-replica", "2", "--steps", "45", "--min-replicas", "2",
           "--timeout", "120s", "-m", "ftrun.train.ft_worker", "--step-time", "0.05"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=ENV)
    victim = None
    try:
        wait_for(lambda evs: any(e["event"] == "steady" for e in evs), out, proc, 90, "steady state")
        assert stat.S_IMODE(os.stat(out / "token").st_mode) == 0o600
        healthy = diagnose(out)
        assert healthy.returncode == 0, healthy.stderr
        v = json.loads(healthy.stdout.strip().splitlines()[-1])
        assert v["num_ranks"] == 6 and v["eviction"]["replicas"] == [], v
        page = status_page(out)  # the lighthouse's status page beside it, behind the job token
        assert all(f"<td>r{i}</td>" in page for i in range(3)) and (out / "token").read_text() not in page
        victim = next(e["pid"] for e in events(out) if e["event"] == "ready" and e["replica_id"] == "r1"
                      and e["rank"] == 1 and e["incarnation"] == 0)
        os.kill(victim, signal.SIGSTOP)
        stopped_at = time.monotonic()
        evict = wait_for(lambda evs: next((e for e in evs if e["event"] == "evict"), None), out, proc, 60, "eviction")
        assert evict["replica_id"] == "r1" and evict["incarnation"] == 0, evict
        wait_for(lambda evs: {e["replica_id"] for e in evs if e["event"] == "commit" and e["t"] > evict["t"]}
                 >= {"r0", "r2"}, out, proc, 60, "survivors' commit after the eviction")
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for p in leftovers(str(out)):
            p.kill()
    assert proc.returncode == 0, stdout[-2000:] + stderr[-3000:]
    f = json.loads(stdout.strip().splitlines()[-1])
    assert f["complete"] and f["diagnosis"]["evictions"][0]["replica_id"] == "r1", f["diagnosis"]
    named = [e for e in events(out) if e["event"] == "verdict" and "r1/1" in e["ranks"] + e["silent"]]
    assert named and named[0]["kind"] == "hang" and named[0]["t"] >= stopped_at - 0.1, named
    print(f"SIGSTOP -> named {named[0]['t'] - stopped_at:.2f}s, evicted {evict['t'] - stopped_at:.2f}s")
    kills = [e for e in events(out) if e["event"] == "kill"]
    assert [(k["replica_id"], k["why"]) for k in kills] == [("r1", "evicted")], kills  # nobody else
    assert any(e["event"] == "commit" and e["replica_id"] == "r1" and e["incarnation"] == 1 for e in events(out))
    report = json.load(open(out / "report.json"))
    assert report["diagnosis_report"]["evictions"][0]["incarnation"] == 0
    drawn = report["diagnosis"]["graph"]  # the last naming verdict's wait-for graph, as the status page draws it
    assert drawn["verdict"]["kind"] != "no_hang" and any(n["kind"] in ("culprit", "candidate")
                                                         for n in drawn["nodes"]), drawn
    trace = json.load(open(out / "trace.json"))["traceEvents"]  # and in the Perfetto trace
    hung = [e for e in trace if e["name"] == "verdict: hang" and "r1/1" in e["args"]["ranks"] + e["args"]["silent"]]
    assert hung and any(n["kind"] == "culprit" for n in hung[0]["args"]["graph"]["nodes"]), hung


def status_page(out) -> str:
    import urllib.request

    url = (out / "status").read_text().strip()
    token = (out / "token").read_text().strip()
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read().decode()


@pytest.mark.timeout(30)
def test_the_lighthouse_answers_verdicts_with_the_token_only_and_says_when_no_monitor_runs():
    from ftrun.config import LighthouseConfig
    from ftrun.diagnose.collect import DiagnoseError, request
    from ftrun.env.real import RealEnv
    from ftrun.quorum.service import Lighthouse

    env = RealEnv()
    lh = Lighthouse(env=env, token="tok", config=LighthouseConfig(min_replicas=1))
    lh.start()
    try:
        with pytest.raises(DiagnoseError, match="no diagnosis runs beside this lighthouse"):
            request(env, lh.addr, {"type": "verdict", "token": "tok"}, 5.0)
        lh.diagnosis = lambda: {"kind": "no_hang", "reason": "fine", "ranks": []}
        with pytest.raises(DiagnoseError, match="wrong job token"):
            request(env, lh.addr, {"type": "verdict", "token": "nope"}, 5.0)
        reply = request(env, lh.addr, {"type": "verdict", "token": "tok"}, 5.0)
        assert reply == {"type": "verdict", "kind": "no_hang", "reason": "fine", "ranks": []}
        lh.evict(("r9",), "unknown replica: a no-op")
        assert lh.status()["live"] == [] and lh.failed is None
    finally:
        lh.stop()


@pytest.mark.timeout(60)
def test_gloo_collectives_are_recorded_entered_sent_and_done():
    import torch.distributed as dist

    from ftrun.diagnose.summary import summarize
    from ftrun.diagnose.telemetry import Ev
    from ftrun.diagnose.telemetry import Recorder
    from ftrun.env.real import RealEnv
    from ftrun.replica.comm import GlooComm

    comm = GlooComm(store=dist.HashStore(), prefix="t/", rank=0, world_size=1, timeout_s=10.0, bind_host="127.0.0.1")
    rec = comm.telemetry = Recorder(RealEnv().clock)
    assert comm.all_reduce_int([3], "max") == [3]
    assert comm.broadcast_bytes(b"hi") == b"hi"
    got = rec.records()
    assert list(got["ev"][:3]) == [Ev.ENTER, Ev.SEND, Ev.DONE] and list(got["cid"][:3]) == [1, 1, 1]
    s, _ = summarize(got, 0.0)
    assert s["t_ev"][0] == Ev.DONE and s["t_cid"][0] == got["cid"].max()
    comm.close()
