"""Shape-only FTAR kernels: no bytes touched, modeled time returned. Also the shadow of
`ftrun.ftar.cuda_kernels` (same public API), so GPU training scripts run on CPU under emulation.

`ShapeOnlyKernels` implements the Kernels seam (ftrun/ftar/kernels.py): each op checks its
arguments' shapes, never reads or writes a buffer (any object will do, even None), and returns
`launch_s + nbytes / bandwidth` seconds, which the emulated engine charges to its virtual clock.
Totals are kept in `elapsed_s`, `num_calls` and `bytes_by_op`.

`CudaKernels` here models the CUDA kernels' speed from their launch shape: bandwidth grows with
`blocks` (one SM each) up to a memory-bound peak. The defaults are modeling assumptions for an
H100, not measurements: 100 GB/s of reduced payload per block (the DESIGN target of 200 GB/s at
2 blocks x 512 threads), copies 1.5x that, a 1.1 TB/s reduce peak (3.35 TB/s HBM over three
memory streams) and 5 us per launch. Override them per instance.
"""

from __future__ import annotations

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
    "ShapeOnlyKernels",
    "WaitStatus",
    "default_library_path",
    "is_available",
]


class ShapeOnlyKernels:
    """Kernels that model time and touch no memory.

    Args: copy_bw, reduce_bw: payload bytes per second; reduce_copy_bw defaults to 3/4 of
    reduce_bw (one more memory stream: read 2, write 2 instead of read 2, write 1); launch_s: fixed
    cost per op. Raises ValueError for non-positive bandwidths or a negative launch cost.
    """

    computes_values = False

    def __init__(self, *, copy_bw: float, reduce_bw: float, reduce_copy_bw: float | None = None,
                 launch_s: float = 0.0) -> None:
        reduce_copy_bw = reduce_bw * 0.75 if reduce_copy_bw is None else reduce_copy_bw
        if min(copy_bw, reduce_bw, reduce_copy_bw) <= 0 or launch_s < 0:
            raise ValueError("bandwidths must be > 0 and launch_s >= 0")
        self.copy_bw, self.reduce_bw, self.reduce_copy_bw = copy_bw, reduce_bw, reduce_copy_bw
        self.launch_s = launch_s
        self.elapsed_s = 0.0
        self.num_calls = 0
        self.bytes_by_op = {"copy": 0, "reduce": 0, "reduce_copy": 0}

    def _charge(self, op: str, nbytes: int, bandwidth: float) -> float:
        seconds = self.launch_s + nbytes / bandwidth if nbytes else 0.0
        self.elapsed_s += seconds
        self.num_calls += 1
        self.bytes_by_op[op] += nbytes
        return seconds

    def copy(self, dst: Any, dst_offset: int, src: Any, src_offset: int, nbytes: int) -> float:
        check_region("dst", dst_offset, nbytes, None)
        check_region("src", src_offset, nbytes, None)
        return self._charge("copy", nbytes, self.copy_bw)

    def reduce(self, dst: Any, dst_offset: int, src: Any, src_offset: int, nbytes: int,
               dtype: DType) -> float:
        check_elements(nbytes, DType.parse(dtype))
        check_region("dst", dst_offset, nbytes, None)
        check_region("src", src_offset, nbytes, None)
        return self._charge("reduce", nbytes, self.reduce_bw)

    def reduce_copy(self, dst: Any, dst_offset: int, src: Any, src_offset: int, out: Any,
                    out_offset: int, nbytes: int, dtype: DType) -> float:
        check_elements(nbytes, DType.parse(dtype))
        for name, off in (("dst", dst_offset), ("src", src_offset), ("out", out_offset)):
            check_region(name, off, nbytes, None)
        return self._charge("reduce_copy", nbytes, self.reduce_copy_bw)

    def synchronize(self) -> float:
        return 0.0


class CudaKernels(ShapeOnlyKernels):
    """Stand-in for `ftrun.ftar.cuda_kernels.CudaKernels` with the same constructor and methods;
    the modeling parameters are extra keyword arguments. `stream`, `library` and `guard` are kept
    but unused. Defaults are the csrc/ kernels measured on an H200 (benchmarks/cuda_kernels.py, fp32,
    256 MB): reduce 79.5 GB/s at 2 blocks x 512 threads, copy 1.22x that, reduce 1.34 TB/s on all SMs."""

    def __init__(self, *, stream: Any = None, blocks: int = DEFAULT_BLOCKS, threads: int = DEFAULT_THREADS,
                 library: str | Path | None = None, guard: Any = None, reduce_bw_per_block: float = 39.7e9,
                 peak_reduce_bw: float = 1.34e12, launch_s: float = 5e-6) -> None:
        check_launch_shape(blocks, threads)
        # Fewer threads per block keep fewer bytes in flight; scale down below the paper's 512.
        reduce_bw = min(reduce_bw_per_block * blocks * min(1.0, threads / DEFAULT_THREADS), peak_reduce_bw)
        super().__init__(copy_bw=1.22 * reduce_bw, reduce_bw=reduce_bw, launch_s=launch_s)
        self.stream, self.blocks, self.threads, self.guard = stream, blocks, threads, guard
        self.library = library

    def wait_flag(self, flag: Any, expected: int, timeout_s: float, status: Any) -> float:
        """Models only the launch: in emulation the engine waits through its Env, not on a flag."""
        if timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0, got {timeout_s}")
        self.num_calls += 1
        self.elapsed_s += self.launch_s
        return self.launch_s


def default_library_path() -> Path:
    """Where the real library would be (csrc/build/libftar_kernels.so); nothing is loaded."""
    return Path(__file__).resolve().parents[1] / "csrc" / "build" / "libftar_kernels.so"


def is_available(path: str | Path | None = None) -> bool:
    """Shape-only kernels run anywhere."""
    return True
