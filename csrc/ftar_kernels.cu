// FTAR data-plane kernels (see ftar_kernels.h for the contract).
//
// Design notes (FT-HSDP §4.2): the kernels run on few SMs (default 2 blocks x 512 threads) next to
// the backward pass, so bandwidth comes from instruction-level parallelism rather than occupancy:
// each thread issues kUnroll independent 16-byte loads per operand before it computes or stores,
// which keeps enough bytes in flight per SM to approach HBM bandwidth with a handful of warps.
// Variant 1 (staged) keeps its loads in flight in shared memory instead: a ring of cp.async stages
// per thread, as large as the block's opt-in shared memory allows (ftar::staged_thread); variant 2
// (bulk, sm_90) fills the same ring with one bulk copy per tile and operand (bulk_kernel).

#include "ftar_kernels.h"

#include <cuda_runtime.h>

#include <atomic>
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

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// -- variant 2: Hopper bulk copies -----------------------------------------------------------------
// Thread 0 loads each tile with one cp.async.bulk per operand (the TMA unit moves it, no per-thread
// copies) and an mbarrier per stage counts the bytes in; every thread waits for the stage and leaves
// its slots' results in the stage (ftar::reduce_stage_in_place, the same layout as variant 1); after a
// proxy fence and a block barrier thread 0 stores the tile with one bulk copy per output (so the
// SM's store path carries no per-thread stores either), and refills the stage of the tile before once
// that tile's store has read it. The mbarriers and the block's guard flag sit in the first
// kBarrierBytes of dynamic shared memory, the ring after them.
constexpr int kBarrierBytes = 256;  // ftar::kMaxStages x 8-byte mbarriers, then the guard flag
static_assert(ftar::kMaxStages * 8 + 4 <= kBarrierBytes, "one mbarrier per stage and the flag");

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr uint64_t kBulkWaitLimitNs = 4000000000ull;  // a stage that never lands traps instead of hanging

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void bulk_load(void* smem, const void* global, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               :
               : "r"(smem_addr(smem)), "l"(global), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}

