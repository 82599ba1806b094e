"""One contract for every Kernels backend: CPU (values), shape-only (modeled time, no memory), and
CUDA where a GPU and the built library exist (values)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest
import torch

import mocks.ftar_kernels as mock_cuda
from ftrun.ftar import cuda_kernels
from ftrun.ftar.cpu_kernels import CpuKernels
from ftrun.ftar.kernels import DType, Kernels, KernelUnavailableError

TORCH = {DType.FLOAT32: torch.float32, DType.FLOAT16: torch.float16, DType.BFLOAT16: torch.bfloat16}
TOL = {DType.FLOAT32: (1e-6, 1e-6), DType.FLOAT16: (1e-3, 1e-3), DType.BFLOAT16: (1e-2, 1e-2)}  # rtol, atol


class Untouchable:
    """A buffer stand-in that fails the test if a backend reads it in any way."""

    def __getattribute__(self, name: str) -> Any:
        raise AssertionError(f"shape-only backend touched buffer attribute {name!r}")

    def __len__(self) -> int:
        raise AssertionError("shape-only backend took len() of a buffer")

    def __getitem__(self, key: Any) -> Any:
        raise AssertionError("shape-only backend indexed a buffer")

    def __buffer__(self, flags: int) -> memoryview:
        raise AssertionError("shape-only backend used the buffer protocol")


@dataclass
class Backend:
    kernels: Any
    alloc: Callable[[np.ndarray], Any]  # bytes (uint8 array) -> a buffer of this backend
    read: Callable[[Any], np.ndarray]  # buffer -> uint8 array copy


def cpu_backend() -> Backend:
    return Backend(CpuKernels(), lambda b: b.copy(), lambda b: b.copy())


def shape_only_backend() -> Backend:
    k = mock_cuda.ShapeOnlyKernels(copy_bw=4e9, reduce_bw=2e9, launch_s=1e-6)
    return Backend(k, lambda b: Untouchable(), lambda b: pytest.fail("shape-only buffers hold no values"))


def shadow_cuda_backend() -> Backend:
    return Backend(mock_cuda.CudaKernels(), lambda b: Untouchable(), lambda b: pytest.fail("no values"))


def cuda_backend() -> Backend:
    if not cuda_kernels.is_available():
        pytest.skip("no CUDA GPU or csrc/build/libftar_kernels.so")
    k = cuda_kernels.CudaKernels()

    def read(t: Any) -> np.ndarray:
        k.synchronize()
        return t.cpu().numpy().copy()

    return Backend(k, lambda b: torch.from_numpy(b.copy()).cuda(), read)


BACKENDS = {"cpu": cpu_backend, "shape_only": shape_only_backend, "shadow_cuda": shadow_cuda_backend,
            "cuda": cuda_backend}


COMPUTING = ["cpu", "cuda"]  # backends whose computes_values is True


@pytest.fixture(params=list(BACKENDS))
def backend(request: pytest.FixtureRequest) -> Backend:
    b = BACKENDS[request.param]()
    assert b.kernels.computes_values == (request.param in COMPUTING)
    return b


@pytest.fixture(params=COMPUTING)
def value_backend(request: pytest.FixtureRequest) -> Backend:
    return BACKENDS[request.param]()


def values(count: int, dtype: DType, seed: int) -> torch.Tensor:
    return torch.randn(count, generator=torch.Generator().manual_seed(seed)).to(TORCH[dtype])


def as_bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy().copy()


def from_bytes(b: np.ndarray, dtype: DType) -> torch.Tensor:
    return torch.from_numpy(b.copy()).view(TORCH[dtype])


def padded(t: torch.Tensor, pad: int) -> np.ndarray:
    """t's bytes with `pad` marker bytes (0xA5) on each side, to catch writes out of range."""
    return np.concatenate([np.full(pad, 0xA5, np.uint8), as_bytes(t), np.full(pad, 0xA5, np.uint8)])


# ---- shared contract -----------------------------------------------------------------------

def test_implements_the_protocol(backend):
    assert isinstance(backend.kernels, Kernels)
    assert isinstance(backend.kernels.computes_values, bool)
    assert backend.kernels.synchronize() >= 0.0


@pytest.mark.parametrize("dtype", list(DType))
def test_zero_bytes_is_a_no_op(backend, dtype):
    buf = np.arange(16, dtype=np.uint8)
    a, b = backend.alloc(buf), backend.alloc(buf)
    k = backend.kernels
    for seconds in (k.copy(a, 0, b, 0, 0), k.reduce(a, 4, b, 8, 0, dtype), k.reduce_copy(a, 0, b, 0, b, 0, 0, dtype)):
        assert seconds == 0.0
    if k.computes_values:
        assert np.array_equal(backend.read(a), buf)


