"""Shared staging slots for ring neighbours on the same host.

For co-located ranks the data plane skips the network: each rank's staging slots live in a file-backed
shared mapping that its next rank maps too, so a "send" is a small control message naming the slot and
the receiver reduces straight out of its neighbour's slot (then acknowledges it). This is the CPU form of
the paper's design (CPU control plane, data in memory both sides can reach) and halves the memory
traffic of a loopback socket, which copies every byte into the kernel and out again.

Lifetime: the owner creates the file, the neighbour maps it and says so, and the owner then unlinks it,
so nothing is left in /dev/shm even if either process is SIGKILLed afterwards; the memory goes away
when both have unmapped it. A process killed inside that window leaves its file behind: the next
`create` on the host removes files whose owner pid (in the name) is no longer running.
"""

from __future__ import annotations

import mmap
import os
import secrets

import numpy as np

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


def host_identity() -> str:
    """Equal for two processes exactly when they can share memory (same kernel boot) and are on the same
    network host: processes in different network namespaces (containers, `ftrun.launch.netns` hosts)
    are different hosts, so their ring links go over the network they were given."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = "no-netns"
    return f"{os.uname().nodename}/{boot}/{netns}"


def same_machine(a: str, b: str) -> bool:
    """Whether two host_identity() values are one machine (one kernel boot), network namespaces aside:
    the processes then share CPUs and caches even when their ring link crosses namespaces. Pure."""
    return a.rpartition("/")[0] == b.rpartition("/")[0]


def _pid_of(name: str) -> int | None:
    """ftrun-ftar-{tag}-{pid}-{hex} -> pid (tags contain no '-')."""
    parts = name.split("-")
    return int(parts[3]) if len(parts) == 5 and parts[3].isdigit() else None


def sweep_stale() -> list[str]:
    """Remove staging files of processes that are gone (killed between create and unlink)."""
    removed = []
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith("ftrun-ftar-")]
    except OSError:
        return removed
    for name in names:
        pid = _pid_of(name)
        if pid is None or pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
            continue  # its owner runs
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # another user's live process
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except OSError:
            pass
    return removed


class SharedSlots:
    """A shared byte area of `nbytes`, as a uint8 numpy array (`array`)."""

    def __init__(self, path: str, nbytes: int, create: bool) -> None:
        self.path, self.nbytes = path, nbytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, nbytes)
            elif os.fstat(fd).st_size != nbytes:
                raise ValueError(f"shared slots {path} hold {os.fstat(fd).st_size} bytes, expected {nbytes}")
            self._map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self._owner = create

    @classmethod
    def create(cls, nbytes: int, tag: str) -> "SharedSlots":
        sweep_stale()
        return cls(os.path.join(SHM_DIR, f"ftrun-ftar-{tag}-{os.getpid()}-{secrets.token_hex(6)}"), nbytes, True)

    @classmethod
    def attach(cls, path: str, nbytes: int) -> "SharedSlots":
        if not os.path.basename(path).startswith("ftrun-ftar-") or os.path.dirname(path) != SHM_DIR:
            raise ValueError(f"refusing to map {path!r}: not an FTAR staging file")
        return cls(path, nbytes, False)

    def unlink(self) -> None:
        """Remove the name (the owner, once the neighbour has mapped it)."""
        if self._owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self._owner = False

    def close(self) -> None:
        self.unlink()
        self.array = None  # type: ignore[assignment]
        try:
            self._map.close()
        except BufferError:
            pass  # a view still exists (an aborted operation); the mapping goes when it is collected
