"""`ftrun bench ftar`: FTAR vs torch.distributed gloo all_reduce, same buffers, same run.

For each process count, P processes on 127.0.0.1 rendezvous on a TCPStore, build both a gloo group and
an FTAR ring, check that both give the same sums, then time each on float32 buffers of every size
(best of --iters after a warm-up; FTAR and gloo alternate iteration by iteration, so both see the same
load on a shared machine). Bandwidth is algorithm bandwidth: buffer bytes / seconds. Each row also gives
the CPU seconds (user + system, every thread) rank 0 spent per all-reduce, median over the iterations,
and `cpu_ratio` = gloo's / FTAR's: the work each does per byte, which a busy machine does not skew; and
`median_ratio`, the ratio of the median times (a best-of favours whichever varies more under load).

`--netns`: each process on its own network namespace host (ftrun.launch.netns; needs root): the store
inside host 0, every rank binding its host's address, so both FTAR and gloo cross the bridge (FTAR's
shared-memory path is for ranks on one host only). `--netns-rate` caps each link (default: none).
The JSON adds `hosts` (the largest process count's hosts; 1 without --netns) and `shaping`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

import torch.distributed as dist

from ftrun.cli import emit_json
from ftrun.config import FtarConfig


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--procs", default="2,4", help="process counts, comma separated")
    p.add_argument("--sizes", default="64M,256M", help="buffer sizes, comma separated (K/M/G suffixes)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--chunk-kb", type=int, default=4096, help="FTAR chunk size S")
    p.add_argument("--chunks", type=int, default=4, help="FTAR chunks in flight C")
    p.add_argument("--transport", choices=["auto", "socket"], default="auto",
                   help="auto: shared staging between same-host neighbours; socket: bulk frames over TCP only")
    p.add_argument("--socket-io", choices=["blocking", "threads"], default=FtarConfig.socket_io,
                   help="socket links: a sender thread per link with blocking calls (default) or waiting in "
                        "poll()")
    p.add_argument("--local-socket-buffer-kb", type=int, default=FtarConfig.local_socket_buffer_bytes >> 10,
                   help="socket buffers of FTAR links within one machine, KiB; 0 keeps the connections' 4 MiB "
                        "(default: %(default)s)")
    p.add_argument("--netns", action="store_true", help="one network namespace per process (needs root)")
    p.add_argument("--netns-rate", type=float, default=0.0, metavar="MBIT",
                   help="with --netns: bandwidth cap per link and direction, 0 for none (default: %(default)s)")
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    rows, counts, shaping = [], [int(p) for p in args.procs.split(",")], None
    if args.netns:
        from ftrun.launch.netns import available

        ok, why = available()
        if not ok:
            print(f"ftrun bench ftar: error: --netns: network namespaces cannot be created here: {why}",
                  file=sys.stderr)
            return 2
    for procs in counts:
        if args.netns:
            got, shaping = _run_netns_group(procs, sizes, args)
            rows += got
        else:
            rows += _run_group(procs, sizes, args)
    print(f"{'procs':>5} {'size':>8} {'ftar GB/s':>10} {'gloo GB/s':>10} {'ratio':>6} {'median ratio':>12} {'cpu ratio':>9}")
    for r in rows:
        print(f"{r['procs']:5d} {r['size_mb']:6.0f}MB {r['ftar_gbps']:10.2f} {r['gloo_gbps']:10.2f} {r['ratio']:6.2f} "
              f"{r['median_ratio']:12.2f} {r['cpu_ratio']:9.2f}")
    if args.json:
        emit_json({"results": rows, "min_ratio": min(r["ratio"] for r in rows),
                   "min_cpu_ratio": min(r["cpu_ratio"] for r in rows), "transport": args.transport,
                   "socket_io": args.socket_io, "local_socket_buffer_kb": args.local_socket_buffer_kb, "hosts": max(counts) if args.netns else 1, "shaping": shaping})
    return 0


def _run_netns_group(procs: int, sizes: list[int], args: argparse.Namespace) -> tuple[list[dict], str]:
    """procs ranks, rank r alone on host r (a namespace); the store inside host 0."""
    from ftrun.launch.netns import NetnsConfig, NetnsHosts, in_netns

    with NetnsHosts(NetnsConfig(num_hosts=procs, rate_mbit=args.netns_rate or None)) as hosts:
        with in_netns(hosts[0].namespace):
            store = dist.TCPStore(hosts[0].addr, 0, procs + 1, True, timeout=datetime.timedelta(seconds=120),
                                  wait_for_workers=False)
        rows = _run_workers(procs, sizes, args, store.port, lambda r: (
            ["ip", "netns", "exec", hosts[r].namespace], [hosts[0].addr, hosts[r].addr],
            {"GLOO_SOCKET_IFNAME": hosts.config.veth(r)[1]}))
        del store
        return [{**row, "hosts": procs} for row in rows], hosts.shaping


def _run_group(procs: int, sizes: list[int], args: argparse.Namespace) -> list[dict]:
    store = dist.TCPStore("127.0.0.1", 0, procs + 1, True, timeout=datetime.timedelta(seconds=120),
                          wait_for_workers=False)
    return _run_workers(procs, sizes, args, store.port, lambda r: ([], [], {}))


def _run_workers(procs: int, sizes: list[int], args: argparse.Namespace, port: int, where) -> list[dict]:
    """where(rank) -> (command prefix, extra worker arguments, extra environment)."""
    cmd = [sys.executable, "-m", "ftrun_bench.ftar_worker", str(port), str(procs), ",".join(map(str, sizes)),
           str(args.iters), str(args.chunk_kb << 10), str(args.chunks), args.transport, args.socket_io,
           str(args.local_socket_buffer_kb << 10)]
    workers = []
    for r in range(procs):
        prefix, extra, env = where(r)
        workers.append(subprocess.Popen([*prefix, *cmd, str(r), *extra], stdout=subprocess.PIPE, text=True,
                                        env={**os.environ, **env}))
    try:
        outs = [w.communicate(timeout=900)[0] for w in workers]
    finally:
        for w in workers:
            w.kill()
    if any(w.returncode for w in workers):
        raise RuntimeError(f"bench workers failed: {[w.returncode for w in workers]}")
    return json.loads(outs[0].strip().splitlines()[-1])
