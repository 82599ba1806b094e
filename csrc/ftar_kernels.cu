// FTAR data-plane kernels (see ftar_kernels.h for the contract).
//
// Design notes (FT-HSDP §4.2): the kernels run on few SMs (default 2 blocks x 512 threads) next to
// the backward pass, so bandwidth comes from instruction-level parallelism rather than occupancy:
// each thread issues kUnroll independent 16-byte loads per operand before it computes or stores,
// which keeps enough bytes in flight per SM to approach HBM bandwidth with a handful of warps.
// Variant 1 (staged) keeps its loads in flight in shared memory instead: a ring of cp.async stages
// per thread, as large as the block's opt-in shared memory allows (ftar::staged_thread).

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

// The staged body's copy engine: Ampere's 16-byte cp.async into shared memory (L2 only, .cg).
struct CpAsync {
  __device__ __forceinline__ void copy16(ftar::Vec* smem, const ftar::Vec* global) {
    const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(global) : "memory");
  }
  __device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
  template <int N>
  __device__ __forceinline__ void wait_group() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
  }
  __device__ __forceinline__ void wait(int pending) {  // wait_group takes an immediate
    static_assert(ftar::kMaxStages == 16, "one case per pending count below kMaxStages");
    switch (pending) {
      case 0: wait_group<0>(); break;
      case 1: wait_group<1>(); break;
      case 2: wait_group<2>(); break;
      case 3: wait_group<3>(); break;
      case 4: wait_group<4>(); break;
      case 5: wait_group<5>(); break;
      case 6: wait_group<6>(); break;
      case 7: wait_group<7>(); break;
      case 8: wait_group<8>(); break;
      case 9: wait_group<9>(); break;
      case 10: wait_group<10>(); break;
      case 11: wait_group<11>(); break;
      case 12: wait_group<12>(); break;
      case 13: wait_group<13>(); break;
      case 14: wait_group<14>(); break;
      default: wait_group<15>(); break;
    }
  }
};

template <typename E, Op kOp>
__global__ void __launch_bounds__(FTAR_MAX_THREADS)
    staged_kernel(typename E::T* dst, const typename E::T* src, typename E::T* out, ftar::Plan plan,
                  ftar::StagePlan stages, const int32_t* guard) {
  extern __shared__ __align__(16) ftar::Vec smem[];
  CpAsync async;
  ftar::staged_thread<E, kOp>(dst, src, out, plan, stages, smem, async, guard, blockIdx.x, gridDim.x,
                              static_cast<int>(threadIdx.x));
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

int cuda_status(cudaError_t err) { return err == cudaSuccess ? FTAR_OK : FTAR_ERR_CUDA_BASE + static_cast<int>(err); }

int launch_status() { return cuda_status(cudaGetLastError()); }

// The stage ring for this launch: the device's opt-in shared memory per block (227 KB on sm_90,
// 163 KB on sm_80), opted in for this kernel. stages == 0 when not even two stages fit.
template <typename E, Op kOp>
int plan_staged_launch(int threads, ftar::StagePlan* sp) {
  int device = 0, optin = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err != cudaSuccess) return cuda_status(err);
  *sp = ftar::plan_stages(ftar::kLoadedOperands<kOp>, threads, optin);
  if (sp->stages == 0) return FTAR_OK;
  return cuda_status(cudaFuncSetAttribute(staged_kernel<E, kOp>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(ftar::stage_smem_bytes(*sp))));
}

// Checks (ftar::dispatch, ftar::plan_region), then one kernel launch on `stream`.
template <Op kOp>
int launch(void* dst, const void* src, void* out, int64_t count, int dtype, const int32_t* guard, int blocks,
           int threads, int variant, ftar_stream_t stream) {
  return ftar::dispatch<kOp>(dtype, count, blocks, threads, variant, [&](auto elem, auto) {
    using E = decltype(elem);
    using T = typename E::T;
    if (count == 0) return FTAR_OK;
    ftar::Plan plan;
    int rc = ftar::plan_region(dst, src, out, kOp == Op::kReduceCopy, count, sizeof(T), &plan);
    if (rc != FTAR_OK) return rc;
    const auto s = static_cast<cudaStream_t>(stream);
    ftar::StagePlan sp{};
    if (variant == FTAR_VARIANT_STAGED && (rc = plan_staged_launch<E, kOp>(threads, &sp)) != FTAR_OK) return rc;
    if (sp.stages > 0) {
      staged_kernel<E, kOp><<<blocks, threads, ftar::stage_smem_bytes(sp), s>>>(
          static_cast<T*>(dst), static_cast<const T*>(src), static_cast<T*>(out), plan, sp, guard);
    } else {
      elementwise_kernel<E, kOp><<<blocks, threads, 0, s>>>(static_cast<T*>(dst), static_cast<const T*>(src),
                                                           static_cast<T*>(out), plan, guard);
    }
    return launch_status();
  });
}

}  // namespace

extern "C" {

int ftar_copy(void* dst, const void* src, int64_t count, int dtype, const int32_t* guard, int blocks,
              int threads, int variant, ftar_stream_t stream) {
  return launch<Op::kCopy>(dst, src, nullptr, count, dtype, guard, blocks, threads, variant, stream);
}

int ftar_reduce(void* dst, const void* src, int64_t count, int dtype, const int32_t* guard, int blocks,
                int threads, int variant, ftar_stream_t stream) {
  return launch<Op::kReduce>(dst, src, nullptr, count, dtype, guard, blocks, threads, variant, stream);
}

int ftar_reduce_copy(void* dst, const void* src, void* out, int64_t count, int dtype, const int32_t* guard,
                     int blocks, int threads, int variant, ftar_stream_t stream) {
  return launch<Op::kReduceCopy>(dst, src, out, count, dtype, guard, blocks, threads, variant, stream);
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
    case FTAR_ERR_INVALID_VARIANT:
      return "invalid kernel variant: expected 0 (registers) or 1 (shared-memory stages)";
    default:
      break;
  }
  if (code >= FTAR_ERR_CUDA_BASE) return cudaGetErrorString(static_cast<cudaError_t>(code - FTAR_ERR_CUDA_BASE));
  return "unknown FTAR error code";
}

int ftar_abi_version(void) { return FTAR_ABI_VERSION; }

}  // extern "C"
