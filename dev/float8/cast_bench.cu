// Standalone timing of FP8 cast designs, bf16 -> e4m3, no torch (compile and run in well under a minute):
//   nvcc -O3 -std=c++17 -arch=sm_90a dev/float8/cast_bench.cu -o /tmp/cast_bench && /tmp/cast_bench
//
// Question: how close to the copy bandwidth can one tensorwise cast get, and what does current scaling (the amax
// must be known before the first code is written) cost on top? Variants, each timed as back-to-back launches with
// events (median of 7 loops) and checked bit for bit against the two-pass version:
//   copy          cudaMemcpyAsync of the same bytes read + written (the ceiling);
//   two-pass      the shipped csrc/float8/casts.cu design: a grid-stride amax pass, then a grid-stride cast walked
//                 backwards (the amax pass's tail is in L2), two launches, 256 threads, 4 loads in flight;
//   hints         the two-pass design with L2 cache policies: the amax pass's last part of x kept (evict_last),
//                 the cast's loads evict_first and its stores streaming (.cs);
//   onepass-grid  that cast alone with a given scale (what delayed scaling costs);
//   onepass-chunk a persistent grid, each block streaming one contiguous chunk, U loads in flight per thread;
//   fused-smem    current scaling in one cooperative launch: each block reads its chunk once for the amax, keeping
//                 its first part in shared memory, waits at a grid barrier, then casts the rest backwards (the last
//                 reads still in L2) and the kept part from shared memory; also captured in a CUDA graph;
//   rows          rowwise current scaling: a block per row (the shipped long-row design) against a persistent grid
//                 that issues the next row's loads before this row's reduction;
//   pair          both layouts (to_float8_pair), and the transposing cast ([K, M] only), current scaling: the
//                 shipped amax pass + one 128 x 128 tile per block, against a persistent tile loop that issues the
//                 next tile's loads first, and against one cooperative launch that keeps 6 tiles per SM in shared
//                 memory across the grid barrier.
// Shapes: the FP8 stack's 8192^2, 16384 x 2048, 16384 x 8192, and two that fit in L2 (2048^2, 4096^2).
#include "probe_common.cuh"

// ---- the shipped two-pass design ----
constexpr int kLoads = 4;

__global__ void __launch_bounds__(256) amax_grid(const V8* __restrict__ x, int64_t nvec, unsigned* g_amax, int* g_bad) {
  float acc = 0.0f;
  bool bad = false;
  const int64_t stride = int64_t(gridDim.x) * 256;
  int64_t i = int64_t(blockIdx.x) * 256 + threadIdx.x;
  for (; i + (kLoads - 1) * stride < nvec; i += kLoads * stride) {
    V8 r[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) r[u] = x[i + u * stride];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) acc8(r[u], acc, bad);
  }
  for (; i < nvec; i += stride) acc8(x[i], acc, bad);
  reduce_to_global<256>(acc, bad, g_amax, g_bad);
}

__global__ void __launch_bounds__(256)
    cast_grid(const V8* __restrict__ x, uint2* __restrict__ out, int64_t nvec, const float* given_scale,
              const unsigned* g_amax, const int* g_bad) {
  const float scale = given_scale ? *given_scale : scale_of(__uint_as_float(*g_amax), *g_bad != 0);
  const int64_t stride = int64_t(gridDim.x) * 256;
  int64_t i = int64_t(blockIdx.x) * 256 + threadIdx.x;
  for (; i + (kLoads - 1) * stride < nvec; i += kLoads * stride) {
    V8 r[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) r[u] = x[nvec - 1 - (i + u * stride)];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) out[nvec - 1 - (i + u * stride)] = cast8(r[u], scale);
  }
  for (; i < nvec; i += stride) out[nvec - 1 - i] = cast8(x[nvec - 1 - i], scale);
}

// ---- the two-pass design with L2 cache hints ----
// kKeep: the amax pass loads the last `keep` vectors (the ones the backward cast reads first) with an evict_last
// policy; kStream: the cast pass loads with an evict_first policy (x is dead after it) and stores with st.global.cs,
// so that neither its reads nor its codes push the kept part of x out of L2 before it is read.
__device__ __forceinline__ uint64_t l2_policy_evict_last() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
  return p;
}

__device__ __forceinline__ uint64_t l2_policy_evict_first() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}

__device__ __forceinline__ V8 load_with_policy(const V8* p, uint64_t policy) {
  uint4 v;
  asm volatile("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p), "l"(policy));
  V8 r;
  memcpy(&r, &v, sizeof r);
  return r;
}

template <bool kKeep>
__global__ void __launch_bounds__(256)
    amax_hinted(const V8* __restrict__ x, int64_t nvec, int64_t keep_from, unsigned* g_amax, int* g_bad) {
  const uint64_t keep = l2_policy_evict_last();
  float acc = 0.0f;
  bool bad = false;
  const int64_t stride = int64_t(gridDim.x) * 256;
  int64_t i = int64_t(blockIdx.x) * 256 + threadIdx.x;
  for (; i + (kLoads - 1) * stride < nvec; i += kLoads * stride) {
    V8 r[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int64_t v = i + u * stride;
      r[u] = kKeep && v >= keep_from ? load_with_policy(x + v, keep) : x[v];
    }
#pragma unroll
    for (int u = 0; u < kLoads; ++u) acc8(r[u], acc, bad);
  }
  for (; i < nvec; i += stride) acc8(x[i], acc, bad);
  reduce_to_global<256>(acc, bad, g_amax, g_bad);
}

template <bool kStream>
__global__ void __launch_bounds__(256)
    cast_hinted(const V8* __restrict__ x, uint2* __restrict__ out, int64_t nvec, const unsigned* g_amax,
                const int* g_bad) {
  const float scale = scale_of(__uint_as_float(*g_amax), *g_bad != 0);
  const uint64_t first = l2_policy_evict_first();
  const int64_t stride = int64_t(gridDim.x) * 256;
  int64_t i = int64_t(blockIdx.x) * 256 + threadIdx.x;
  for (; i + (kLoads - 1) * stride < nvec; i += kLoads * stride) {
    V8 r[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int64_t v = nvec - 1 - (i + u * stride);
      r[u] = kStream ? load_with_policy(x + v, first) : x[v];
    }
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      uint2* o = out + nvec - 1 - (i + u * stride);
      if (kStream)
        __stcs(o, cast8(r[u], scale));
      else
        *o = cast8(r[u], scale);
    }
  }
  for (; i < nvec; i += stride) out[nvec - 1 - i] = cast8(x[nvec - 1 - i], scale);
}

