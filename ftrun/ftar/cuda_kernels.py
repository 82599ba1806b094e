"""CUDA backend of the Kernels seam: the csrc/ kernels, loaded with ctypes from libftar_kernels.so.

Importing this module needs neither a GPU nor the built library; both are looked for when a
`CudaKernels` is created (or `load_library()` is called), which raises KernelUnavailableError with
what is missing. Build the library with `bash csrc/build.sh`.

Buffers are addresses: an int (a device pointer, or a host-pinned pointer the device can use
through unified addressing) or an object with `data_ptr()` such as a torch CUDA or pinned tensor;
byte offsets are added to the address. Ops are enqueued on the instance's stream and return at
once (0.0 modeled seconds); `synchronize()` waits for them. Launch failures raise KernelError with
CUDA's message. The shadow loader replaces this module with `mocks.ftar_kernels` (same public API).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

from ftrun.ftar.kernels import (
    DEFAULT_BLOCKS,
    DEFAULT_THREADS,
    DType,
    KernelError,
    KernelUnavailableError,
    WaitStatus,
    check_elements,
    check_launch_shape,
    check_region,
)

__all__ = [
    "CudaKernels",
    "DEFAULT_BLOCKS",
    "DEFAULT_THREADS",
    "KernelError",
    "KernelUnavailableError",
    "WaitStatus",
    "default_library_path",
    "is_available",
]

ABI_VERSION = 1  # csrc/ftar_kernels.h FTAR_ABI_VERSION
BYTE_DTYPE = 3  # csrc/ftar_kernels.h FTAR_BYTE (copy only)

_c_void_p, _c_int, _c_i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_SIGNATURES = {
    "ftar_copy": [_c_void_p, _c_void_p, _c_i64, _c_int, _c_void_p, _c_int, _c_int, _c_void_p],
    "ftar_reduce": [_c_void_p, _c_void_p, _c_i64, _c_int, _c_void_p, _c_int, _c_int, _c_void_p],
    "ftar_reduce_copy": [_c_void_p, _c_void_p, _c_void_p, _c_i64, _c_int, _c_void_p, _c_int, _c_int,
                         _c_void_p],
    "ftar_wait_flag": [_c_void_p, _c_i64, _c_i64, _c_void_p, _c_void_p],
}


def default_library_path() -> Path:
    """csrc/build/libftar_kernels.so in the source tree this module belongs to."""
    return Path(__file__).resolve().parents[2] / "csrc" / "build" / "libftar_kernels.so"


class FtarLibrary:
    """Typed ctypes bindings of csrc/ftar_kernels.h; each launcher raises KernelError on a nonzero
    code. Arguments are raw: int addresses, element counts, dtype codes, an int stream handle."""

    def __init__(self, path: Path) -> None:
        try:
            self._lib = ctypes.CDLL(str(path))
        except OSError as e:
            raise KernelUnavailableError(f"cannot load FTAR CUDA kernels from {path}: {e}; "
                                         "build them with `bash csrc/build.sh`") from e
        try:
            for name, argtypes in _SIGNATURES.items():
                fn = getattr(self._lib, name)
                fn.argtypes, fn.restype = argtypes, ctypes.c_int
            self._lib.ftar_error_string.argtypes, self._lib.ftar_error_string.restype = [_c_int], ctypes.c_char_p
            self._lib.ftar_abi_version.restype = ctypes.c_int
        except AttributeError as e:
            raise KernelUnavailableError(f"{path} lacks an FTAR symbol ({e}); rebuild it") from e
        version = self._lib.ftar_abi_version()
        if version != ABI_VERSION:
            raise KernelUnavailableError(f"{path} has ABI version {version}, expected {ABI_VERSION}; rebuild it")
        self.path = path

    def error_string(self, code: int) -> str:
        return (self._lib.ftar_error_string(code) or b"?").decode()

    def _check(self, name: str, code: int) -> None:
        if code:
            raise KernelError(f"{name} failed with code {code}: {self.error_string(code)}", code)

    def copy(self, dst: int, src: int, count: int, dtype: int, guard: int | None, blocks: int,
             threads: int, stream: int) -> None:
        self._check("ftar_copy", self._lib.ftar_copy(dst, src, count, dtype, guard, blocks, threads, stream))

    def reduce(self, dst: int, src: int, count: int, dtype: int, guard: int | None, blocks: int,
               threads: int, stream: int) -> None:
        self._check("ftar_reduce", self._lib.ftar_reduce(dst, src, count, dtype, guard, blocks, threads, stream))

    def reduce_copy(self, dst: int, src: int, out: int, count: int, dtype: int, guard: int | None,
                    blocks: int, threads: int, stream: int) -> None:
        code = self._lib.ftar_reduce_copy(dst, src, out, count, dtype, guard, blocks, threads, stream)
        self._check("ftar_reduce_copy", code)

    def wait_flag(self, flag: int, expected: int, timeout_ns: int, status: int, stream: int) -> None:
        self._check("ftar_wait_flag", self._lib.ftar_wait_flag(flag, expected, timeout_ns, status, stream))


def load_library(path: str | Path | None = None) -> FtarLibrary:
    """Load the kernels library (default: `default_library_path()`). Needs no GPU.

    Raises: KernelUnavailableError if it is missing, unloadable or of another ABI version.
    """
    p = Path(path) if path is not None else default_library_path()
    if not p.exists():
        raise KernelUnavailableError(f"FTAR CUDA kernels not built: {p} is missing; run `bash csrc/build.sh`")
    return FtarLibrary(p)


def is_available(path: str | Path | None = None) -> bool:
    """True if a CUDA GPU is visible to torch and the library loads."""
    try:
        _require_gpu()
        load_library(path)
    except KernelUnavailableError:
        return False
    return True


def _require_gpu() -> Any:
    try:
        import torch
    except ImportError as e:
        raise KernelUnavailableError("torch is not installed") from e
    if not torch.cuda.is_available():
        raise KernelUnavailableError("no CUDA GPU is visible to torch")
    return torch


def _address(buf: Any, offset: int) -> int:
    base = buf if isinstance(buf, int) else buf.data_ptr()
    return base + offset


def _extent(buf: Any) -> int | None:
    """Bytes in buf when known (tensors), for bounds checks; None for raw addresses."""
    if isinstance(buf, int):
        return None
    return buf.numel() * buf.element_size()


def _region(name: str, buf: Any, offset: int, nbytes: int) -> int:
    check_region(name, offset, nbytes, _extent(buf))
    return _address(buf, offset)


class CudaKernels:
    """Kernels on GPU-visible memory, enqueued on one CUDA stream.

    Args: stream: an int cudaStream_t, an object with `.cuda_stream` (torch.cuda.Stream), or None
    for torch's current stream at construction; blocks, threads: the launch shape of the data
    kernels; library: path of libftar_kernels.so; guard: optional status word (int address or
    tensor) that makes every data kernel a no-op once nonzero (see `wait_flag`).
    Raises: KernelUnavailableError without a GPU or library; ValueError on a bad launch shape.
    Threading: one caller at a time.
    """

    computes_values = True

    def __init__(self, *, stream: Any = None, blocks: int = DEFAULT_BLOCKS, threads: int = DEFAULT_THREADS,
                 library: str | Path | None = None, guard: Any = None) -> None:
        check_launch_shape(blocks, threads)
        torch = _require_gpu()
        self._lib = load_library(library)
        if stream is None:
            stream = torch.cuda.current_stream()
        self.stream = int(getattr(stream, "cuda_stream", stream))
        self.blocks, self.threads = blocks, threads
        self.guard = None if guard is None else _address(guard, 0)

    def copy(self, dst: Any, dst_offset: int, src: Any, src_offset: int, nbytes: int) -> float:
        d = _region("dst", dst, dst_offset, nbytes)
        s = _region("src", src, src_offset, nbytes)
        # The widest element that divides both addresses and the size: 4-byte words when possible.
        width = next(w for w in (4, 2, 1) if (d | s | nbytes) % w == 0)
        code = {4: DType.FLOAT32, 2: DType.FLOAT16, 1: BYTE_DTYPE}[width]
        self._lib.copy(d, s, nbytes // width, int(code), self.guard, self.blocks, self.threads, self.stream)
        return 0.0

    def reduce(self, dst: Any, dst_offset: int, src: Any, src_offset: int, nbytes: int,
               dtype: DType) -> float:
        dtype = DType.parse(dtype)
        count = check_elements(nbytes, dtype)
        d = _region("dst", dst, dst_offset, nbytes)
        s = _region("src", src, src_offset, nbytes)
        self._lib.reduce(d, s, count, int(dtype), self.guard, self.blocks, self.threads, self.stream)
        return 0.0

    def reduce_copy(self, dst: Any, dst_offset: int, src: Any, src_offset: int, out: Any,
                    out_offset: int, nbytes: int, dtype: DType) -> float:
        dtype = DType.parse(dtype)
        count = check_elements(nbytes, dtype)
        d = _region("dst", dst, dst_offset, nbytes)
        s = _region("src", src, src_offset, nbytes)
        o = _region("out", out, out_offset, nbytes)
        self._lib.reduce_copy(d, s, o, count, int(dtype), self.guard, self.blocks, self.threads, self.stream)
        return 0.0

    def wait_flag(self, flag: Any, expected: int, timeout_s: float, status: Any) -> float:
        """Enqueue a device-side wait until the int64 at `flag` (host-pinned) is >= expected; it
        writes a WaitStatus (int32) to `status`. A negative flag value aborts the wait.

        Raises: ValueError for a negative timeout; KernelError if the launch fails.
        """
        if timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0, got {timeout_s}")
        timeout_ns = min(int(timeout_s * 1e9), 2**63 - 1)
        self._lib.wait_flag(_address(flag, 0), expected, timeout_ns, _address(status, 0), self.stream)
        return 0.0

    def synchronize(self) -> float:
        torch = _require_gpu()
        if self.stream:
            torch.cuda.ExternalStream(self.stream).synchronize()
        else:  # the legacy default stream: waiting for the device is the only handle torch offers
            torch.cuda.synchronize()
        return 0.0
