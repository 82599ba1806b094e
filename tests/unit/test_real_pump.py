"""The ring link pump (ftrun/env/real_pump.py): one thread sends queued bulk frames while it receives,
interoperates with plain send_bytes / recv_into, and fails like a RealConnection does."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from ftrun.env import wire
from ftrun.env.base import NetTimeout, PeerClosed, ProtocolError

from tests.unit.conftest import FRAMES, receive_frames

pytestmark = pytest.mark.timeout(30)


def test_two_pumps_exchange_many_frames_larger_than_the_socket_buffers(both_ranks_exchange):
    def rank(nxt, prev):
        pump = nxt.duplex(prev)
        tickets = [pump.send(f) for f in FRAMES]  # ~18 MB queued: only progress on both sides drains it
        assert pump.num_sent < len(FRAMES)
        got = receive_frames(pump.recv_into)
        pump.flush(10.0)
        assert pump.num_sent == tickets[-1] == len(FRAMES)
        return got

    both_ranks_exchange(rank)


def test_pump_frames_are_ordinary_bulk_frames(ring2):
    a_next, a_prev, b_next, b_prev = ring2
    pump = a_next.duplex(a_prev)
    pump.send(b"hello pump")
    pump.flush(5.0)
    buf = bytearray(10)
    b_prev.recv_into(memoryview(buf), timeout=5.0)
    assert bytes(buf) == b"hello pump"
    b_next.send_bytes(b"back")
    out = bytearray(4)
    pump.recv_into(out, 5.0)
    assert bytes(out) == b"back"


def test_wait_sent_returns_once_the_frame_is_in_the_kernel(ring2):
    a_next, a_prev, _, b_prev = ring2
    pump = a_next.duplex(a_prev)
    ticket = pump.send(b"x" * 1000)
    pump.wait_sent(ticket, 5.0)
    assert pump.num_sent == 1
    buf = bytearray(1000)
    b_prev.recv_into(memoryview(buf), timeout=5.0)
    assert bytes(buf) == b"x" * 1000


def test_peer_closing_mid_frame_is_peer_closed(ring2):
    a_next, a_prev, b_next, _ = ring2
    b_next.send_bytes(b"y" * 10)  # a 10-byte frame; a expects 20
    raw = b_next._sock
    raw.setblocking(True)
    raw.sendall(wire.bulk_header(20) + b"z" * 5)
    b_next.close()
    pump = a_next.duplex(a_prev)
    first = bytearray(10)
    pump.recv_into(first, 5.0)
    with pytest.raises(PeerClosed):
        pump.recv_into(bytearray(20), 5.0)
    assert a_prev.closed


def test_a_frame_of_another_size_is_a_protocol_error(ring2):
    a_next, a_prev, b_next, _ = ring2
    b_next.send_bytes(b"1234")
    with pytest.raises(ProtocolError, match="expected a bulk frame of 8 bytes, got 4"):
        a_next.duplex(a_prev).recv_into(bytearray(8), 5.0)
    assert a_prev.closed


def test_silence_is_a_timeout_that_closes_both_links(ring2):
    a_next, a_prev, _, _ = ring2
    with pytest.raises(NetTimeout, match="no progress within 0.2s"):
        a_next.duplex(a_prev).recv_into(bytearray(8), 0.2)
    assert a_prev.closed and a_next.closed


def test_a_local_close_wakes_a_waiting_pump(ring2):
    a_next, a_prev, _, _ = ring2
    closer = threading.Timer(0.1, a_prev.close)
    closer.start()
    with pytest.raises(PeerClosed, match="closed locally"):
        a_next.duplex(a_prev).recv_into(bytearray(8), 10.0)
    closer.join()
