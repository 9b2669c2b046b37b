// Shared by the standalone FP8 cast probes (cast_bench.cu, amax_bench.cu): bf16 vectors, the reference
// semantics of an e4m3 cast (amax over finite values, non-finite flag, saturation), event timing, random fill.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CHECK(call)                                                                             \
  do {                                                                                          \
    cudaError_t err_ = (call);                                                                  \
    if (err_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

struct alignas(16) V8 {
  __nv_bfloat16 v[8];
};

__device__ __forceinline__ void accumulate(float v, float& acc, bool& bad) {
  const float a = fabsf(v);
  const bool finite = a < INFINITY;
  acc = fmaxf(acc, finite ? a : 0.0f);
  bad |= !finite;
}

__device__ __forceinline__ float saturated(float x, float scale) {
  float p = x * scale;
  p = p > 448.0f ? 448.0f : p;
  p = p < -448.0f ? -448.0f : p;
  return fabsf(x) < INFINITY ? p : __int_as_float(0x7fc00000);
}

__device__ __forceinline__ uint2 cast8(const V8& r, float scale) {
  uint32_t w[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float a = saturated(__bfloat162float(r.v[2 * e]), scale);
    const float b = saturated(__bfloat162float(r.v[2 * e + 1]), scale);
    w[e] = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  }
  return make_uint2(w[0] | (w[1] << 16), w[2] | (w[3] << 16));
}

__device__ __forceinline__ void acc8(const V8& r, float& acc, bool& bad) {
#pragma unroll
  for (int e = 0; e < 8; ++e) accumulate(__bfloat162float(r.v[e]), acc, bad);
}

__device__ __forceinline__ float scale_of(float amax, bool bad) {
  return bad ? 1.0f : __frcp_rn(fmaxf(amax, 1e-12f)) * 448.0f;
}

// The block's max of acc and `or` of bad, in every thread (one call per kernel: s_acc is not reused).
template <int kThreads>
__device__ __forceinline__ float block_max(float acc, bool& bad) {
  __shared__ float s_acc[kThreads / 32];
  bad = __syncthreads_or(bad);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc = fmaxf(acc, __shfl_xor_sync(0xffffffffu, acc, o));
  if (threadIdx.x % 32 == 0) s_acc[threadIdx.x / 32] = acc;
  __syncthreads();
  acc = s_acc[0];
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) acc = fmaxf(acc, s_acc[w]);
  return acc;
}

template <int kThreads>
__device__ __forceinline__ void reduce_to_global(float acc, bool bad, unsigned* g_amax, int* g_bad) {
  acc = block_max<kThreads>(acc, bad);
  if (threadIdx.x == 0) {
    atomicMax(g_amax, __float_as_uint(acc));
    if (bad) atomicOr(g_bad, 1);
  }
}

// ---- harness ----
// Median over 7 loops of `iters` launches, ms per launch; events on `stream`.
template <typename F>
float time_ms(F&& launch, int iters, cudaStream_t stream = 0) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> t;
  launch();
  CHECK(cudaDeviceSynchronize());
  for (int rep = 0; rep < 7; ++rep) {
    CHECK(cudaEventRecord(a, stream));
    for (int i = 0; i < iters; ++i) launch();
    CHECK(cudaEventRecord(b, stream));
    CHECK(cudaEventSynchronize(b));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms / iters);
  }
  CHECK(cudaGetLastError());
  std::sort(t.begin(), t.end());
  return t[3];
}

__global__ void fill(V8* x, int64_t nvec, uint32_t seed) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < nvec; i += int64_t(gridDim.x) * blockDim.x) {
    V8 r;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      uint32_t h = uint32_t(i * 8 + e) * 2654435761u ^ seed;
      h ^= h >> 15;
      h *= 2246822519u;
      h ^= h >> 13;
      r.v[e] = __float2bfloat16((int(h & 0xffff) - 32768) * (3.0f / 8192.0f));
    }
    x[i] = r;
  }
}

// The ceiling: a 1 GiB device-to-device copy on `stream`, GB/s of bytes read + written (printed).
inline double copy_bandwidth(cudaStream_t stream = 0) {
  const size_t bytes = size_t(1) << 30;
  void *a, *b;
  CHECK(cudaMalloc(&a, bytes));
  CHECK(cudaMalloc(&b, bytes));
  CHECK(cudaMemset(a, 1, bytes));
  const float ms = time_ms([&] { CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream)); }, 10, stream);
  const double gbs = 2.0 * bytes / ms / 1e6;
  std::printf("copy 1 GiB: %.4f ms, %.0f GB/s (read + write)\n", ms, gbs);
  CHECK(cudaFree(a));
  CHECK(cudaFree(b));
  return gbs;
}
