// The wgmma scaled matmul: the same op as the WMMA kernel (wmma.cuh: the epilogue's math, Params), on Hopper's asynchronous warpgroup MMA. Built only for sm_90a (TORCH_CUDA_ARCH_LIST
// "9.0a"): wgmma and setmaxnreg exist on no other target; for the others the kernel compiles empty and the launcher
// refuses to run it (scaled_matmul_wgmma_built).
//
//     out = alpha * scale * (a @ b) + bias            (accumulate = false)
//     out = out_old + alpha * scale * (a @ b) + bias  (accumulate = true)
//
// Persistent, warp-specialized: one block of three warpgroups per SM walks the output tiles (BM = 128 rows x BN
// columns, grouped order) in a static round-robin.
// - Warpgroup 0 (one thread, 40 registers) is the producer: TMA copies of each 128 x 64 A tile and BN x 64 B tile
//   into a ring of STAGES stages, 128-byte swizzled, completion counted on the stage's `full` mbarrier.
// - Warpgroups 1 and 2 (232 registers each) are the consumers, 64 rows of the tile each: four m64nBNk16 wgmmas per
//   stage straight from shared memory, one group in flight, the stage handed back (`empty` mbarrier) when the group
//   after it was issued. Then the epilogue through the consumer's part of the last k-tile's stage: the common case
//   (one scale, no bias, no accumulation, 16-bit output) scaled and rounded in the registers, 64 columns at a time;
//   the others in fp32, 32 columns at a time, with the WMMA kernel's store8 (scale, bias, old output, cast). 16-byte
//   stores; found_inf from the values as stored. Meanwhile the producer already fills the other stages.
// Any of the four operand layouts: a K-major operand (row-major a, column-major b) is one TMA box per tile; an
// M/N-major one (a transposed view) is copied in 64-wide boxes and read with wgmma's transpose bit.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>

#include <cstring>

#include "matmul/wmma.cuh"
#include "matmul/generated/wgmma_asm.cuh"

namespace ampkernels {
namespace wgmma_mm {

using wmma_mm::kOutF16;
using wmma_mm::kOutF32;
using wmma_mm::Params;

constexpr int kBM = 128;               // two consumer warpgroups of 64 rows
constexpr int kBK = 64;                // 64 16-bit elements = one 128-byte swizzle row
constexpr int kBox = 64;               // TMA box width along a contiguous M or N (128 bytes)
constexpr int kGroupM = 8;             // tile rows per group of the tile order (as the Triton kernel)
constexpr int kThreads = 384;          // producer + two consumer warpgroups
constexpr int kAStageBytes = kBM * kBK * 2;
constexpr int kHalfABytes = kAStageBytes / 2;  // one consumer's 64 rows
constexpr int kSwizzleAtom = 1024;     // 8 rows of 128 bytes: the unit of the 128-byte swizzle
// Epilogue scratch: 64 rows x 32 fp32 columns per consumer = 8 KB, in the consumer's own A rows of the stage of the
// tile's last k-tile (read by no one else, done once its wgmmas are), which it hands back after the epilogue.
constexpr int kScratchFloats = 64 * 32;
static_assert(kScratchFloats * 4 == kHalfABytes, "the scratch is one consumer's half of an A stage");

template <int BN>
struct Tile {
  static constexpr int kStages = BN == 256 ? 4 : (BN == 192 ? 5 : 6);  // as many as 227 KB hold
  static constexpr int kBStageBytes = BN * kBK * 2;
  static constexpr int kStageBytes = kAStageBytes + kBStageBytes;
  static constexpr int kSmem = kStages * kStageBytes + kSwizzleAtom;  // + slack to align the ring to 1024 bytes
  static constexpr int kRegs = BN / 2;  // fp32 accumulators per consumer thread (64 x BN over 128 threads)
};

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  } while (!done);
}

// One TMA box (2-D coordinates, innermost first) into shared memory; completion counted on `bar`.
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, int c0, int c1, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_addr(bar))
      : "memory");
}

