"""Blocking bulk holds on ring links (ftrun/env/real_bulk.py): frames larger than the socket buffers go both
ways, interoperate with plain send_bytes / recv_into, honour their deadlines, wake at once on close(), and
hand the connection back in non-blocking mode; a peer that closes mid-frame is PeerClosed, held or not."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import numpy as np
import pytest

from ftrun.env import wire
from ftrun.env.base import NetTimeout, PeerClosed, ProtocolError

from tests.unit.conftest import FRAMES, receive_frames

pytestmark = pytest.mark.timeout(30)


def _in_thread(fn):
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_both_ranks_exchange_frames_many_times_their_small_socket_buffers(ring2, both_ranks_exchange):
    for c in ring2:
        c.set_buffer_bytes(128 << 10)

    def rank(nxt, prev):
        out, inc = nxt.hold_bulk(10.0), prev.hold_bulk(10.0)
        sender, sent = _in_thread(lambda: [out.send_bytes(f, 10.0) for f in FRAMES])
        got = receive_frames(inc.recv_into)
        sender.join(10.0)
        assert "error" not in sent
        out.release()
        inc.release()
        return got

    both_ranks_exchange(rank)


def test_held_frames_are_ordinary_bulk_frames_and_release_restores_non_blocking(ring2):
    a_next, _, _, b_prev = ring2
    payload = np.arange(1 << 20, dtype=np.uint8)
    out = a_next.hold_bulk(5.0)
    out.send_bytes(payload, 5.0)
    buf = np.empty_like(payload)
    b_prev.recv_into(memoryview(buf), timeout=5.0)  # RealConnection's own (poll) receive
    np.testing.assert_array_equal(buf, payload)
    inc = b_prev.hold_bulk(5.0)
    a_next.send_bytes(payload[::-1].copy())  # RealConnection's own send, while a_next is held: same frames
    inc.recv_into(buf, 5.0)
    np.testing.assert_array_equal(buf, payload[::-1])
    out.release()
    inc.release()
    assert not a_next._sock.getblocking() and not b_prev._sock.getblocking()
    t0 = time.monotonic()
    with pytest.raises(NetTimeout):
        b_prev.recv(timeout=0.2)  # the poll path works again, deadline and all
    assert time.monotonic() - t0 < 2.0
    a_next.send({"still": "framed"})
    assert b_prev.recv(timeout=5.0) == {"still": "framed"}


def test_a_receive_with_nothing_sent_times_out_and_leaves_the_connection_open(ring2):
    """The kernel's timeout ends the blocked call; the poll() wait behind it ends at the deadline."""
    _, _, _, b_prev = ring2
    inc = b_prev.hold_bulk(0.3)
    t0 = time.monotonic()
    with pytest.raises(NetTimeout, match="timed out"):
        inc.recv_into(np.empty(1024, np.uint8), 0.3)
    assert 0.25 <= time.monotonic() - t0 < 2.0
    assert not b_prev.closed  # no byte of a frame was read: the stream is intact


def test_a_receive_that_times_out_mid_frame_closes_the_connection(ring2):
    a_next, _, _, b_prev = ring2
    a_next._sock.sendall(b"\x02" + (1 << 20).to_bytes(8, "big") + b"x" * 1000)  # header + part of a payload
    inc = b_prev.hold_bulk(0.3)
    with pytest.raises(NetTimeout, match="mid-frame"):
        inc.recv_into(np.empty(1 << 20, np.uint8), 0.3)
    assert b_prev.closed


def test_a_send_the_peer_never_reads_times_out_and_closes(ring2):
    a_next, _, _, _ = ring2
    a_next.set_buffer_bytes(128 << 10)
    out = a_next.hold_bulk(0.3)
    t0 = time.monotonic()
    with pytest.raises(NetTimeout, match="send"):
        out.send_bytes(np.zeros(64 << 20, np.uint8), 0.3)  # far more than both socket buffers hold
    assert 0.25 <= time.monotonic() - t0 < 2.0
    assert a_next.closed


@pytest.mark.parametrize("side", ["receiver", "sender"])
def test_close_from_another_task_wakes_a_blocked_call_at_once(ring2, side):
    a_next, _, _, b_prev = ring2
    a_next.set_buffer_bytes(128 << 10)
    if side == "receiver":
        conn, held = b_prev, b_prev.hold_bulk(20.0)
        call = lambda: held.recv_into(np.empty(1 << 20, np.uint8), 20.0)  # noqa: E731
    else:
        conn, held = a_next, a_next.hold_bulk(20.0)
        call = lambda: held.send_bytes(np.zeros(64 << 20, np.uint8), 20.0)  # noqa: E731
    t, res = _in_thread(call)
    time.sleep(0.3)
    assert t.is_alive()  # blocked in the kernel
    t0 = time.monotonic()
    conn.close()
    t.join(5.0)
    assert not t.is_alive() and time.monotonic() - t0 < 1.0
    assert isinstance(res.get("error"), PeerClosed), res
    held.release()  # nothing to do on a closed connection


