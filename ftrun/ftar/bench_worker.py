"""One process of `ftrun bench ftar` (see ftrun/ftar/bench.py).

argv: port procs sizes iters chunk chunks transport socket_io rank [host]: host is the address the store
listens on and this rank binds (`--netns`: its namespace's address; default 127.0.0.1)."""

from __future__ import annotations

import datetime
import json
import sys

import numpy as np
import torch
import torch.distributed as dist

from ftrun.env.real import RealEnv
from ftrun.ftar.cpu_kernels import CpuKernels
from ftrun.ftar.engine import FtarConfig, FtarEngine


def main() -> int:
    port, procs, sizes, iters, chunk, chunks, transport, socket_io, rank = sys.argv[1:10]
    store_host, bind_host = (sys.argv[10], sys.argv[11]) if len(sys.argv) > 11 else ("127.0.0.1", "127.0.0.1")
    procs, iters, rank = int(procs), int(iters), int(rank)
    env = RealEnv()
    store = dist.TCPStore(store_host, int(port), procs + 1, False, timeout=datetime.timedelta(seconds=120))
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, procs, datetime.timedelta(seconds=120))
    engine = FtarEngine(env=env, kernels=CpuKernels(), token="bench",
                        config=FtarConfig(chunk_bytes=int(chunk), num_chunks=int(chunks), timeout_s=60.0,
                                          transport=transport, socket_io=socket_io), bind=f"{bind_host}:0")
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

        results = {}
        for name, fn in (("ftar", ftar), ("gloo", gloo_all_reduce)):
            best = float("inf")
            for i in range(iters + 1):
                np.copyto(arr, source)
                gloo.barrier().wait()
                t0 = env.clock.now()
                fn()
                took = env.clock.now() - t0
                best = min(best, took) if i else best  # iteration 0 warms up
            results[name] = (best, arr.copy() if size <= (64 << 20) else None)
        if results["ftar"][1] is not None:
            np.testing.assert_allclose(results["ftar"][1], results["gloo"][1], rtol=1e-5, atol=1e-4)
        f, g = results["ftar"][0], results["gloo"][0]
        rows.append({"procs": procs, "size_mb": size / 2**20, "ftar_s": f, "gloo_s": g,
                     "ftar_gbps": size / f / 1e9, "gloo_gbps": size / g / 1e9, "ratio": g / f})
    engine.close()
    if rank == 0:
        print(json.dumps(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
