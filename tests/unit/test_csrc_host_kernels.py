"""The CUDA kernels' per-thread bodies (csrc/ftar_bodies.cuh), compiled for the CPU with g++ and run
over an emulated grid (csrc/host/ftar_host.cpp), against numpy: every op and dtype the launchers
accept, odd sizes, misaligned heads and tails, several launch shapes, the guard word, and the launch
checks. No GPU and no nvcc needed: this runs in every CI run.

Each buffer sits between canary bytes, so a thread that writes outside its range fails the test, and
a reduce that visits an element twice (or never) gives a wrong sum."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from ftrun.ftar.kernels import DType

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "csrc" / "host" / "ftar_host.cpp"
CXX = shutil.which("g++") or shutil.which("c++")

pytestmark = [pytest.mark.skipif(CXX is None, reason="no C++ compiler"), pytest.mark.timeout(120)]

BYTE = 3  # FTAR_BYTE: copy only
NUMPY = {DType.FLOAT32: np.float32, DType.FLOAT16: np.float16, DType.BFLOAT16: np.uint16}
CANARY = 0xA5
PAD = 64  # canary bytes on each side of every buffer
COUNTS = [1, 3, 7, 8, 9, 31, 64, 1000, 4099]
SHAPES = [(1, 1), (1, 32), (2, 512), (3, 7)]  # (blocks, threads); 3 x 7 = 21 threads, an odd stride
OFFSETS = [(0, 0, 0), (1, 1, 1), (1, 0, 0), (0, 3, 3), (5, 2, 1), (7, 7, 7)]  # elements, dst/src/out


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    out = tmp_path_factory.mktemp("ftar_host") / "libftar_host.so"
    proc = subprocess.run([CXX, "-O1", "-std=c++17", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared",
                           "-o", str(out), str(SOURCE)], capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lib = ctypes.CDLL(str(out))
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    for name, args in {"ftar_host_copy": [p, p, i64, i32, p, i32, i32],
                       "ftar_host_reduce": [p, p, i64, i32, p, i32, i32],
                       "ftar_host_reduce_copy": [p, p, p, i64, i32, p, i32, i32],
                       "ftar_host_plan": [p, p, p, i32, i64, i64, p, p],
                       "ftar_host_wait_decision": [i64, i64, i64, i64]}.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    lib.ftar_host_float_to_half.argtypes, lib.ftar_host_float_to_half.restype = [ctypes.c_float], ctypes.c_uint16
    lib.ftar_host_float_to_bf16.argtypes, lib.ftar_host_float_to_bf16.restype = [ctypes.c_float], ctypes.c_uint16
    lib.ftar_host_half_to_float.argtypes, lib.ftar_host_half_to_float.restype = [ctypes.c_uint16], ctypes.c_float
    return lib


class Padded:
    """`count` elements of `np_dtype` starting `offset` elements after a 16-byte boundary, with canary
    bytes around them."""

    def __init__(self, values: np.ndarray, offset: int) -> None:
        itemsize = values.itemsize
        raw = np.full(2 * PAD + (offset + values.size) * itemsize + 16, CANARY, np.uint8)
        start = (-raw.ctypes.data) % 16 + PAD  # a 16-byte boundary after the leading canary
        self.lo, self.hi = start + offset * itemsize, start + (offset + values.size) * itemsize
        self.raw = raw
        self.view = raw[self.lo:self.hi].view(values.dtype)
        self.view[:] = values

    @property
    def ptr(self) -> int:
        return self.raw.ctypes.data + self.lo

    def assert_canaries(self) -> None:
        assert (self.raw[:self.lo] == CANARY).all() and (self.raw[self.hi:] == CANARY).all(), "write out of range"


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even (finite inputs)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_float(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def values(dtype: DType, count: int, seed: int) -> np.ndarray:
    """Values whose sums round differently across elements, including ties and large magnitudes."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(count) * rng.choice([1e-3, 1.0, 300.0], count)).astype(np.float32)
    if dtype is DType.BFLOAT16:
        return bf16_bits(x)
    return x.astype(NUMPY[dtype])


def reference_sum(a: np.ndarray, b: np.ndarray, dtype: DType) -> np.ndarray:
    """a + b computed in float32 and rounded once to the storage type (round to nearest even)."""
    if dtype is DType.BFLOAT16:
        return bf16_bits(bf16_float(a) + bf16_float(b))
    total = a.astype(np.float32) + b.astype(np.float32)
    return total.astype(NUMPY[dtype])