__device__ __forceinline__ void bulk_store(void* global, const void* smem, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(global), "r"(smem_addr(smem)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }

// Until at most one bulk store group (the newest) still reads shared memory.
__device__ __forceinline__ void bulk_wait_read_all_but_newest() {
  asm volatile("cp.async.bulk.wait_group.read 1;\n" ::: "memory");
}

__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// Makes this thread's shared-memory writes visible to bulk copies (the async proxy).
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ void bar_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ bool bar_try_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

__device__ __forceinline__ void bar_wait(uint64_t* bar, uint32_t parity) {
  if (bar_try_wait(bar, parity)) return;
  const uint64_t start = global_timer_ns();
  while (!bar_try_wait(bar, parity)) {
    if (global_timer_ns() - start > kBulkWaitLimitNs) __trap();
  }
}
#endif

template <typename E, Op kOp>
__global__ void __launch_bounds__(FTAR_MAX_THREADS)
    bulk_kernel(typename E::T* dst, const typename E::T* src, typename E::T* out, ftar::Plan plan,
                ftar::StagePlan sp, const int32_t* guard) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char raw[];
  uint64_t* full = reinterpret_cast<uint64_t*>(raw);
  int& skip = *reinterpret_cast<int*>(raw + ftar::kMaxStages * 8);
  ftar::Vec* smem = reinterpret_cast<ftar::Vec*>(raw + kBarrierBytes);
  const int thread = static_cast<int>(threadIdx.x);
  if (thread == 0) {
    skip = ftar::guarded(guard);  // one read for the whole block: all threads reach the same barriers
    for (int s = 0; s < sp.stages; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_addr(full + s)) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (skip) return;
  ftar::scalar_ends<E, kOp>(dst, src, out, plan, static_cast<int64_t>(blockIdx.x) * sp.threads + thread,
                            static_cast<int64_t>(gridDim.x) * sp.threads);

  constexpr int kSrc = ftar::kLoadedOperands<kOp> - 1;
  ftar::Vec* dv = reinterpret_cast<ftar::Vec*>(dst + plan.head);
  const ftar::Vec* sv = reinterpret_cast<const ftar::Vec*>(src + plan.head);
  ftar::Vec* ov = kOp == Op::kReduceCopy ? reinterpret_cast<ftar::Vec*>(out + plan.head) : nullptr;
  const ftar::BlockTiles tiles(plan.num_vecs, sp, blockIdx.x, gridDim.x);
  auto issue = [&](int64_t i) {  // thread 0: tile i into stage i % stages
    const int stage = static_cast<int>(i % sp.stages);
    const int64_t first = tiles.first_vec(i);
    const int64_t n = plan.num_vecs - first < tiles.tile_vecs ? plan.num_vecs - first : tiles.tile_vecs;
    const uint32_t bytes = static_cast<uint32_t>(n * ftar::kVecBytes);
    bar_expect(full + stage, bytes * ftar::kLoadedOperands<kOp>);
    bulk_load(smem + ftar::stage_slot(sp, stage, kSrc, 0, 0), sv + first, bytes, full + stage);
    if constexpr (kOp != Op::kCopy) {
      bulk_load(smem + ftar::stage_slot(sp, stage, 0, 0, 0), dv + first, bytes, full + stage);
    }
  };
  if (thread == 0) {
    for (int64_t i = 0; i < sp.stages && i < tiles.mine; ++i) issue(i);
  }
  for (int64_t i = 0; i < tiles.mine; ++i) {
    const int stage = static_cast<int>(i % sp.stages);
    const int64_t first = tiles.first_vec(i);
    bar_wait(full + stage, static_cast<uint32_t>((i / sp.stages) & 1));
    ftar::reduce_stage_in_place<E, kOp>(plan.num_vecs, sp, smem, stage, first, thread);
    fence_proxy_async();
    __syncthreads();  // the tile's results are in shared memory
    if (thread == 0) {
      const ftar::Vec* result = smem + ftar::stage_slot(sp, stage, 0, 0, 0);
      const int64_t n = plan.num_vecs - first < tiles.tile_vecs ? plan.num_vecs - first : tiles.tile_vecs;
      const auto bytes = static_cast<uint32_t>(n * ftar::kVecBytes);
      bulk_store(dv + first, result, bytes);
      if constexpr (kOp == Op::kReduceCopy) bulk_store(ov + first, result, bytes);
      bulk_commit();
      const int64_t done = i - 1;  // the tile before: once its store has read the stage, refill it
      if (done >= 0 && done + sp.stages < tiles.mine) {
        bulk_wait_read_all_but_newest();
        issue(done + sp.stages);
      }
    }
  }
  if (thread == 0) bulk_wait_all();  // the stores are done before the kernel is
#else
  __trap();  // the launcher runs this kernel on sm_90 and newer only
#endif
}

template <typename E, Op kOp>
__global__ void __launch_bounds__(FTAR_MAX_THREADS)
    staged_kernel(typename E::T* dst, const typename E::T* src, typename E::T* out, ftar::Plan plan,
                  ftar::StagePlan stages, const int32_t* guard) {
  extern __shared__ __align__(16) ftar::Vec smem[];
  CpAsync async;
  ftar::staged_thread<E, kOp>(dst, src, out, plan, stages, smem, async, guard, blockIdx.x, gridDim.x,
                              static_cast<int>(threadIdx.x));
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

std::atomic<int> g_stage_smem_limit{0}, g_max_stages{0};  // ftar_set_stage_limits; 0: no limit

// The stage ring for a staged (1) or bulk (2) launch: the device's opt-in shared memory per block
// (227 KB on sm_90, 163 KB on sm_80) within ftar_set_stage_limits, opted in for `kernel`. stages == 0
// when not even two stages fit.
template <Op kOp, typename Kernel>
int plan_staged_launch(Kernel kernel, int variant, int threads, ftar::StagePlan* sp, int* smem_bytes) {
  int device = 0, optin = 0, major = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err != cudaSuccess) return cuda_status(err);
  if (variant == FTAR_VARIANT_BULK && major < 9) return FTAR_ERR_INVALID_VARIANT;
  const int limit = g_stage_smem_limit.load(std::memory_order_relaxed);
  const int max_stages = g_max_stages.load(std::memory_order_relaxed);
  const int reserved = variant == FTAR_VARIANT_BULK ? kBarrierBytes : 0;
  *sp = ftar::plan_stages(ftar::kLoadedOperands<kOp>, threads, (limit > 0 && limit < optin ? limit : optin) - reserved,
                          max_stages > 0 ? max_stages : ftar::kMaxStages);
  if (sp->stages == 0) return FTAR_OK;
  *smem_bytes = reserved + static_cast<int>(ftar::stage_smem_bytes(*sp));
  return cuda_status(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, *smem_bytes));
}

// Checks (ftar::dispatch, ftar::plan_region), then one kernel launch on `stream`: `variant`'s kernel,
// or variant 0's when the shared memory holds fewer than two stages.
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
    auto* d = static_cast<T*>(dst);
    auto* sr = static_cast<const T*>(src);
    auto* o = static_cast<T*>(out);
    if (variant != FTAR_VARIANT_REGISTERS) {
      const auto kernel = variant == FTAR_VARIANT_BULK ? bulk_kernel<E, kOp> : staged_kernel<E, kOp>;
      ftar::StagePlan sp{};
      int smem = 0;
      if ((rc = plan_staged_launch<kOp>(kernel, variant, threads, &sp, &smem)) != FTAR_OK) return rc;
      if (sp.stages > 0) {
        kernel<<<blocks, threads, smem, s>>>(d, sr, o, plan, sp, guard);
        return launch_status();
      }
    }
    elementwise_kernel<E, kOp><<<blocks, threads, 0, s>>>(d, sr, o, plan, guard);
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

int ftar_set_stage_limits(int smem_bytes, int max_stages) {
  if (smem_bytes < 0 || max_stages < 0 || max_stages == 1 || max_stages > FTAR_MAX_STAGES) {
    return FTAR_ERR_INVALID_ARGUMENT;
  }
  g_stage_smem_limit.store(smem_bytes);
  g_max_stages.store(max_stages);
  return FTAR_OK;
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
      return "invalid kernel variant: expected 0 (registers), 1 (shared-memory stages) or 2 (bulk copies, sm_90 "
             "and newer only)";
    default:
      break;
  }
  if (code >= FTAR_ERR_CUDA_BASE) return cudaGetErrorString(static_cast<cudaError_t>(code - FTAR_ERR_CUDA_BASE));
  return "unknown FTAR error code";
}

int ftar_abi_version(void) { return FTAR_ABI_VERSION; }

}  // extern "C"