// ---- persistent chunks ----
// Block b's chunk: vectors [begin, end), chunks of whole kThreads * U steps except the last.
__device__ __forceinline__ void chunk_of(int64_t nvec, int64_t step, int64_t& begin, int64_t& end) {
  const int64_t steps = (nvec + step - 1) / step;
  const int64_t per = (steps + gridDim.x - 1) / gridDim.x;
  begin = min(nvec, int64_t(blockIdx.x) * per * step);
  end = min(nvec, begin + per * step);
}

template <int kThreads, int U, bool kRecord = false>
__global__ void __launch_bounds__(kThreads)
    cast_chunk(const V8* __restrict__ x, uint2* __restrict__ out, int64_t nvec, const float* given_scale,
               unsigned* g_amax = nullptr, int* g_bad = nullptr) {
  const float scale = *given_scale;
  float acc = 0.0f;
  bool bad = false;
  int64_t begin, end;
  chunk_of(nvec, int64_t(kThreads) * U, begin, end);
  for (int64_t v0 = begin; v0 < end; v0 += int64_t(kThreads) * U) {
    V8 r[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t v = v0 + u * kThreads + threadIdx.x;
      if (v < end) r[u] = x[v];
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t v = v0 + u * kThreads + threadIdx.x;
      if (v < end) {
        out[v] = cast8(r[u], scale);
        if (kRecord) acc8(r[u], acc, bad);
      }
    }
  }
  if (kRecord) reduce_to_global<kThreads>(acc, bad, g_amax, g_bad);
}

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// One cooperative launch: amax of the chunk (its first `kept` vectors stored to shared memory on the way), grid
// barrier on g_ticket, then the cast: the rest of the chunk backwards, then the kept part.
template <int kThreads, int U>
__global__ void __launch_bounds__(kThreads)
    cast_fused_smem(const V8* __restrict__ x, uint2* __restrict__ out, int64_t nvec, int64_t kept_capacity,
                    unsigned* g_amax, int* g_bad, unsigned* g_ticket) {
  extern __shared__ V8 kept[];
  int64_t begin, end;
  chunk_of(nvec, int64_t(kThreads) * U, begin, end);
  const int64_t kept_end = min(end, begin + kept_capacity);
  float acc = 0.0f;
  bool bad = false;
  for (int64_t v0 = begin; v0 < end; v0 += int64_t(kThreads) * U) {
    V8 r[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t v = v0 + u * kThreads + threadIdx.x;
      if (v < end) r[u] = x[v];
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t v = v0 + u * kThreads + threadIdx.x;
      if (v < end) {
        acc8(r[u], acc, bad);
        if (v < kept_end) kept[v - begin] = r[u];
      }
    }
  }
  reduce_to_global<kThreads>(acc, bad, g_amax, g_bad);
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(g_ticket, 1u);
    while (load_acquire(g_ticket) < gridDim.x) __nanosleep(64);
  }
  __syncthreads();
  const float scale = scale_of(__uint_as_float(load_acquire(g_amax)), load_acquire(reinterpret_cast<unsigned*>(g_bad)) != 0);
  // The part not kept, from its end (the lines this block read last).
  const int64_t rest = end - kept_end;
  for (int64_t i0 = 0; i0 < rest; i0 += int64_t(kThreads) * U) {
    V8 r[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t i = i0 + u * kThreads + threadIdx.x;
      if (i < rest) r[u] = x[end - 1 - i];
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t i = i0 + u * kThreads + threadIdx.x;
      if (i < rest) out[end - 1 - i] = cast8(r[u], scale);
    }
  }
  for (int64_t v = kept_end - 1 - threadIdx.x; v >= begin; v -= kThreads) out[v] = cast8(kept[v - begin], scale);
}


// ---- rowwise: a block per row (kThreads * R vectors exactly), persistent, the next row's loads issued before
// this row's reduction ----
template <int kThreads, int R>
__global__ void __launch_bounds__(kThreads)
    rows_prefetch(const V8* __restrict__ x, uint2* __restrict__ out, float* scale_inv, int64_t M) {
  constexpr int kWarps = kThreads / 32;
  __shared__ float s_acc[2][kWarps];
  __shared__ int s_bad[2][kWarps];
  const int64_t vpr = int64_t(kThreads) * R;
  V8 cur[R], next[R];
  int64_t row = blockIdx.x;
  if (row < M) {
#pragma unroll
    for (int j = 0; j < R; ++j) cur[j] = x[row * vpr + j * kThreads + threadIdx.x];
  }
  for (int parity = 0; row < M; row += gridDim.x, parity ^= 1) {
    const int64_t nrow = row + gridDim.x;
    if (nrow < M) {
#pragma unroll
      for (int j = 0; j < R; ++j) next[j] = x[nrow * vpr + j * kThreads + threadIdx.x];
    }
    float acc = 0.0f;
    bool bad = false;
#pragma unroll
    for (int j = 0; j < R; ++j) acc8(cur[j], acc, bad);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc = fmaxf(acc, __shfl_xor_sync(0xffffffffu, acc, o));
    bad = __any_sync(0xffffffffu, bad);
    if (kWarps > 1) {
      if (threadIdx.x % 32 == 0) s_acc[parity][threadIdx.x / 32] = acc, s_bad[parity][threadIdx.x / 32] = bad;
      __syncthreads();  // two buffers: the next row's writes cannot race this row's reads
#pragma unroll
      for (int w = 0; w < kWarps; ++w) acc = fmaxf(acc, s_acc[parity][w]), bad |= s_bad[parity][w] != 0;
    }
    const float scale = scale_of(acc, bad);
    if (threadIdx.x == 0) scale_inv[row] = __frcp_rn(scale);
#pragma unroll
    for (int j = 0; j < R; ++j) out[row * vpr + j * kThreads + threadIdx.x] = cast8(cur[j], scale);
#pragma unroll
    for (int j = 0; j < R; ++j) cur[j] = next[j];
  }
}

