// Device-side helpers shared by every multi-tensor kernel: walking a tensor table's chunks (one block per chunk),
// 16-byte vector access, and deterministic block reductions.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "common/tensor_table.h"

namespace ampkernels {
namespace cuda {

constexpr int kThreads = 256;

// Blocks for a launch over `chunks` chunks: one per chunk (the kernels loop over chunks, so a smaller grid would
// stay correct). NOTE (H200, dev/scaler/NOTES.md and the benchmarks): faster than a persistent grid of the resident
// blocks everywhere it was measured: unscale in place 97.7% against 91.0% of copy bandwidth (Llama-1B set, 16 loads a
// thread), read-only 109% against 105%, FusedAdamW 93-95% against 91-93%.
inline int64_t chunk_grid(int64_t chunks) { return std::min<int64_t>(chunks, std::numeric_limits<int32_t>::max()); }

// Elements of T in one 16-byte access.
template <typename T>
struct alignas(16) Pack {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

// A chunk of one tensor as seen by one block.
template <typename T>
struct Chunk {
  T* data;
  int64_t size;
};

template <typename T>
__device__ __forceinline__ Chunk<T> chunk_at(const TableView& tv, int64_t c) {
  const int64_t t = tv.chunk_tensor[c];
  const int64_t start = tv.chunk_start[c];
  const int64_t remaining = tv.numels[t] - start;
  return {reinterpret_cast<T*>(tv.addrs[t]) + start, remaining < kChunkSize ? remaining : kChunkSize};
}

// NaN-propagating max, matching torch.max's treatment of NaN.
template <typename A>
__device__ __forceinline__ A nan_max(A a, A b) {
  return (b > a || b != b) && a == a ? b : a;
}

// Block-wide reduction of (flag, acc) with a fixed tree: deterministic for a fixed block size. A is float, or
// double for float64 tensors. Every thread must call it; the result is valid in thread 0.
template <bool kMax, typename A>
__device__ __forceinline__ void block_reduce(bool& flag, A& acc) {
  __shared__ A s_acc[kThreads / 32];
  flag = __syncthreads_or(flag);
  for (int offset = 16; offset > 0; offset >>= 1) {
    const A other = __shfl_down_sync(0xffffffffu, acc, offset);
    acc = kMax ? nan_max(acc, other) : acc + other;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) s_acc[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    acc = lane < kThreads / 32 ? s_acc[lane] : A(0);  // 0 is the identity of both + and max(|.|)
    for (int offset = 16; offset > 0; offset >>= 1) {
      const A other = __shfl_down_sync(0xffffffffu, acc, offset);
      acc = kMax ? nan_max(acc, other) : acc + other;
    }
  }
  __syncthreads();  // s_acc is reused by the next chunk
}

}  // namespace cuda
}  // namespace ampkernels