// Shared-memory matrix descriptor of a 128-byte-swizzled tile (PTX ISA, "Matrix Descriptor Format"): start address,
// leading and stride byte offsets (all >> 4), swizzle mode 1 (128 B) in bits 62-63. Tiles start on 1024-byte
// boundaries, so the base-offset field stays 0.
__device__ __forceinline__ uint64_t smem_desc(const void* p, uint32_t leading, uint32_t stride) {
  return (uint64_t(smem_addr(p) & 0x3FFFF) >> 4) | (uint64_t((leading >> 4) & 0x3FFF) << 16) |
         (uint64_t((stride >> 4) & 0x3FFF) << 32) | (uint64_t(1) << 62);
}

// Descriptor of the k-th 16-deep slice of a 64-deep operand tile in the ring.
// K-major (one 128-byte row of 64 k values per M or N index): 8-row atoms 1024 B apart (SBO), a slice 32 B further
// along the row. M/N-major (one 128-byte row of 64 M or N values per k, a box per 64 columns): 8-k-row atoms 1024 B
// apart (SBO), boxes of 64 columns x 64 k rows = 8 KB apart (LBO), a slice 16 k rows = 2048 B further.
template <bool kMNMajor>
__device__ __forceinline__ uint64_t slice_desc(const uint8_t* tile, int k) {
  if constexpr (kMNMajor) {
    return smem_desc(tile + k * 2048, kBox * kBK * 2, kSwizzleAtom);
  } else {
    return smem_desc(tile + k * 32, 16, kSwizzleAtom);
  }
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Keeps the compiler from moving reads of the accumulators above a wgmma wait.
template <int R>
__device__ __forceinline__ void fence_registers(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

template <typename T, int BN, int kTransA, int kTransB>
__device__ __forceinline__ void mma_slice(float (&acc)[BN / 2], uint64_t da, uint64_t db, int accumulate) {
  constexpr bool kBf16 = std::is_same<T, __nv_bfloat16>::value;
  if constexpr (BN == 256) {
    if constexpr (kBf16) wgmma_m64n256k16_bf16<kTransA, kTransB>(acc, da, db, accumulate);
    else wgmma_m64n256k16_f16<kTransA, kTransB>(acc, da, db, accumulate);
  } else if constexpr (BN == 192) {
    if constexpr (kBf16) wgmma_m64n192k16_bf16<kTransA, kTransB>(acc, da, db, accumulate);
    else wgmma_m64n192k16_f16<kTransA, kTransB>(acc, da, db, accumulate);
  } else {
    if constexpr (kBf16) wgmma_m64n128k16_bf16<kTransA, kTransB>(acc, da, db, accumulate);
    else wgmma_m64n128k16_f16<kTransA, kTransB>(acc, da, db, accumulate);
  }
}

// Grouped tile order (kGroupM tile rows at a time, column by column): the tiles in flight share A and B in L2.
__device__ __forceinline__ void tile_coords(int tile, int tiles_m, int tiles_n, int& pm, int& pn) {
  const int per_group = kGroupM * tiles_n;
  const int first_m = (tile / per_group) * kGroupM;
  const int rows = min(tiles_m - first_m, kGroupM);
  pm = first_m + (tile % per_group) % rows;
  pn = (tile % per_group) / rows;
}

// Named barrier of one consumer warpgroup (ids 1 and 2; 0 is __syncthreads).
__device__ __forceinline__ void warpgroup_sync(int consumer) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + consumer) : "memory");
}

// The scratch as 64 rows of 32 words (fp32 values, or pairs of 16-bit outputs): word `word` of 16-byte group
// `group` of row `r`. The groups are XOR-swizzled by the row, so that the eight rows one warp stashes at a time, and
// the 16-byte reads, spread over the banks.
__device__ __forceinline__ int scratch_word(int r, int group, int word) {
  return r * 32 + ((group ^ (r & 7)) << 2) + word;
}

// Where fp32 column `col` (0..31) of row `r` sits in the scratch.
__device__ __forceinline__ int scratch_index(int r, int col) { return scratch_word(r, col >> 2, col & 3); }

// The consumer's columns [32 kChunk, 32 kChunk + 32) of its 64 x BN accumulators, in wgmma's D layout (thread t of
// the warpgroup holds, for each 8-column group j, rows 16 (t / 32) + (t % 32) / 4 (+ 8) and columns 8 j + 2 (t % 4)
// (+ 1) as acc[4 j + 2 h + {0, 1}]), into the scratch.
template <int kChunk, int R>
__device__ __forceinline__ void stash_chunk(const float (&acc)[R], float* scratch, int t) {
  const int lane = t % 32;
  const int r0 = 16 * (t / 32) + lane / 4;
#pragma unroll
  for (int jj = 0; jj < 4; ++jj) {
    const int j = 4 * kChunk + jj;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      *reinterpret_cast<float2*>(scratch + scratch_index(r0 + 8 * h, 8 * jj + 2 * (lane % 4))) =
          make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
    }
  }
}

