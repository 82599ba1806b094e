"""Ranks as real processes next to a TCPStore they rendezvous at, for the integration tests that run a
replica's ranks (gloo groups) outside any launcher."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from typing import Callable

import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_ranks(argv_of: Callable[[int, int], list[str]], world: int, *,
              timeout_s: float) -> list[tuple[int, str, str]]:
    """Run `world` processes `python argv_of(rank, store_port)` (the repository on PYTHONPATH) against a
    TCPStore on 127.0.0.1 served here, and wait up to `timeout_s` for them: (exit code, stdout, stderr)
    of each rank. Every process is killed and reaped before this returns or raises."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    env = {**os.environ, "PYTHONPATH": ROOT}
    procs = [subprocess.Popen([sys.executable, *argv_of(r, store.port)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=env, text=True) for r in range(world)]
    try:
        outs = [p.communicate(timeout=timeout_s) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]
