// Variants of the in-place unscale kernel (fp32, found_inf, no norm), to find what holds the write path at 85-88% of
// copy bandwidth (dev/NOTES.md). Standalone (no torch headers, builds in seconds); driven by dev/unscale_probe.py,
// which also times torch's copy_ and in-place mul_ in the same process.
// Table: per chunk c of CHUNK elements, tensor t = chunk_tensor[c], start = chunk_start[c]; numels[t], addrs[t], as
// in the extension's TensorTable (the chunk walk reads the same chain of dependent loads).
#include <cstdint>

namespace {

constexpr int kThreads = 256;

template <int kHint>
__device__ __forceinline__ float4 load4(const float4* p) {
  if (kHint == 1) return __ldcs(p);  // evict-first
  if (kHint == 2) return __ldlu(p);  // last use
  return *p;
}

template <int kHint>
__device__ __forceinline__ void store4(float4* p, float4 v) {
  if (kHint == 3) return;  // read-only pass (found_inf only)
  if (kHint == 1) {
    __stcs(p, v);  // streaming
  } else if (kHint == 2) {
    __stcg(p, v);  // L2 only
  } else {
    *p = v;
  }
}

__device__ __forceinline__ void unscale4(float4& v, float inv, bool& bad) {
  bad |= !isfinite(v.x) | !isfinite(v.y) | !isfinite(v.z) | !isfinite(v.w);
  v.x *= inv;
  v.y *= inv;
  v.z *= inv;
  v.w *= inv;
}

// kReduce 1: one block reduction per chunk (the extension); 0: one flag store per warp, no barrier.
template <int CHUNK, int UNROLL, int LOAD_HINT, int STORE_HINT, int REDUCE, int MIN_BLOCKS = 1, int PIPELINE = 0>
__global__ void __launch_bounds__(kThreads, MIN_BLOCKS) unscale_kernel(const int64_t* addrs, const int64_t* numels,
                                                          const int64_t* chunk_tensor, const int64_t* chunk_start,
                                                          int64_t num_chunks, const float* scale, float* partials) {
  const float inv = static_cast<float>(1.0 / static_cast<double>(*scale));
  for (int64_t c = blockIdx.x; c < num_chunks; c += gridDim.x) {
    const int64_t t = chunk_tensor[c];
    const int64_t start = chunk_start[c];
    const int64_t remaining = numels[t] - start;
    const int64_t size = remaining < CHUNK ? remaining : CHUNK;
    float* data = reinterpret_cast<float*>(addrs[t]) + start;
    bool bad = false;
    const int64_t num_packs = size / 4;
    float4* packs = reinterpret_cast<float4*>(data);
    if (PIPELINE == 2) {
      // Lean: full trips through one pointer with constant offsets and no bounds checks, then a checked tail.
      constexpr int64_t kStep = int64_t(kThreads) * UNROLL;
      const int64_t full = num_packs / kStep;
      float4* p = packs + threadIdx.x;
      for (int64_t trip = 0; trip < full; ++trip, p += kStep) {
        float4 regs[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) regs[u] = load4<LOAD_HINT>(p + u * kThreads);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          unscale4(regs[u], inv, bad);
          store4<STORE_HINT>(p + u * kThreads, regs[u]);
        }
      }
      for (int64_t i = full * kStep + threadIdx.x; i < num_packs; i += kThreads) {
        float4 v = load4<LOAD_HINT>(packs + i);
        unscale4(v, inv, bad);
        store4<STORE_HINT>(packs + i, v);
      }
    } else if (PIPELINE) {
      // The next trip's loads are issued before this trip's stores: loads stay in flight across trips.
      constexpr int64_t kStep = int64_t(kThreads) * UNROLL;
      float4 cur[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int64_t i = threadIdx.x + int64_t(u) * kThreads;
        if (i < num_packs) cur[u] = load4<LOAD_HINT>(packs + i);
      }
      for (int64_t base = threadIdx.x; base < num_packs; base += kStep) {
        float4 nxt[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          const int64_t i = base + kStep + int64_t(u) * kThreads;
          if (i < num_packs) nxt[u] = load4<LOAD_HINT>(packs + i);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          const int64_t i = base + int64_t(u) * kThreads;
          if (i < num_packs) {
            unscale4(cur[u], inv, bad);
            store4<STORE_HINT>(packs + i, cur[u]);
          }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) cur[u] = nxt[u];
      }
    } else
    for (int64_t base = threadIdx.x; base < num_packs; base += int64_t(kThreads) * UNROLL) {
      float4 regs[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int64_t i = base + int64_t(u) * kThreads;
        if (i < num_packs) regs[u] = load4<LOAD_HINT>(packs + i);
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int64_t i = base + int64_t(u) * kThreads;
        if (i < num_packs) {
          unscale4(regs[u], inv, bad);
          store4<STORE_HINT>(packs + i, regs[u]);
        }
      }
    }
    for (int64_t i = num_packs * 4 + threadIdx.x; i < size; i += kThreads) {
      bad |= !isfinite(data[i]);
      if (STORE_HINT != 3) data[i] *= inv;
    }
    if (REDUCE) {
      bad = __syncthreads_or(bad);
      if (threadIdx.x == 0) partials[c] = bad ? 1.f : 0.f;
    } else {
      bad = __any_sync(0xffffffffu, bad);
      if ((threadIdx.x & 31) == 0 && bad) partials[c] = 1.f;  // partials zeroed by the driver
    }
  }
}

