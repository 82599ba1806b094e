"""One replica process of `ftrun bench overlap` (see ftrun_bench/overlap.py).

argv: store_port config_json rank store_host bind_host. Rank 0 prints one JSON line: its steps
({"mode", "step_s", "exchange_s", "compute_s"}), whether both modes' parameters ended bitwise equal,
the gradient bytes and the bucket count."""

from __future__ import annotations

import copy
import datetime
import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ftrun.env.real import RealEnv
from ftrun.ftar.engine import FtarConfig, FtarEngine
from ftrun.quorum.decide import Participant
from ftrun.replica.endpoints import encode_endpoints
from ftrun.replica.manager import StepQuorum
from ftrun.train.api import Float32CpuKernels
from ftrun.train.exchange import GradientExchange
from ftrun.train.grads import FlatGrads
from ftrun.train.overlap import OverlapExchange

WARMUP = 2  # untimed steps per mode first (the first all-reduces, torch's first optimizer step)


def make_model(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights in every replica and both modes
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods)


class Bench:
    def __init__(self, cfg: dict, rank: int, store: dist.TCPStore, bind_host: str) -> None:
        self.cfg, self.rank, self.store, self.n = cfg, rank, store, cfg["replicas"]
        self.env = RealEnv()
        self.engine = FtarEngine(env=self.env, kernels=Float32CpuKernels(), token="bench", bind=f"{bind_host}:0",
                                 config=FtarConfig(chunk_bytes=cfg["chunk_kb"] << 10, num_chunks=cfg["chunks"],
                                                   timeout_s=60.0, transport="socket"))
        store.set(f"ftar/{rank}", self.engine.addr)
        addrs = [store.get(f"ftar/{r}").decode() for r in range(self.n)]
        self.q = StepQuorum(quorum_id=1, step=0, participants=tuple(Participant(f"r{r}", 0) for r in range(self.n)),
                            replica_index=rank, healed=False, reason="bench",
                            peer_addrs=tuple(encode_endpoints({"ftar": a}) for a in addrs))
        self.exchange = GradientExchange(engine=self.engine, rank=0)
        self.exchange.prepare(self.q)
        base = make_model(cfg["width"], cfg["layers"])
        self.models = {"serial": base, "overlap": copy.deepcopy(base)}
        self.flats = {m: FlatGrads(model.parameters()) for m, model in self.models.items()}
        self.opts = {m: torch.optim.SGD(model.parameters(), lr=1e-3) for m, model in self.models.items()}
        self.overlap = OverlapExchange(env=self.env, exchange=self.exchange, flat=self.flats["overlap"],
                                       bucket_bytes=cfg["bucket_kb"] << 10)
        self.done = {"serial": 0, "overlap": 0}  # steps trained per mode: step i uses batch i in both

    def batch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * self.rank + i)
        x = torch.randn(self.cfg["batch"], self.cfg["width"], generator=g)
        return x, torch.randn(self.cfg["batch"], self.cfg["width"], generator=g)

    def step(self, mode: str) -> tuple[float, float, float]:
        """(step, exchange wait, compute) seconds of one training step."""
        model, flat, clock = self.models[mode], self.flats[mode], self.env.clock
        x, y = self.batch(self.done[mode])
        t0 = clock.now()
        if mode == "overlap":
            self.overlap.start(self.q)
        model.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        flat.gather()
        t1 = clock.now()
        if mode == "overlap":
            self.overlap.finish()
        else:
            self.exchange.average(self.q, flat.buffer)
        t2 = clock.now()
        flat.scatter()
        self.opts[mode].step()
        self.done[mode] += 1
        return clock.now() - t0, t2 - t1, t1 - t0

    def barrier(self, tag: str) -> None:
        if self.store.add(f"barrier/{tag}", 1) == self.n:
            self.store.set(f"barrier/{tag}/go", "1")
        self.store.wait([f"barrier/{tag}/go"])

    def run(self) -> dict:
        for mode in ("serial", "overlap"):
            self.barrier(f"warm-{mode}")
            for _ in range(WARMUP):
                self.step(mode)
        rows = []  # one per step; the modes alternate step by step, so both see the same load on the machine
        for b in range(self.cfg["blocks"]):
            self.barrier(f"block-{b}")
            for i in range(self.cfg["steps"]):
                for mode in (("serial", "overlap") if (b + i) % 2 == 0 else ("overlap", "serial")):
                    step_s, exchange_s, compute_s = self.step(mode)
                    rows.append({"mode": mode, "step_s": step_s, "exchange_s": exchange_s, "compute_s": compute_s})
        self.barrier("end")
        serial, overlap = (list(self.models[m].parameters()) for m in ("serial", "overlap"))
        identical = all(torch.equal(a, b) for a, b in zip(serial, overlap))
        return {"steps": rows, "identical": identical, "grad_bytes": self.flats["serial"].nbytes,
                "num_buckets": len(self.overlap.plan)}


def main() -> int:
    port, cfg, rank, store_host, bind_host = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:6]
    torch.set_num_threads(1)
    store = dist.TCPStore(store_host, int(port), cfg["replicas"] + 1, False, timeout=datetime.timedelta(seconds=120))
    bench = Bench(cfg, rank, store, bind_host)
    try:
        out = bench.run()
    finally:
        bench.barrier("close")
        bench.engine.close()
    if rank == 0:
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
