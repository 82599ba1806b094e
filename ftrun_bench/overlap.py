"""`ftrun bench overlap`: training steps with the gradient exchange overlapped with backward vs after it.

R replica processes x 1 rank (torch.set_num_threads(1) each) train the same MLP (same initial weights,
same batches) on one FTAR ring, alternating the two modes step by step (so both see the same load from
whatever else runs on the machine): serial (forward/backward, then
GradientExchange.average of the whole buffer, the trainer's path without overlap) and overlapped
(ftrun.train.overlap: buckets all-reduced during backward). A step is forward, backward, exchange,
scatter and the optimizer step; the figures are medians of rank 0's per-step seconds:

    step_s_serial, step_s_overlap, ratio = overlap / serial (< 1: overlap helps),
    exchange_fraction = the serial step's exchange seconds / its step seconds,
    compute_s_* (forward, backward, gather), tail_s_overlap (the wait for the last buckets after backward),
    identical: with 2 replicas, the two modes' parameters are bitwise equal at the end (a + b sums).

The quorum machinery (lighthouse, vote) is left out: it costs the same in both modes.

`--netns-rate MBIT` (default 500; 0: loopback, no namespaces): each replica alone on a network namespace
host whose link is capped at MBIT per direction (ftrun.launch.netns, needs root), i.e. replicas on
different hosts: the exchange is then bound by the wire, as across hosts, not by this machine's CPUs.
On loopback with few cores the exchange's copies and sums compete with backward for the same cores,
which hides what overlap buys where replicas are on different hosts.

The batch decides how much of the serial step the exchange takes (`exchange_fraction` in --json), and
overlap can only hide the part of the exchange that runs beside backward, so its gain is bounded by that
share. A fixed batch cannot keep the share put: the same batch 384 (8 MB of gradients at 500 Mbit/s) gave
47% and ratio 0.75 on a loaded 2-core box, 71% and 0.854 with the box to itself (compute per sample
differs ~2x with load). So by default, over capped links, the batch is sized in the run: this process times
forward and backward of the model alone (one thread, batch 256, median of 5), estimates the exchange from
the link rate (a ring all-reduce sends 2 (R - 1) / R of the gradient bytes per replica), and takes the batch
whose compute equals that, i.e. an exchange of about half the serial step (`auto_batch`). Quiet 2-core
box, three runs: batch 832 / 832 / 768, exchange 49-52% of the serial step, ratio 0.744-0.770. On
loopback there is no rate to size against: 384. `--batch N` fixes it; the JSON says which (`batch`,
`batch_auto`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

from ftrun.cli import emit_json

WORKER = "ftrun_bench.overlap_worker"
LOOPBACK_BATCH = 384  # --batch's default without a link rate to size against
PROBE_BATCH = 256  # the compute probe's batch (auto_batch)
BATCH_STEP, MAX_BATCH = 64, 8192  # auto_batch rounds to a multiple of BATCH_STEP, at most MAX_BATCH


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=2, help="replica processes, 1 rank each (default: %(default)s)")
    p.add_argument("--width", type=int, default=512, help="MLP width (default: %(default)s)")
    p.add_argument("--layers", type=int, default=8, help="MLP layers of width x width (default: %(default)s)")
    p.add_argument("--batch", type=int, default=None,
                   help="samples per step (default: sized so the exchange is about half the serial step over "
                        f"capped links, {LOOPBACK_BATCH} on loopback)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per mode per block (default: %(default)s)")
    p.add_argument("--blocks", type=int, default=3, help="blocks, each after a barrier (default: %(default)s)")
    p.add_argument("--bucket-kb", type=int, default=1024, help="overlap bucket size (default: %(default)s)")
    p.add_argument("--chunk-kb", type=int, default=256, help="FTAR chunk size S (default: %(default)s)")
    p.add_argument("--chunks", type=int, default=4, help="FTAR chunks in flight C (default: %(default)s)")
    p.add_argument("--netns-rate", type=float, default=500.0, metavar="MBIT",
                   help="each replica on its own namespace host, links capped at MBIT; 0: loopback "
                        "(default: %(default)s)")
    p.add_argument("--json", action="store_true")


def check_args(args: argparse.Namespace) -> str | None:
    """The first bad argument, named, or None."""
    for name in ("replicas", "width", "layers", "batch", "steps", "blocks", "bucket_kb", "chunk_kb", "chunks"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
    if args.replicas < 2:
        return f"--replicas must be >= 2 (an exchange needs peers), got {args.replicas}"
    if args.netns_rate < 0:
        return f"--netns-rate must be >= 0, got {args.netns_rate}"
    return None


def exchange_estimate_s(grad_bytes: int, replicas: int, rate_mbit: float) -> float:
    """Seconds a ring all-reduce of grad_bytes over R replicas needs on links of rate_mbit (per direction):
    each replica sends 2 (R - 1) / R of the bytes (reduce-scatter, then all-gather). Pure."""
    return 2 * (replicas - 1) / replicas * grad_bytes * 8 / (rate_mbit * 1e6)


def auto_batch(sample_s: float, exchange_s: float) -> int:
    """The batch whose forward and backward (sample_s seconds per sample) take exchange_s: a multiple of
    BATCH_STEP in [BATCH_STEP, MAX_BATCH]. Pure."""
    if sample_s <= 0 or exchange_s <= 0:
        raise ValueError(f"auto_batch needs positive times, got {sample_s}, {exchange_s}")
    return min(MAX_BATCH, max(BATCH_STEP, round(exchange_s / sample_s / BATCH_STEP) * BATCH_STEP))


def _probe(width: int, layers: int) -> tuple[float, int]:
    """(forward + backward seconds per sample, gradient bytes) of the bench's model in this process."""
    import torch
    import torch.nn.functional as F

    from ftrun_bench.overlap_worker import make_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each replica runs
    try:
        model = make_model(width, layers)
        x, y = torch.randn(PROBE_BATCH, width), torch.randn(PROBE_BATCH, width)
        times = []
        for _ in range(6):  # the first warms up
            t0 = time.perf_counter()
            model.zero_grad(set_to_none=True)
            F.mse_loss(model(x), y).backward()
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(times[1:]) / PROBE_BATCH, sum(p.numel() * p.element_size() for p in model.parameters())


