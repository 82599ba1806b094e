// Host build of the FTAR kernel bodies (../ftar_bodies.cuh) over an emulated CUDA grid: every
// (blockIdx, threadIdx) of a `blocks` x `threads` launch runs the same per-thread body the GPU runs,
// one after another. Threads of these kernels touch disjoint elements, so running them in sequence
// gives what the GPU gives. Built with g++ (no CUDA) by tests/unit/test_csrc_host_kernels.py and
// driven through ctypes; same checks and return codes as the CUDA launchers.
#include <stdint.h>

#include "../ftar_bodies.cuh"

namespace {

using ftar::Op;

template <Op kOp>
int run_grid(void* dst, const void* src, void* out, int64_t count, int dtype, const int32_t* guard, int blocks,
             int threads) {
  return ftar::plan_launch<kOp>(dst, src, out, count, dtype, blocks, threads, [&](auto elem, const ftar::Plan& plan) {
    using E = decltype(elem);
    using T = typename E::T;
    const int64_t nthreads = static_cast<int64_t>(blocks) * threads;
    for (int64_t block = 0; block < blocks; ++block) {
      for (int64_t thread = 0; thread < threads; ++thread) {
        ftar::elementwise_thread<E, kOp>(static_cast<T*>(dst), static_cast<const T*>(src), static_cast<T*>(out),
                                         plan, guard, block * threads + thread, nthreads);
      }
    }
    return FTAR_OK;
  });
}

}  // namespace

extern "C" {

int ftar_host_copy(void* dst, const void* src, int64_t count, int dtype, const int32_t* guard, int blocks,
                   int threads) {
  return run_grid<Op::kCopy>(dst, src, nullptr, count, dtype, guard, blocks, threads);
}

int ftar_host_reduce(void* dst, const void* src, int64_t count, int dtype, const int32_t* guard, int blocks,
                     int threads) {
  return run_grid<Op::kReduce>(dst, src, nullptr, count, dtype, guard, blocks, threads);
}

int ftar_host_reduce_copy(void* dst, const void* src, void* out, int64_t count, int dtype, const int32_t* guard,
                          int blocks, int threads) {
  return run_grid<Op::kReduceCopy>(dst, src, out, count, dtype, guard, blocks, threads);
}

// The plan the launchers compute, for tests of the head / vector / tail split.
int ftar_host_plan(const void* dst, const void* src, const void* out, int need_out, int64_t count, int64_t elem,
                   int64_t* head, int64_t* num_vecs) {
  ftar::Plan plan{};
  const int rc = ftar::plan_region(dst, src, out, need_out != 0, count, static_cast<size_t>(elem), &plan);
  *head = plan.head;
  *num_vecs = plan.num_vecs;
  return rc;
}

int ftar_host_wait_decision(int64_t flag_value, int64_t expected, int64_t elapsed_ns, int64_t timeout_ns) {
  return ftar::wait_decision(flag_value, expected, elapsed_ns, timeout_ns);
}

uint16_t ftar_host_float_to_half(float f) { return ftar::sw_float_to_half(f); }
float ftar_host_half_to_float(uint16_t h) { return ftar::sw_half_to_float(h); }
uint16_t ftar_host_float_to_bf16(float f) { return ftar::sw_float_to_bf16(f); }

}  // extern "C"
