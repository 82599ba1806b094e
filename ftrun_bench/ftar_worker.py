"""One process of `ftrun bench ftar` (see ftrun_bench/ftar.py).

argv: port procs sizes iters chunk chunks transport socket_io local_socket_buffer_bytes rank [store_host
bind_host]: the address the store listens on and the one this rank binds (`--netns`: host 0's and its
namespace's; default 127.0.0.1)."""

from __future__ import annotations

import datetime
import json
import resource
import sys

import numpy as np
import torch
import torch.distributed as dist

from ftrun.env.real import RealEnv
from ftrun.ftar.cpu_kernels import CpuKernels
from ftrun.ftar.engine import FtarConfig, FtarEngine


def _cpu_s() -> float:
    """CPU seconds this process used so far, every thread, user and system (the kernel's socket copies)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> int:
    port, procs, sizes, iters, chunk, chunks, transport, socket_io, local_buffer, rank = sys.argv[1:11]
    store_host, bind_host = (sys.argv[11], sys.argv[12]) if len(sys.argv) > 12 else ("127.0.0.1", "127.0.0.1")
    procs, iters, rank = int(procs), int(iters), int(rank)
    env = RealEnv()
    store = dist.TCPStore(store_host, int(port), procs + 1, False, timeout=datetime.timedelta(seconds=120))
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, procs, datetime.timedelta(seconds=120))
    engine = FtarEngine(env=env, kernels=CpuKernels(), token="bench",
                        config=FtarConfig(chunk_bytes=int(chunk), num_chunks=int(chunks), timeout_s=60.0,
                                          transport=transport, socket_io=socket_io,
                                          local_socket_buffer_bytes=int(local_buffer)), bind=f"{bind_host}:0")
    store.set(f"ftar/{rank}", engine.addr)
    ring = [store.get(f"ftar/{r}").decode() for r in range(procs)]
    engine.reconfigure(epoch=1, ring=ring, index=rank)
    rows = []
    for size in [int(s) for s in sizes.split(",")]:
        source = np.random.default_rng(rank).standard_normal(size // 4).astype(np.float32)
        buf = torch.empty(size // 4, dtype=torch.float32)
        arr = buf.numpy()

        def ftar():
            engine.all_reduce(arr)

        def gloo_all_reduce():
            gloo.allreduce([buf]).wait()

        # The two alternate iteration by iteration, so on a shared machine both see the same load.
        walls, cpu, sums = {"ftar": [], "gloo": []}, {"ftar": [], "gloo": []}, {}
        for i in range(iters + 1):
            for name, fn in (("ftar", ftar), ("gloo", gloo_all_reduce)):
                np.copyto(arr, source)
                gloo.barrier().wait()
                c0, t0 = _cpu_s(), env.clock.now()
                fn()
                took, used = env.clock.now() - t0, _cpu_s() - c0
                if i:  # iteration 0 warms up
                    walls[name].append(took)
                    cpu[name].append(used)
                elif size <= (64 << 20):
                    sums[name] = arr.copy()
        if sums:
            np.testing.assert_allclose(sums["ftar"], sums["gloo"], rtol=1e-5, atol=1e-4)
        f, g = min(walls["ftar"]), min(walls["gloo"])
        fm, gm = float(np.median(walls["ftar"])), float(np.median(walls["gloo"]))
        fc, gc = float(np.median(cpu["ftar"])), float(np.median(cpu["gloo"]))
        rows.append({"procs": procs, "size_mb": size / 2**20, "ftar_s": f, "gloo_s": g,
                     "ftar_gbps": size / f / 1e9, "gloo_gbps": size / g / 1e9, "ratio": g / f,
                     "ftar_median_s": fm, "gloo_median_s": gm, "median_ratio": gm / fm,
                     "ftar_cpu_s": fc, "gloo_cpu_s": gc, "cpu_ratio": gc / fc})
    engine.close()
    if rank == 0:
        print(json.dumps(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
