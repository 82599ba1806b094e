"""A peer process that is SIGKILLed surfaces as PeerClosed at once, not after a timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from ftrun.env.base import PeerClosed
from ftrun.env.real import RealEnv

CHILD = """
import sys, time
from ftrun.env.real import RealEnv
conn = RealEnv().net.connect(sys.argv[1], timeout=10.0)
conn.send({"ready": True})
time.sleep(60)
"""


def test_sigkilled_peer_raises_peer_closed_at_once():
    env = RealEnv()
    listener = env.net.listen("127.0.0.1:0")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child = subprocess.Popen([sys.executable, "-c", CHILD, listener.addr], env={**os.environ, "PYTHONPATH": root})
    try:
        conn = listener.accept(timeout=20.0)
        assert conn.recv(timeout=20.0) == {"ready": True}
        os.kill(child.pid, signal.SIGKILL)
        try:  # PeerClosed, not NetTimeout: the loss is seen, not waited out (benchmarks/detection.py times it)
            conn.recv(timeout=30.0)
        except PeerClosed:
            pass
        else:
            raise AssertionError("recv returned although the peer was killed")
    finally:
        child.kill()
        child.wait()
        listener.close()