// The same without the prefetch and without persistence: a block per row (the shipped design for long rows).
template <int kThreads, int R>
__global__ void __launch_bounds__(kThreads)
    rows_plain(const V8* __restrict__ x, uint2* __restrict__ out, float* scale_inv, int64_t M) {
  constexpr int kWarps = kThreads / 32;
  __shared__ float s_acc[kWarps];
  __shared__ int s_bad[kWarps];
  const int64_t vpr = int64_t(kThreads) * R;
  const int64_t row = blockIdx.x;
  V8 cur[R];
#pragma unroll
  for (int j = 0; j < R; ++j) cur[j] = x[row * vpr + j * kThreads + threadIdx.x];
  float acc = 0.0f;
  bool bad = false;
#pragma unroll
  for (int j = 0; j < R; ++j) acc8(cur[j], acc, bad);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc = fmaxf(acc, __shfl_xor_sync(0xffffffffu, acc, o));
  bad = __any_sync(0xffffffffu, bad);
  if (kWarps > 1) {
    if (threadIdx.x % 32 == 0) s_acc[threadIdx.x / 32] = acc, s_bad[threadIdx.x / 32] = bad;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kWarps; ++w) acc = fmaxf(acc, s_acc[w]), bad |= s_bad[w] != 0;
  }
  const float scale = scale_of(acc, bad);
  if (threadIdx.x == 0) scale_inv[row] = __frcp_rn(scale);
#pragma unroll
  for (int j = 0; j < R; ++j) out[row * vpr + j * kThreads + threadIdx.x] = cast8(cur[j], scale);
}



// A warp per row (the shipped design for rows of up to 2048 bf16: 8 warps per block, grid-stride over rows, 3
// blocks per SM), R vectors per lane; kPrefetch: the warp's next row loaded before this row's reduction (2 blocks
// per SM).
template <int R, bool kPrefetch>
__global__ void __launch_bounds__(256, kPrefetch ? 2 : 3)  // prefetching: 2 per SM, 3 spill (85 registers)
    rows_warp(const V8* __restrict__ x, uint2* __restrict__ out, float* scale_inv, int64_t M) {
  const int lane = threadIdx.x % 32;
  const int64_t vpr = 32 * R;
  const int64_t stride = int64_t(gridDim.x) * 8;
  int64_t row = int64_t(blockIdx.x) * 8 + threadIdx.x / 32;
  V8 cur[R], next[R];
  if (kPrefetch && row < M) {
#pragma unroll
    for (int j = 0; j < R; ++j) cur[j] = x[row * vpr + j * 32 + lane];
  }
  for (; row < M; row += stride) {
    if (kPrefetch) {
      if (row + stride < M) {
#pragma unroll
        for (int j = 0; j < R; ++j) next[j] = x[(row + stride) * vpr + j * 32 + lane];
      }
    } else {
#pragma unroll
      for (int j = 0; j < R; ++j) cur[j] = x[row * vpr + j * 32 + lane];
    }
    float acc = 0.0f;
    bool bad = false;
#pragma unroll
    for (int j = 0; j < R; ++j) acc8(cur[j], acc, bad);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc = fmaxf(acc, __shfl_xor_sync(0xffffffffu, acc, o));
    bad = __any_sync(0xffffffffu, bad);
    const float scale = scale_of(acc, bad);
    if (lane == 0) scale_inv[row] = __frcp_rn(scale);
#pragma unroll
    for (int j = 0; j < R; ++j) out[row * vpr + j * 32 + lane] = cast8(cur[j], scale);
    if (kPrefetch) {
#pragma unroll
      for (int j = 0; j < R; ++j) cur[j] = next[j];
    }
  }
}

// ---- pair and transposing casts (both layouts, or [K, M] only; current tensorwise scaling) of an [M, K] matrix, M
// and K multiples of 128 ----
// The shipped tile (csrc/float8/casts.cu, cast_tiles_kernel): 128 x 128, 256 threads, thread t owns column vector
// t % 16 of rows t / 16 + 16 i (8 vectors); codes written as [M, K] from registers and as [K, M] through a
// swizzled shared-memory tile, each thread transposing 4 x 4 byte blocks and storing 16-byte runs.
constexpr int kTile = 128;
constexpr int kTileThreads = 256;
constexpr int kTileVecs = kTile * kTile / 8 / kTileThreads;  // 8 vectors of 8 bf16 per thread

__device__ __forceinline__ int swz(int m, int k) { return (((k >> 3) ^ ((m / 16) & 7)) << 3) | (k & 7); }