def test_a_peer_that_goes_away_is_peer_closed(ring2):
    a_next, _, _, b_prev = ring2
    inc = b_prev.hold_bulk(10.0)
    t, res = _in_thread(lambda: inc.recv_into(np.empty(1 << 20, np.uint8), 10.0))
    time.sleep(0.2)
    a_next._sock.shutdown(socket.SHUT_RDWR)  # as the kernel does for a killed process
    t.join(5.0)
    assert isinstance(res.get("error"), PeerClosed), res


@pytest.mark.parametrize("held", [True, False])
def test_a_peer_closing_mid_frame_is_peer_closed_and_closes(ring2, held):
    a_next, _, _, b_prev = ring2
    a_next.send_bytes(b"y" * 10)
    a_next._sock.sendall(wire.bulk_header(20) + b"z" * 5)  # then 5 of a 20-byte frame's bytes
    a_next.close()
    recv_into = b_prev.hold_bulk(5.0).recv_into if held else b_prev.recv_into
    first = bytearray(10)
    recv_into(memoryview(first), 5.0)
    assert bytes(first) == b"y" * 10
    with pytest.raises(PeerClosed, match="closed the connection"):
        recv_into(memoryview(bytearray(20)), 5.0)
    assert b_prev.closed


def test_a_frame_of_another_size_is_a_protocol_error_and_closes(ring2):
    a_next, _, _, b_prev = ring2
    a_next.send_bytes(np.zeros(100, np.uint8))
    inc = b_prev.hold_bulk(5.0)
    with pytest.raises(ProtocolError, match="100"):
        inc.recv_into(np.empty(200, np.uint8), 5.0)
    assert b_prev.closed


def test_a_shorter_frame_with_more_behind_it_is_a_protocol_error_at_once(ring2):
    """Held, header and payload come in with one call: the header is still checked when that call returns,
    here as soon as the bytes behind the short frame fill the buffers, long before the hold's timeout."""
    a_next, _, _, b_prev = ring2
    a_next.send_bytes(np.zeros(100, np.uint8))
    a_next.send_bytes(np.ones(300, np.uint8))
    inc = b_prev.hold_bulk(10.0)
    t0 = time.monotonic()
    with pytest.raises(ProtocolError, match="expected a bulk frame of 200 bytes, got 100"):
        inc.recv_into(np.empty(200, np.uint8), 10.0)
    assert time.monotonic() - t0 < 2.0
    assert b_prev.closed


def test_a_control_message_where_a_held_bulk_frame_is_expected_is_a_protocol_error(ring2):
    a_next, _, _, b_prev = ring2
    a_next.send({"ack": 1})
    inc = b_prev.hold_bulk(0.5)
    with pytest.raises(ProtocolError, match="expected a bulk frame, got a control message"):
        inc.recv_into(np.empty(1 << 20, np.uint8), 0.5)
    assert b_prev.closed


def test_holding_a_closed_connection_is_peer_closed(ring2):
    a_next = ring2[0]
    a_next.close()
    with pytest.raises(PeerClosed):
        a_next.hold_bulk(1.0)
    with pytest.raises(ValueError):
        ring2[1].hold_bulk(0.0)


@contextlib.contextmanager
def _trickling(action):
    """Inside the block, `action` runs every 50 ms: a peer that keeps a held call moving, slowly."""
    stop = threading.Event()

    def run():
        while not stop.wait(0.05):
            try:
                action()
            except OSError:
                return
    t = threading.Thread(target=run)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(5.0)


def test_a_peer_that_trickles_a_frame_in_cannot_stretch_a_held_receive_past_its_deadline(ring2):
    a_next, _, _, b_prev = ring2
    a_next._sock.sendall(b"\x02" + (1 << 20).to_bytes(8, "big"))  # the header of a 1 MiB frame
    with _trickling(lambda: a_next._sock.sendall(b"x" * 100)):
        inc = b_prev.hold_bulk(0.3)
        t0 = time.monotonic()
        with pytest.raises(NetTimeout, match="mid-frame"):
            inc.recv_into(np.empty(1 << 20, np.uint8), 0.3)
        assert time.monotonic() - t0 < 1.5  # the deadline, not the peer's pace (which would take 50 min)
    assert b_prev.closed


def test_a_peer_that_reads_slowly_cannot_stretch_a_held_send_past_its_deadline(ring2):
    a_next, _, _, b_prev = ring2
    a_next.set_buffer_bytes(128 << 10)
    b_prev.set_buffer_bytes(128 << 10)
    with _trickling(lambda: b_prev._sock.recv(64 << 10)):
        out = a_next.hold_bulk(0.3)
        t0 = time.monotonic()
        with pytest.raises(NetTimeout, match="send"):
            out.send_bytes(np.zeros(64 << 20, np.uint8), 0.3)  # ~50 s at the reader's pace
        assert time.monotonic() - t0 < 1.5
    assert a_next.closed


def test_a_hold_under_a_microsecond_still_times_out(ring2):
    """A struct timeval of zero means 'wait forever' to the kernel."""
    _, _, _, b_prev = ring2
    inc = b_prev.hold_bulk(1e-7)
    t, res = _in_thread(lambda: inc.recv_into(np.empty(1024, np.uint8), 1e-7))
    t.join(2.0)
    alive = t.is_alive()
    b_prev.close()  # wakes it if it is blocked for good
    t.join(5.0)
    assert not alive and isinstance(res.get("error"), NetTimeout), res
