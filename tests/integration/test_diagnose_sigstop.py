"""Real processes: 3 replicas x 2 ranks, each rank a process running FTAR all-reduces in a loop with
telemetry and a telemetry server; one rank is SIGSTOPped mid-FTAR and the collector's verdict names it.

Run as a script (`worker` argument) it is one rank process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKEN = "sigstop-job-token"
REPLICAS, RANKS = 3, 2


def worker(replica: int, rank: int, collector: str) -> int:
    import numpy as np

    from ftrun.diagnose.collect import RankInfo, TelemetryServer
    from ftrun.diagnose.telemetry import Recorder
    from ftrun.env.real import RealEnv
    from ftrun.ftar.cpu_kernels import CpuKernels
    from ftrun.ftar.engine import FtarConfig, FtarEngine
    from ftrun.ftar.ring import RecoverableError

    env, token = RealEnv(), os.environ["FTRUN_TOKEN"]
    engine = FtarEngine(env=env, kernels=CpuKernels(), token=token,
                        config=FtarConfig(chunk_bytes=1 << 16, num_chunks=2, timeout_s=10.0, transport="socket"))
    engine.telemetry = rec = Recorder(env.clock)
    server = TelemetryServer(env=env, token=token, ranks={RankInfo(f"r{replica}/{rank}", replica, rank, f"host{replica}"): rec})
    server.start()
    server.register(collector)
    print(json.dumps({"ftar": engine.addr}), flush=True)
    ring = json.loads(sys.stdin.readline())
    engine.reconfigure(epoch=1, ring=ring, index=replica, timeout=20.0)
    print("ready", flush=True)
    buf = np.ones(1 << 20, np.float32)
    try:
        while sys.stdin.readable():
            buf[:] = 1.0
            engine.all_reduce(buf)
    except RecoverableError:
        pass
    finally:
        server.stop()
        engine.close()
    return 0


@pytest.mark.timeout(90)
def test_sigstopped_rank_is_named_by_the_collector():
    from ftrun.diagnose.analysis import AnalysisConfig
    from ftrun.diagnose.collect import Collector, CollectorConfig
    from ftrun.env.real import RealEnv

    env = RealEnv()
    collector = Collector(env=env, token=TOKEN, config=CollectorConfig(
        pull_timeout_s=0.5, analysis=AnalysisConfig(stall_s=0.5)))
    collector.start()
    procs, t0 = {}, time.monotonic()
    environ = {**os.environ, "FTRUN_TOKEN": TOKEN, "PYTHONPATH": ROOT}
    try:
        for r in range(REPLICAS):
            for g in range(RANKS):
                procs[(r, g)] = subprocess.Popen(
                    [sys.executable, __file__, "worker", str(r), str(g), collector.addr], env=environ, cwd=ROOT,
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        addrs = {k: json.loads(p.stdout.readline())["ftar"] for k, p in procs.items()}
        for (r, g), p in procs.items():
            p.stdin.write(json.dumps([addrs[(x, g)] for x in range(REPLICAS)]) + "\n")
            p.stdin.flush()
        assert all(p.stdout.readline().strip() == "ready" for p in procs.values())
        print(f"6 rank processes up and in their rings after {time.monotonic() - t0:.1f}s")
        env.clock.sleep(1.0)
        healthy = collector.diagnose()
        # no hang and nobody evicted (a 50 ms step on shared cores may show a slow rank: never evicted)
        assert healthy["kind"] not in ("hang", "candidates") and healthy["num_answered"] == 6, healthy
        assert healthy["eviction"]["replicas"] == []
        victim = procs[(1, 0)]
        victim.send_signal(signal.SIGSTOP)
        stopped, named, v = time.monotonic(), None, None
        while time.monotonic() - stopped < 40.0:  # a deadline only: the loop ends once the rank is named
            v = collector.diagnose()
            if v["ranks"] == ["r1/0"]:
                named = time.monotonic() - stopped
                break
            env.clock.sleep(0.2)
        assert named is not None, (v, _ring_table(collector))
        assert v["kind"] == "hang" and "did not answer the collector" in v["reason"], v
        print(f"SIGSTOPped rank named {named:.2f}s after the stop: {v['reason']}")
    finally:
        for p in procs.values():
            p.kill()
        for p in procs.values():
            p.wait(10)
            p.stdin.close()
            p.stdout.close()
        collector.stop()


def _ring_table(collector) -> list[dict]:
    """What the last diagnosis saw of each rank, for a failure message."""
    snap, layout = collector.last_input
    fields = ("f_qid", "f_cid", "f_state", "f_steps", "f_total", "f_recvd", "f_used", "f_sends", "f_sent")
    return [{"rank": layout.rank_name(i), "answered": bool(snap.answered[i]),
             "age_s": round(snap.now - float(row["f_last"]), 3), **{f: int(row[f]) for f in fields}}
            for i, row in enumerate(snap.summary)]


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "worker":
        sys.exit(worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))
    sys.exit("usage: test_diagnose_sigstop.py worker REPLICA RANK COLLECTOR")
