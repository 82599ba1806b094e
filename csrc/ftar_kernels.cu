// FTAR data-plane kernels (see ftar_kernels.h for the contract).
//
// Design notes (FT-HSDP §4.2): the kernels run on few SMs (default 2 blocks x 512 threads) next to
// the backward pass, so bandwidth comes from instruction-level parallelism rather than occupancy:
// each thread issues kUnroll independent 16-byte loads per operand before it computes or stores,
// which keeps enough bytes in flight per SM to approach HBM bandwidth with a handful of warps.

#include "ftar_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr int kVecBytes = 16;
constexpr int kUnroll = 4;

enum class Op { kCopy, kReduce, kReduceCopy };

// Element arithmetic. add_word adds the elements packed in one 32-bit word (1 float, 2 halves).
template <typename T>
struct Elem;

template <>
struct Elem<float> {
  static __device__ __forceinline__ float add(float a, float b) { return a + b; }
  static __device__ __forceinline__ uint32_t add_word(uint32_t a, uint32_t b) {
    return __float_as_uint(__uint_as_float(a) + __uint_as_float(b));
  }
};

template <>
struct Elem<__half> {
  static __device__ __forceinline__ __half add(__half a, __half b) {
    return __float2half_rn(__half2float(a) + __half2float(b));
  }
  static __device__ __forceinline__ uint32_t add_word(uint32_t a, uint32_t b) {
    __half2 x, y;
    memcpy(&x, &a, 4);
    memcpy(&y, &b, 4);
    const float2 fx = __half22float2(x), fy = __half22float2(y);
    const __half2 r = __floats2half2_rn(fx.x + fy.x, fx.y + fy.y);
    uint32_t w;
    memcpy(&w, &r, 4);
    return w;
  }
};

template <>
struct Elem<__nv_bfloat16> {
  static __device__ __forceinline__ __nv_bfloat16 add(__nv_bfloat16 a, __nv_bfloat16 b) {
    return __float2bfloat16_rn(__bfloat162float(a) + __bfloat162float(b));
  }
  static __device__ __forceinline__ uint32_t add_word(uint32_t a, uint32_t b) {
    __nv_bfloat162 x, y;
    memcpy(&x, &a, 4);
    memcpy(&y, &b, 4);
    const float2 fx = __bfloat1622float2(x), fy = __bfloat1622float2(y);
    const __nv_bfloat162 r = __floats2bfloat162_rn(fx.x + fy.x, fx.y + fy.y);
    uint32_t w;
    memcpy(&w, &r, 4);
    return w;
  }
};

template <typename T, Op kOp>
__device__ __forceinline__ uint4 combine(uint4 d, uint4 s) {
  if constexpr (kOp == Op::kCopy) {
    return s;
  } else {
    return make_uint4(Elem<T>::add_word(d.x, s.x), Elem<T>::add_word(d.y, s.y),
                      Elem<T>::add_word(d.z, s.z), Elem<T>::add_word(d.w, s.w));
  }
}

template <typename T, Op kOp>
__device__ __forceinline__ void scalar_op(T* dst, const T* src, T* out, int64_t i) {
  if constexpr (kOp == Op::kCopy) {
    dst[i] = src[i];
  } else {
    const T v = Elem<T>::add(dst[i], src[i]);
    dst[i] = v;
    if constexpr (kOp == Op::kReduceCopy) out[i] = v;
  }
}

