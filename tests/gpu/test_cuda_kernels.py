"""The csrc/ CUDA kernels against torch references: every dtype, odd sizes, misaligned offsets,
launch shapes, the guard word and the flag wait's ok / timeout / abort paths. Skips without a CUDA
GPU or without csrc/build/libftar_kernels.so (`bash csrc/build.sh`)."""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")

from ftrun.ftar import cuda_kernels  # noqa: E402
from ftrun.ftar.kernels import DType, WaitStatus  # noqa: E402

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)
if not cuda_kernels.default_library_path().exists():
    pytest.skip("csrc/build/libftar_kernels.so not built (bash csrc/build.sh)", allow_module_level=True)

pytestmark = pytest.mark.gpu

TORCH = {DType.FLOAT32: torch.float32, DType.FLOAT16: torch.float16, DType.BFLOAT16: torch.bfloat16}
TOL = {DType.FLOAT32: (1e-6, 1e-6), DType.FLOAT16: (1e-3, 1e-3), DType.BFLOAT16: (1e-2, 1e-2)}  # rtol, atol
COUNTS = [1, 7, 8, 1023, 4097, (1 << 20) + 3]
SHAPES = [(1, 32), (2, 512), (8, 256)]  # (blocks, threads)


def randn(count: int, dtype: DType, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(count, device="cuda", generator=g).to(TORCH[dtype])


def with_offset(t: torch.Tensor, offset: int) -> torch.Tensor:
    """t's values placed `offset` elements into a fresh buffer (misaligns the data pointer)."""
    buf = torch.empty(t.numel() + offset + 8, dtype=t.dtype, device="cuda")
    view = buf[offset:offset + t.numel()]
    view.copy_(t)
    return view


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: DType) -> None:
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", list(DType))
@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("offsets", [(0, 0), (1, 1), (1, 0), (0, 3), (5, 2)])
def test_reduce_matches_torch_add(dtype, count, offsets):
    a, b = randn(count, dtype, 1), randn(count, dtype, 2)
    dst, src = with_offset(a, offsets[0]), with_offset(b, offsets[1])
    want = a + b  # torch also accumulates half types in float32
    k = cuda_kernels.CudaKernels()
    k.reduce(dst, 0, src, 0, count * dtype.itemsize, dtype)
    k.synchronize()
    assert_close(dst, want, dtype)
    assert torch.equal(src, b)


@pytest.mark.parametrize("dtype", list(DType))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("count", [4097, (1 << 20) + 3])
def test_reduce_copy_matches_add_then_copy_for_every_launch_shape(dtype, shape, count):
    a, b = randn(count, dtype, 3), randn(count, dtype, 4)
    dst, src, out = a.clone(), b.clone(), torch.zeros_like(a)
    k = cuda_kernels.CudaKernels(blocks=shape[0], threads=shape[1])
    k.reduce_copy(dst, 0, src, 0, out, 0, count * dtype.itemsize, dtype)
    k.synchronize()
    assert_close(dst, a + b, dtype)
    assert torch.equal(dst, out)


@pytest.mark.parametrize("dtype", list(DType))
def test_reduce_copy_may_write_out_over_src(dtype):
    a, b = randn(100_003, dtype, 5), randn(100_003, dtype, 6)
    slot, data = a.clone(), b.clone()
    k = cuda_kernels.CudaKernels()
    k.reduce_copy(slot, 0, data, 0, data, 0, a.numel() * dtype.itemsize, dtype)
    k.synchronize()
    assert_close(data, a + b, dtype)
    assert torch.equal(slot, data)


