// Host build of the FTAR kernel bodies (../ftar_bodies.cuh) over an emulated CUDA grid: every
// (blockIdx, threadIdx) of a `blocks` x `threads` launch runs the same per-thread body the GPU runs,
// one after another. Threads of these kernels touch disjoint elements, so running them in sequence
// gives what the GPU gives. Built with g++ (no CUDA) by tests/unit/test_csrc_host_kernels.py and
// driven through ctypes; same checks and return codes as the CUDA launchers.
//
// The staged variant runs with a copy engine that delays every asynchronous copy to the latest moment
// cp.async allows (the wait that retires its group), so a read of a stage before its wait, a wait for
// too few groups or a stage refilled before it is consumed gives wrong results here as on the GPU.
#include <stdint.h>
#include <string.h>

#include <deque>
#include <utility>
#include <vector>

#include "../ftar_bodies.cuh"

namespace {

using ftar::Op;

// cp.async's contract, latest-possible: copies happen when a wait retires their group.
class LazyAsync {
 public:
  void copy16(ftar::Vec* smem, const ftar::Vec* global) { open_.emplace_back(smem, global); }
  void commit() {
    groups_.push_back(std::move(open_));
    open_.clear();
  }
  void wait(int pending) {
    while (static_cast<int>(groups_.size()) > pending) {
      for (const auto& [smem, global] : groups_.front()) memcpy(smem, global, sizeof(ftar::Vec));
      groups_.pop_front();
    }
  }
  bool idle() const { return open_.empty() && groups_.empty(); }

 private:
  std::vector<std::pair<ftar::Vec*, const ftar::Vec*>> open_;
  std::deque<std::vector<std::pair<ftar::Vec*, const ftar::Vec*>>> groups_;
};

// Every thread of a `blocks` x `threads` grid, one after another; `smem_budget` > 0 runs the staged
// variant with the ring ftar::plan_stages gives for that many bytes of shared memory per block.
template <Op kOp>
int run_grid(void* dst, const void* src, void* out, int64_t count, int dtype, const int32_t* guard, int blocks,
             int threads, int variant, int64_t smem_budget) {
  return ftar::dispatch<kOp>(dtype, count, blocks, threads, variant, [&](auto elem, auto) {
    using E = decltype(elem);
    using T = typename E::T;
    if (count == 0) return FTAR_OK;
    if (variant == FTAR_VARIANT_BULK) return FTAR_ERR_INVALID_VARIANT;  // as on a GPU before sm_90: no bulk copies
    ftar::Plan plan;
    const int rc = ftar::plan_region(dst, src, out, kOp == Op::kReduceCopy, count, sizeof(T), &plan);
    if (rc != FTAR_OK) return rc;
    const ftar::StagePlan sp = ftar::plan_stages(ftar::kLoadedOperands<kOp>, threads, smem_budget);
    if (variant == FTAR_VARIANT_STAGED && sp.stages > 0) {
      std::vector<ftar::Vec> smem(static_cast<size_t>(ftar::stage_smem_bytes(sp)) / sizeof(ftar::Vec));
      for (int64_t block = 0; block < blocks; ++block) {
        for (int thread = 0; thread < threads; ++thread) {
          LazyAsync async;
          ftar::staged_thread<E, kOp>(static_cast<T*>(dst), static_cast<const T*>(src), static_cast<T*>(out), plan,
                                      sp, smem.data(), async, guard, block, blocks, thread);
          if (!async.idle()) return -1;  // the body left copies pending
        }
      }
      return FTAR_OK;
    }
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
                   int threads, int variant, int64_t smem_budget) {
  return run_grid<Op::kCopy>(dst, src, nullptr, count, dtype, guard, blocks, threads, variant, smem_budget);
}

int ftar_host_reduce(void* dst, const void* src, int64_t count, int dtype, const int32_t* guard, int blocks,
                     int threads, int variant, int64_t smem_budget) {
  return run_grid<Op::kReduce>(dst, src, nullptr, count, dtype, guard, blocks, threads, variant, smem_budget);
}

int ftar_host_reduce_copy(void* dst, const void* src, void* out, int64_t count, int dtype, const int32_t* guard,
                          int blocks, int threads, int variant, int64_t smem_budget) {
  return run_grid<Op::kReduceCopy>(dst, src, out, count, dtype, guard, blocks, threads, variant, smem_budget);
}

// The stage ring the staged launchers use for `smem_budget` bytes per block.
void ftar_host_stage_plan(int operands, int threads, int64_t smem_budget, int max_stages, int* stages, int* vecs) {
  const ftar::StagePlan sp = ftar::plan_stages(operands, threads, smem_budget, max_stages);
  *stages = sp.stages;
  *vecs = sp.vecs;
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
