"""ReplicaComm: the small collectives inside one replica (check-in, decision broadcast, commit vote).

One collective replaces N RPCs to the leader: gloo's algorithms (and the emulator's tree) scale as
O(log N) rounds. Implementations:
- `LocalComm`: a replica of one rank.
- `GlooComm`: a torch.distributed ProcessGroupGloo of the replica's ranks, created on its own store
  prefix (no process-wide default group), so a restarted replica builds a fresh group.
- `TreeComm` (ftrun/replica/tree_comm.py): a k-ary tree over env.net, real or emulated.
Payloads are raw bytes and int64 vectors: nothing is pickled.
"""

from __future__ import annotations

import datetime
from typing import Literal, Protocol

import msgpack
import torch
import torch.distributed as dist

ReduceOp = Literal["min", "max", "sum"]


class ReplicaCommError(Exception):
    """A collective inside the replica failed (a rank died or timed out): the replica is broken."""


class ReplicaComm(Protocol):
    rank: int
    world_size: int

    def all_reduce_int(self, values: list[int], op: ReduceOp) -> list[int]: ...

    def broadcast_bytes(self, data: bytes | None, root: int = 0) -> bytes:
        """`data` on the root (ignored elsewhere); every rank returns the root's bytes."""

    def all_gather_bytes(self, data: bytes) -> list[bytes]: ...

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        """Rank 0 returns every rank's bytes in rank order; the others return None."""

    def scatter_bytes(self, chunks: list[bytes] | None) -> bytes:
        """Rank 0 supplies one chunk per rank (ignored elsewhere); rank r returns chunks[r]."""

    def close(self) -> None: ...


class LocalComm:
    rank, world_size = 0, 1

    def all_reduce_int(self, values: list[int], op: ReduceOp) -> list[int]:
        return list(values)

    def broadcast_bytes(self, data: bytes | None, root: int = 0) -> bytes:
        assert data is not None, "the root must supply the bytes"
        return bytes(data)

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        return [bytes(data)]

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        return [bytes(data)]

    def scatter_bytes(self, chunks: list[bytes] | None) -> bytes:
        assert chunks is not None and len(chunks) == 1, "the root must supply one chunk per rank"
        return bytes(chunks[0])

    def close(self) -> None:
        pass


_OPS = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}
BROADCAST_INLINE = 4096  # bytes of GlooComm's first broadcast collective: an 8-byte length, then the payload


class GlooComm:
    telemetry = None  # this rank's ftrun.diagnose.telemetry.Recorder, when root-cause telemetry is on

    def __init__(self, *, store: dist.Store, prefix: str, rank: int, world_size: int, timeout_s: float,
                 bind_host: str | None = None) -> None:
        """`bind_host`: the address gloo's pairs listen on and publish through the store (this host's
        interface in a multi-host replica); None keeps gloo's default (the hostname's address)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a replica of {world_size} ranks")
        self.rank, self.world_size = rank, world_size
        self._seq = 0  # collectives issued: the telemetry's collective id
        prefixed = dist.PrefixStore(prefix, store)
        if bind_host is None:
            self._pg = dist.ProcessGroupGloo(prefixed, rank, world_size, datetime.timedelta(seconds=timeout_s))
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = datetime.timedelta(seconds=timeout_s)
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
            self._pg = dist.ProcessGroupGloo(prefixed, rank, world_size, opts)

    @classmethod
    def of_group(cls, group: dist.ProcessGroup, *, rank: int, world_size: int) -> "GlooComm":
        """A ReplicaComm over an existing gloo group of the replica's ranks (e.g. one made with
        dist.new_group for a background checkpoint write, apart from the step's control group)."""
        comm = cls.__new__(cls)
        comm.rank, comm.world_size, comm._seq, comm._pg = rank, world_size, 0, group
        return comm

    def _group(self) -> dist.ProcessGroup:
        if self._pg is None:
            raise ReplicaCommError("collective on a closed replica group")
        return self._pg

    def _wait(self, work, what: str) -> None:
        """Telemetry: gloo has no tree of ours, so a collective is entered and our part sent when issued."""
        rec, self._seq = self.telemetry, self._seq + 1
        if rec: rec.tree_enter(self._seq)
        if rec: rec.tree_sent(self._seq)
        try:
            work.wait()
        except RuntimeError as e:  # gloo reports peer loss and timeouts as RuntimeError
            raise ReplicaCommError(f"{what} inside the replica failed: {e}") from e
        if rec: rec.tree_done(self._seq)

    def all_reduce_int(self, values: list[int], op: ReduceOp) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = _OPS[op]
        self._wait(self._group().allreduce([t], opts), f"all_reduce({op})")
        return t.tolist()

    def broadcast_bytes(self, data: bytes | None, root: int = 0) -> bytes:
        """One collective (length and bytes together) for up to BROADCAST_INLINE - 8 bytes, as the step's
        decision is; a longer payload's rest follows in a second one."""
        inline = BROADCAST_INLINE - 8
        data = bytes(data) if self.rank == root and data is not None else b""
        head = torch.zeros(BROADCAST_INLINE, dtype=torch.uint8)
        if self.rank == root:
            head[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
            if data:
                head[8:8 + min(len(data), inline)] = torch.frombuffer(bytearray(data[:inline]), dtype=torch.uint8)
        self._broadcast(head, root)
        n = int(head[:8].view(torch.int64).item())
        if n <= inline:
            return head[8:8 + n].numpy().tobytes()
        rest = torch.empty(n - inline, dtype=torch.uint8)
        if self.rank == root:
            rest.copy_(torch.frombuffer(bytearray(data[inline:]), dtype=torch.uint8))
        self._broadcast(rest, root)
        return head[8:].numpy().tobytes() + rest.numpy().tobytes()

    def _broadcast(self, t: torch.Tensor, root: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        self._wait(self._group().broadcast([t], opts), "broadcast")

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        longest = self.all_reduce_int([len(data)], "max")[0]
        mine = torch.zeros(longest + 8, dtype=torch.uint8)
        mine[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        mine[8:8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[8:8]
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._wait(self._group().allgather([out], [mine]), "all_gather")
        return [o[8:8 + int(o[:8].view(torch.int64).item())].numpy().tobytes() for o in out]

    # A gloo replica is a handful of processes on real hosts: gather and scatter reuse the all-gather and
    # the broadcast (O(N) bytes per rank) rather than gloo's rooted collectives with per-rank sizes.
    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        everyone = self.all_gather_bytes(data)
        return everyone if self.rank == 0 else None

    def scatter_bytes(self, chunks: list[bytes] | None) -> bytes:
        packed = None
        if self.rank == 0:
            if chunks is None or len(chunks) != self.world_size:
                raise ValueError(f"scatter needs one chunk per rank ({self.world_size})")
            packed = msgpack.packb([bytes(c) for c in chunks])
        return msgpack.unpackb(self.broadcast_bytes(packed, root=0))[self.rank]

    def close(self) -> None:
        # Drop the group and let its destructor tear it down. An explicit ProcessGroupGloo.shutdown()
        # aborted the process ("terminate called without an active exception") in about 1 run in 4
        # when the peer rank exited at the same time; dropping the reference did not, in 10 runs.
        self._pg = None
