// FTAR kernel bodies, compiled twice: by nvcc into the CUDA kernels (ftar_kernels.cu) and by a host
// C++ compiler into the emulated-grid driver (host/ftar_host.cpp), so CI checks the kernels' index
// arithmetic, vector/tail split and half-precision rounding on every run without a GPU.
//
// Everything a thread does is `elementwise_thread(..., tid, nthreads)`; a CUDA kernel derives
// tid/nthreads from blockIdx/threadIdx, the host driver loops over an emulated grid. Launch planning
// (argument checks, the 16-byte vector region) and the dtype dispatch are shared too, so the only
// CUDA-only code is the `<<<>>>` launch itself and the flag-wait's global timer.
//
// Element storage is raw bits (uint32_t for float32, uint16_t for float16/bfloat16). Half types
// accumulate in float32 and round to nearest even once: with CUDA's intrinsics on the device, with
// the bit-exact software conversions below on the host (both are IEEE round-to-nearest-even).
#ifndef FTAR_BODIES_CUH_
#define FTAR_BODIES_CUH_

#include <stdint.h>
#include <string.h>

#include <type_traits>

#include "ftar_kernels.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define FTAR_HD __host__ __device__ __forceinline__
#define FTAR_UNROLL _Pragma("unroll")
#else
#define FTAR_HD inline
#define FTAR_UNROLL
#endif

