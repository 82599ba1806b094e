"""Failure-detection times against the heartbeat timeout, over real loopback sockets (issue 12).

The default suite asserts only how a failure is detected (a closed connection, a notice, an abort
request: not a timeout); how fast is measured here, where machine load cannot break a test. Each figure
is printed with its ratio to the baseline measured in the same run: the time the lighthouse takes to
declare a silent (hung) replica, i.e. the heartbeat timeout as this machine delivers it.

- lighthouse_closed_conn: a replica's connection closes; time until the lighthouse records it lost.
- ftar_peer_closed: one rank of a 4-rank FTAR ring closes mid-all-reduce; time until every survivor's
  all-reduce has failed (RecoverableError).
- hung_notice: a participant stops heartbeating; time from the lighthouse declaring it hung to the
  survivor's blocked all-reduce failing (the lighthouse's notice to the leader, the leader's abort).
- leader_request: the leader's abort request to another rank of its replica (over that rank's FTAR
  listener); time until that rank's blocked all-reduce fails.
- with --e2e: the end-to-end scenario of tests/integration/test_hung_peer_all_ranks.py (2 replicas x 2
  rank processes, both ranks of r1 SIGSTOPped): time until r0 commits alone on both ranks.

    PYTHONPATH=. .venv/bin/python benchmarks/detection.py [--repeat 5] [--heartbeat-timeout 1.0] [--e2e] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ftrun.config import LighthouseConfig, Timeouts  # noqa: E402
from ftrun.env.real import RealEnv  # noqa: E402
from ftrun.ftar.cpu_kernels import CpuKernels  # noqa: E402
from ftrun.ftar.engine import FtarConfig, FtarEngine  # noqa: E402
from ftrun.ftar.ring import RecoverableError  # noqa: E402
from ftrun.quorum.client import LighthouseClient  # noqa: E402
from ftrun.quorum.service import Lighthouse  # noqa: E402

TOKEN = "bench-token"
LONG = FtarConfig(chunk_bytes=1 << 16, num_chunks=2, timeout_s=60.0, transport="socket")


def _wait(env, cond, timeout=30.0):
    deadline = env.clock.now() + timeout
    while not cond():
        if env.clock.now() > deadline:
            raise RuntimeError("timed out waiting")
        env.clock.sleep(0.0005)


def _lost_at(lh, rid, why):
    return next((h["t"] for h in lh.history if h["event"] == "member_lost" and h["replica_id"] == rid
                 and h["why"] == why), None)


def _lighthouse(env, timeouts):
    lh = Lighthouse(env=env, config=LighthouseConfig(min_replicas=1, timeouts=timeouts), token=TOKEN)
    lh.start()
    return lh


def _client(env, lh, rid, timeouts, on_peer_hung=None):
    c = LighthouseClient(env=env, addr=lh.addr, token=TOKEN, replica_id=rid, timeouts=timeouts,
                         on_peer_hung=on_peer_hung)
    c.connect()
    return c


def hung_baseline(env, timeouts) -> float:
    """Seconds from a replica's last heartbeat to the lighthouse declaring it hung."""
    lh = _lighthouse(env, timeouts)
    try:
        conn = env.net.connect(lh.addr, timeout=5.0)
        conn.send({"type": "hello", "token": TOKEN, "replica_id": "silent"})
        conn.recv(timeout=5.0)
        last = env.clock.now()  # says nothing more: its reader's heartbeat wait starts about now
        _wait(env, lambda: _lost_at(lh, "silent", "hung") is not None)
        conn.close()
        return _lost_at(lh, "silent", "hung") - last
    finally:
        lh.stop()


def lighthouse_closed_conn(env, timeouts) -> float:
    lh = _lighthouse(env, timeouts)
    try:
        c = _client(env, lh, "r0", timeouts)
        closed = env.clock.now()
        c.close()
        _wait(env, lambda: _lost_at(lh, "r0", "lost") is not None)
        return _lost_at(lh, "r0", "lost") - closed
    finally:
        lh.stop()


def _ring(env, n):
    engs = [FtarEngine(env=env, kernels=CpuKernels(), token=TOKEN, config=LONG) for _ in range(n)]
    ring = [e.addr for e in engs]
    tasks = [env.spawn(lambda e=e, i=i: e.reconfigure(epoch=1, ring=ring, index=i), name="build")
             for i, e in enumerate(engs)]
    assert all(t.join(30.0) and t.exception is None for t in tasks)
    return engs