// Elements [0, head) and [head + num_vecs * per_vec, count) go one by one; the vectors between
// are 16-byte aligned in dst, src and out (the launcher checked). No __restrict__: out may be src,
// which is safe because each element is read before it is written, by the same thread.
template <typename T, Op kOp>
__global__ void __launch_bounds__(FTAR_MAX_THREADS)
    elementwise_kernel(T* dst, const T* src, T* out, int64_t head, int64_t num_vecs, int64_t count,
                       const int32_t* guard) {
  if (guard != nullptr && *reinterpret_cast<const volatile int32_t*>(guard) != 0) return;
  constexpr int64_t kPerVec = kVecBytes / sizeof(T);
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nthreads = static_cast<int64_t>(gridDim.x) * blockDim.x;

  for (int64_t i = tid; i < head; i += nthreads) scalar_op<T, kOp>(dst, src, out, i);

  uint4* dv = reinterpret_cast<uint4*>(dst + head);
  const uint4* sv = reinterpret_cast<const uint4*>(src + head);
  uint4* ov = kOp == Op::kReduceCopy ? reinterpret_cast<uint4*>(out + head) : nullptr;
  int64_t p = tid;
  for (; p + (kUnroll - 1) * nthreads < num_vecs; p += kUnroll * nthreads) {
    uint4 d[kUnroll], s[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {  // all loads first: kUnroll x 2 requests in flight
      s[u] = sv[p + u * nthreads];
      if constexpr (kOp != Op::kCopy) d[u] = dv[p + u * nthreads];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      uint4 v;
      if constexpr (kOp == Op::kCopy) {
        v = s[u];
      } else {
        v = combine<T, kOp>(d[u], s[u]);
      }
      dv[p + u * nthreads] = v;
      if constexpr (kOp == Op::kReduceCopy) ov[p + u * nthreads] = v;
    }
  }
  for (; p < num_vecs; p += nthreads) {
    uint4 d = make_uint4(0, 0, 0, 0);
    if constexpr (kOp != Op::kCopy) d = dv[p];
    const uint4 v = combine<T, kOp>(d, sv[p]);
    dv[p] = v;
    if constexpr (kOp == Op::kReduceCopy) ov[p] = v;
  }

  for (int64_t i = head + num_vecs * kPerVec + tid; i < count; i += nthreads) {
    scalar_op<T, kOp>(dst, src, out, i);
  }
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void wait_flag_kernel(const volatile int64_t* flag, int64_t expected, int64_t timeout_ns,
                                 int32_t* status) {
  const uint64_t start = global_timer_ns();
  int32_t result;
  for (;;) {
    const int64_t v = *flag;
    if (v < 0) {
      result = FTAR_WAIT_ABORTED;
      break;
    }
    if (v >= expected) {
      result = FTAR_WAIT_OK;
      break;
    }
    if (static_cast<int64_t>(global_timer_ns() - start) >= timeout_ns) {
      result = FTAR_WAIT_TIMEOUT;
      break;
    }
    __nanosleep(256);  // each poll is a PCIe read of host memory; no need to hammer it
  }
  *reinterpret_cast<volatile int32_t*>(status) = result;
  __threadfence_system();
}

int check_launch(int blocks, int threads) {
  if (blocks < 1 || blocks > FTAR_MAX_BLOCKS || threads < 1 || threads > FTAR_MAX_THREADS) {
    return FTAR_ERR_INVALID_LAUNCH;
  }
  return FTAR_OK;
}

int launch_status() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? FTAR_OK : FTAR_ERR_CUDA_BASE + static_cast<int>(err);
}

bool aligned(const void* p, uintptr_t n) { return reinterpret_cast<uintptr_t>(p) % n == 0; }

template <typename T, Op kOp>
int launch(void* dst, const void* src, void* out, int64_t count, const int32_t* guard, int blocks,
           int threads, cudaStream_t stream) {
  if (count == 0) return FTAR_OK;
  const bool need_out = kOp == Op::kReduceCopy;
  if (dst == nullptr || src == nullptr || (need_out && out == nullptr)) return FTAR_ERR_INVALID_ARGUMENT;
  if (!aligned(dst, sizeof(T)) || !aligned(src, sizeof(T)) || (need_out && !aligned(out, sizeof(T)))) {
    return FTAR_ERR_INVALID_ARGUMENT;
  }
  // Vectorize only if dst, src (and out) share their offset within 16 bytes: peel the scalar head
  // that brings dst to a 16-byte boundary; otherwise run everything through the scalar loop.
  constexpr int64_t kPerVec = kVecBytes / sizeof(T);
  const uintptr_t mis = reinterpret_cast<uintptr_t>(dst) % kVecBytes;
  const bool same = reinterpret_cast<uintptr_t>(src) % kVecBytes == mis &&
                    (!need_out || reinterpret_cast<uintptr_t>(out) % kVecBytes == mis);
  int64_t head = mis ? static_cast<int64_t>((kVecBytes - mis) / sizeof(T)) : 0;
  int64_t num_vecs = 0;
  if (same && head < count) {
    num_vecs = (count - head) / kPerVec;
  } else {
    head = count;
  }
  elementwise_kernel<T, kOp><<<blocks, threads, 0, stream>>>(
      static_cast<T*>(dst), static_cast<const T*>(src), static_cast<T*>(out), head, num_vecs, count, guard);
  return launch_status();
}

template <Op kOp>
int launch_reduce(void* dst, const void* src, void* out, int64_t count, int dtype, const int32_t* guard,
                  int blocks, int threads, ftar_stream_t stream) {
  const int rc = check_launch(blocks, threads);
  if (rc != FTAR_OK) return rc;
  if (count < 0) return FTAR_ERR_INVALID_ARGUMENT;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case FTAR_FLOAT32:
      return launch<float, kOp>(dst, src, out, count, guard, blocks, threads, s);
    case FTAR_FLOAT16:
      return launch<__half, kOp>(dst, src, out, count, guard, blocks, threads, s);
    case FTAR_BFLOAT16:
      return launch<__nv_bfloat16, kOp>(dst, src, out, count, guard, blocks, threads, s);
    default:
      return FTAR_ERR_INVALID_DTYPE;
  }
}

}  // namespace

