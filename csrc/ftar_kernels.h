/*
 * FTAR data-plane kernels: copy, reduce (dst += src), fused reduce+copy, and a flag wait.
 *
 * C ABI for ctypes (ftrun/ftar/cuda_kernels.py). Every launcher checks its arguments, enqueues one
 * kernel on `stream` and returns FTAR_OK or an error code; nothing blocks the host. Pointers are
 * device pointers or host-pinned pointers usable from the device (unified addressing).
 *
 * Data kernels run a grid of `blocks` x `threads` (default 2 x 512, as in FT-HSDP §4.2, so they
 * occupy two SMs next to the training kernels) and move 16-byte vectors, several per thread in
 * flight, with scalar head/tail loops for unaligned or odd-sized ranges. Half types accumulate in
 * float32 and round to nearest even once per element.
 *
 * Cancellation: if `guard` is non-NULL and *guard != 0 when the kernel starts, it does nothing.
 * Pass the status word of an earlier ftar_wait_flag on the same stream so that work queued behind
 * a timed-out or aborted wait is skipped (the paper's "terminate queued GPU ops").
 */
#ifndef FTAR_KERNELS_H_
#define FTAR_KERNELS_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FTAR_ABI_VERSION 1

/* Return codes. */
#define FTAR_OK 0
#define FTAR_ERR_INVALID_DTYPE 1    /* dtype code unknown, or not valid for this op */
#define FTAR_ERR_INVALID_ARGUMENT 2 /* NULL pointer with count > 0, count < 0, misaligned pointer */
#define FTAR_ERR_INVALID_LAUNCH 3   /* blocks or threads out of range */
#define FTAR_ERR_CUDA_BASE 1000     /* FTAR_ERR_CUDA_BASE + cudaError_t: the launch failed */

/* dtype codes (ftrun.ftar.kernels.DType). FTAR_BYTE is valid for ftar_copy only. */
#define FTAR_FLOAT32 0
#define FTAR_FLOAT16 1
#define FTAR_BFLOAT16 2
#define FTAR_BYTE 3

/* Status words written by ftar_wait_flag (ftrun.ftar.kernels.WaitStatus). */
#define FTAR_WAIT_OK 0
#define FTAR_WAIT_TIMEOUT 1
#define FTAR_WAIT_ABORTED 2

/* The kernels are compiled with __launch_bounds__(FTAR_MAX_THREADS): 512 gives each thread up to 128
 * registers, enough for 8 in-flight 16-byte loads per operand without spills (at 1024 the 64-register
 * cap spilled them). Measured on an H200 at the default 2 blocks: reduce 64 -> 80 GB/s (fp32). */
#define FTAR_MAX_THREADS 512
#define FTAR_MAX_BLOCKS 65535

typedef void* ftar_stream_t; /* a cudaStream_t; NULL is the legacy default stream */

/* dst[i] = src[i] for count elements of dtype (bytes copied exactly). */
int ftar_copy(void* dst, const void* src, int64_t count, int dtype, const int32_t* guard,
              int blocks, int threads, ftar_stream_t stream);

/* dst[i] += src[i]. dst and src must not overlap. */
int ftar_reduce(void* dst, const void* src, int64_t count, int dtype, const int32_t* guard,
                int blocks, int threads, ftar_stream_t stream);

/* v = dst[i] + src[i]; dst[i] = v; out[i] = v. out may equal src; no other overlap. */
int ftar_reduce_copy(void* dst, const void* src, void* out, int64_t count, int dtype,
                     const int32_t* guard, int blocks, int threads, ftar_stream_t stream);

/*
 * One thread polls *flag (host-pinned, written by a CPU thread) until it is >= expected
 * (status FTAR_WAIT_OK), negative (FTAR_WAIT_ABORTED) or timeout_ns passed on the GPU's global
 * timer (FTAR_WAIT_TIMEOUT), then writes the status to *status. The host writes the payload
 * before it raises the flag.
 */
int ftar_wait_flag(const int64_t* flag, int64_t expected, int64_t timeout_ns, int32_t* status,
                   ftar_stream_t stream);

/* A static message for any code the launchers return (CUDA's own text for CUDA errors). */
const char* ftar_error_string(int code);

int ftar_abi_version(void);

#ifdef __cplusplus
}
#endif

#endif /* FTAR_KERNELS_H_ */