def _failing_all_reduce(env, eng, ended):
    def run():
        try:
            eng.all_reduce(np.ones(1 << 20, np.float32))
        except RecoverableError:
            ended.append(env.clock.now())
    return env.spawn(run, name="all-reduce")


def ftar_peer_closed(env) -> float:
    engs = _ring(env, 4)
    ended: list[float] = []
    tasks = [_failing_all_reduce(env, e, ended) for e in engs[:3]]  # rank 3 never joins
    env.clock.sleep(0.1)
    closed = env.clock.now()
    engs[3].close()
    assert all(t.join(30.0) for t in tasks) and len(ended) == 3
    for e in engs[:3]:
        e.close()
    return max(ended) - closed


def hung_notice(env, timeouts) -> float:
    """r0's leader (a client whose hung notices abort its engine) and a silent participant r1 in a
    formed quorum; r0 blocks in an all-reduce with r1's engine, which never joins."""
    lh = _lighthouse(env, timeouts)
    engs = []
    try:
        engs = _ring(env, 2)
        ended: list[float] = []
        c0 = _client(env, lh, "r0", timeouts, on_peer_hung=lambda rid, qid: engs[0].abort(1))
        silent = env.net.connect(lh.addr, timeout=5.0)
        silent.send({"type": "hello", "token": TOKEN, "replica_id": "r1"})
        silent.recv(timeout=5.0)
        silent.send({"type": "quorum", "step": 0, "commit_failed": False, "last_quorum_id": 0})
        d = c0.quorum(0)
        assert d.replica_ids == ("r0", "r1") and d.quorum_id == 1, d
        task = _failing_all_reduce(env, engs[0], ended)
        _wait(env, lambda: _lost_at(lh, "r1", "hung") is not None, timeout=60.0)
        assert task.join(30.0) and ended, "the notice did not end the all-reduce"
        silent.close()
        c0.close()
        return ended[0] - _lost_at(lh, "r1", "hung")
    finally:
        for e in engs:
            e.close()
        lh.stop()


def leader_request(env) -> float:
    """Rank 1 of replica r0 blocked in its ring with r1's rank 1 (which never joins); r0's leader sends it
    the abort request over its FTAR listener."""
    engs = _ring(env, 2)
    leader = FtarEngine(env=env, kernels=CpuKernels(), token=TOKEN, config=LONG)
    ended: list[float] = []
    task = _failing_all_reduce(env, engs[0], ended)
    env.clock.sleep(0.1)
    sent = env.clock.now()
    assert leader.send_abort(engs[0].addr, 1, timeout=5.0)
    assert task.join(30.0) and ended
    for e in (*engs, leader):
        e.close()
    return ended[0] - sent


def end_to_end() -> float:
    from tests.integration.test_hung_peer_all_ranks import run_hung_peer
    with tempfile.TemporaryDirectory() as d:
        return run_hung_peer(Path(d))["stall_s"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs per figure (the median is reported)")
    parser.add_argument("--heartbeat-timeout", type=float, default=1.0)
    parser.add_argument("--e2e", action="store_true", help="also run the 2x2-process hung-peer scenario (~1 min)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat must be >= 1, got {args.repeat}")
    if args.heartbeat_timeout <= 0.1:
        parser.error(f"--heartbeat-timeout must be above the 0.1 s heartbeat interval, got {args.heartbeat_timeout}")
    env = RealEnv()
    timeouts = Timeouts(heartbeat_interval_s=0.1, heartbeat_timeout_s=args.heartbeat_timeout, join_timeout_s=0.2)
    runs = {
        "hung_baseline": lambda: hung_baseline(env, timeouts),
        "lighthouse_closed_conn": lambda: lighthouse_closed_conn(env, timeouts),
        "ftar_peer_closed": lambda: ftar_peer_closed(env),
        "hung_notice": lambda: hung_notice(env, timeouts),
        "leader_request": lambda: leader_request(env),
    }
    ms = {name: round(1000 * statistics.median(fn() for _ in range(args.repeat)), 3) for name, fn in runs.items()}
    if args.e2e:
        ms["hung_peer_all_ranks_e2e"] = round(1000 * end_to_end(), 1)
    base = ms["hung_baseline"]
    result = {"heartbeat_timeout_ms": 1000 * args.heartbeat_timeout, "repeat": args.repeat, "ms": ms,
              "ratio_to_hung_baseline": {k: round(v / base, 5) for k, v in ms.items() if k != "hung_baseline"}}
    for name, v in ms.items():
        extra = "" if name == "hung_baseline" else f"  ({v / base:.5f} x the baseline)"
        print(f"{name:>26}: {v:10.3f} ms{extra}")
    if args.json:
        print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
