// FTAR data-plane kernels (see ftar_kernels.h for the contract).
//
// Design notes (FT-HSDP §4.2): the kernels run on few SMs (default 2 blocks x 512 threads) next to
// the backward pass, so bandwidth comes from instruction-level parallelism rather than occupancy:
// each thread issues kUnroll independent 16-byte loads per operand before it computes or stores,
// which keeps enough bytes in flight per SM to approach HBM bandwidth with a handful of warps.

#include "ftar_kernels.h"

#include <cuda_runtime.h>

#include <cstdint>

#include "ftar_bodies.cuh"

namespace {

using ftar::Op;

// One grid-stride pass: every thread runs the shared body (ftar_bodies.cuh) for its global index.
template <typename E, Op kOp>
__global__ void __launch_bounds__(FTAR_MAX_THREADS)
    elementwise_kernel(typename E::T* dst, const typename E::T* src, typename E::T* out, ftar::Plan plan,
                       const int32_t* guard) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nthreads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  ftar::elementwise_thread<E, kOp>(dst, src, out, plan, guard, tid, nthreads);
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void wait_flag_kernel(const volatile int64_t* flag, int64_t expected, int64_t timeout_ns,
                                 int32_t* status) {
  const uint64_t start = global_timer_ns();
  int result;
  while ((result = ftar::wait_decision(*flag, expected, static_cast<int64_t>(global_timer_ns() - start),
                                       timeout_ns)) < 0) {
    __nanosleep(256);  // each poll is a PCIe read of host memory; no need to hammer it
  }
  *reinterpret_cast<volatile int32_t*>(status) = result;
  __threadfence_system();
}

int launch_status() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? FTAR_OK : FTAR_ERR_CUDA_BASE + static_cast<int>(err);
}

// Checks and plan (ftar::plan_launch), then one kernel launch on `stream`.
template <Op kOp>
int launch(void* dst, const void* src, void* out, int64_t count, int dtype, const int32_t* guard, int blocks,
           int threads, ftar_stream_t stream) {
  return ftar::plan_launch<kOp>(dst, src, out, count, dtype, blocks, threads, [&](auto elem, const ftar::Plan& plan) {
    using E = decltype(elem);
    using T = typename E::T;
    elementwise_kernel<E, kOp><<<blocks, threads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<T*>(dst), static_cast<const T*>(src), static_cast<T*>(out), plan, guard);
    return launch_status();
  });
}

}  // namespace

extern "C" {

int ftar_copy(void* dst, const void* src, int64_t count, int dtype, const int32_t* guard, int blocks,
              int threads, ftar_stream_t stream) {
  return launch<Op::kCopy>(dst, src, nullptr, count, dtype, guard, blocks, threads, stream);
}

int ftar_reduce(void* dst, const void* src, int64_t count, int dtype, const int32_t* guard, int blocks,
                int threads, ftar_stream_t stream) {
  return launch<Op::kReduce>(dst, src, nullptr, count, dtype, guard, blocks, threads, stream);
}

int ftar_reduce_copy(void* dst, const void* src, void* out, int64_t count, int dtype, const int32_t* guard,
                     int blocks, int threads, ftar_stream_t stream) {
  return launch<Op::kReduceCopy>(dst, src, out, count, dtype, guard, blocks, threads, stream);
}

int ftar_wait_flag(const int64_t* flag, int64_t expected, int64_t timeout_ns, int32_t* status,
                   ftar_stream_t stream) {
  if (flag == nullptr || status == nullptr || timeout_ns < 0) return FTAR_ERR_INVALID_ARGUMENT;
  if (!ftar::aligned(flag, sizeof(int64_t)) || !ftar::aligned(status, sizeof(int32_t))) return FTAR_ERR_INVALID_ARGUMENT;
  wait_flag_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(flag, expected, timeout_ns, status);
  return launch_status();
}

const char* ftar_error_string(int code) {
  switch (code) {
    case FTAR_OK:
      return "ok";
    case FTAR_ERR_INVALID_DTYPE:
      return "invalid dtype code for this kernel";
    case FTAR_ERR_INVALID_ARGUMENT:
      return "invalid argument: NULL or misaligned pointer, or negative count/timeout";
    case FTAR_ERR_INVALID_LAUNCH:
      return "invalid launch configuration: blocks must be 1..65535 and threads 1..512";
    default:
      break;
  }
  if (code >= FTAR_ERR_CUDA_BASE) return cudaGetErrorString(static_cast<cudaError_t>(code - FTAR_ERR_CUDA_BASE));
  return "unknown FTAR error code";
}

int ftar_abi_version(void) { return FTAR_ABI_VERSION; }

}  // extern "C"