// The codes of this thread's 8 vectors of tile (m0, k0): [M, K] codes to global (unless out is null: the transposing
// cast), the same to the staging tile.
__device__ __forceinline__ void tile_codes(const V8 (&r)[kTileVecs], float scale, int64_t m0, int64_t k0, int64_t K,
                                           uint8_t* __restrict__ out, uint8_t (*codes)[kTile]) {
  const int cv = threadIdx.x % 16;
#pragma unroll
  for (int i = 0; i < kTileVecs; ++i) {
    const int row = threadIdx.x / 16 + 16 * i;
    const uint2 c = cast8(r[i], scale);
    if (out != nullptr) *reinterpret_cast<uint2*>(out + (m0 + row) * K + k0 + cv * 8) = c;
    *reinterpret_cast<uint2*>(&codes[row][swz(row, cv * 8)]) = c;
  }
}

// The staging tile's codes written as rows k0.. of the [K, M] codes (call between two barriers).
__device__ __forceinline__ void tile_transposed(const uint8_t (*codes)[kTile], int64_t m0, int64_t k0, int64_t M,
                                                uint8_t* __restrict__ out_t) {
  const int run = threadIdx.x % 8;
  const int kk = (threadIdx.x / 8) * 4;
  uint32_t o[4][4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = run * 16 + q * 4 + i;
      w[i] = *reinterpret_cast<const uint32_t*>(&codes[row][swz(row, kk)]);
    }
    const uint32_t t0 = __byte_perm(w[0], w[1], 0x5140), t1 = __byte_perm(w[0], w[1], 0x7362);
    const uint32_t t2 = __byte_perm(w[2], w[3], 0x5140), t3 = __byte_perm(w[2], w[3], 0x7362);
    o[0][q] = __byte_perm(t0, t2, 0x5410);
    o[1][q] = __byte_perm(t0, t2, 0x7632);
    o[2][q] = __byte_perm(t1, t3, 0x5410);
    o[3][q] = __byte_perm(t1, t3, 0x7632);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j)
    *reinterpret_cast<uint4*>(out_t + (k0 + kk + j) * M + m0 + run * 16) = make_uint4(o[j][0], o[j][1], o[j][2], o[j][3]);
}

__device__ __forceinline__ void tile_load(V8 (&r)[kTileVecs], const V8* __restrict__ x, int64_t m0, int64_t k0,
                                          int64_t K) {
  const int cv = threadIdx.x % 16;
#pragma unroll
  for (int i = 0; i < kTileVecs; ++i) r[i] = x[((m0 + threadIdx.x / 16 + 16 * i) * K + k0) / 8 + cv];
}

// Shipped: a tile per block, the last tile first (the amax pass's tail in L2); 3 blocks per SM.
__global__ void __launch_bounds__(kTileThreads, 3)
    pair_tiles(const V8* __restrict__ x, uint8_t* __restrict__ out, uint8_t* __restrict__ out_t, int64_t M, int64_t K,
               const unsigned* g_amax, const int* g_bad) {
  __shared__ __align__(16) uint8_t codes[kTile][kTile];
  const float scale = scale_of(__uint_as_float(*g_amax), *g_bad != 0);
  const int64_t tiles_k = K / kTile;
  const int64_t tile = int64_t(gridDim.x) - 1 - blockIdx.x;
  const int64_t m0 = (tile / tiles_k) * kTile, k0 = (tile % tiles_k) * kTile;
  V8 r[kTileVecs];
  tile_load(r, x, m0, k0, K);
  tile_codes(r, scale, m0, k0, K, out, codes);
  __syncthreads();
  tile_transposed(codes, m0, k0, M, out_t);
}

// Persistent: each block walks tiles blockIdx, + gridDim, ... from the last; the next tile's loads are issued before
// this tile's casts and transposed stores, so the loads stay in flight through the whole loop.
__global__ void __launch_bounds__(kTileThreads, 2)
    pair_tiles_prefetch(const V8* __restrict__ x, uint8_t* __restrict__ out, uint8_t* __restrict__ out_t, int64_t M,
                        int64_t K, const unsigned* g_amax, const int* g_bad) {
  __shared__ __align__(16) uint8_t codes[kTile][kTile];
  const float scale = scale_of(__uint_as_float(*g_amax), *g_bad != 0);
  const int64_t tiles_k = K / kTile, tiles = (M / kTile) * tiles_k;
  V8 cur[kTileVecs], next[kTileVecs];
  int64_t t = blockIdx.x;
  if (t < tiles) tile_load(cur, x, ((tiles - 1 - t) / tiles_k) * kTile, ((tiles - 1 - t) % tiles_k) * kTile, K);
  for (; t < tiles; t += gridDim.x) {
    const int64_t tile = tiles - 1 - t, nt = t + gridDim.x;
    if (nt < tiles) tile_load(next, x, ((tiles - 1 - nt) / tiles_k) * kTile, ((tiles - 1 - nt) % tiles_k) * kTile, K);
    const int64_t m0 = (tile / tiles_k) * kTile, k0 = (tile % tiles_k) * kTile;
    tile_codes(cur, scale, m0, k0, K, out, codes);
    __syncthreads();
    tile_transposed(codes, m0, k0, M, out_t);
    __syncthreads();  // the staging tile is rewritten by the next iteration
#pragma unroll
    for (int i = 0; i < kTileVecs; ++i) cur[i] = next[i];
  }
}

