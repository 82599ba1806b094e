"""TreeComm: ReplicaComm over env.net as a k-ary tree rooted at rank 0.

Reductions travel up the tree and results down it, so a collective costs O(log_k N) message latencies
and each rank handles at most k + 1 messages per collective — the property that lets check-in and
commit votes run at 8,192 ranks per replica. It runs on any Env (threads and sockets, or the emulator).

`FlatComm` is the naive variant (every rank messages the leader directly); it exists so the emulator
can show the scale bug it causes.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Collection

from ftrun.env.base import Connection, Env, Listener, NetError, ProtocolError, serve_connections
from ftrun.net import require_token, token_matches
from ftrun.replica.comm import ReduceOp, ReplicaCommError

log = logging.getLogger("ftrun.replica")
_COMBINE: dict[str, Callable[[int, int], int]] = {"min": min, "max": max, "sum": lambda a, b: a + b}


class TreeComm:
    """Connect with `TreeComm.build(...)`; every rank of the replica must call it."""

    telemetry = None  # this rank's ftrun.diagnose.telemetry.Recorder, when root-cause telemetry is on

    def __init__(self, *, rank: int, world_size: int, parent: Connection | None,
                 children: list[Connection], timeout_s: float, fanout: int = 16) -> None:
        self.rank, self.world_size = rank, world_size
        self._parent, self._children, self._timeout = parent, children, timeout_s
        self._fanout = fanout
        self._child_ranks = self.children_of(rank, world_size, fanout)
        if len(self._child_ranks) != len(children):
            raise ValueError(f"rank {rank} of {world_size} with fanout {fanout} has {len(self._child_ranks)} "
                             f"children, got {len(children)} connections")
        self._seq = 0

    @staticmethod
    def children_of(rank: int, world_size: int, fanout: int) -> list[int]:
        return [c for c in range(rank * fanout + 1, rank * fanout + fanout + 1) if c < world_size]

    @classmethod
    def build(cls, *, env: Env, rank: int, world_size: int, listener: Listener, addrs: list[str], token: str,
              fanout: int = 16, timeout_s: float = 30.0) -> "TreeComm":
        """Connect to the parent and accept the children. `addrs[r]` is rank r's listener address; `listener` is
        this rank's own, closed once the children are in (or the build failed); `token`: the job token, which
        every hello carries. A connection whose hello is not a missing child's with the token (check_hello) is
        closed and logged, and accepting goes on. Raises ReplicaCommError when the parent cannot be reached
        within `timeout_s` or the children are not all in `timeout_s` after accepting began."""
        if fanout < 1 or len(addrs) != world_size:
            raise ValueError(f"need fanout >= 1 and one address per rank, got {fanout}, {len(addrs)}")
        require_token(token, "TreeComm")
        expected = cls.children_of(rank, world_size, fanout)
        parent = None
        try:
            if rank > 0:
                parent = env.net.connect(addrs[(rank - 1) // fanout], timeout=timeout_s)
                parent.send({"rank": rank, "token": token})
            by_rank = _accept_children(env, listener, token, rank, expected, timeout_s)
        except (NetError, TimeoutError) as e:
            if parent is not None:
                parent.close()
            raise ReplicaCommError(f"rank {rank} could not join the replica tree: {e}") from e
        return cls(rank=rank, world_size=world_size, parent=parent,
                   children=[by_rank[c] for c in expected], timeout_s=timeout_s, fanout=fanout)

    # -- the two primitives: gather up, broadcast down -----------------------------------------
    def _up(self, value, combine: Callable):
        """Combine children's values with ours; the root returns the total, others return None."""
        self._seq += 1
        if self.telemetry: self.telemetry.tree_enter(self._seq)
        for child in self._children:
            value = combine(value, self._recv(child)["v"])
        if self.telemetry: self.telemetry.tree_sent(self._seq)
        if self._parent is None:
            return value
        self._send(self._parent, {"s": self._seq, "v": value})
        return None

    def _down(self, value):
        if self._parent is not None:
            value = self._recv(self._parent)["v"]
        if self._children:
            msg = {"s": self._seq, "v": value}  # sent as is to every child (sending never mutates it)
            for child in self._children:
                self._send(child, msg)
        if self.telemetry: self.telemetry.tree_done(self._seq)
        return value

    def _recv(self, conn: Connection) -> dict:
        try:
            msg = conn.recv(timeout=self._timeout)
        except (NetError, TimeoutError) as e:
            raise ReplicaCommError(f"rank {self.rank}: collective {self._seq} failed: {e}") from e
        if msg.get("s") != self._seq:
            raise ReplicaCommError(f"rank {self.rank}: expected collective {self._seq}, got {msg.get('s')}")
        return msg

    def _send(self, conn: Connection, msg: dict) -> None:
        try:
            conn.send(msg, timeout=self._timeout)
        except NetError as e:
            raise ReplicaCommError(f"rank {self.rank}: collective {self._seq} failed: {e}") from e

    # -- ReplicaComm ---------------------------------------------------------------------------
    def all_reduce_int(self, values: list[int], op: ReduceOp) -> list[int]:
        f = _COMBINE[op]
        total = self._up(list(values), lambda a, b: [f(x, y) for x, y in zip(a, b)])
        return self._down(total)

    def broadcast_bytes(self, data: bytes | None, root: int = 0) -> bytes:
        if root != 0:
            raise ValueError("TreeComm broadcasts from its root, rank 0")
        self._seq += 1
        return self._down(data if self.rank == 0 else None)

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        pairs = self._up([[self.rank, bytes(data)]], lambda a, b: a + b)
        got = self._down(None if pairs is None else [d for _, d in sorted(pairs)])
        return list(got)

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        pairs = self._up([[self.rank, bytes(data)]], lambda a, b: a + b)
        return None if pairs is None else [d for _, d in sorted(pairs)]

    def scatter_bytes(self, chunks: list[bytes] | None) -> bytes:
        """Each rank receives only its subtree's chunks: O(subtree) bytes per hop, not O(N) per rank."""
        self._seq += 1
        if self._parent is None:
            if chunks is None or len(chunks) != self.world_size:
                raise ValueError(f"scatter needs one chunk per rank ({self.world_size})")
            mine = dict(enumerate(chunks))
        else:
            mine = {int(r): c for r, c in self._recv(self._parent)["v"]}
        if self._children:
            by_child: dict[int, list] = {c: [] for c in self._child_ranks}
            for r, c in mine.items():
                if r != self.rank:
                    by_child[self._child_of(r)].append([r, c])
            for rank, conn in zip(self._child_ranks, self._children):
                self._send(conn, {"s": self._seq, "v": by_child[rank]})
        return bytes(mine[self.rank])

    def _child_of(self, rank: int) -> int:
        """The child of this rank whose subtree holds `rank` (a descendant)."""
        while True:
            up = (rank - 1) // self._fanout
            if up == self.rank:
                return rank
            rank = up

    def close(self) -> None:
        for conn in self._children + ([self._parent] if self._parent else []):
            conn.close()


