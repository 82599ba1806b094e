"""`ftrun bench catchup`: catch-up state transfer bandwidth per state size and source count, vs raw TCP.

For each --state-mb, N source processes on 127.0.0.1 each publish the same state (float32 tensors of
mixed sizes, same seed) on a CatchupServer. This process fetches the whole state from the first 1, 2...
of them (into one reused buffer, every shard CRC-checked, one client whose connections persist across
fetches as a replica's do) and reports the best of --iters. With --fresh-buffer each fetch receives into
a buffer it allocates itself, as a restarted joiner does (its pages fault in during the fetch). Baseline, same run, same bytes, interleaved
with the fetches: one plain single-stream transfer over ftrun's real net (a bulk frame from source 0,
received with recv_into) — no HTTP, no checksum, no sharding. Each row: state_mb, sources, gbps,
raw_gbps and ratio = gbps / raw_gbps (the raw stream always reuses one touched buffer).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys

import torch

from ftrun.catchup.config import CatchupConfig
from ftrun.catchup.fetcher import fetch_with
from ftrun.catchup.http_transport import HttpTransport
from ftrun.catchup.net_transport import BytePayloads
from ftrun.catchup.server import CatchupServer
from ftrun.cli import emit_json
from ftrun.config import Timeouts
from ftrun.env.base import NetError
from ftrun.env.real import RealEnv

_TENSOR_BYTES = (32 << 20, 8 << 20, 1 << 20, 64 << 10, 4 << 10)  # a model's mix of large and small tensors
_FILL_BLOCK = 262_147  # floats (a prime, about 1 MiB): make_state repeats a random block of this length


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-mb", default="50,500", help="state sizes in MiB, comma separated")
    p.add_argument("--sources", default="1,2", help="source counts, comma separated")
    p.add_argument("--iters", type=int, default=5, help="fetches per row (best is reported)")
    p.add_argument("--shard-mb", type=int, default=8, help="max shard size in MiB")
    p.add_argument("--fresh-buffer", action="store_true",
                   help="each fetch allocates its own receive buffer, as a restarted joiner's does")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object, last")
    p.add_argument("--_source", nargs=3, metavar=("STATE_MB", "SHARD_MB", "BASELINE"),
                   help=argparse.SUPPRESS)  # the token comes in $FTRUN_TOKEN, never on argv


def make_state(state_mb: int, seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A flat float32 buffer of state_mb MiB and tensors viewing it, the same in every process: a block
    of about 1 MiB of seeded random floats, repeated (drawing every float took seconds at 500 MiB on a
    loaded host). The block's length is prime, so no two shards hold the same bytes."""
    flat = torch.empty((state_mb << 20) // 4, dtype=torch.float32)
    block = torch.empty(min(_FILL_BLOCK, flat.numel()), dtype=torch.float32)
    block.uniform_(generator=torch.Generator().manual_seed(seed))
    whole = flat.numel() // block.numel() * block.numel()
    flat[:whole].view(-1, block.numel()).copy_(block.expand(whole // block.numel(), -1))
    flat[whole:] = block[:flat.numel() - whole]
    state, pos, i = {}, 0, 0
    while pos < flat.numel():
        n = min(_TENSOR_BYTES[i % len(_TENSOR_BYTES)] // 4, flat.numel() - pos)
        state[f"layer{i // len(_TENSOR_BYTES)}.t{i % len(_TENSOR_BYTES)}"] = flat[pos:pos + n]
        pos, i = pos + n, i + 1
    return flat, state


def _source(sizes: list[int], shard_mb: int, token: str, baseline: bool) -> None:
    """One source process: a CatchupServer per state size (started once: importing torch is slow on a
    loaded machine), and with `baseline` a raw-stream listener per size."""
    env = RealEnv()
    servers, urls, addrs = [], {}, {}
    for mb in sizes:
        flat, state = make_state(mb)
        server = CatchupServer(env=env, token=token, config=CatchupConfig(max_shard_bytes=shard_mb << 20))
        urls[mb] = server.start()
        server.publish(1, state, {"bench": True})
        server.wait_ready()
        servers.append(server)
        del state
        if baseline:
            listener = env.net.listen("127.0.0.1:0")
            addrs[mb] = listener.addr
            env.spawn(_serve_raw, listener, flat, name="baseline")
        del flat
    print(json.dumps({"urls": urls, "baseline": addrs}), flush=True)
    sys.stdin.read()  # serve until the parent closes our stdin
    for server in servers:
        server.stop()


def _serve_raw(listener, flat: torch.Tensor) -> None:
    conn = listener.accept(timeout=600.0)
    view = memoryview(flat.numpy()).cast("B")
    try:
        while True:
            conn.recv(timeout=None)
            conn.send_bytes(view)
    except NetError:  # the parent closed the connection: done
        conn.close()


def _start_sources(n: int, sizes: list[int], shard_mb: int, token: str) -> tuple[list[subprocess.Popen], list[dict]]:
    procs = [subprocess.Popen([sys.executable, "-m", "ftrun.cli", "bench", "catchup", "--_source",
                               ",".join(map(str, sizes)), str(shard_mb), "1" if i == 0 else "0"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "FTRUN_TOKEN": token})
             for i in range(n)]
    infos = []
    for p in procs:
        line = p.stdout.readline()
        if not line:
            _stop(procs)
            raise RuntimeError(f"catch-up source exited with {p.wait()}")
        infos.append(json.loads(line))
    return procs, infos


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.stdin and not p.stdin.closed:
            p.stdin.close()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        if p.stdout:
            p.stdout.close()


def _fetch_gbps(env: RealEnv, transport: HttpTransport, urls: list[str], state_mb: int,
                config: CatchupConfig) -> float:
    result = fetch_with(env, transport, 1, urls, config)
    if result.failures or result.num_bytes != state_mb << 20:
        raise RuntimeError(f"bench fetch went wrong: {result.num_bytes} bytes, {result.failures}")
    return result.gbps


def _raw_gbps(env: RealEnv, conn, view: memoryview) -> float:
    t0 = env.clock.now()
    conn.send({"go": 1})
    conn.recv_into(view, timeout=300.0)
    return view.nbytes / (env.clock.now() - t0) / 1e9


def _measure(env: RealEnv, state_mb: int, counts: list[int], args: argparse.Namespace, infos: list[dict],
             token: str) -> list[dict]:
    """Rows of one state size: best fetch GB/s per source count and the best raw stream, interleaved."""
    buffer = torch.zeros(state_mb << 20, dtype=torch.uint8)  # touched once, reused by every fetch
    config = CatchupConfig(max_shard_bytes=args.shard_mb << 20, timeouts=Timeouts(catchup_timeout_s=300.0))
    payloads = BytePayloads(None if args.fresh_buffer else buffer)
    transport = HttpTransport(env=env, token=token, config=config, payloads=payloads)
    try:
        urls = [info["urls"][str(state_mb)] for info in infos]
        raw = env.net.connect(infos[0]["baseline"][str(state_mb)], timeout=10.0)
        view = memoryview(buffer.numpy()).cast("B")
        _fetch_gbps(env, transport, urls[:max(counts)], state_mb, config)  # warm-up: connections, page cache
        _raw_gbps(env, raw, view)
        best = {k: 0.0 for k in counts}
        best_raw = 0.0
        for _ in range(args.iters):
            best_raw = max(best_raw, _raw_gbps(env, raw, view))
            for k in counts:
                best[k] = max(best[k], _fetch_gbps(env, transport, urls[:k], state_mb, config))
        raw.close()
    finally:
        transport.close()
    return [{"state_mb": state_mb, "sources": k, "gbps": best[k], "raw_gbps": best_raw, "ratio": best[k] / best_raw,
             "fresh_buffer": bool(args.fresh_buffer)} for k in counts]


def _int_list(text: str, what: str) -> list[int]:
    try:
        values = sorted({int(c) for c in text.split(",") if c.strip()})
    except ValueError:
        raise SystemExit(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values or values[0] < 1:
        raise SystemExit(f"{what} must list integers >= 1, got {text!r}")
    return values


def run(args: argparse.Namespace) -> int:
    if args._source:
        state_mbs, shard_mb, baseline = args._source
        _source(_int_list(state_mbs, "--state-mb"), int(shard_mb), os.environ["FTRUN_TOKEN"], baseline == "1")
        return 0
    sizes, counts = _int_list(args.state_mb, "--state-mb"), _int_list(args.sources, "--sources")
    if args.iters < 1 or args.shard_mb < 1:
        raise SystemExit("--iters and --shard-mb must be >= 1")
    env, token = RealEnv(), secrets.token_hex(16)
    procs, infos = _start_sources(max(counts), sizes, args.shard_mb, token)
    try:
        rows = [row for mb in sizes for row in _measure(env, mb, counts, args, infos, token)]
    finally:
        _stop(procs)
    _report(args, rows)
    return 0


def _report(args: argparse.Namespace, rows: list[dict]) -> None:
    into = "a fresh buffer per fetch" if args.fresh_buffer else "one reused buffer"
    print(f"catch-up fetch ({args.shard_mb} MiB shards, best of {args.iters}, into {into}) vs one raw TCP stream "
          f"of the same bytes in the same run")
    print(f"{'state MiB':>9} {'sources':>7} {'GB/s':>6} {'raw GB/s':>8} {'ratio':>6}")
    for r in rows:
        print(f"{r['state_mb']:>9} {r['sources']:>7} {r['gbps']:6.2f} {r['raw_gbps']:8.2f} {r['ratio']:6.2f}")
    if args.json:
        emit_json({"results": rows, "shard_mb": args.shard_mb, "iters": args.iters, "fresh_buffer": args.fresh_buffer,
                   "min_ratio": min(r["ratio"] for r in rows)})