// Current scaling in one cooperative launch, one block per SM: block b's tiles are a contiguous range (row strips
// of tiles); the amax pass reads them two tiles at a time, keeping the first kKeptTiles (32 KB of bf16 each) in
// shared memory; grid barrier; then the tiles from the last: those not kept from global memory (the last read in
// L2), the next one's loads in flight, then the kept ones from shared memory.
constexpr int kKeptTiles = 6;
__global__ void __launch_bounds__(kTileThreads, 1)
    pair_fused_smem(const V8* __restrict__ x, uint8_t* __restrict__ out, uint8_t* __restrict__ out_t, int64_t M,
                    int64_t K, unsigned* g_amax, int* g_bad, unsigned* g_ticket) {
  extern __shared__ __align__(16) uint8_t smem[];
  uint8_t(*codes)[kTile] = reinterpret_cast<uint8_t(*)[kTile]>(smem);
  V8* kept = reinterpret_cast<V8*>(smem + kTile * kTile);  // [kKeptTiles][kTileVecs][kTileThreads]
  const int64_t tiles_k = K / kTile, tiles = (M / kTile) * tiles_k;
  const int64_t per = (tiles + gridDim.x - 1) / gridDim.x;
  const int64_t begin = min(tiles, int64_t(blockIdx.x) * per), end = min(tiles, begin + per);
  const int64_t kept_end = min(end, begin + kKeptTiles);
  float acc = 0.0f;
  bool bad = false;
  for (int64_t tile = begin; tile < end; tile += 2) {
    V8 a[kTileVecs], b[kTileVecs];
    tile_load(a, x, (tile / tiles_k) * kTile, (tile % tiles_k) * kTile, K);
    if (tile + 1 < end) tile_load(b, x, ((tile + 1) / tiles_k) * kTile, ((tile + 1) % tiles_k) * kTile, K);
#pragma unroll
    for (int i = 0; i < kTileVecs; ++i) {
      acc8(a[i], acc, bad);
      if (tile < kept_end) kept[((tile - begin) * kTileVecs + i) * kTileThreads + threadIdx.x] = a[i];
    }
    if (tile + 1 < end) {
#pragma unroll
      for (int i = 0; i < kTileVecs; ++i) {
        acc8(b[i], acc, bad);
        if (tile + 1 < kept_end) kept[((tile + 1 - begin) * kTileVecs + i) * kTileThreads + threadIdx.x] = b[i];
      }
    }
  }
  reduce_to_global<kTileThreads>(acc, bad, g_amax, g_bad);
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(g_ticket, 1u);
    while (load_acquire(g_ticket) < gridDim.x) __nanosleep(64);
  }
  __syncthreads();
  const float scale =
      scale_of(__uint_as_float(load_acquire(g_amax)), load_acquire(reinterpret_cast<unsigned*>(g_bad)) != 0);
  V8 cur[kTileVecs], next[kTileVecs];
  if (end - 1 >= kept_end) tile_load(cur, x, ((end - 1) / tiles_k) * kTile, ((end - 1) % tiles_k) * kTile, K);
  for (int64_t tile = end - 1; tile >= begin; --tile) {
    if (tile >= kept_end) {
      if (tile - 1 >= kept_end)
        tile_load(next, x, ((tile - 1) / tiles_k) * kTile, ((tile - 1) % tiles_k) * kTile, K);
    } else {
#pragma unroll
      for (int i = 0; i < kTileVecs; ++i) cur[i] = kept[((tile - begin) * kTileVecs + i) * kTileThreads + threadIdx.x];
    }
    const int64_t m0 = (tile / tiles_k) * kTile, k0 = (tile % tiles_k) * kTile;
    tile_codes(cur, scale, m0, k0, K, out, codes);
    __syncthreads();
    tile_transposed(codes, m0, k0, M, out_t);
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kTileVecs; ++i) cur[i] = next[i];
  }
}

