"""CPU backend of the Kernels seam: numpy and numba on host memory, synchronous, no temporaries.

Choices, measured on this project's 2-core CI box (16 MB payloads, single thread, best of 3;
rerun with `python -m ftrun.ftar.cpu_kernels`):
- float32 reduce: numpy `np.add(dst, src, out=dst)` (AVX-512 ufunc loop); numba's loop was no faster.
- float16 / bfloat16: numba loops that widen to float32, add and round to nearest even once per
  element (the same rounding as torch's CPU add). numpy's float16 add is ~50x slower; torch's CPU
  add_ was 1.3-1.5x slower single-threaded and several times slower with its 2-thread pool.
- reduce_copy: one fused numba pass (dst += src; out = dst), one memory pass fewer than add + copy.
- copy: `np.copyto` on byte views.
bfloat16 works on the raw uint16 bits: widen with `bits << 16`, add as float32, round back with
`(x + 0x7FFF + ((x >> 16) & 1)) >> 16`. No NaN special case is needed: a NaN sum of bfloat16
inputs has zero low 16 bits, so the rounding add leaves it alone (NaN payloads may differ from
torch's canonical NaN; NaN-ness does not).

All loops release the GIL (numpy ufuncs do; numba functions are `nogil`) so an engine's network
threads keep running while a chunk is reduced.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from ftrun.ftar.kernels import DType, check_elements, check_region

# ---- bit casts numba lacks for scalars (one LLVM instruction each) ----


@intrinsic
def _u32_as_f32(typingctx: Any, x: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic
def _f32_as_u32(typingctx: Any, x: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def _f16_bits_to_f32(typingctx: Any, x: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def _f32_to_f16_bits(typingctx: Any, x: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        # fptrunc rounds to nearest even, as IEEE conversion does.
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


@njit(inline="always")
def _bf16_add(a: Any, b: Any) -> Any:
    x = _f32_as_u32(_u32_as_f32(np.uint32(a) << np.uint32(16)) + _u32_as_f32(np.uint32(b) << np.uint32(16)))
    return np.uint16((x + np.uint32(0x7FFF) + ((x >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@njit(inline="always")
def _f16_add(a: Any, b: Any) -> Any:
    return _f32_to_f16_bits(_f16_bits_to_f32(a) + _f16_bits_to_f32(b))


# ---- the loops (arrays are same-length 1-D views; half types as uint16 bits) ----


@njit(nogil=True, cache=True)
def _reduce_bf16(dst: Any, src: Any) -> None:
    for i in range(dst.shape[0]):
        dst[i] = _bf16_add(dst[i], src[i])


@njit(nogil=True, cache=True)
def _reduce_f16(dst: Any, src: Any) -> None:
    for i in range(dst.shape[0]):
        dst[i] = _f16_add(dst[i], src[i])


@njit(nogil=True, cache=True)
def _reduce_copy_bf16(dst: Any, src: Any, out: Any) -> None:
    for i in range(dst.shape[0]):
        v = _bf16_add(dst[i], src[i])
        dst[i] = v
        out[i] = v


@njit(nogil=True, cache=True)
def _reduce_copy_f16(dst: Any, src: Any, out: Any) -> None:
    for i in range(dst.shape[0]):
        v = _f16_add(dst[i], src[i])
        dst[i] = v
        out[i] = v


@njit(nogil=True, cache=True)
def _reduce_copy_f32(dst: Any, src: Any, out: Any) -> None:
    for i in range(dst.shape[0]):
        v = dst[i] + src[i]
        dst[i] = v
        out[i] = v


def _reduce_f32(dst: np.ndarray, src: np.ndarray) -> None:
    np.add(dst, src, out=dst)


# Element views: (numpy view dtype, reduce, reduce_copy) per DType.
_LOOPS = {
    DType.FLOAT32: (np.float32, _reduce_f32, _reduce_copy_f32),
    DType.FLOAT16: (np.uint16, _reduce_f16, _reduce_copy_f16),
    DType.BFLOAT16: (np.uint16, _reduce_bf16, _reduce_copy_bf16),
}


def as_bytes(buf: Any) -> np.ndarray:
    """A writable 1-D uint8 view of `buf` (a C-contiguous numpy array or a writable buffer such as
    bytearray/memoryview). Raises ValueError if no such view exists without copying."""
    if isinstance(buf, np.ndarray):
        if buf.dtype == np.uint8 and buf.ndim == 1:
            return buf
        if not buf.flags.c_contiguous:
            raise ValueError("CPU kernel buffers must be C-contiguous")
        return buf.reshape(-1).view(np.uint8)
    view = np.frombuffer(buf, np.uint8)
    if not view.flags.writeable:
        raise ValueError("CPU kernel buffers must be writable")
    return view


def _region(name: str, buf: Any, offset: int, nbytes: int) -> np.ndarray:
    b = as_bytes(buf)
    check_region(name, offset, nbytes, b.nbytes)
    return b[offset:offset + nbytes]


class CpuKernels:
    """Kernels on host memory. Buffers: writable C-contiguous numpy arrays (viewed as bytes) or
    writable buffer objects. For a torch CPU tensor pass `t.view(torch.uint8).numpy()`.

    Synchronous: every op has finished when it returns; each returns 0.0 modeled seconds.
    Threading: ops release the GIL; an instance holds no state, so it may be shared.
    """

    computes_values = True

    def copy(self, dst: Any, dst_offset: int, src: Any, src_offset: int, nbytes: int) -> float:
        d = _region("dst", dst, dst_offset, nbytes)
        s = _region("src", src, src_offset, nbytes)
        if nbytes:
            np.copyto(d, s)
        return 0.0

    def reduce(self, dst: Any, dst_offset: int, src: Any, src_offset: int, nbytes: int,
               dtype: DType) -> float:
        dtype = DType.parse(dtype)
        check_elements(nbytes, dtype)
        d = _region("dst", dst, dst_offset, nbytes)
        s = _region("src", src, src_offset, nbytes)
        if nbytes:
            view, loop, _ = _LOOPS[dtype]
            loop(d.view(view), s.view(view))
        return 0.0

    def reduce_copy(self, dst: Any, dst_offset: int, src: Any, src_offset: int, out: Any,
                    out_offset: int, nbytes: int, dtype: DType) -> float:
        dtype = DType.parse(dtype)
        check_elements(nbytes, dtype)
        d = _region("dst", dst, dst_offset, nbytes)
        s = _region("src", src, src_offset, nbytes)
        o = _region("out", out, out_offset, nbytes)
        if nbytes:
            view, _, loop = _LOOPS[dtype]
            loop(d.view(view), s.view(view), o.view(view))
        return 0.0

    def synchronize(self) -> float:
        return 0.0

    def warmup(self) -> None:
        """Compile (or load from numba's cache) every loop now, so no op pays for it later."""
        for dtype in DType:
            a = np.zeros(16, np.uint8)
            self.reduce(a, 0, a.copy(), 0, 8, dtype)
            self.reduce_copy(a, 0, a.copy(), 0, a, 8, 8, dtype)


class Float32CpuKernels(CpuKernels):
    """CPU FTAR kernels that compile float32 only at start (the other dtypes' numba loops cost ~1.5 s,
    which a restarted replica would spend before checking in); gradients travel as float32."""

    def warmup(self) -> None:
        a = np.zeros(16, np.uint8)
        self.reduce(a, 0, a.copy(), 0, 8, DType.FLOAT32)
        self.reduce_copy(a, 0, a.copy(), 0, a, 8, 8, DType.FLOAT32)


def _sample(nbytes: int, dtype: DType, rng: np.random.Generator) -> np.ndarray:
    """nbytes of normal-distributed values of dtype, as bytes (no NaNs or denormals to skew timing)."""
    x = rng.standard_normal(nbytes // dtype.itemsize, dtype=np.float32)
    if dtype is DType.FLOAT16:
        x = x.astype(np.float16)
    elif dtype is DType.BFLOAT16:
        x = (x.view(np.uint32) >> 16).astype(np.uint16)
    return x.view(np.uint8)


def _measure(nbytes: int = 16 << 20, reps: int = 20) -> None:
    """Print GB/s (payload bytes per second) for each op and dtype, best of 3 rounds."""
    from timeit import Timer

    k = CpuKernels()
    k.warmup()
    rng = np.random.default_rng(0)
    out = np.empty(nbytes, np.uint8)
    for dt in DType:
        a, b = _sample(nbytes, dt, rng), _sample(nbytes, dt, rng)
        cases = {
            "copy": lambda: k.copy(a, 0, b, 0, nbytes),
            f"reduce {dt.name.lower()}": lambda dt=dt: k.reduce(a, 0, b, 0, nbytes, dt),
            f"reduce_copy {dt.name.lower()}": lambda dt=dt: k.reduce_copy(a, 0, b, 0, out, 0, nbytes, dt),
        }
        for name, fn in cases.items():
            if name == "copy" and dt is not DType.FLOAT32:
                continue
            a2 = a.copy()
            best = min(Timer(fn).repeat(3, reps)) / reps
            a[:] = a2
            print(f"{name:24s} {nbytes / best / 1e9:7.2f} GB/s  ({nbytes >> 20} MB, {best * 1e3:.2f} ms)")


if __name__ == "__main__":
    _measure()

