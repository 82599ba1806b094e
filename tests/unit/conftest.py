"""Fixtures shared by the unit tests."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from ftrun.env.real_net import RealNetwork


@pytest.fixture
def ring2():
    """Two ranks' links: a.next -> b.prev and b.next -> a.prev (two TCP connections)."""
    net = RealNetwork()
    la, lb = net.listen("127.0.0.1:0"), net.listen("127.0.0.1:0")
    a_next, b_next = net.connect(lb.addr, 5.0), net.connect(la.addr, 5.0)
    b_prev, a_prev = lb.accept(5.0), la.accept(5.0)
    conns = [a_next, a_prev, b_next, b_prev]
    yield a_next, a_prev, b_next, b_prev
    for c in conns:
        c.close()
    la.close()
    lb.close()


FRAMES = [np.random.default_rng(i).integers(0, 256, 3_000_001 + i, dtype=np.uint8) for i in range(6)]  # ~18 MB


def receive_frames(recv_into) -> list:
    """len(FRAMES) frames, each received with recv_into(buffer of that frame's size, timeout)."""
    got = []
    for f in FRAMES:
        buf = np.empty_like(f)
        recv_into(buf, 10.0)
        got.append(buf)
    return got


@pytest.fixture
def both_ranks_exchange(ring2):
    """Run `rank(next, prev)` for both ranks of ring2 at once (b on a thread); each must send FRAMES to its
    next rank and return the frames it received from its previous one, which must equal FRAMES."""

    def run(rank):
        a_next, a_prev, b_next, b_prev = ring2
        got: dict = {}
        t = threading.Thread(target=lambda: got.update(b=rank(b_next, b_prev)))
        t.start()
        got["a"] = rank(a_next, a_prev)
        t.join(10.0)
        for name in "ab":
            assert len(got.get(name, ())) == len(FRAMES), name
            for want, have in zip(FRAMES, got[name]):
                np.testing.assert_array_equal(have, want)

    return run