template <int BN, int kChunk = 0>
__device__ __forceinline__ void stash_chunk_at(const float (&acc)[BN / 2], float* scratch, int t, int chunk) {
  if constexpr (kChunk < BN / 32) {
    if (chunk == kChunk) {
      stash_chunk<kChunk>(acc, scratch, t);
    } else {
      stash_chunk_at<BN, kChunk + 1>(acc, scratch, t, chunk);
    }
  }
}

// store8's common case, with its math (x * (alpha * scale), rounded once) and no per-element branches: one scale for
// the whole tile, no bias, no old output, eight outputs inside the matrix, 16-byte aligned. `amax` as in store8.
template <typename O, typename Amax>
__device__ __forceinline__ void store8_scaled(O* o, const float (&v)[8], float s, bool check, bool& bad,
                                              Amax& amax) {
  O res[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) res[j] = wmma_mm::from_f32<O>(v[j] * s);
  if (check) {
#pragma unroll
    for (int j = 0; j < 8; ++j) bad |= !isfinite(wmma_mm::to_f32<O>(res[j]));
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) amax.add(wmma_mm::to_f32<O>(res[j]));
  constexpr int kVecs = 8 * sizeof(O) / 16;
#pragma unroll
  for (int u = 0; u < kVecs; ++u) {
    uint4 w;
    memcpy(&w, &res[u * (16 / sizeof(O))], 16);
    reinterpret_cast<uint4*>(o)[u] = w;
  }
}

template <typename O>
__device__ __forceinline__ void store8_scaled(O* o, const float (&v)[8], float s, bool check, bool& bad) {
  wmma_mm::NoAmax none;
  store8_scaled(o, v, s, check, bad, none);
}

// Stores x * s and y * s, each rounded once to O (round to nearest even, as from_f32), as one 32-bit word of shared
// memory, x in the lower half. One asm block: its temporaries never compete with the live accumulators for
// registers, and the accumulators are only read. NOTE (ptxas 13.0, 256-wide kernel): products in C++ temporaries
// spilled 476 bytes; writing the packed pairs back into the accumulators made ptxas wait for every wgmma group
// (C7517: "warpgroup.wait is injected ... to allow use of registers defined by GMMA").
template <typename O>
__device__ __forceinline__ void st_shared_scaled_pair(uint32_t addr, float x, float y, float s) {
  if constexpr (std::is_same<O, __nv_bfloat16>::value) {
    asm volatile(
        "{\n.reg .f32 x, y;\n.reg .b32 w;\nmul.rn.f32 x, %1, %3;\nmul.rn.f32 y, %2, %3;\n"
        "cvt.rn.bf16x2.f32 w, y, x;\nst.shared.b32 [%0], w;\n}\n" ::"r"(addr),
        "f"(x), "f"(y), "f"(s)
        : "memory");
  } else {
    asm volatile(
        "{\n.reg .f32 x, y;\n.reg .b32 w;\nmul.rn.f32 x, %1, %3;\nmul.rn.f32 y, %2, %3;\n"
        "cvt.rn.f16x2.f32 w, y, x;\nst.shared.b32 [%0], w;\n}\n" ::"r"(addr),
        "f"(x), "f"(y), "f"(s)
        : "memory");
  }
}

// Whether either 16-bit value of a packed pair is inf or NaN (all exponent bits set).
template <typename O>
__device__ __forceinline__ bool pair_not_finite(uint32_t w) {
  constexpr uint32_t kExp = std::is_same<O, __nv_bfloat16>::value ? 0x7F80u : 0x7C00u;
  return (w & kExp) == kExp || ((w >> 16) & kExp) == kExp;
}