def sized_batch(args: argparse.Namespace) -> tuple[int, bool]:
    """(the batch to run, whether it was sized here)."""
    if args.batch is not None:
        return args.batch, False
    if not args.netns_rate:
        return LOOPBACK_BATCH, False
    sample_s, grad_bytes = _probe(args.width, args.layers)
    return auto_batch(sample_s, exchange_estimate_s(grad_bytes, args.replicas, args.netns_rate)), True


def summarize(rows: list[dict]) -> dict:
    """Rank 0's per-step rows -> the figures (medians per mode). Pure."""
    serial = [r for r in rows if r["mode"] == "serial"]
    overlap = [r for r in rows if r["mode"] == "overlap"]
    if not serial or not overlap:
        raise ValueError("summarize needs steps of both modes")
    step_s = statistics.median(r["step_s"] for r in serial)
    step_o = statistics.median(r["step_s"] for r in overlap)
    exch = statistics.median(r["exchange_s"] for r in serial)
    return {"step_s_serial": step_s, "step_s_overlap": step_o, "ratio": step_o / step_s,
            "exchange_s_serial": exch, "exchange_fraction": exch / step_s,
            "compute_s_serial": statistics.median(r["compute_s"] for r in serial),
            "compute_s_overlap": statistics.median(r["compute_s"] for r in overlap),
            "tail_s_overlap": statistics.median(r["exchange_s"] for r in overlap)}


def run(args: argparse.Namespace) -> int:
    bad = check_args(args)
    if bad:
        print(f"ftrun bench overlap: error: {bad}", file=sys.stderr)
        return 2
    if args.netns_rate:
        from ftrun.launch.netns import available

        ok, why = available()
        if not ok:
            print(f"ftrun bench overlap: error: --netns-rate: network namespaces cannot be created here ({why}); "
                  f"use --netns-rate 0 for loopback", file=sys.stderr)
            return 2
    args.batch, batch_auto = sized_batch(args)
    out, shaping = _run_netns(args) if args.netns_rate else (_run_loopback(args), "none (loopback)")
    figures = {**summarize(out["steps"]), "identical": out["identical"], "replicas": args.replicas,
               "grad_mb": out["grad_bytes"] / 2**20, "num_buckets": out["num_buckets"], "shaping": shaping,
               "bucket_kb": args.bucket_kb, "steps": len(out["steps"]) // 2, "batch": args.batch,
               "batch_auto": batch_auto}
    print(f"batch {args.batch}" + (" (sized so the exchange is about half the serial step)" if batch_auto else ""))
    print(f"replicas {args.replicas}, gradients {figures['grad_mb']:.1f} MB in {out['num_buckets']} buckets, "
          f"links: {shaping}")
    print(f"serial step {figures['step_s_serial'] * 1e3:.1f} ms (exchange {figures['exchange_s_serial'] * 1e3:.1f} "
          f"ms, {figures['exchange_fraction']:.0%}), overlapped step {figures['step_s_overlap'] * 1e3:.1f} ms: "
          f"ratio {figures['ratio']:.2f}; parameters identical across modes: {out['identical']}")
    if args.json:
        emit_json(figures)
    return 0


def _worker_argv(args: argparse.Namespace, port: int) -> list[str]:
    cfg = {k: getattr(args, k) for k in ("replicas", "width", "layers", "batch", "steps", "blocks", "bucket_kb",
                                        "chunk_kb", "chunks")}
    return [sys.executable, "-m", WORKER, str(port), json.dumps(cfg)]


def _run_loopback(args: argparse.Namespace) -> dict:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, args.replicas + 1, True, timeout=datetime.timedelta(seconds=120),
                          wait_for_workers=False)
    cmd = _worker_argv(args, store.port)
    return _collect([subprocess.Popen([*cmd, str(r), "127.0.0.1", "127.0.0.1"], stdout=subprocess.PIPE, text=True)
                     for r in range(args.replicas)])


def _run_netns(args: argparse.Namespace) -> tuple[dict, str]:
    import torch.distributed as dist

    from ftrun.launch.netns import NetnsConfig, NetnsHosts, in_netns

    with NetnsHosts(NetnsConfig(num_hosts=args.replicas, rate_mbit=args.netns_rate)) as hosts:
        with in_netns(hosts[0].namespace):
            store = dist.TCPStore(hosts[0].addr, 0, args.replicas + 1, True, timeout=datetime.timedelta(seconds=120),
                                  wait_for_workers=False)
        cmd = _worker_argv(args, store.port)
        procs = [subprocess.Popen(["ip", "netns", "exec", hosts[r].namespace, *cmd, str(r), hosts[0].addr,
                                   hosts[r].addr], stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "GLOO_SOCKET_IFNAME": hosts.config.veth(r)[1]})
                 for r in range(args.replicas)]
        out = _collect(procs)
        del store
        return out, hosts.shaping


def _collect(procs: list[subprocess.Popen]) -> dict:
    try:
        outs = [p.communicate(timeout=900)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"bench overlap workers failed: exit codes {[p.returncode for p in procs]}")
    return json.loads(outs[0].strip().splitlines()[-1])
