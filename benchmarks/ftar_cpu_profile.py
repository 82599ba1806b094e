"""Where an FTAR all-reduce's wall time goes on this machine, next to gloo's, in the same processes.

P processes on 127.0.0.1 each build a gloo group and one FTAR ring over sockets per socket_io ("blocking",
"threads"), then alternate the all-reduces iteration by iteration (same load for all). Per
all-reduce and rank: wall seconds, CPU seconds (user + system, every thread; and the system part: the
kernel's socket copies and TCP), voluntary context switches,
and run-queue wait (seconds the process's threads were runnable but not running, /proc/*/schedstat).
On a shared machine, wall = CPU + run-queue wait + sleep; this shows which one dominates.

    python benchmarks/ftar_cpu_profile.py --procs 2 --size-mb 64 --iters 5 [--chunk-kb 256 --chunks 2] [--json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np

from ftrun.config import FtarConfig

SOCKET_IO = ("blocking", "threads")
VARIANTS = (*SOCKET_IO, "gloo")


def _usage() -> tuple[float, float, int, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    wait = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                wait += int(f.read().split()[1])
        except OSError:
            pass  # the thread ended meanwhile
    return r.ru_utime + r.ru_stime, r.ru_stime, r.ru_nvcsw, wait / 1e9


def worker(port: int, procs: int, rank: int, size: int, iters: int, chunk_bytes: int, num_chunks: int) -> None:
    import torch
    import torch.distributed as dist

    from ftrun.env.real import RealEnv
    from ftrun.ftar.cpu_kernels import CpuKernels
    from ftrun.ftar.engine import FtarEngine

    env = RealEnv()
    store = dist.TCPStore("127.0.0.1", port, procs + 1, False, timeout=datetime.timedelta(seconds=120))
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, procs, datetime.timedelta(seconds=120))
    engines = {io: FtarEngine(env=env, kernels=CpuKernels(), token="profile",
                              config=FtarConfig(timeout_s=120.0, transport="socket", socket_io=io,
                                                chunk_bytes=chunk_bytes, num_chunks=num_chunks))
               for io in SOCKET_IO}
    for io, engine in engines.items():
        store.set(f"{io}/{rank}", engine.addr)
    for io, engine in engines.items():
        ring = [store.get(f"{io}/{r}").decode() for r in range(procs)]
        engine.reconfigure(epoch=1, ring=ring, index=rank)
    source = np.random.default_rng(rank).standard_normal(size // 4).astype(np.float32)
    buf = torch.empty(size // 4, dtype=torch.float32)
    arr = buf.numpy()
    run = {io: engine.all_reduce for io, engine in engines.items()}
    run["gloo"] = lambda _: gloo.allreduce([buf]).wait()
    got: dict[str, list] = {v: [] for v in VARIANTS}
    for i in range(iters + 1):
        for v in VARIANTS:
            np.copyto(arr, source)
            gloo.barrier().wait()
            c0, k0, s0, w0 = _usage()
            t0 = time.perf_counter()
            run[v](arr)
            wall = time.perf_counter() - t0
            c1, k1, s1, w1 = _usage()
            if i:  # iteration 0 warms up
                got[v].append((wall, c1 - c0, s1 - s0, w1 - w0, k1 - k0))
    for engine in engines.values():
        engine.close()
    print(json.dumps({v: [float(x) for x in np.median(np.array(rows), axis=0)] for v, rows in got.items()}), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--size-mb", type=int, default=64)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--chunk-kb", type=int, default=FtarConfig.chunk_bytes >> 10, help="FTAR chunk size S in KiB")
    p.add_argument("--chunks", type=int, default=FtarConfig.num_chunks, help="FTAR chunks in flight per peer C")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, args.procs + 1, True, timeout=datetime.timedelta(seconds=120),
                          wait_for_workers=False)
    workers = [subprocess.Popen([sys.executable, __file__, "--worker", str(store.port), str(args.procs), str(r),
                                 str(args.size_mb << 20), str(args.iters),
                                 str(args.chunk_kb << 10), str(args.chunks)], stdout=subprocess.PIPE, text=True)
               for r in range(args.procs)]
    try:
        outs = [w.communicate(timeout=1800)[0] for w in workers]
    finally:
        for w in workers:
            w.kill()
    if any(w.returncode for w in workers):
        print(f"ftar_cpu_profile: workers failed: {[w.returncode for w in workers]}", file=sys.stderr)
        return 1
    per_rank = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    rows = []
    for v in VARIANTS:
        cols = np.mean([r[v] for r in per_rank], axis=0)  # medians per rank, averaged over ranks
        wall = max(r[v][0] for r in per_rank)
        rows.append({"variant": v, "procs": args.procs, "size_mb": args.size_mb, "chunk_kb": args.chunk_kb,
                     "chunks": args.chunks, "wall_s": wall,
                     "cpu_s": cols[1], "sys_s": cols[4], "voluntary_switches": cols[2], "runqueue_wait_s": cols[3]})
        print(f"{v:8s} P={args.procs} {args.size_mb} MB: wall {wall * 1e3:7.1f} ms  cpu/rank {cols[1] * 1e3:6.1f} ms "
              f"(sys {cols[4] * 1e3:6.1f})  "
              f"runqueue wait/rank {cols[3] * 1e3:7.1f} ms  voluntary switches/rank {cols[2]:5.0f}")
    if args.json:
        print(json.dumps({"results": rows, "load_avg_1m": os.getloadavg()[0]}))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*map(int, sys.argv[2:9]))
        sys.exit(0)
    sys.exit(main())