// Columns [64 kChunk, 64 kChunk + 64) of the consumer's accumulators, times s and rounded to O, into the scratch as
// 64 rows x 64 16-bit outputs (wgmma's D layout: see stash_chunk).
template <typename O, int kChunk, int R>
__device__ __forceinline__ void stash_packed(const float (&acc)[R], uint32_t* scratch, float s, int t) {
  const int lane = t % 32;
  const int r0 = 16 * (t / 32) + lane / 4;
#pragma unroll
  for (int jj = 0; jj < 8; ++jj) {
    const int j = 8 * kChunk + jj;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      st_shared_scaled_pair<O>(smem_addr(scratch + scratch_word(r0 + 8 * h, jj, lane % 4)), acc[4 * j + 2 * h],
                               acc[4 * j + 2 * h + 1], s);
    }
  }
}

template <typename O, int BN, int kChunk = 0>
__device__ __forceinline__ void stash_packed_at(const float (&acc)[BN / 2], uint32_t* scratch, float s, int t,
                                                int chunk) {
  if constexpr (kChunk < BN / 64) {
    if (chunk == kChunk) {
      stash_packed<O, kChunk>(acc, scratch, s, t);
    } else {
      stash_packed_at<O, BN, kChunk + 1>(acc, scratch, s, t, chunk);
    }
  }
}

// store8_scaled's case for a 16-bit output (one scale for the tile, no bias, no old output, 16-byte rows), 64
// columns at a time: the values are scaled and rounded in the registers, so the scratch holds what is stored (half
// the bytes of the fp32 path, half its barriers) and each 16-byte read is one 16-byte store. Same values as
// store8_scaled: x * s rounded once. NOTE (H200, ncu source view of 8192x3072x768 bf16, 128x256 tiles): the fp32
// path was 43% of the consumers' time against 48% for the k-steps, ~11 warp instructions per output, latency-bound.
template <typename O, int BN>
__device__ __forceinline__ bool epilogue_packed(const Params& p, const float (&acc)[BN / 2], uint32_t* scratch,
                                                int m0, int n0, int consumer, int t, float s, bool check) {
  bool bad = false;
  O* out = static_cast<O*>(p.out);
#pragma unroll 1
  for (int chunk = 0; chunk < BN / 64; ++chunk) {
    stash_packed_at<O, BN>(acc, scratch, s, t, chunk);
    warpgroup_sync(consumer);
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // 64 rows x 8 groups of 8 outputs, four per thread
      const int q = t + 128 * i;
      const int r = q / 8, group = q % 8;
      const int row = m0 + r, col = n0 + 64 * chunk + 8 * group;
      if (row < p.M && col < p.N) {  // N % 8 == 0 (out_vec): the group is whole
        const uint4 w = *reinterpret_cast<const uint4*>(scratch + scratch_word(r, group, 0));
        if (check) bad |= pair_not_finite<O>(w.x) | pair_not_finite<O>(w.y) | pair_not_finite<O>(w.z) |
                          pair_not_finite<O>(w.w);
        *reinterpret_cast<uint4*>(out + static_cast<int64_t>(row) * p.N + col) = w;
      }
    }
    warpgroup_sync(consumer);  // the scratch is rewritten by the next chunk
  }
  return bad;
}