namespace ftar {

constexpr int kVecBytes = 16;
#ifndef FTAR_UNROLL_LOADS
#define FTAR_UNROLL_LOADS 8  // with FTAR_MAX_THREADS 512 these stay in registers (ftar_kernels.h)
#endif
constexpr int kUnroll = FTAR_UNROLL_LOADS;  // independent 16-byte loads per operand in flight per thread

enum class Op { kCopy, kReduce, kReduceCopy };

#if defined(__CUDACC__)
using Vec = uint4;
#else
struct alignas(16) Vec {
  uint32_t x, y, z, w;
};
#endif

FTAR_HD float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

FTAR_HD uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

// -- software conversions (host side; bit-exact round to nearest even) ---------------------------
inline float sw_half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant x 2^-24, exact in float
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return bits_float(float_bits(v) | sign);
  }
  if (exp == 31) return bits_float(sign | 0x7f800000u | (mant << 13));
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline uint16_t sw_float_to_half(float f) {
  uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  if (u >= 0x7f800000u) return sign | 0x7c00u | (u > 0x7f800000u ? 0x200u : 0u);  // inf, quiet NaN
  if (u >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to inf
  if (u < 0x38800000u) {                        // below 2^-14: a half subnormal (units of 2^-24)
    const uint32_t exp = u >> 23;
    const uint32_t m = (u & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - exp;
    if (exp == 0 || shift > 24) return sign;
    uint32_t q = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u), halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  u += 0xfffu + ((u >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((u >> 13) - (112u << 10)));
}

inline float sw_bf16_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

inline uint16_t sw_float_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// -- element types: storage bits plus add (one element) and add_word (the elements of 32 bits) ----
struct F32 {
  using T = uint32_t;
  static FTAR_HD T add(T a, T b) { return float_bits(bits_float(a) + bits_float(b)); }
  static FTAR_HD uint32_t add_word(uint32_t a, uint32_t b) { return add(a, b); }
};

struct F16 {
  using T = uint16_t;
  static FTAR_HD T add(T a, T b) {
#if defined(__CUDA_ARCH__)
    return __half_as_ushort(__float2half_rn(__half2float(__ushort_as_half(a)) + __half2float(__ushort_as_half(b))));
#else
    return sw_float_to_half(sw_half_to_float(a) + sw_half_to_float(b));
#endif
  }
  static FTAR_HD uint32_t add_word(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
    __half2 x, y;
    memcpy(&x, &a, 4);
    memcpy(&y, &b, 4);
    const float2 fx = __half22float2(x), fy = __half22float2(y);
    const __half2 r = __floats2half2_rn(fx.x + fy.x, fx.y + fy.y);
    uint32_t w;
    memcpy(&w, &r, 4);
    return w;
#else
    return add(a & 0xffffu, b & 0xffffu) | (static_cast<uint32_t>(add(a >> 16, b >> 16)) << 16);
#endif
  }
};

struct BF16 {
  using T = uint16_t;
  static FTAR_HD T add(T a, T b) {
#if defined(__CUDA_ARCH__)
    return __bfloat16_as_ushort(__float2bfloat16_rn(__bfloat162float(__ushort_as_bfloat16(a)) +
                                                    __bfloat162float(__ushort_as_bfloat16(b))));
#else
    return sw_float_to_bf16(sw_bf16_to_float(a) + sw_bf16_to_float(b));
#endif
  }
  static FTAR_HD uint32_t add_word(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
    __nv_bfloat162 x, y;
    memcpy(&x, &a, 4);
    memcpy(&y, &b, 4);
    const float2 fx = __bfloat1622float2(x), fy = __bfloat1622float2(y);
    const __nv_bfloat162 r = __floats2bfloat162_rn(fx.x + fy.x, fx.y + fy.y);
    uint32_t w;
    memcpy(&w, &r, 4);
    return w;
#else
    return add(a & 0xffffu, b & 0xffffu) | (static_cast<uint32_t>(add(a >> 16, b >> 16)) << 16);
#endif
  }
};

// Copies care only about the element width.
template <typename Bits>
struct Raw {
  using T = Bits;
};

// -- the per-thread body -------------------------------------------------------------------------
// Elements [0, head) and [head + num_vecs * per_vec, count) go one at a time; the vectors between
// are 16-byte aligned in dst, src and out (plan() made sure).
struct Plan {
  int64_t head;
  int64_t num_vecs;
  int64_t count;
};

template <typename E, Op kOp>
FTAR_HD Vec combine(Vec d, Vec s) {
  if constexpr (kOp == Op::kCopy) {
    return s;
  } else {
    Vec r;
    r.x = E::add_word(d.x, s.x);
    r.y = E::add_word(d.y, s.y);
    r.z = E::add_word(d.z, s.z);
    r.w = E::add_word(d.w, s.w);
    return r;
  }
}

template <typename E, Op kOp>
FTAR_HD void scalar_op(typename E::T* dst, const typename E::T* src, typename E::T* out, int64_t i) {
  if constexpr (kOp == Op::kCopy) {
    dst[i] = src[i];
  } else {
    const typename E::T v = E::add(dst[i], src[i]);
    dst[i] = v;
    if constexpr (kOp == Op::kReduceCopy) out[i] = v;
  }
}

// Thread `tid` of `nthreads`: grid-stride over the head, then kUnroll vectors per operand per
// iteration (all loads before any store), the leftover vectors, then the tail. No __restrict__: out
// may be src, which is safe because each element is read before it is written, by the same thread.
template <typename E, Op kOp>
FTAR_HD void elementwise_thread(typename E::T* dst, const typename E::T* src, typename E::T* out, Plan plan,
                                const int32_t* guard, int64_t tid, int64_t nthreads) {
  using T = typename E::T;
  if (guard != nullptr && *reinterpret_cast<const volatile int32_t*>(guard) != 0) return;
  constexpr int64_t kPerVec = kVecBytes / sizeof(T);
  for (int64_t i = tid; i < plan.head; i += nthreads) scalar_op<E, kOp>(dst, src, out, i);

  Vec* dv = reinterpret_cast<Vec*>(dst + plan.head);
  const Vec* sv = reinterpret_cast<const Vec*>(src + plan.head);
  Vec* ov = kOp == Op::kReduceCopy ? reinterpret_cast<Vec*>(out + plan.head) : nullptr;
  int64_t p = tid;
  for (; p + (kUnroll - 1) * nthreads < plan.num_vecs; p += kUnroll * nthreads) {
    Vec d[kUnroll], s[kUnroll];
FTAR_UNROLL
    for (int u = 0; u < kUnroll; ++u) {
      s[u] = sv[p + u * nthreads];
      if constexpr (kOp != Op::kCopy) d[u] = dv[p + u * nthreads];
    }
FTAR_UNROLL
    for (int u = 0; u < kUnroll; ++u) {
      const Vec v = combine<E, kOp>(d[u], s[u]);
      dv[p + u * nthreads] = v;
      if constexpr (kOp == Op::kReduceCopy) ov[p + u * nthreads] = v;
    }
  }
  for (; p < plan.num_vecs; p += nthreads) {
    Vec d{};
    if constexpr (kOp != Op::kCopy) d = dv[p];
    const Vec v = combine<E, kOp>(d, sv[p]);
    dv[p] = v;
    if constexpr (kOp == Op::kReduceCopy) ov[p] = v;
  }
  for (int64_t i = plan.head + plan.num_vecs * kPerVec + tid; i < plan.count; i += nthreads) {
    scalar_op<E, kOp>(dst, src, out, i);
  }
}

// What the flag wait does with one poll: a status, or -1 to poll again. `elapsed_ns` is measured
// on the device's global timer.
FTAR_HD int wait_decision(int64_t flag_value, int64_t expected, int64_t elapsed_ns, int64_t timeout_ns) {
  if (flag_value < 0) return FTAR_WAIT_ABORTED;
  if (flag_value >= expected) return FTAR_WAIT_OK;
  if (elapsed_ns >= timeout_ns) return FTAR_WAIT_TIMEOUT;
  return -1;
}

// -- launch planning (host) ----------------------------------------------------------------------
inline int check_launch(int blocks, int threads) {
  if (blocks < 1 || blocks > FTAR_MAX_BLOCKS || threads < 1 || threads > FTAR_MAX_THREADS) {
    return FTAR_ERR_INVALID_LAUNCH;
  }
  return FTAR_OK;
}

inline bool aligned(const void* p, uintptr_t n) { return reinterpret_cast<uintptr_t>(p) % n == 0; }

// Checks pointers and splits [0, count) into scalar head, 16-byte vectors and scalar tail. The
// vector region exists only if dst, src (and out) share their offset within 16 bytes: the head
// brings dst to a 16-byte boundary; otherwise every element goes through the scalar loops.
inline int plan_region(const void* dst, const void* src, const void* out, bool need_out, int64_t count,
                       size_t elem, Plan* plan) {
  if (dst == nullptr || src == nullptr || (need_out && out == nullptr)) return FTAR_ERR_INVALID_ARGUMENT;
  if (!aligned(dst, elem) || !aligned(src, elem) || (need_out && !aligned(out, elem))) {
    return FTAR_ERR_INVALID_ARGUMENT;
  }
  const int64_t per_vec = kVecBytes / static_cast<int64_t>(elem);
  const uintptr_t mis = reinterpret_cast<uintptr_t>(dst) % kVecBytes;
  const bool same = reinterpret_cast<uintptr_t>(src) % kVecBytes == mis &&
                    (!need_out || reinterpret_cast<uintptr_t>(out) % kVecBytes == mis);
  int64_t head = mis ? static_cast<int64_t>((kVecBytes - mis) / elem) : 0;
  int64_t num_vecs = 0;
  if (same && head < count) {
    num_vecs = (count - head) / per_vec;
  } else {
    head = count;
  }
  *plan = Plan{head, num_vecs, count};
  return FTAR_OK;
}

template <Op kOp>
using OpTag = std::integral_constant<Op, kOp>;

// Calls run(E{}, OpTag<kOp>{}) with the element type for (op, dtype) after the checks every launcher
// makes, in this order: launch shape, count, dtype. A count of 0 launches nothing.
template <Op kOp, typename Run>
int dispatch(int dtype, int64_t count, int blocks, int threads, Run&& run) {
  const int rc = check_launch(blocks, threads);
  if (rc != FTAR_OK) return rc;
  if (count < 0) return FTAR_ERR_INVALID_ARGUMENT;
  const OpTag<kOp> op{};
  if constexpr (kOp == Op::kCopy) {
    switch (dtype) {
      case FTAR_FLOAT32:
        return run(Raw<uint32_t>{}, op);
      case FTAR_FLOAT16:
      case FTAR_BFLOAT16:
        return run(Raw<uint16_t>{}, op);
      case FTAR_BYTE:
        return run(Raw<uint8_t>{}, op);
      default:
        return FTAR_ERR_INVALID_DTYPE;
    }
  } else {
    switch (dtype) {
      case FTAR_FLOAT32:
        return run(F32{}, op);
      case FTAR_FLOAT16:
        return run(F16{}, op);
      case FTAR_BFLOAT16:
        return run(BF16{}, op);
      default:
        return FTAR_ERR_INVALID_DTYPE;
    }
  }
}

// What every launcher does before its launch: dispatch (the checks and the element type), then the
// region plan for that type; calls run(E{}, plan) when there is something to do (a count of 0
// launches nothing). Returns run's code or the first check's error.
template <Op kOp, typename Run>
int plan_launch(void* dst, const void* src, void* out, int64_t count, int dtype, int blocks, int threads, Run&& run) {
  return dispatch<kOp>(dtype, count, blocks, threads, [&](auto elem, auto) {
    using T = typename decltype(elem)::T;
    if (count == 0) return FTAR_OK;
    Plan plan;
    const int rc = plan_region(dst, src, out, kOp == Op::kReduceCopy, count, sizeof(T), &plan);
    if (rc != FTAR_OK) return rc;
    return run(elem, plan);
  });
}

}  // namespace ftar

#endif  // FTAR_BODIES_CUH_