@pytest.mark.parametrize("nbytes", [1, 2, 3, 4, 17, 4096, (1 << 20) + 5])
@pytest.mark.parametrize("offsets", [(0, 0), (1, 1), (3, 0), (2, 6)])
def test_copy_moves_exact_bytes(nbytes, offsets):
    src = torch.randint(0, 256, (nbytes + 16,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(nbytes + 16, dtype=torch.uint8, device="cuda")
    k = cuda_kernels.CudaKernels()
    k.copy(dst, offsets[0], src, offsets[1], nbytes)
    k.synchronize()
    want = torch.zeros_like(dst)
    want[offsets[0]:offsets[0] + nbytes] = src[offsets[1]:offsets[1] + nbytes]
    assert torch.equal(dst, want)


def test_copy_works_between_pinned_host_and_device_memory():
    host = torch.arange(1000, dtype=torch.float32).pin_memory()
    dev = torch.zeros(1000, dtype=torch.float32, device="cuda")
    k = cuda_kernels.CudaKernels()
    k.copy(dev, 0, host, 0, 4000)
    k.reduce(host, 0, dev, 0, 4000, DType.FLOAT32)  # a staging slot in pinned memory += data
    k.synchronize()
    assert torch.equal(dev.cpu(), torch.arange(1000, dtype=torch.float32))
    assert torch.equal(host, 2 * torch.arange(1000, dtype=torch.float32))


def pinned_flag(value: int) -> tuple[torch.Tensor, torch.Tensor]:
    flag = torch.full((1,), value, dtype=torch.int64).pin_memory()
    status = torch.full((1,), -1, dtype=torch.int32).pin_memory()
    return flag, status


def wait(flag: torch.Tensor, expected: int, timeout_s: float, status: torch.Tensor) -> float:
    """Run one wait on a fresh stream; returns host wall seconds until it finished."""
    k = cuda_kernels.CudaKernels(stream=torch.cuda.Stream())
    start = time.monotonic()
    k.wait_flag(flag, expected, timeout_s, status)
    k.synchronize()
    return time.monotonic() - start


def test_wait_returns_at_once_when_the_flag_is_already_set():
    flag, status = pinned_flag(5)
    assert wait(flag, 5, 10.0, status) < 1.0
    assert status.item() == WaitStatus.OK


def test_wait_times_out_on_the_gpu_timer():
    flag, status = pinned_flag(0)
    elapsed = wait(flag, 1, 0.05, status)
    assert status.item() == WaitStatus.TIMEOUT
    assert 0.05 <= elapsed < 5.0


def test_wait_sees_a_flag_raised_by_a_host_thread():
    flag, status = pinned_flag(0)
    timer = threading.Timer(0.05, lambda: flag.fill_(3))
    timer.start()
    elapsed = wait(flag, 3, 10.0, status)
    timer.join()
    assert status.item() == WaitStatus.OK and elapsed < 5.0


def test_negative_flag_aborts_the_wait():
    flag, status = pinned_flag(-1)
    assert wait(flag, 1, 10.0, status) < 1.0
    assert status.item() == WaitStatus.ABORTED


def test_guard_skips_work_queued_behind_a_failed_wait():
    flag, status = pinned_flag(0)
    dst, src = torch.ones(4096, device="cuda"), torch.ones(4096, device="cuda")
    k = cuda_kernels.CudaKernels(stream=torch.cuda.Stream(), guard=status)
    k.wait_flag(flag, 1, 0.01, status)
    k.reduce(dst, 0, src, 0, dst.numel() * 4, DType.FLOAT32)
    k.synchronize()
    assert status.item() == WaitStatus.TIMEOUT
    assert torch.equal(dst, torch.ones_like(dst))  # skipped
    status.fill_(WaitStatus.OK)
    k.reduce(dst, 0, src, 0, dst.numel() * 4, DType.FLOAT32)
    k.synchronize()
    assert torch.equal(dst, 2 * torch.ones_like(dst))


def test_bad_launch_shape_is_rejected_before_launch():
    with pytest.raises(ValueError):
        cuda_kernels.CudaKernels(blocks=0)
    with pytest.raises(ValueError):
        cuda_kernels.CudaKernels(threads=2048)
