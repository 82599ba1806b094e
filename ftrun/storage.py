"""The Storage seam: small keyed blobs written atomically (lighthouse state, loader_state, manifests).

`FileStorage` writes to a temporary file, fsyncs it, renames it over the target and fsyncs the folder,
so a reader (or a restart after `kill -9`) sees either the old or the new content, never a torn one.
The emulator provides a mock object store with modeled latency behind the same interface
(mocks.storage.MockObjectStore); tests/unit/test_storage_contract.py runs one contract against all.
`StorageAuditSink` keeps an audit log in any of them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol


class Storage(Protocol):
    def write_atomic(self, key: str, data: bytes) -> None: ...

    def read(self, key: str) -> bytes | None:
        """The blob at `key`, or None if there is none."""


class FileStorage:
    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / _checked(key)

    def write_atomic(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def read(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None


class StorageAuditSink:
    """An audit-log sink (ftrun.data.audit.AuditLog) over any Storage: the log is one blob at `key`,
    rewritten whole, atomically, on every append, so a reader never sees a torn record and an object
    store without appends can hold it. Meant for one writer (a replica incarnation's leader) and a log
    of a run's steps, not millions of records."""

    def __init__(self, storage: Storage, key: str) -> None:
        self.storage, self.key = storage, key
        self._data = bytearray(storage.read(key) or b"")

    def __call__(self, data: bytes) -> None:
        self._data += data
        self.storage.write_atomic(self.key, bytes(self._data))


class MemoryStorage:
    """Storage in a dict: for tests and in-process runs. Writes are atomic by construction."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}

    def write_atomic(self, key: str, data: bytes) -> None:
        self.blobs[_checked(key)] = bytes(data)

    def read(self, key: str) -> bytes | None:
        return self.blobs.get(_checked(key))


def _checked(key: str) -> str:
    """The key rule every Storage follows: a relative path without '..' (ValueError otherwise)."""
    if not key or key.startswith("/") or ".." in Path(key).parts:
        raise ValueError(f"storage key {key!r} must be a relative path without '..'")
    return key