@pytest.mark.parametrize("dtype", list(DType))
def test_bad_regions_raise_value_error(backend, dtype):
    a, b = backend.alloc(np.zeros(64, np.uint8)), backend.alloc(np.zeros(64, np.uint8))
    k = backend.kernels
    with pytest.raises(ValueError):
        k.reduce(a, 0, b, 0, dtype.itemsize + 1, dtype)  # splits an element
    with pytest.raises(ValueError):
        k.reduce_copy(a, 0, b, 0, b, 0, 3, dtype)
    with pytest.raises(ValueError):
        k.copy(a, -4, b, 0, 8)
    if k.computes_values:  # backends that see buffers also check bounds
        with pytest.raises(ValueError):
            k.reduce(a, 60, b, 0, 8, dtype)
        with pytest.raises(ValueError):
            k.copy(a, 0, b, 32, 40)


# ---- value-computing backends ---------------------------------------------------------------

@pytest.mark.parametrize("nbytes", [1, 3, 16, 17, 1000, 4099])
@pytest.mark.parametrize("offsets", [(0, 0), (5, 0), (16, 3)])
def test_copy_moves_exact_bytes_and_nothing_else(value_backend, nbytes, offsets):
    backend = value_backend
    rng = np.random.default_rng(nbytes)
    dst0, src0 = rng.integers(0, 256, nbytes + 32, np.uint8), rng.integers(0, 256, nbytes + 32, np.uint8)
    dst, src = backend.alloc(dst0), backend.alloc(src0)
    (do, so) = offsets
    backend.kernels.copy(dst, do, src, so, nbytes)
    want = dst0.copy()
    want[do:do + nbytes] = src0[so:so + nbytes]
    assert np.array_equal(backend.read(dst), want)


COUNTS = [1, 3, 8, 33, 1027]


@pytest.mark.parametrize("dtype", list(DType))
@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("elem_offsets", [(0, 0), (1, 0), (3, 5)])
def test_reduce_adds_src_into_dst_like_torch(value_backend, dtype, count, elem_offsets):
    backend = value_backend
    a, b = values(count, dtype, 1), values(count, dtype, 2)
    pad = 8 * dtype.itemsize
    da, sb = elem_offsets[0] * dtype.itemsize, elem_offsets[1] * dtype.itemsize
    dst0 = np.concatenate([np.full(da, 0x5A, np.uint8), padded(a, pad)])
    src0 = np.concatenate([np.full(sb, 0x5A, np.uint8), padded(b, pad)])
    dst, src = backend.alloc(dst0), backend.alloc(src0)
    nbytes = count * dtype.itemsize
    backend.kernels.reduce(dst, da + pad, src, sb + pad, nbytes, dtype)
    got = backend.read(dst)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(from_bytes(got[da + pad:da + pad + nbytes], dtype), a + b, rtol=rtol, atol=atol)
    assert np.array_equal(got[:da + pad], dst0[:da + pad]) and np.array_equal(got[da + pad + nbytes:], dst0[da + pad + nbytes:])
    assert np.array_equal(backend.read(src), src0)


@pytest.mark.parametrize("dtype", list(DType))
@pytest.mark.parametrize("count", COUNTS)
def test_reduce_copy_writes_the_sum_to_dst_and_out(value_backend, dtype, count):
    backend = value_backend
    a, b = values(count, dtype, 3), values(count, dtype, 4)
    nbytes, pad = count * dtype.itemsize, 16
    dst, src, out = (backend.alloc(padded(t, pad)) for t in (a, b, torch.zeros_like(a)))
    backend.kernels.reduce_copy(dst, pad, src, pad, out, pad, nbytes, dtype)
    rtol, atol = TOL[dtype]
    for buf in (dst, out):
        got = backend.read(buf)
        torch.testing.assert_close(from_bytes(got[pad:pad + nbytes], dtype), a + b, rtol=rtol, atol=atol)
        assert np.all(got[:pad] == 0xA5) and np.all(got[pad + nbytes:] == 0xA5)
    assert np.array_equal(backend.read(dst), backend.read(out))


@pytest.mark.parametrize("dtype", list(DType))
def test_reduce_copy_may_write_out_over_src(value_backend, dtype):
    """The schedule's fused step: slot += data; data <- slot, with data as both src and out."""
    backend = value_backend
    a, b = values(301, dtype, 5), values(301, dtype, 6)
    slot, data = backend.alloc(as_bytes(a)), backend.alloc(as_bytes(b))
    backend.kernels.reduce_copy(slot, 0, data, 0, data, 0, 301 * dtype.itemsize, dtype)
    assert np.array_equal(backend.read(slot), backend.read(data))
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(from_bytes(backend.read(data), dtype), a + b, rtol=rtol, atol=atol)