def run(lib, op: str, dst: Padded, src: Padded, out: Padded | None, count: int, dtype: int,
        blocks: int, threads: int, guard=None) -> int:
    g = None if guard is None else guard.ctypes.data
    if op == "reduce_copy":
        return lib.ftar_host_reduce_copy(dst.ptr, src.ptr, out.ptr if out else None, count, dtype, g, blocks, threads)
    return getattr(lib, f"ftar_host_{op}")(dst.ptr, src.ptr, count, dtype, g, blocks, threads)


@pytest.mark.parametrize("dtype", list(DType))
@pytest.mark.parametrize("offsets", OFFSETS)
@pytest.mark.parametrize("blocks, threads", SHAPES)
def test_reduce_and_reduce_copy_match_numpy(lib, dtype, offsets, blocks, threads):
    for count in COUNTS:
        a, b = values(dtype, count, 1), values(dtype, count, 2)
        want = reference_sum(a, b, dtype)
        dst, src = Padded(a, offsets[0]), Padded(b, offsets[1])
        assert run(lib, "reduce", dst, src, None, count, int(dtype), blocks, threads) == 0
        np.testing.assert_array_equal(dst.view.view(np.uint8), want.view(np.uint8), err_msg=f"reduce n={count}")
        np.testing.assert_array_equal(src.view, b)

        dst, src, out = Padded(a, offsets[0]), Padded(b, offsets[1]), Padded(np.zeros_like(a), offsets[2])
        assert run(lib, "reduce_copy", dst, src, out, count, int(dtype), blocks, threads) == 0
        np.testing.assert_array_equal(dst.view.view(np.uint8), want.view(np.uint8))
        np.testing.assert_array_equal(out.view.view(np.uint8), want.view(np.uint8))
        for buf in (dst, src, out):
            buf.assert_canaries()


@pytest.mark.parametrize("dtype", list(DType))
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_reduce_copy_may_write_over_its_source(lib, dtype, offset):
    """The schedule's ReduceCopy passes the same region as src and out."""
    count = 1001
    a, b = values(dtype, count, 3), values(dtype, count, 4)
    dst, src = Padded(a, offset), Padded(b, offset)
    assert lib.ftar_host_reduce_copy(dst.ptr, src.ptr, src.ptr, count, int(dtype), None, 2, 512) == 0
    want = reference_sum(a, b, dtype).view(np.uint8)
    np.testing.assert_array_equal(dst.view.view(np.uint8), want)
    np.testing.assert_array_equal(src.view.view(np.uint8), want)


@pytest.mark.parametrize("dtype, itemsize", [(0, 4), (1, 2), (2, 2), (BYTE, 1)])
@pytest.mark.parametrize("offsets", [(0, 0), (1, 1), (3, 0), (0, 5)])
@pytest.mark.parametrize("blocks, threads", SHAPES)
def test_copy_moves_every_byte_exactly(lib, dtype, itemsize, offsets, blocks, threads):
    for count in COUNTS:
        src_vals = np.random.default_rng(count).integers(0, 256, count * itemsize, dtype=np.uint8)
        src_vals = src_vals.view({4: np.uint32, 2: np.uint16, 1: np.uint8}[itemsize])
        dst, src = Padded(np.zeros_like(src_vals), offsets[0]), Padded(src_vals, offsets[1])
        assert run(lib, "copy", dst, src, None, count, dtype, blocks, threads) == 0
        np.testing.assert_array_equal(dst.view, src_vals)
        dst.assert_canaries()
        src.assert_canaries()


@pytest.mark.parametrize("addrs, count, elem, need_out, want", [
    ((0, 0, 0), 100, 4, False, (0, 25)),  # aligned: all vectors
    ((0, 0, 0), 101, 4, False, (0, 25)),  # one-element tail
    ((4, 4, 0), 100, 4, False, (3, 24)),  # 3-element head to reach 16 bytes, then 24 vectors, 1 tail
    ((4, 8, 0), 100, 4, False, (100, 0)),  # dst and src disagree within 16 bytes: all scalar
    ((2, 2, 2), 100, 2, True, (7, 11)),  # halves: 7-element head, 11 vectors of 8, 5 tail
    ((2, 2, 4), 100, 2, True, (100, 0)),  # out disagrees
    ((4, 4, 0), 2, 4, False, (2, 0)),  # head longer than the range: all scalar
    ((12, 12, 0), 2, 4, False, (1, 0)),  # 1-element head, no whole vector, 1 tail
    ((1, 1, 0), 40, 1, False, (15, 1)),  # bytes: 15-byte head, one 16-byte vector, 9 tail
])
def test_plan_splits_head_vectors_tail(lib, addrs, count, elem, need_out, want):
    base = 1 << 20
    head, vecs = ctypes.c_int64(-1), ctypes.c_int64(-1)
    d, s, o = (base + a for a in addrs)
    assert lib.ftar_host_plan(d, s, o, need_out, count, elem, ctypes.byref(head), ctypes.byref(vecs)) == 0
    assert (head.value, vecs.value) == want


