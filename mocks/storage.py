"""A mock object store with modeled latency, behind the `ftrun.storage.Storage` seam.

Blobs live in a dict; every call waits on the Env's clock for a first-byte latency plus size over
bandwidth, so an emulated lighthouse persisting its state, or ranks writing loader_state every step,
pay what a remote object store (or a local disk) would charge. Writes are atomic (a reader sees the
old or the new blob, never a torn one), as the seam requires, because the new bytes replace the old
in one assignment once the modeled write is over.

Presets: `MockObjectStore.remote(env)` (an S3-like store: 20 ms first byte, 200 MB/s per stream) and
`MockObjectStore.local_disk(env)` (an fsync'ed local SSD write: 1 ms, 1 GB/s). These are modeling
assumptions, not measurements.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

__all__ = ["MockObjectStore"]


class MockObjectStore:
    """Storage (write_atomic / read) over an in-memory dict, with latency charged to `env.clock`.

    Args:
        env: the Env of the task that calls it (its clock is slept on).
        write_latency_s, read_latency_s: first-byte latency of a put and a get.
        bandwidth_bytes_per_s: transfer rate of one call's payload.
    Raises ValueError on negative latencies or a non-positive bandwidth; `write_atomic`/`read` raise
    ValueError on a key FileStorage would reject (absolute, '..', empty).
    """

    def __init__(self, *, env: Any, write_latency_s: float = 0.02, read_latency_s: float = 0.02,
                 bandwidth_bytes_per_s: float = 200e6) -> None:
        if write_latency_s < 0 or read_latency_s < 0 or bandwidth_bytes_per_s <= 0:
            raise ValueError("latencies must be >= 0 and bandwidth > 0")
        self.env = env
        self.write_latency_s, self.read_latency_s = write_latency_s, read_latency_s
        self.bandwidth = bandwidth_bytes_per_s
        self._blobs: dict[str, bytes] = {}
        self.num_writes = self.num_reads = 0
        self.bytes_written = self.bytes_read = 0
        self.busy_s = 0.0  # modeled seconds spent in calls
        self.append_latency_s = 0.0  # an `append` (a log's write(2) without fsync)

    @classmethod
    def remote(cls, env: Any) -> "MockObjectStore":
        return cls(env=env, write_latency_s=0.02, read_latency_s=0.02, bandwidth_bytes_per_s=200e6)

    @classmethod
    def local_disk(cls, env: Any) -> "MockObjectStore":
        return cls(env=env, write_latency_s=0.001, read_latency_s=0.0002, bandwidth_bytes_per_s=1e9)

    def _wait(self, latency: float, nbytes: int) -> None:
        seconds = latency + nbytes / self.bandwidth
        self.busy_s += seconds
        self.env.clock.sleep(seconds)

    def write_atomic(self, key: str, data: bytes) -> None:
        _check_key(key)
        blob = bytes(data)
        self._wait(self.write_latency_s, len(blob))
        self._blobs[key] = blob  # visible all at once, after the modeled write
        self.num_writes += 1
        self.bytes_written += len(blob)

    def append(self, key: str, data: bytes) -> None:
        """Append to the blob at `key`, as a log file's O_APPEND write(2) without fsync (the real audit log,
        ftrun.data.audit.FileAuditSink): `append_latency_s` plus the bytes, not a whole atomic write."""
        _check_key(key)
        self._wait(self.append_latency_s, len(data))
        self._blobs[key] = self._blobs.get(key, b"") + bytes(data)
        self.num_writes += 1
        self.bytes_written += len(data)

    def charge_write(self, nbytes: int) -> None:
        """Model writing `nbytes` of bulk data (e.g. a shape-only checkpoint's shards) without keeping it."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        self._wait(self.write_latency_s, nbytes)
        self.num_writes += 1
        self.bytes_written += nbytes

    def read(self, key: str) -> bytes | None:
        _check_key(key)
        blob = self._blobs.get(key)
        self._wait(self.read_latency_s, len(blob) if blob is not None else 0)
        self.num_reads += 1
        if blob is not None:
            self.bytes_read += len(blob)
        return blob

    def peek(self, key: str) -> bytes | None:
        """The blob at `key` without a modeled read (for inspecting a store after an emulated run)."""
        _check_key(key)
        return self._blobs.get(key)

    def keys(self) -> list[str]:
        return sorted(self._blobs)


def _check_key(key: str) -> None:
    """The real store's key rule (ftrun.storage.FileStorage): a relative path without '..'."""
    if not key or key.startswith("/") or ".." in PurePosixPath(key).parts:
        raise ValueError(f"storage key {key!r} must be a relative path without '..'")