# ---- shape-only backends ------------------------------------------------------------------------

def test_shape_only_models_time_from_bandwidth_and_accumulates():
    k = mock_cuda.ShapeOnlyKernels(copy_bw=4e9, reduce_bw=2e9, launch_s=1e-6)
    nb = 8 << 20
    assert k.copy(None, 0, None, 0, nb) == pytest.approx(1e-6 + nb / 4e9)
    assert k.reduce(None, 0, None, 0, nb, DType.BFLOAT16) == pytest.approx(1e-6 + nb / 2e9)
    assert k.reduce_copy(None, 0, None, 0, None, 0, nb, "float32") == pytest.approx(1e-6 + nb / 1.5e9)
    assert k.elapsed_s == pytest.approx(3e-6 + nb / 4e9 + nb / 2e9 + nb / 1.5e9)
    assert k.num_calls == 3 and k.bytes_by_op == {"copy": nb, "reduce": nb, "reduce_copy": nb}
    with pytest.raises(ValueError):
        mock_cuda.ShapeOnlyKernels(copy_bw=0, reduce_bw=1)


def test_shadow_cuda_kernels_scale_with_blocks_up_to_a_peak():
    nb = 64 << 20
    two, four = mock_cuda.CudaKernels(), mock_cuda.CudaKernels(blocks=4)
    # The defaults are the csrc/ kernels' H200 figures: 2 x 39.7 GB/s per block, 1.34 TB/s on every SM.
    assert two.reduce(None, 0, None, 0, nb, "float32") == pytest.approx(5e-6 + nb / 79.4e9)
    assert four.reduce(None, 0, None, 0, nb, "float32") < two.reduce(None, 0, None, 0, nb, "float32")
    many = mock_cuda.CudaKernels(blocks=132)
    assert many.reduce(None, 0, None, 0, nb, "float32") == pytest.approx(5e-6 + nb / 1.34e12)
    assert two.wait_flag(None, 1, 1.0, None) == pytest.approx(5e-6)


# ---- the CUDA module and its shadow ---------------------------------------------------------------

def test_shadow_module_exposes_the_cuda_module_api():
    assert set(cuda_kernels.__all__) <= set(mock_cuda.__all__)
    for name in cuda_kernels.__all__:
        real, mock = getattr(cuda_kernels, name), getattr(mock_cuda, name)
        if isinstance(real, type) and issubclass(real, Exception) or name == "WaitStatus":
            assert real is mock  # shared, so except clauses work under the shadow loader
    real_init = inspect.signature(cuda_kernels.CudaKernels.__init__).parameters
    assert set(real_init) <= set(inspect.signature(mock_cuda.CudaKernels.__init__).parameters)
    for method in ("copy", "reduce", "reduce_copy", "wait_flag", "synchronize"):
        real = inspect.signature(getattr(cuda_kernels.CudaKernels, method))
        assert inspect.signature(getattr(mock_cuda.CudaKernels, method)).parameters.keys() == real.parameters.keys()


def test_cuda_kernels_fail_clearly_without_gpu_or_library(tmp_path):
    with pytest.raises(KernelUnavailableError, match="not built"):
        cuda_kernels.load_library(tmp_path / "missing.so")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert not cuda_kernels.is_available()
    with pytest.raises(KernelUnavailableError, match="no CUDA GPU"):
        cuda_kernels.CudaKernels()


def test_dtype_parse_accepts_names_numpy_and_torch_dtypes():
    assert DType.parse("bf16") is DType.BFLOAT16 and DType.parse(torch.bfloat16) is DType.BFLOAT16
    assert DType.parse(np.dtype(np.float16)) is DType.FLOAT16 and DType.parse(torch.float32) is DType.FLOAT32
    assert DType.parse(np.float32) is DType.FLOAT32
    with pytest.raises(ValueError):
        DType.parse("int8")


def test_launch_shapes_above_the_kernels_launch_bound_are_refused():
    # csrc/ftar_kernels.h compiles with __launch_bounds__(FTAR_MAX_THREADS = 512): both modules refuse more.
    for bad in ({"threads": 1024}, {"threads": 0}, {"blocks": 0}, {"blocks": 65536}):
        with pytest.raises(ValueError, match="must be 1.."):
            mock_cuda.CudaKernels(**bad)