// Epilogue of one consumer's 64 x BN accumulators through `scratch` (8 KB). A tile-wide scale without bias or
// accumulation into 16-byte output rows: epilogue_packed for 16-bit outputs, store8_scaled for fp32 ones (the same
// values as store8, ~1/5 of its instructions). Every other case (per-row / per-column scale, bias, accumulate,
// edges): 32 columns at a time as fp32, registers -> shared memory -> 8 consecutive outputs per thread -> the WMMA
// kernel's store8, with 16-byte accesses where the output rows allow.
// NOTE (H200, ncu): storing from the registers, two outputs at a time, with every step unrolled makes 600 KB of
// epilogue code, and the 256-wide kernel then spends 6 cycles per issued instruction waiting for instruction fetch
// (4096^3 bf16: 340 us against 249 for 128-wide tiles). So the chunk loop stays rolled; only the stash is unrolled.
template <typename T, int BN>
__device__ __forceinline__ void epilogue(const Params& p, const float (&acc)[BN / 2], float* scratch, int m0, int n0,
                                         int consumer, int t) {
  const bool simple = p.scale_mode <= 1 && p.bias_kind == wmma_mm::kBiasNone && !p.accumulate && p.out_vec;
  const float s = p.scale_mode == 1 ? p.alpha * p.scale[0] : p.alpha;  // store8's order: alpha, then * scale
  const bool check = p.found_inf != nullptr;
  bool bad = false;
  if (simple && p.out_kind != kOutF32) {
    uint32_t* packed = reinterpret_cast<uint32_t*>(scratch);
    bad = p.out_kind == kOutF16 ? epilogue_packed<__half, BN>(p, acc, packed, m0, n0, consumer, t, s, check)
                                : epilogue_packed<__nv_bfloat16, BN>(p, acc, packed, m0, n0, consumer, t, s, check);
  } else {
#pragma unroll 1
    for (int chunk = 0; chunk < BN / 32; ++chunk) {
      stash_chunk_at<BN>(acc, scratch, t, chunk);
      warpgroup_sync(consumer);
#pragma unroll
      for (int i = 0; i < 2; ++i) {  // 64 rows x 4 groups of 8 columns, two per thread
        const int q = t + 128 * i;
        const int r = q / 4, c8 = (q % 4) * 8;
        const int row = m0 + r, col = n0 + 32 * chunk + c8;
        if (row < p.M && col < p.N) {
          const float4 lo = *reinterpret_cast<const float4*>(scratch + scratch_index(r, c8));
          const float4 hi = *reinterpret_cast<const float4*>(scratch + scratch_index(r, c8 + 4));
          const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
          const int n = min(8, p.N - col);
          const int64_t offset = static_cast<int64_t>(row) * p.N + col;
          if (simple) {  // an fp32 output (16-bit ones are packed above); out_vec: the 8 columns are whole
            store8_scaled(static_cast<float*>(p.out) + offset, v, s, check, bad);
          } else {
            switch (p.out_kind) {
              case kOutF32: wmma_mm::store8<T, float>(p, row, col, n, v, bad); break;
              case kOutF16: wmma_mm::store8<T, __half>(p, row, col, n, v, bad); break;
              default: wmma_mm::store8<T, __nv_bfloat16>(p, row, col, n, v, bad); break;
            }
          }
        }
      }
      warpgroup_sync(consumer);  // the scratch is rewritten by the next chunk
    }
  }
  // Only warps that stored a non-finite value write found_inf: no extra pass, no atomics.
  if (check && __any_sync(0xffffffffu, bad) && t % 32 == 0) *p.found_inf = 1.f;
}

#endif  // sm_90a

