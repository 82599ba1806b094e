"""Fixtures shared by the unit tests."""

from __future__ import annotations

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