int main() {
  int sms = 0, dev = 0, coop = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CHECK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, dev));
  std::printf("%s, %d SMs, L2 %d MB, cooperative %d, smem/block optin %zu KB\n", prop.name, sms,
              prop.l2CacheSize >> 20, coop, prop.sharedMemPerBlockOptin >> 10);
  const double copy_gbs = copy_bandwidth();
  const int64_t shapes[][2] = {{8192, 8192}, {16384, 2048}, {16384, 8192}, {2048, 2048}, {4096, 4096}};
  for (auto& s : shapes) {
    const int64_t n = s[0] * s[1], nvec = n / 8;
    V8* x;
    uint2 *ref, *out;
    unsigned* scratch;  // amax, bad, ticket
    float* scale;
    CHECK(cudaMalloc(&x, n * 2));
    CHECK(cudaMalloc(&ref, n));
    CHECK(cudaMalloc(&out, n));
    CHECK(cudaMalloc(&scratch, 16));
    CHECK(cudaMalloc(&scale, 4));
    fill<<<1024, 256>>>(x, nvec, 12345u);
    CHECK(cudaGetLastError());
    const double floor_ms = 3.0 * n / (copy_gbs * 1e6);  // one pass: x read once, the codes written once
    std::printf("== %lld x %lld bf16 (%.0f MB read + %.0f MB written)\n", (long long)s[0], (long long)s[1], 2.0 * n / 1e6,
                1.0 * n / 1e6);
    // bytes-equal copy: 3n bytes moved = copy of 1.5n bytes
    {
      void* dst;
      CHECK(cudaMalloc(&dst, n * 2));
      const float ms = time_ms([&] { CHECK(cudaMemcpyAsync(dst, x, n * 3 / 2, cudaMemcpyDeviceToDevice)); }, 20);
      std::printf("  %-40s %.4f ms %6.0f GB/s\n", "memcpy of the same bytes moved", ms, 3.0 * n / ms / 1e6);
      CHECK(cudaFree(dst));
    }
    const int resident = sms * 8;
    const int grid = int(std::max<int64_t>(1, std::min<int64_t>((nvec + 255) / 256, resident)));
    auto two_pass = [&] {
      CHECK(cudaMemsetAsync(scratch, 0, 16));
      amax_grid<<<grid, 256>>>(x, nvec, scratch, reinterpret_cast<int*>(scratch + 1));
      cast_grid<<<grid, 256>>>(x, ref, nvec, nullptr, scratch, reinterpret_cast<int*>(scratch + 1));
    };
    two_pass();
    CHECK(cudaDeviceSynchronize());
    unsigned amax_bits;
    CHECK(cudaMemcpy(&amax_bits, scratch, 4, cudaMemcpyDeviceToHost));
    float amax;
    std::memcpy(&amax, &amax_bits, 4);
    const float sc = 448.0f / amax;  // only for the given-scale variants (their reference is their own first run)
    CHECK(cudaMemcpy(scale, &sc, 4, cudaMemcpyHostToDevice));
    std::vector<uint8_t> h_ref(n), h_out(n);
    CHECK(cudaMemcpy(h_ref.data(), ref, n, cudaMemcpyDeviceToHost));
    auto report = [&](const char* name, float ms, bool check) {
      bool ok = true;
      if (check) {
        CHECK(cudaMemcpy(h_out.data(), out, n, cudaMemcpyDeviceToHost));
        ok = std::memcmp(h_out.data(), h_ref.data(), n) == 0;
      }
      std::printf("  %-40s %.4f ms %6.0f GB/s %4.0f%% of copy, x one-pass floor %.2f %s\n", name, ms,
                  3.0 * n / ms / 1e6, 100.0 * floor_ms / ms, ms / floor_ms, check ? (ok ? "bit-exact" : "MISMATCH") : "");
    };
    report("two-pass (shipped)", time_ms(two_pass, 20), false);
    {  // cache hints; reference: the shipped two-pass codes (in ref)
      int* bad = reinterpret_cast<int*>(scratch + 1);
      const int64_t l2_vecs = int64_t(prop.l2CacheSize) / 16;
      auto hinted = [&](auto amax_kernel, auto cast_kernel, double keep_l2, const char* name) {
        const int64_t keep_from = std::max<int64_t>(0, nvec - int64_t(keep_l2 * l2_vecs));
        CHECK(cudaMemset(out, 0, n));
        report(name, time_ms([&] {
          CHECK(cudaMemsetAsync(scratch, 0, 16));
          amax_kernel<<<grid, 256>>>(x, nvec, keep_from, scratch, bad);
          cast_kernel<<<grid, 256>>>(x, out, nvec, scratch, bad);
        }, 20), true);
        CHECK(cudaCtxResetPersistingL2Cache());
      };
      hinted(amax_hinted<false>, cast_hinted<false>, 0.0, "two-pass, no hints (this harness)");
      hinted(amax_hinted<false>, cast_hinted<true>, 0.0, "two-pass, cast streams (evict_first, .cs)");
      hinted(amax_hinted<true>, cast_hinted<false>, 0.5, "two-pass, amax keeps last 0.5 L2");
      hinted(amax_hinted<true>, cast_hinted<true>, 0.5, "two-pass, keep 0.5 L2 + cast streams");
      hinted(amax_hinted<true>, cast_hinted<true>, 0.75, "two-pass, keep 0.75 L2 + cast streams");
      hinted(amax_hinted<true>, cast_hinted<true>, 1.0, "two-pass, keep 1.0 L2 + cast streams");
      // evict_last may only hold within the L2 set aside for persisting accesses (none by default)
      CHECK(cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, prop.persistingL2CacheMaxSize));
      std::printf("  (set-aside L2 for persisting accesses: %d MB)\n", prop.persistingL2CacheMaxSize >> 20);
      hinted(amax_hinted<true>, cast_hinted<false>, 0.5, "  set-aside: amax keeps last 0.5 L2");
      hinted(amax_hinted<true>, cast_hinted<true>, 0.5, "  set-aside: keep 0.5 L2 + cast streams");
      hinted(amax_hinted<true>, cast_hinted<true>, 0.75, "  set-aside: keep 0.75 L2 + cast streams");
      CHECK(cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, 0));
    }
    {
      const float ms = time_ms([&] { amax_grid<<<grid, 256>>>(x, nvec, scratch, reinterpret_cast<int*>(scratch + 1)); }, 20);
      std::printf("  %-40s %.4f ms %6.0f GB/s (read only)\n", "  amax pass alone", ms, 2.0 * n / ms / 1e6);
    }
    // given-scale one-pass variants; their codes are checked against the grid one-pass
    cast_grid<<<grid, 256>>>(x, ref, nvec, scale, nullptr, nullptr);
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemcpy(h_ref.data(), ref, n, cudaMemcpyDeviceToHost));
    report("onepass-grid 256x8/SM, 4 loads", time_ms([&] { cast_grid<<<grid, 256>>>(x, out, nvec, scale, nullptr, nullptr); }, 20), true);
