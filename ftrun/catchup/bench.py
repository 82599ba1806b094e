"""`ftrun bench catchup`: catch-up state transfer bandwidth per source count, vs a raw TCP stream.

N source processes on 127.0.0.1 each publish the same state (--state-mb, float32 tensors of mixed sizes,
same seed) on a CatchupServer. This process fetches the whole state from the first 1, 2, 4... of them
(best of --iters, into one reused buffer, every shard CRC-checked) and prints GB/s per source count.
Baseline, same run, same bytes: one plain single-stream transfer over ftrun's real net (a bulk frame
from source 0, received with recv_into) — no HTTP, no checksum, no sharding.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys

import torch

from ftrun.catchup.client import fetch
from ftrun.catchup.config import CatchupConfig
from ftrun.catchup.server import CatchupServer
from ftrun.cli import emit_json
from ftrun.config import Timeouts
from ftrun.env.real import RealEnv

_TENSOR_BYTES = (32 << 20, 8 << 20, 1 << 20, 64 << 10, 4 << 10)  # a model's mix of large and small tensors


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-mb", type=int, default=500, help="state size in MiB")
    p.add_argument("--sources", default="1,2,4", help="source counts, comma separated")
    p.add_argument("--iters", type=int, default=3, help="fetches per source count (best is reported)")
    p.add_argument("--shard-mb", type=int, default=32, help="max shard size in MiB")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object, last")
    p.add_argument("--_source", nargs=3, metavar=("STATE_MB", "SHARD_MB", "BASELINE"),
                   help=argparse.SUPPRESS)  # the token comes in $FTRUN_TOKEN, never on argv


def make_state(state_mb: int, seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A flat float32 buffer of state_mb MiB and tensors viewing it, the same in every process."""
    flat = torch.empty((state_mb << 20) // 4, dtype=torch.float32)
    flat.uniform_(generator=torch.Generator().manual_seed(seed))
    state, pos, i = {}, 0, 0
    while pos < flat.numel():
        n = min(_TENSOR_BYTES[i % len(_TENSOR_BYTES)] // 4, flat.numel() - pos)
        state[f"layer{i // len(_TENSOR_BYTES)}.t{i % len(_TENSOR_BYTES)}"] = flat[pos:pos + n]
        pos, i = pos + n, i + 1
    return flat, state


def _source(state_mb: int, shard_mb: int, token: str, baseline: bool) -> None:
    env = RealEnv()
    flat, state = make_state(state_mb)
    server = CatchupServer(env=env, token=token, config=CatchupConfig(max_shard_bytes=shard_mb << 20))
    url = server.start()
    server.publish(1, state, {"bench": True})
    server.wait_ready()
    del state
    addr = ""
    if baseline:
        listener = env.net.listen("127.0.0.1:0")
        addr = listener.addr
        env.spawn(_serve_raw, listener, flat, name="baseline")
    else:
        del flat
    print(json.dumps({"url": url, "baseline": addr}), flush=True)
    sys.stdin.read()  # serve until the parent closes our stdin
    server.stop()


def _serve_raw(listener, flat: torch.Tensor) -> None:
    conn = listener.accept(timeout=600.0)
    view = memoryview(flat.numpy()).cast("B")
    while True:
        conn.recv(timeout=None)
        conn.send_bytes(view)


def _start_sources(n: int, args: argparse.Namespace, token: str) -> tuple[list[subprocess.Popen], list[dict]]:
    procs = [subprocess.Popen([sys.executable, "-m", "ftrun.cli", "bench", "catchup", "--_source",
                               str(args.state_mb), str(args.shard_mb), "1" if i == 0 else "0"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "FTRUN_TOKEN": token})
             for i in range(n)]
    infos = []
    for p in procs:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"catch-up source exited with {p.wait()}")
        infos.append(json.loads(line))
    return procs, infos


def _best_fetch_gbps(urls: list[str], token: str, args: argparse.Namespace, buffer: torch.Tensor) -> float:
    config = CatchupConfig(max_shard_bytes=args.shard_mb << 20)
    best = 0.0
    for _ in range(args.iters):
        result = fetch(1, urls, token, Timeouts(catchup_timeout_s=300.0), config=config, buffer=buffer)
        if result.failures or result.num_bytes != args.state_mb << 20:
            raise RuntimeError(f"bench fetch went wrong: {result.num_bytes} bytes, {result.failures}")
        best = max(best, result.gbps)
    return best


def _baseline_gbps(env: RealEnv, addr: str, buffer: torch.Tensor, iters: int) -> float:
    conn = env.net.connect(addr, timeout=10.0)
    view = memoryview(buffer.numpy()).cast("B")
    best = 0.0
    for _ in range(iters):
        t0 = env.clock.now()
        conn.send({"go": 1})
        conn.recv_into(view, timeout=300.0)
        best = max(best, view.nbytes / (env.clock.now() - t0) / 1e9)
    conn.close()
    return best


def run(args: argparse.Namespace) -> int:
    if args._source:
        state_mb, shard_mb, baseline = args._source
        _source(int(state_mb), int(shard_mb), os.environ["FTRUN_TOKEN"], baseline == "1")
        return 0
    counts = sorted({int(c) for c in args.sources.split(",")})
    if not counts or counts[0] < 1 or args.state_mb < 1 or args.iters < 1:
        raise SystemExit("need --sources >= 1, --state-mb >= 1, --iters >= 1")
    env, token = RealEnv(), secrets.token_hex(16)
    buffer = torch.zeros(args.state_mb << 20, dtype=torch.uint8)  # touched once, reused by every fetch
    procs, infos = _start_sources(max(counts), args, token)
    try:
        urls = [info["url"] for info in infos]
        fetch(1, urls[:1], token, Timeouts(catchup_timeout_s=300.0), buffer=buffer)  # warm-up
        gbps = {str(k): _best_fetch_gbps(urls[:k], token, args, buffer) for k in counts}
        baseline = _baseline_gbps(env, infos[0]["baseline"], buffer, args.iters)
    finally:
        for p in procs:
            p.stdin.close()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
    _report(args, gbps, baseline)
    return 0


def _report(args: argparse.Namespace, gbps: dict[str, float], baseline: float) -> None:
    print(f"catch-up fetch of a {args.state_mb} MiB state ({args.shard_mb} MiB shards, best of {args.iters}); "
          f"baseline: one raw TCP stream of the same bytes, {baseline:.2f} GB/s")
    print(f"{'sources':>7} {'GB/s':>6} {'vs baseline':>11}")
    for k, v in gbps.items():
        print(f"{k:>7} {v:6.2f} {v / baseline:10.2f}x")
    if args.json:
        emit_json({"results": [{"sources": int(k), "state_mb": args.state_mb, "gbps": v,
                                "ratio_to_baseline": v / baseline} for k, v in gbps.items()],
                   "state_mb": args.state_mb, "shard_mb": args.shard_mb, "gbps": gbps, "baseline_gbps": baseline,
                   "ratio_to_baseline": {k: v / baseline for k, v in gbps.items()}})