template <typename T, int BN, int kTransA, int kTransB>
__global__ void __launch_bounds__(kThreads, 1)
    scaled_matmul_wgmma_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                               const Params p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = Tile<BN>;
  constexpr int S = C::kStages;
  __shared__ __align__(8) uint64_t full[S];   // stage s holds its tiles (producer's expect_tx + TMA bytes)
  __shared__ __align__(8) uint64_t empty[S];  // both consumers are done reading stage s
  extern __shared__ uint8_t smem_raw[];
  uint8_t* ring = smem_raw + ((kSwizzleAtom - smem_addr(smem_raw) % kSwizzleAtom) % kSwizzleAtom);

  const int warpgroup = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 2);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  const int tiles_m = p.tiles_m, tiles_n = p.tiles_n;
  const int num_tiles = tiles_m * tiles_n;
  const int k_tiles = (p.K + kBK - 1) / kBK;

  if (warpgroup == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (threadIdx.x != 0) return;
    int it = 0;
    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
      int pm, pn;
      tile_coords(tile, tiles_m, tiles_n, pm, pn);
      const int m0 = pm * kBM, n0 = pn * BN;
      for (int kt = 0; kt < k_tiles; ++kt, ++it) {
        const int s = it % S;
        mbar_wait(&empty[s], ((it / S) & 1) ^ 1);  // the first round passes: the barrier's previous phase is done
        mbar_expect_tx(&full[s], C::kStageBytes);
        uint8_t* a_st = ring + s * C::kStageBytes;
        uint8_t* b_st = a_st + kAStageBytes;
        const int k0 = kt * kBK;
        if constexpr (kTransA) {
          tma_load(a_st, &map_a, m0, k0, &full[s]);
          tma_load(a_st + kHalfABytes, &map_a, m0 + kBox, k0, &full[s]);
        } else {
          tma_load(a_st, &map_a, k0, m0, &full[s]);
        }
        if constexpr (kTransB) {
#pragma unroll
          for (int j = 0; j < BN / kBox; ++j) tma_load(b_st + j * kBox * kBK * 2, &map_b, n0 + j * kBox, k0, &full[s]);
        } else {
          tma_load(b_st, &map_b, k0, n0, &full[s]);
        }
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int consumer = warpgroup - 1;
  const int t = threadIdx.x % 128;
  float acc[C::kRegs];
#pragma unroll
  for (int i = 0; i < C::kRegs; ++i) acc[i] = 0.f;
  int it = 0;
  for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    int pm, pn;
    tile_coords(tile, tiles_m, tiles_n, pm, pn);
    const int m0 = pm * kBM, n0 = pn * BN;
    for (int kt = 0; kt < k_tiles; ++kt, ++it) {
      const int s = it % S;
      mbar_wait(&full[s], (it / S) & 1);
      const uint8_t* a_st = ring + s * C::kStageBytes + consumer * kHalfABytes;
      const uint8_t* b_st = ring + s * C::kStageBytes + kAStageBytes;
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < kBK / 16; ++k) {
        mma_slice<T, BN, kTransA, kTransB>(acc, slice_desc<kTransA != 0>(a_st, k), slice_desc<kTransB != 0>(b_st, k),
                                           kt > 0 || k > 0);
      }
      wgmma_commit();
      // One group stays in flight; the one before it has finished reading its stage, which goes back. NOTE (H200,
      // dev/matmul/wgmma/probe.py): handing every stage back as soon as its own group finished (wait 0, one more stage of
      // prefetch) changed nothing (8192^3 bf16: 641-643 against 652-655 TFLOP/s): the ring is not what waits.
      wgmma_wait<1>();
      if (kt > 0 && t == 0) mbar_arrive(&empty[(it - 1) % S]);
    }
    wgmma_wait<0>();
    fence_registers(acc);
    // The last stage stays taken through the epilogue (scratch); the producer meanwhile fills the others.
    uint8_t* last = ring + ((it - 1) % S) * C::kStageBytes;
    float* scratch = reinterpret_cast<float*>(last + consumer * kHalfABytes);
    epilogue<T, BN>(p, acc, scratch, m0 + consumer * 64, n0, consumer, t);
    if (k_tiles > 0 && t == 0) mbar_arrive(&empty[(it - 1) % S]);
  }
#endif
}

// A 2-D tensor map (host; wgmma.cu): `inner` contiguous elements of `elem_bytes` per line, `outer` lines `ld`
// elements apart; boxes of box_inner x box_outer, 128-byte swizzled, zeros outside the matrix. `op` names the caller
// in errors.
CUtensorMap tensor_map_2d(const void* base, CUtensorMapDataType type, int elem_bytes, int64_t inner, int64_t outer,
                          int64_t ld, int box_inner, int box_outer, const char* op);

template <typename T, int BN, int kTransA, int kTransB>
inline void launch(const Params& p, const CUtensorMap& map_a, const CUtensorMap& map_b, int dev, int grid,
                   cudaStream_t stream) {
  auto* kernel = scaled_matmul_wgmma_kernel<T, BN, kTransA, kTransB>;
  static bool raised[64] = {};  // per instantiation and device
  wmma_mm::raise_smem_limit(reinterpret_cast<const void*>(kernel), Tile<BN>::kSmem, dev, raised);
  kernel<<<grid, kThreads, Tile<BN>::kSmem, stream>>>(map_a, map_b, p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// `grid` persistent blocks: scaled_matmul_wgmma_schedule's (min(tiles, SMs)).
template <typename T, int BN>
void launch_layouts(const Params& p, const CUtensorMap& ma, const CUtensorMap& mb, int dev, int grid,
                    cudaStream_t stream) {
  // Transposed A = column-major a (M contiguous); transposed B = row-major b (N contiguous).
  if (p.row_a) {
    if (p.row_b) launch<T, BN, 0, 1>(p, ma, mb, dev, grid, stream);
    else launch<T, BN, 0, 0>(p, ma, mb, dev, grid, stream);
  } else {
    if (p.row_b) launch<T, BN, 1, 1>(p, ma, mb, dev, grid, stream);
    else launch<T, BN, 1, 0>(p, ma, mb, dev, grid, stream);
  }
}

}  // namespace wgmma_mm
}  // namespace ampkernels