template <int CHUNK, int UNROLL, int LOAD_HINT, int STORE_HINT, int REDUCE, int MIN_BLOCKS = 1, int PIPELINE = 0>
int launch(const int64_t* addrs, const int64_t* numels, const int64_t* chunk_tensor, const int64_t* chunk_start,
           int64_t num_chunks, const float* scale, float* partials, int blocks_per_sm, cudaStream_t stream) {
  auto kernel = unscale_kernel<CHUNK, UNROLL, LOAD_HINT, STORE_HINT, REDUCE, MIN_BLOCKS, PIPELINE>;
  int resident = 0, sms = 0, dev = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, kThreads, 0);
  const int per_sm = blocks_per_sm > 0 ? blocks_per_sm : resident;
  int64_t blocks = blocks_per_sm < 0 ? num_chunks : int64_t(sms) * per_sm;  // < 0: one block per chunk
  if (blocks > num_chunks) blocks = num_chunks;
  kernel<<<blocks, kThreads, 0, stream>>>(addrs, numels, chunk_tensor, chunk_start, num_chunks, scale, partials);
  return cudaGetLastError() == cudaSuccess ? resident : -1;
}

}  // namespace

// variant: see VARIANTS in dev/unscale_probe.py (same order). Returns the resident blocks per SM, or -1.
extern "C" int unscale_probe(int variant, const int64_t* addrs, const int64_t* numels, const int64_t* chunk_tensor,
                             const int64_t* chunk_start, int64_t num_chunks, const float* scale, float* partials,
                             int blocks_per_sm, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
#define AMPK_V(C, U, L, S, R, ...)                                                                          \
  return launch<C, U, L, S, R, ##__VA_ARGS__>(addrs, numels, chunk_tensor, chunk_start, num_chunks, scale, partials, \
                                              blocks_per_sm, s)
  switch (variant) {
    case 0: AMPK_V(16384, 4, 0, 0, 1);  // the extension today
    case 1: AMPK_V(16384, 4, 0, 1, 1);  // streaming stores
    case 2: AMPK_V(16384, 4, 1, 1, 1);  // streaming loads and stores
    case 3: AMPK_V(16384, 8, 0, 0, 1);  // 8 loads in flight
    case 4: AMPK_V(4096, 4, 0, 0, 1);   // one loop trip per chunk: concurrent blocks on adjacent memory
    case 5: AMPK_V(4096, 4, 0, 1, 1);
    case 6: AMPK_V(16384, 4, 0, 0, 0);  // no block barrier
    case 7: AMPK_V(65536, 4, 0, 0, 1);
    case 8: AMPK_V(16384, 4, 2, 2, 1);  // .lu loads, .cg stores
    case 9: AMPK_V(2048, 2, 0, 0, 1);   // torch-like: 2 KB... 8 KB per block trip
    case 10: AMPK_V(16384, 8, 0, 0, 1, 6);    // 8 in flight, held to 40 registers (6 blocks/SM)
    case 11: AMPK_V(16384, 4, 0, 0, 1, 8);    // 4 in flight, 32 registers (8 blocks/SM)
    case 12: AMPK_V(16384, 16, 0, 0, 1);      // 16 in flight
    case 13: AMPK_V(16384, 4, 0, 0, 1, 1, 1);  // 4 in flight, next trip's loads before this trip's stores
    case 14: AMPK_V(16384, 8, 0, 0, 1, 1, 1);  // 8 in flight, pipelined
    case 15: AMPK_V(16384, 8, 0, 0, 1, 5);    // 8 in flight, 48 registers (5 blocks/SM)
    case 16: AMPK_V(16384, 8, 0, 1, 1);       // 8 in flight, streaming stores
    case 17: AMPK_V(16384, 4, 0, 0, 1, 1, 2);  // lean full trips
    case 18: AMPK_V(16384, 8, 0, 0, 1, 1, 2);
    case 19: AMPK_V(16384, 8, 0, 0, 1, 6, 2);  // lean, 40 registers
    case 20: AMPK_V(16384, 16, 0, 0, 1, 1, 2);
    case 21: AMPK_V(16384, 4, 0, 0, 1, 8, 2);   // lean, 32 registers (8 blocks/SM)
    case 22: AMPK_V(16384, 16, 0, 0, 1, 3, 2);  // lean, 16 in flight, 3 blocks/SM
    case 23: AMPK_V(16384, 4, 0, 3, 1);         // read-only (no store)
    case 24: AMPK_V(16384, 8, 0, 3, 1);         // read-only, 8 in flight
    case 25: AMPK_V(16384, 8, 0, 3, 1, 6, 2);   // read-only, lean, 40 registers
    default: return -1;
  }
#undef AMPK_V
}
