"""The Kernels seam: FTAR's data plane (copy, reduce, fused reduce+copy) behind one interface.

Backends (each passes tests/unit/test_ftar_kernels_contract.py):
- `ftrun.ftar.cpu_kernels.CpuKernels`: numpy / numba on host memory; synchronous.
- `ftrun.ftar.cuda_kernels.CudaKernels`: the csrc/ CUDA kernels on device or pinned host memory,
  enqueued on a CUDA stream (asynchronous until `synchronize()`).
- `mocks.ftar_kernels.ShapeOnlyKernels`: touches no memory; returns modeled seconds.

Every op addresses bytes: (buffer, byte offset) pairs and a byte count, so the schedule's offsets
are used as they are. What a buffer is depends on the backend (CPU: a writable 1-D uint8 numpy
array; CUDA: an int address or an object with `data_ptr()`; shape-only: anything, never read).
Regions passed to one call must not overlap, except that `reduce_copy` may be given the same region
as `src` and `out` (the schedule's ReduceCopy does: slot += data; data <- slot).

Each op returns modeled seconds: the device time the op stands for beyond the wall time the call
itself took. Backends that do the work (CPU) or enqueue it (CUDA) return 0.0; the shape-only backend
returns its model, which an emulated engine charges to its virtual clock (`env.clock.sleep`).

Errors: bad arguments raise ValueError; a backend that cannot run here raises
KernelUnavailableError; a failure inside a backend raises KernelError (an engine treats both as
fatal for the rank, never as a peer's fault).
"""

from __future__ import annotations

import enum
from typing import Any, Protocol, runtime_checkable


MAX_THREADS = 512  # csrc/ftar_kernels.h FTAR_MAX_THREADS (the kernels' __launch_bounds__)
MAX_BLOCKS = 65535  # csrc/ftar_kernels.h FTAR_MAX_BLOCKS
# The CUDA backend's default launch shape (ftrun.ftar.cuda_kernels and its CPU shadow mocks.ftar_kernels).
DEFAULT_BLOCKS = 2  # FT-HSDP §4.2: two SMs hide copy/reduce behind the network
DEFAULT_THREADS = 512


def check_launch_shape(blocks: int, threads: int) -> None:
    """Raise ValueError unless (blocks, threads) is a launch shape the csrc/ kernels accept."""
    if not (1 <= blocks <= MAX_BLOCKS and 1 <= threads <= MAX_THREADS):
        raise ValueError(f"blocks={blocks} must be 1..{MAX_BLOCKS} and threads={threads} 1..{MAX_THREADS}")


class KernelError(RuntimeError):
    """A kernel backend failed (launch error, device fault). `code` is the backend's error code."""

    def __init__(self, message: str, code: int = -1) -> None:
        super().__init__(message)
        self.code = code


class KernelUnavailableError(KernelError):
    """The backend cannot run on this machine (no GPU, library not built)."""


class DType(enum.IntEnum):
    """Element types FTAR reduces. Values are the dtype codes of csrc/ftar_kernels.h."""

    FLOAT32 = 0
    FLOAT16 = 1
    BFLOAT16 = 2

    @property
    def itemsize(self) -> int:
        return 4 if self is DType.FLOAT32 else 2

    @classmethod
    def parse(cls, value: Any) -> "DType":
        """Accept a DType, a name ('float32', 'fp16', 'bf16', ...), a numpy dtype or a torch dtype.

        Raises: ValueError for anything else.
        """
        if isinstance(value, DType):
            return value
        if isinstance(value, type):  # numpy scalar types such as np.float32
            value = value.__name__
        name = str(value).lower().removeprefix("torch.").removeprefix("dtype(").strip("')\"")
        found = _ALIASES.get(name)
        if found is None:
            raise ValueError(f"unsupported FTAR dtype {value!r}; expected one of float32, float16, bfloat16")
        return found


_ALIASES = {
    "float32": DType.FLOAT32, "fp32": DType.FLOAT32, "float": DType.FLOAT32, "f4": DType.FLOAT32,
    "float16": DType.FLOAT16, "fp16": DType.FLOAT16, "half": DType.FLOAT16, "f2": DType.FLOAT16,
    "bfloat16": DType.BFLOAT16, "bf16": DType.BFLOAT16,
}


class WaitStatus(enum.IntEnum):
    """Status a device-side flag wait writes (csrc/ftar_kernels.h FTAR_WAIT_*)."""

    OK = 0  # the flag reached the expected value
    TIMEOUT = 1  # the timeout passed first
    ABORTED = 2  # the host wrote a negative flag value (cancel queued work)


@runtime_checkable
class Kernels(Protocol):
    """FTAR's data-plane kernels. Threading: one caller at a time per instance."""

    computes_values: bool  # False for backends that model time without touching memory

    def copy(self, dst: Any, dst_offset: int, src: Any, src_offset: int, nbytes: int) -> float:
        """dst[dst_offset : +nbytes] <- src[src_offset : +nbytes], bytes exactly.

        Returns modeled seconds. Raises ValueError on negative or out-of-range regions.
        """

    def reduce(self, dst: Any, dst_offset: int, src: Any, src_offset: int, nbytes: int,
               dtype: DType) -> float:
        """dst += src elementwise over nbytes bytes of `dtype` (half types accumulate in float32 and
        round to nearest even once per element).

        Returns modeled seconds. Raises ValueError if nbytes is not a multiple of dtype.itemsize or a
        region is out of range.
        """

    def reduce_copy(self, dst: Any, dst_offset: int, src: Any, src_offset: int, out: Any,
                    out_offset: int, nbytes: int, dtype: DType) -> float:
        """dst += src; out <- dst, in one pass (the fused last reduce-scatter step). `out` may be
        the same region as `src`. Returns and raises as `reduce`."""

    def synchronize(self) -> float:
        """Block until every op issued so far has finished (a no-op for synchronous backends).

        Returns modeled seconds (0.0 for real backends).
        """


def check_region(name: str, offset: int, nbytes: int, size: int | None) -> None:
    """Raise ValueError unless [offset, offset + nbytes) is a valid region of a `size`-byte buffer
    (size None: bounds unknown, only signs are checked)."""
    if offset < 0 or nbytes < 0:
        raise ValueError(f"{name}: negative offset {offset} or nbytes {nbytes}")
    if size is not None and offset + nbytes > size:
        raise ValueError(f"{name}: region [{offset}, {offset + nbytes}) exceeds the buffer's {size} bytes")


def check_elements(nbytes: int, dtype: DType) -> int:
    """The element count of nbytes of dtype; ValueError if nbytes splits an element."""
    count, rest = divmod(nbytes, dtype.itemsize)
    if rest:
        raise ValueError(f"nbytes={nbytes} is not a multiple of {dtype.name} itemsize {dtype.itemsize}")
    return count
