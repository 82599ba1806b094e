"""A process holding one FtarEngine, driven by JSON lines on stdin (for test_ftar_engine.py); FTAR_TRANSPORT
picks the data transport.

Commands: {"cmd": "ring", "epoch", "ring", "index"}; {"cmd": "allreduce", "nbytes", "seed"} -> sum hash
and time; {"cmd": "die_after_reduces", "n"}: SIGKILL itself inside its n-th reduce kernel call (printing
the monotonic time of death first), i.e. mid-operation.
"""

import hashlib
import json
import os
import signal
import sys
import time

import numpy as np

from ftrun.env.real import RealEnv
from ftrun.ftar.cpu_kernels import CpuKernels
from ftrun.ftar.engine import FtarConfig, FtarEngine


def io_config(transport: str) -> dict:
    """FTAR_TRANSPORT: auto, socket, or socket+IO with IO an FtarConfig.socket_io (blocking, threads)."""
    kind, _, io = transport.partition("+")
    return {"transport": kind, "socket_io": io} if io else {"transport": kind}
from ftrun.ftar.ring import FtarError


class DyingKernels(CpuKernels):
    def __init__(self):
        super().__init__()
        self.die_after = None
        self.reduces = 0

    def reduce(self, *args):
        self.reduces += 1
        if self.die_after is not None and self.reduces >= self.die_after:
            print(json.dumps({"dying_at": time.monotonic()}), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return super().reduce(*args)


def out(**kw):
    print(json.dumps(kw), flush=True)


def main():
    kernels = DyingKernels()
    engine = FtarEngine(env=RealEnv(), kernels=kernels, token="job",
                        config=FtarConfig(chunk_bytes=1 << 20, num_chunks=4, timeout_s=30.0,
                                            **io_config(os.environ.get("FTAR_TRANSPORT", "auto"))))
    out(addr=engine.addr)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["cmd"] == "ring":
                engine.reconfigure(epoch=cmd["epoch"], ring=cmd["ring"], index=cmd["index"])
                out(ok=True)
            elif cmd["cmd"] == "die_after_reduces":
                kernels.die_after = kernels.reduces + cmd["n"]
                out(ok=True)
            elif cmd["cmd"] == "allreduce":
                buf = np.random.default_rng(cmd["seed"]).standard_normal(cmd["nbytes"] // 4).astype(np.float32)
                engine.all_reduce(buf)
                out(ok=True, sha=hashlib.sha256(buf.tobytes()).hexdigest(), head=buf[:4].tolist())
        except FtarError as e:
            out(ok=False, error=type(e).__name__, at=time.monotonic(), text=str(e))
    engine.close()


if __name__ == "__main__":
    main()