extern "C" {

int ftar_copy(void* dst, const void* src, int64_t count, int dtype, const int32_t* guard, int blocks,
              int threads, ftar_stream_t stream) {
  const int rc = check_launch(blocks, threads);
  if (rc != FTAR_OK) return rc;
  if (count < 0) return FTAR_ERR_INVALID_ARGUMENT;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {  // a copy only cares about the element width
    case FTAR_FLOAT32:
      return launch<uint32_t, Op::kCopy>(dst, src, nullptr, count, guard, blocks, threads, s);
    case FTAR_FLOAT16:
    case FTAR_BFLOAT16:
      return launch<uint16_t, Op::kCopy>(dst, src, nullptr, count, guard, blocks, threads, s);
    case FTAR_BYTE:
      return launch<uint8_t, Op::kCopy>(dst, src, nullptr, count, guard, blocks, threads, s);
    default:
      return FTAR_ERR_INVALID_DTYPE;
  }
}

int ftar_reduce(void* dst, const void* src, int64_t count, int dtype, const int32_t* guard, int blocks,
                int threads, ftar_stream_t stream) {
  return launch_reduce<Op::kReduce>(dst, src, nullptr, count, dtype, guard, blocks, threads, stream);
}

int ftar_reduce_copy(void* dst, const void* src, void* out, int64_t count, int dtype, const int32_t* guard,
                     int blocks, int threads, ftar_stream_t stream) {
  return launch_reduce<Op::kReduceCopy>(dst, src, out, count, dtype, guard, blocks, threads, stream);
}

int ftar_wait_flag(const int64_t* flag, int64_t expected, int64_t timeout_ns, int32_t* status,
                   ftar_stream_t stream) {
  if (flag == nullptr || status == nullptr || timeout_ns < 0) return FTAR_ERR_INVALID_ARGUMENT;
  if (!aligned(flag, sizeof(int64_t)) || !aligned(status, sizeof(int32_t))) return FTAR_ERR_INVALID_ARGUMENT;
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
      return "invalid launch configuration: blocks must be 1..65535 and threads 1..1024";
    default:
      break;
  }
  if (code >= FTAR_ERR_CUDA_BASE) return cudaGetErrorString(static_cast<cudaError_t>(code - FTAR_ERR_CUDA_BASE));
  return "unknown FTAR error code";
}

int ftar_abi_version(void) { return FTAR_ABI_VERSION; }

}  // extern "C"