def check_hello(hello: Any, token: str, children: Collection[int], joined: Collection[int]) -> tuple[int | None, str]:
    """(the child's rank, "") for a hello with the job token from one of `children` not in `joined` yet, else
    (None, why). Pure."""
    if not isinstance(hello, dict):
        return None, f"its hello is a {type(hello).__name__}, not a map"
    if not token_matches(hello.get("token"), token):
        return None, "missing or wrong job token"
    child = hello.get("rank")
    if type(child) is not int:
        return None, f"rank {child!r:.40} is not an int"
    if child not in children:
        return None, f"rank {child} is not a child of this rank"
    if child in joined:
        return None, f"child {child} joined already"
    return child, ""


def _accept_children(env: Env, listener: Listener, token: str, rank: int, expected: list[int],
                     timeout_s: float) -> dict[int, Connection]:
    """{child rank: its connection} for every rank in `expected`, accepted on `listener` (closed on return).
    Each connection's hello is read on a task of its own, so a peer that never sends one holds nothing up;
    the ones not kept are closed. Raises TimeoutError when the children are not all in within `timeout_s`."""
    if not expected:
        listener.close()
        return {}
    children, hellos, accepted, ended = set(expected), env.queue(), set(), env.event()
    deadline = env.clock.now() + timeout_s

    def note(conn: Connection) -> None:
        accepted.add(conn)
        if ended.is_set():  # accepted after the build ended, so its loop below missed it
            conn.close()

    def greet(conn: Connection) -> None:
        try:
            hellos.put((conn, conn.recv(timeout=max(deadline - env.clock.now(), 0.0))))
        except NetError as e:  # garbage, a close or silence (closed below)
            hellos.put((conn, e))

    serve_connections(env, listener, greet, name=f"tree-accept-{rank}", conn_name=f"tree-hello-{rank}",
                      on_accept=note)
    by_rank: dict[int, Connection] = {}
    try:
        while len(by_rank) < len(expected):
            try:
                conn, hello = hellos.get(timeout=max(deadline - env.clock.now(), 0.0))
            except TimeoutError:
                missing = [c for c in expected if c not in by_rank]
                raise TimeoutError(f"children {missing} did not join within {timeout_s}s") from None
            if isinstance(hello, NetError) and not isinstance(hello, ProtocolError):  # silent or gone (the
                # listener logs a flood of such once per burst): not a warning each
                log.debug("replica tree rank %d: closed a connection from %s: no hello: %s", rank, conn.peer_addr,
                          hello)
                conn.close()
                accepted.discard(conn)  # not kept until the build ends: a closed one still holds a descriptor
                continue
            if isinstance(hello, ProtocolError):
                child, why = None, f"no hello: {hello}"
            else:
                child, why = check_hello(hello, token, children, by_rank)
            if child is None:
                log.warning("replica tree rank %d: closed a connection from %s: %s", rank, conn.peer_addr, why)
                conn.close()
                accepted.discard(conn)
            else:
                by_rank[child] = conn
    finally:
        ended.set()
        listener.close()
        keep = set(by_rank.values()) if len(by_rank) == len(expected) else set()
        for conn in list(accepted):
            if conn not in keep:
                conn.close()
    return by_rank


class FlatComm(TreeComm):
    """Every rank is a direct child of the leader: the naive check-in the tree replaces."""

    @classmethod
    def build(cls, *, env: Env, rank: int, world_size: int, listener: Listener, addrs: list[str], token: str,
              fanout: int = 0, timeout_s: float = 30.0) -> "TreeComm":
        return super().build(env=env, rank=rank, world_size=world_size, listener=listener, addrs=addrs,
                             token=token, fanout=max(world_size - 1, 1), timeout_s=timeout_s)