#define CHUNK(T, U, B)                                                                                         \
  {                                                                                                            \
    const int g = int(std::max<int64_t>(1, std::min<int64_t>((nvec + T - 1) / T, int64_t(sms) * B)));          \
    CHECK(cudaMemset(out, 0, n));                                                                              \
    report("onepass-chunk " #T "t U" #U " " #B "/SM",                                                          \
           time_ms([&] { cast_chunk<T, U><<<g, T>>>(x, out, nvec, scale); }, 20), true);                      \
  }
    CHUNK(256, 4, 8)
    CHUNK(256, 8, 8)
    CHUNK(512, 4, 4)
    CHUNK(1024, 4, 2)
    CHUNK(1024, 2, 2)
    CHUNK(512, 8, 2)
    {
      const int g = int(std::max<int64_t>(1, std::min<int64_t>((nvec + 255) / 256, int64_t(sms) * 8)));
      CHECK(cudaMemset(out, 0, n));
      int* bad = reinterpret_cast<int*>(scratch + 1);
      report("onepass-chunk 256t U4 8/SM +record", time_ms([&] {
        CHECK(cudaMemsetAsync(scratch, 0, 16));
        cast_chunk<256, 4, true><<<g, 256>>>(x, out, nvec, scale, scratch, bad); }, 20), true);
    }
    // fused current scaling; reference: the two-pass codes
    two_pass();
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemcpy(h_ref.data(), ref, n, cudaMemcpyDeviceToHost));
#define FUSED(T, U, B, KB)                                                                                          \
  {                                                                                                                 \
    auto kern = cast_fused_smem<T, U>;                                                                              \
    const int smem = KB * 1024;                                                                                     \
    CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));                           \
    int per_sm = 0;                                                                                                 \
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, T, smem));                                   \
    const int g = std::min(sms * std::min(per_sm, B), int(std::max<int64_t>(1, (nvec + T * U - 1) / (T * U))));     \
    int64_t cap = smem / 16;                                                                                        \
    int* bad = reinterpret_cast<int*>(scratch + 1);                                                                 \
    unsigned* ticket = scratch + 2;                                                                                 \
    void* args[] = {&x, &out, const_cast<int64_t*>(&nvec), &cap, &scratch, &bad, &ticket};                         \
    auto launch = [&] {                                                                                             \
      CHECK(cudaMemsetAsync(scratch, 0, 16));                                                                       \
      CHECK(cudaLaunchCooperativeKernel((void*)kern, g, T, args, smem, 0));                                         \
    };                                                                                                              \
    CHECK(cudaMemset(out, 0, n));                                                                                   \
    char name[64];                                                                                                  \
    std::snprintf(name, sizeof name, "fused-smem %dt U%d %dx%dKB (%d blk)", T, U, std::min(per_sm, B), KB, g);       \
    report(name, time_ms(launch, 20), true);                                                                        \
  }
    FUSED(1024, 4, 1, 200)
    FUSED(1024, 2, 1, 200)
    FUSED(512, 4, 2, 100)
    FUSED(512, 4, 1, 200)
    FUSED(1024, 4, 1, 0)
    FUSED(256, 4, 4, 48)

    // rowwise (current per row): reference = rows_plain
    {
      float* sinv;
      CHECK(cudaMalloc(&sinv, s[0] * 4));
      const int64_t M = s[0], vpr = s[1] / 8;
      auto run_rows = [&](auto kern_plain, auto kern_pf, int threads, int R, int per_sm_cap, const char* tag) {
        if (vpr != int64_t(threads) * R) return;
        kern_plain<<<int(M), threads>>>(x, ref, sinv, M);
        CHECK(cudaDeviceSynchronize());
        CHECK(cudaMemcpy(h_ref.data(), ref, n, cudaMemcpyDeviceToHost));
        char name[64];
        std::snprintf(name, sizeof name, "rows plain %s", tag);
        CHECK(cudaMemset(out, 0, n));
        report(name, time_ms([&] { kern_plain<<<int(M), threads>>>(x, out, sinv, M); }, 20), true);
        int per_sm = 0;
        CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern_pf, threads, 0));
        for (int cap : {per_sm_cap, per_sm}) {
          const int g = int(std::min<int64_t>(M, int64_t(sms) * std::min(per_sm, cap)));
          std::snprintf(name, sizeof name, "rows prefetch %s %d/SM", tag, std::min(per_sm, cap));
          CHECK(cudaMemset(out, 0, n));
          report(name, time_ms([&] { kern_pf<<<g, threads>>>(x, out, sinv, M); }, 20), true);
        }
      };
      run_rows(rows_plain<256, 4>, rows_prefetch<256, 4>, 256, 4, 2, "256t x4");
      run_rows(rows_plain<512, 2>, rows_prefetch<512, 2>, 512, 2, 2, "512t x2");
      run_rows(rows_plain<128, 2>, rows_prefetch<128, 2>, 128, 2, 8, "128t x2");
      run_rows(rows_plain<64, 4>, rows_prefetch<64, 4>, 64, 4, 16, "64t x4");
      run_rows(rows_plain<256, 1>, rows_prefetch<256, 1>, 256, 1, 4, "256t x1");
      if (vpr == 32 * 8) {  // the shipped warp per row, and the same with the next row prefetched
        const int g = int(std::min<int64_t>((M + 7) / 8, int64_t(sms) * 3));
        CHECK(cudaMemset(out, 0, n));
        report("rows warp/row (shipped), 3/SM", time_ms([&] { rows_warp<8, false><<<g, 256>>>(x, out, sinv, M); }, 20),
               true);
        const int g2 = int(std::min<int64_t>((M + 7) / 8, int64_t(sms) * 2));
        CHECK(cudaMemset(out, 0, n));
        report("rows warp/row prefetch, 2/SM", time_ms([&] { rows_warp<8, true><<<g2, 256>>>(x, out, sinv, M); }, 20),
               true);
      }
      CHECK(cudaFree(sinv));
    }

    // pair casts (current tensorwise): expected = the two-pass codes and their transpose
    if (s[0] % kTile == 0 && s[1] % kTile == 0) {
      two_pass();
      CHECK(cudaDeviceSynchronize());
      CHECK(cudaMemcpy(h_ref.data(), ref, n, cudaMemcpyDeviceToHost));
      const int64_t M = s[0], K = s[1];
      std::vector<uint8_t> h_ref_t(n), h_out_t(n);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; ++k) h_ref_t[k * M + m] = h_ref[m * K + k];
      uint8_t* out_t;
      CHECK(cudaMalloc(&out_t, n));
      int* bad = reinterpret_cast<int*>(scratch + 1);
      unsigned* ticket = scratch + 2;
      const int64_t tiles = (M / kTile) * (K / kTile);
      // with_data: the pair (both layouts, 4 B moved per element); else the transposing cast ([K, M] only, 3 B).
      for (const bool with_data : {true, false}) {
        uint8_t* o = with_data ? reinterpret_cast<uint8_t*>(out) : nullptr;
        const char* kind = with_data ? "pair" : "transpose";
        const double bytes = (with_data ? 4.0 : 3.0) * n;
        const double floor_ms = bytes / (copy_gbs * 1e6);
        auto report_layouts = [&](const char* what, float ms) {
          bool ok = true;
          if (with_data) {
            CHECK(cudaMemcpy(h_out.data(), out, n, cudaMemcpyDeviceToHost));
            ok = std::memcmp(h_out.data(), h_ref.data(), n) == 0;
          }
          CHECK(cudaMemcpy(h_out_t.data(), out_t, n, cudaMemcpyDeviceToHost));
          ok = ok && std::memcmp(h_out_t.data(), h_ref_t.data(), n) == 0;
          char name[80];
          std::snprintf(name, sizeof name, "%s %s", kind, what);
          std::printf("  %-40s %.4f ms %6.0f GB/s %4.0f%% of copy, x one-pass floor %.2f %s\n", name, ms,
                      bytes / ms / 1e6, 100.0 * floor_ms / ms, ms / floor_ms, ok ? "bit-exact" : "MISMATCH");
        };
        auto report_pass = [&](const char* what, float ms) {
          std::printf("  %-40s %.4f ms (one pass: %.0f%% of copy)\n", what, ms, 100.0 * floor_ms / ms);
        };
        CHECK(cudaMemset(out, 0, n));
        CHECK(cudaMemset(out_t, 0, n));
        report_layouts("two-pass (shipped: amax + tiles)", time_ms([&] {
          CHECK(cudaMemsetAsync(scratch, 0, 16));
          amax_grid<<<grid, 256>>>(x, nvec, scratch, bad);
          pair_tiles<<<int(tiles), kTileThreads>>>(x, o, out_t, M, K, scratch, bad);
        }, 20));
        report_pass("  tiles pass alone (shipped)",
                    time_ms([&] { pair_tiles<<<int(tiles), kTileThreads>>>(x, o, out_t, M, K, scratch, bad); }, 20));
        int per_sm = 0;
        CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, pair_tiles_prefetch, kTileThreads, 0));
        for (int b : {1, 2}) {
          if (b > per_sm) continue;
          const int g = int(std::min<int64_t>(tiles, int64_t(sms) * b));
          CHECK(cudaMemset(out, 0, n));
          CHECK(cudaMemset(out_t, 0, n));
          char name[64];
          std::snprintf(name, sizeof name, "amax + prefetching tiles %d/SM", b);
          report_layouts(name, time_ms([&] {
            CHECK(cudaMemsetAsync(scratch, 0, 16));
            amax_grid<<<grid, 256>>>(x, nvec, scratch, bad);
            pair_tiles_prefetch<<<g, kTileThreads>>>(x, o, out_t, M, K, scratch, bad);
          }, 20));
          report_pass("  prefetching tiles pass alone",
                      time_ms([&] { pair_tiles_prefetch<<<g, kTileThreads>>>(x, o, out_t, M, K, scratch, bad); }, 20));
        }
        const int smem = kTile * kTile + kKeptTiles * kTile * kTile * 2;
        CHECK(cudaFuncSetAttribute(pair_fused_smem, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        int fused_per_sm = 0;
        CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fused_per_sm, pair_fused_smem, kTileThreads, smem));
        const int g = int(std::min<int64_t>(tiles, int64_t(sms) * std::min(fused_per_sm, 1)));
        void* args[] = {&x, &o, &out_t, const_cast<int64_t*>(&M), const_cast<int64_t*>(&K), &scratch, &bad, &ticket};
        CHECK(cudaMemset(out, 0, n));
        CHECK(cudaMemset(out_t, 0, n));
        report_layouts("fused-smem (one cooperative launch)", time_ms([&] {
          CHECK(cudaMemsetAsync(scratch, 0, 16));
          CHECK(cudaLaunchCooperativeKernel((void*)pair_fused_smem, g, kTileThreads, args, smem, 0));
        }, 20));
      }
      CHECK(cudaFree(out_t));
    }
    // The cooperative launch captured in a CUDA graph (as capture_step would): supported, and as fast?
    two_pass();
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemcpy(h_ref.data(), ref, n, cudaMemcpyDeviceToHost));
    {
      auto kern = cast_fused_smem<1024, 4>;
      const int smem = 200 * 1024;
      int64_t cap = smem / 16;
      int* bad = reinterpret_cast<int*>(scratch + 1);
      unsigned* ticket = scratch + 2;
      void* args[] = {&x, &out, const_cast<int64_t*>(&nvec), &cap, &scratch, &bad, &ticket};
      cudaStream_t st;
      CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
      cudaError_t err = cudaSuccess;
      for (int i = 0; i < 20 && err == cudaSuccess; ++i) {
        err = cudaMemsetAsync(scratch, 0, 16, st);
        if (err == cudaSuccess) err = cudaLaunchCooperativeKernel((void*)kern, sms, 1024, args, smem, st);
      }
      const cudaError_t end_err = cudaStreamEndCapture(st, &graph);
      if (err == cudaSuccess) err = end_err;
      if (err == cudaSuccess) err = cudaGraphInstantiate(&exec, graph, 0);
      if (err != cudaSuccess) {
        std::printf("  cooperative launch in a CUDA graph: %s\n", cudaGetErrorString(err));
        (void)cudaGetLastError();
      } else {
        CHECK(cudaMemset(out, 0, n));
        const float ms = time_ms([&] { CHECK(cudaGraphLaunch(exec, 0)); }, 1) / 20;
        report("fused-smem 1024t U4, graph replay", ms, true);
      }
      if (exec) CHECK(cudaGraphExecDestroy(exec));
      if (graph) CHECK(cudaGraphDestroy(graph));
      CHECK(cudaStreamDestroy(st));
    }
    CHECK(cudaFree(x));
    CHECK(cudaFree(ref));
    CHECK(cudaFree(out));
    CHECK(cudaFree(scratch));
    CHECK(cudaFree(scale));
  }
  return 0;
}
