"""The catch-up client connection (ftrun.catchup.conn) as a protocol, fed bytes by hand: pipelined
responses are taken in order into their own buffers, however the bytes are split between receives,
with each body's CRC32; a short or overlong stream fails the right requests."""

from __future__ import annotations

import asyncio
import zlib

import pytest

from ftrun.catchup.conn import RECV_STEP, ConnectionLost, HttpConnection
from ftrun.catchup.errors import CatchupPeerError

pytestmark = pytest.mark.timeout(30)


class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data) -> None:
        self.written.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True


def response(body: bytes, status: int = 200, extra: str = "") -> bytes:
    return f"HTTP/1.1 {status} OK\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


def feed(conn: HttpConnection, data: bytes, step: int) -> None:
    """Deliver `data` as the event loop would: into get_buffer's buffer, at most `step` bytes a time."""
    pos = 0
    while pos < len(data):
        buf = conn.get_buffer(-1)
        n = min(step, len(buf), len(data) - pos)
        buf[:n] = data[pos:pos + n]
        conn.buffer_updated(n)
        pos += n


def into(n: int):
    dest = memoryview(bytearray(n))
    return dest, (lambda head: dest if head.status == 200 else memoryview(bytearray(head.content_length)))


def run(body):
    async def main():
        conn = HttpConnection("127.0.0.1", 1, "tok")
        transport = FakeTransport()
        conn.connection_made(transport)
        return await body(conn, transport)

    return asyncio.run(main())


@pytest.mark.parametrize("step", [1, 7, 100, 1 << 20])
def test_pipelined_responses_land_in_their_own_buffers_with_their_crcs(step):
    a, b, c = b"a" * 300, bytes(range(256)) * 3, b""

    async def body(conn, transport):
        (da, pa), (db, pb), (dc, pc) = into(len(a)), into(len(b)), into(len(c))
        futures = [conn.send("/a", pa), conn.send("/b", pb), conn.send("/c", pc)]
        assert len(transport.written) == 3 and not conn.usable  # all three went out before any answer
        feed(conn, response(a) + response(b) + response(c), step)
        got = [await f for f in futures]
        assert [bytes(r.body) for r in got] == [a, b, c]
        assert bytes(da) == a and bytes(db) == b
        assert [r.crc32 for r in got] == [zlib.crc32(x) for x in (a, b, c)]
        assert conn.usable

    run(body)


def test_a_small_error_body_and_the_next_head_in_one_receive():
    shard = b"x" * 1000

    async def body(conn, transport):
        (_, p404), (dest, pshard) = into(5), into(len(shard))
        first, second = conn.send("/gone", p404), conn.send("/shard", pshard)
        feed(conn, response(b'{"e":1}', 404) + response(shard), 1 << 20)
        r1, r2 = await first, await second
        assert (r1.head.status, bytes(r1.body)) == (404, b'{"e":1}')
        assert r2.head.status == 200 and bytes(dest) == shard

    run(body)


@pytest.mark.parametrize("step", [2, 1 << 20])
def test_bytes_past_the_last_response_close_the_connection(step):
    async def body(conn, transport):
        _, pick = into(3)
        future = conn.send("/a", pick)
        feed(conn, response(b"abc") + b"HTTP/1.1 200", step)
        assert bytes((await future).body) == b"abc"  # whole by its Content-Length (and its CRC is checked)
        assert transport.closed and not conn.usable  # but the stream is out of step: never reused
        with pytest.raises(ConnectionLost):
            conn.send("/b", pick)

    run(body)


def test_a_connection_lost_mid_body_fails_that_request_and_the_ones_behind_it():
    async def body(conn, transport):
        (_, pa), (_, pb) = into(100), into(100)
        first, second = conn.send("/a", pa), conn.send("/b", pb)
        partial = response(b"z" * 100)[:-40]
        feed(conn, partial, 1 << 20)
        conn.connection_lost(None)
        with pytest.raises(ConnectionLost) as e1:
            await first
        with pytest.raises(ConnectionLost) as e2:
            await second
        assert e1.value.got == len(partial) and e2.value.got == 0  # the second never started: safe to retry

    run(body)


def test_a_connection_close_response_fails_the_pipelined_request_behind_it_as_never_answered():
    async def body(conn, transport):
        (da, pa), (_, pb) = into(4), into(4)
        first, second = conn.send("/a", pa), conn.send("/b", pb)
        feed(conn, response(b"abcd", extra="Connection: close\r\n"), 1 << 20)
        assert bytes((await first).body) == b"abcd"
        with pytest.raises(ConnectionLost) as e:
            await second
        assert e.value.got == 0 and transport.closed
        with pytest.raises(ConnectionLost):
            conn.send("/c", pa)

    run(body)


def test_a_wrong_content_length_for_the_buffer_is_a_peer_error_for_that_request_only():
    async def body(conn, transport):
        (_, pa), (_, pb) = into(10), into(4)
        first, second = conn.send("/a", pa), conn.send("/b", pb)
        feed(conn, response(b"12345"), 1 << 20)  # 5 bytes where the caller's buffer holds 10
        with pytest.raises(CatchupPeerError, match="10 bytes for a 5-byte body"):
            await first
        with pytest.raises(ConnectionLost):
            await second
        assert transport.closed

    run(body)


def test_a_large_body_is_received_in_bounded_pieces_and_arrives_whole():
    big = bytes(range(256)) * ((RECV_STEP * 2 + 1000) // 256)

    async def body(conn, transport):
        dest, pick = into(len(big))
        future = conn.send("/big", pick)
        feed(conn, response(big)[:200], 1 << 30)  # the head and the first bytes of the body
        offered, pos = [], 200 - (len(response(big)) - len(big))  # body bytes delivered so far
        while not future.done():
            buf = conn.get_buffer(-1)
            offered.append(buf.nbytes)
            buf[:] = big[pos:pos + buf.nbytes]
            conn.buffer_updated(buf.nbytes)
            pos += buf.nbytes
        assert max(offered) == RECV_STEP
        assert bytes(dest) == big and (await future).crc32 == zlib.crc32(big)

    run(body)


def test_pipelined_large_bodies_get_each_its_own_crc_and_are_answered_in_order():
    a = bytes(range(256)) * ((RECV_STEP * 5 // 2) // 256)
    b = bytes(reversed(range(256))) * ((RECV_STEP * 3 // 2 + 512) // 256)

    async def body(conn, transport):
        (da, pa), (db, pb) = into(len(a)), into(len(b))
        first, second = conn.send("/a", pa), conn.send("/b", pb)
        first_done_before = []
        second.add_done_callback(lambda f: first_done_before.append(first.done()))
        feed(conn, response(a) + response(b), 64 << 10)
        got = [await first, await second]
        await asyncio.sleep(0)  # the done callback
        assert first_done_before == [True] and bytes(da) == a and bytes(db) == b
        assert [r.crc32 for r in got] == [zlib.crc32(a), zlib.crc32(b)]

    run(body)