def test_guard_word_skips_the_work(lib):
    a, b = values(DType.FLOAT32, 100, 1), values(DType.FLOAT32, 100, 2)
    dst, src = Padded(a, 0), Padded(b, 0)
    assert run(lib, "reduce", dst, src, None, 100, 0, 2, 32, guard=np.array([1], np.int32)) == 0
    np.testing.assert_array_equal(dst.view, a)
    assert run(lib, "reduce", dst, src, None, 100, 0, 2, 32, guard=np.array([0], np.int32)) == 0
    np.testing.assert_array_equal(dst.view, reference_sum(a, b, DType.FLOAT32))


@pytest.mark.parametrize("call, code", [
    (lambda lib, p: lib.ftar_host_reduce(p, p, 4, 99, None, 2, 512), 1),  # unknown dtype
    (lambda lib, p: lib.ftar_host_reduce_copy(p, p, p, 4, BYTE, None, 2, 512), 1),  # bytes cannot be reduced
    (lambda lib, p: lib.ftar_host_copy(p, p, 4, 7, None, 2, 512), 1),
    (lambda lib, p: lib.ftar_host_reduce(p, p, 4, 0, None, 0, 512), 3),  # no blocks
    (lambda lib, p: lib.ftar_host_copy(p, p, 4, 1, None, 2, 2048), 3),  # too many threads
    (lambda lib, p: lib.ftar_host_reduce(p, p, -1, 0, None, 2, 512), 2),  # negative count
    (lambda lib, p: lib.ftar_host_reduce(None, p, 4, 2, None, 2, 512), 2),  # NULL dst
    (lambda lib, p: lib.ftar_host_reduce_copy(p, p, None, 4, 0, None, 2, 512), 2),  # NULL out
    (lambda lib, p: lib.ftar_host_reduce(p + 2, p, 4, 0, None, 2, 512), 2),  # misaligned float32
])
def test_launch_checks_match_the_cuda_launchers(lib, call, code):
    buf = np.zeros(64, np.uint8)
    p = buf.ctypes.data + (-buf.ctypes.data) % 16
    assert call(lib, p) == code
    assert not buf.any()


def test_empty_ranges_do_nothing(lib):
    assert lib.ftar_host_reduce(None, None, 0, 0, None, 2, 512) == 0
    assert lib.ftar_host_copy(None, None, 0, BYTE, None, 2, 512) == 0


@pytest.mark.parametrize("flag, expected, elapsed, timeout, want", [
    (5, 5, 0, 10, 0),  # reached: ok
    (9, 5, 99, 10, 0),  # past it: ok, even after the timeout
    (-1, 5, 0, 10, 2),  # negative: aborted
    (4, 5, 10, 10, 1),  # timed out
    (4, 5, 9, 10, -1),  # poll again
])
def test_flag_wait_decision(lib, flag, expected, elapsed, timeout, want):
    assert lib.ftar_host_wait_decision(flag, expected, elapsed, timeout) == want


def test_half_conversions_are_exact_round_to_nearest_even(lib):
    """The host's software conversions agree with numpy on every half and on rounding edge cases."""
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    finite = halves[np.isfinite(halves.view(np.float16))]
    f = finite.view(np.float16).astype(np.float32)
    back = np.array([lib.ftar_host_float_to_half(float(x)) for x in f[::37]], np.uint16)
    np.testing.assert_array_equal(back, finite[::37])
    got = np.array([lib.ftar_host_half_to_float(int(h)) for h in finite[::37]], np.float32)
    np.testing.assert_array_equal(got, f[::37])
    edges = np.array([65504.0, 65519.0, 65520.0, 1e6, 2.0**-24, 2.0**-25, 1.5 * 2.0**-25, 2.0**-14 * 0.999,
                      1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, -0.0], np.float32)
    with np.errstate(over="ignore"):
        want = edges.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal([lib.ftar_host_float_to_half(float(x)) for x in edges], want)
    ties = np.array([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 3.0e38], np.float32)
    np.testing.assert_array_equal([lib.ftar_host_float_to_bf16(float(x)) for x in ties], bf16_bits(ties))
