// The FP8 wgmma scaled matmul: the 16-bit wgmma kernel (wgmma.cuh: schedule, ring, barriers, epilogue helpers) on
// float8 operands, with torch._scaled_mm's dequantization factors and the output's amax. Built only for sm_90a.
//
//     v   = (a @ b) * scale_a[row] * scale_b[col]        (fp32; each factor one element or per row / per column)
//     out = alpha * scale * v + bias  (+ out_old when accumulate)
//     amax_out = max(amax_out, max |out as stored|)      (NaN-propagating, as torch.maximum)
//
// Operands: a [M, K] row-major and b [K, N] column-major, both K-major as fp8 wgmma requires (the instruction has no
// transpose bits for 8-bit types), e4m3 x e4m3, e4m3 x e5m2 or e5m2 x e4m3.
// The same persistent warp-specialized block as the 16-bit kernel: one producer thread issues the TMA copies of each
// 128 x 128 A tile and BN x 128 B tile (128 float8 = one 128-byte swizzle row, so a stage has the 16-bit kernel's
// bytes, Tile<BN>'s stage count and its smem descriptors), two consumer warpgroups run four m64nBNk32 wgmmas per
// stage. The epilogue is the 16-bit kernel's through the same scratch:
// - a 16-bit output with one scale, no bias, no accumulation: packed in the registers, every factor of the tile
//   folded into one multiplier per row (per-row scale_a included); a per-column scale_b is one more multiply;
// - every other case: fp32 through the scratch, the dequantization factors applied per element, then store8_scaled
//   (an fp32 output of the simple case) or store8.
// amax: each thread keeps the max of the bits of |value as stored| (AmaxBits; 16-bit codes two at a time in the
// packed path), one warp max, one atomicMax on the float's bits per warp and tile.
#pragma once

#include "matmul/wgmma.cuh"

namespace ampkernels {
namespace wgmma_mm {

// Float8 operand types, as template arguments (scripts/gen_matmul_sources.py instantiates the pairs).
enum Fp8Type : int { kE4M3 = 0, kE5M2 = 1 };

constexpr int kBKFp8 = 128;  // 128 float8 = one 128-byte swizzle row: four k32 slices, 32 bytes apart
static_assert(kBKFp8 == kBK * 2, "an FP8 k-tile has the bytes of a 16-bit one, so Tile<BN>'s ring holds it");

struct Fp8Params {
  Params p;              // sizes, scale (scale_mode), alpha, bias (fp32, or the output's dtype), out, found_inf
  const float* scale_a;  // nullptr (1), 1 element, or one per row of a (row_scale_a)
  const float* scale_b;  // nullptr (1), 1 element, or one per column of b (col_scale_b)
  bool row_scale_a, col_scale_b;
  float* amax_out;  // nullptr, or 1 element
};

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)

template <int BN, int kA, int kB>
__device__ __forceinline__ void mma_slice_fp8(float (&acc)[BN / 2], uint64_t da, uint64_t db, int accumulate) {
  static_assert(!(kA == kE5M2 && kB == kE5M2), "e5m2 x e5m2 is not instantiated");
  if constexpr (kA == kE5M2) {
    if constexpr (BN == 256) wgmma_m64n256k32_e5m2_e4m3(acc, da, db, accumulate);
    else if constexpr (BN == 192) wgmma_m64n192k32_e5m2_e4m3(acc, da, db, accumulate);
    else wgmma_m64n128k32_e5m2_e4m3(acc, da, db, accumulate);
  } else if constexpr (kB == kE5M2) {
    if constexpr (BN == 256) wgmma_m64n256k32_e4m3_e5m2(acc, da, db, accumulate);
    else if constexpr (BN == 192) wgmma_m64n192k32_e4m3_e5m2(acc, da, db, accumulate);
    else wgmma_m64n128k32_e4m3_e5m2(acc, da, db, accumulate);
  } else {
    if constexpr (BN == 256) wgmma_m64n256k32_e4m3_e4m3(acc, da, db, accumulate);
    else if constexpr (BN == 192) wgmma_m64n192k32_e4m3_e4m3(acc, da, db, accumulate);
    else wgmma_m64n128k32_e4m3_e4m3(acc, da, db, accumulate);
  }
}

// st_shared_scaled_pair with a factor per column: (x * cx) * s and (y * cy) * s, rounded once to O, as one 32-bit word.
template <typename O>
__device__ __forceinline__ void st_shared_scaled_pair_cols(uint32_t addr, float x, float y, float s, float cx,
                                                           float cy) {
  if constexpr (std::is_same<O, __nv_bfloat16>::value) {
    asm volatile(
        "{\n.reg .f32 x, y;\n.reg .b32 w;\nmul.rn.f32 x, %1, %4;\nmul.rn.f32 y, %2, %5;\nmul.rn.f32 x, x, %3;\n"
        "mul.rn.f32 y, y, %3;\ncvt.rn.bf16x2.f32 w, y, x;\nst.shared.b32 [%0], w;\n}\n" ::"r"(addr),
        "f"(x), "f"(y), "f"(s), "f"(cx), "f"(cy)
        : "memory");
  } else {
    asm volatile(
        "{\n.reg .f32 x, y;\n.reg .b32 w;\nmul.rn.f32 x, %1, %4;\nmul.rn.f32 y, %2, %5;\nmul.rn.f32 x, x, %3;\n"
        "mul.rn.f32 y, y, %3;\ncvt.rn.f16x2.f32 w, y, x;\nst.shared.b32 [%0], w;\n}\n" ::"r"(addr),
        "f"(x), "f"(y), "f"(s), "f"(cx), "f"(cy)
        : "memory");
  }
}

// stash_packed with one multiplier per row (rm[h] for the thread's rows r0 + 8 h) and, with kCols, the per-column
// factors of `col_scale` (columns from col0; none past N).
template <typename O, int kChunk, bool kCols, int R>
__device__ __forceinline__ void stash_packed_fp8(const float (&acc)[R], uint32_t* scratch, const float (&rm)[2],
                                                 const float* col_scale, int col0, int N, int t) {
  const int lane = t % 32;
  const int r0 = 16 * (t / 32) + lane / 4;
#pragma unroll
  for (int jj = 0; jj < 8; ++jj) {
    const int j = 8 * kChunk + jj;
    float cx = 1.f, cy = 1.f;
    if constexpr (kCols) {
      const int col = col0 + 64 * kChunk + 8 * jj + 2 * (lane % 4);
      cx = col < N ? col_scale[col] : 0.f;
      cy = col + 1 < N ? col_scale[col + 1] : 0.f;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t addr = smem_addr(scratch + scratch_word(r0 + 8 * h, jj, lane % 4));
      if constexpr (kCols) {
        st_shared_scaled_pair_cols<O>(addr, acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1], rm[h], cx, cy);
      } else {
        st_shared_scaled_pair<O>(addr, acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1], rm[h]);
      }
    }
  }
}

template <typename O, int BN, bool kCols, int kChunk = 0>
__device__ __forceinline__ void stash_packed_fp8_at(const float (&acc)[BN / 2], uint32_t* scratch,
                                                    const float (&rm)[2], const float* col_scale, int col0, int N,
                                                    int t, int chunk) {
  if constexpr (kChunk < BN / 64) {
    if (chunk == kChunk) {
      stash_packed_fp8<O, kChunk, kCols>(acc, scratch, rm, col_scale, col0, N, t);
    } else {
      stash_packed_fp8_at<O, BN, kCols, kChunk + 1>(acc, scratch, rm, col_scale, col0, N, t, chunk);
    }
  }
}

// |value| of the larger of two 16-bit codes (the max of their low 15 bits), as a float: the packed path's amax.
template <typename O>
__device__ __forceinline__ float code_magnitude(uint32_t codes) {
  const uint32_t c = max(codes & 0xFFFFu, codes >> 16);
  if constexpr (std::is_same<O, __nv_bfloat16>::value) {
    return __uint_as_float(c << 16);
  } else {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(c)));
  }
}

// epilogue_packed's loop with the FP8 multipliers; `codes` collects the 15-bit magnitudes stored, two per word (their
// integer order is the values' order, NaN above inf, as for AmaxBits).
template <typename O, int BN, bool kCols>
__device__ __forceinline__ bool epilogue_packed_fp8(const Fp8Params& q, const float (&acc)[BN / 2],
                                                    uint32_t* scratch, int m0, int n0, int consumer, int t,
                                                    const float (&rm)[2], bool check, uint32_t& codes) {
  const Params& p = q.p;
  bool bad = false;
  O* out = static_cast<O*>(p.out);
  const bool track = q.amax_out != nullptr;
#pragma unroll 1
  for (int chunk = 0; chunk < BN / 64; ++chunk) {
    stash_packed_fp8_at<O, BN, kCols>(acc, scratch, rm, q.scale_b, n0, p.N, t, chunk);
    warpgroup_sync(consumer);
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // 64 rows x 8 groups of 8 outputs, four per thread
      const int qi = t + 128 * i;
      const int r = qi / 8, group = qi % 8;
      const int row = m0 + r, col = n0 + 64 * chunk + 8 * group;
      if (row < p.M && col < p.N) {  // N % 8 == 0 (out_vec): the group is whole
        const uint4 w = *reinterpret_cast<const uint4*>(scratch + scratch_word(r, group, 0));
        if (check) bad |= pair_not_finite<O>(w.x) | pair_not_finite<O>(w.y) | pair_not_finite<O>(w.z) |
                          pair_not_finite<O>(w.w);
        if (track) {
          constexpr uint32_t kMag = 0x7FFF7FFFu;
          codes = __vmaxu2(codes, __vmaxu2(__vmaxu2(w.x & kMag, w.y & kMag), __vmaxu2(w.z & kMag, w.w & kMag)));
        }
        *reinterpret_cast<uint4*>(out + static_cast<int64_t>(row) * p.N + col) = w;
      }
    }
    warpgroup_sync(consumer);  // the scratch is rewritten by the next chunk
  }
  return bad;
}

// Epilogue of one consumer's 64 x BN accumulators through `scratch` (8 KB); see the top of this file.
template <int BN>
__device__ __forceinline__ void epilogue_fp8(const Fp8Params& q, const float (&acc)[BN / 2], float* scratch, int m0,
                                             int n0, int consumer, int t) {
  const Params& p = q.p;
  const bool simple = p.scale_mode <= 1 && p.bias_kind == wmma_mm::kBiasNone && !p.accumulate && p.out_vec;
  const float s = p.scale_mode == 1 ? p.alpha * p.scale[0] : p.alpha;  // store8's order: alpha, then * scale
  const bool check = p.found_inf != nullptr;
  bool bad = false;
  wmma_mm::AmaxBits amax;
  if (simple && p.out_kind != kOutF32) {
    // One multiplier per row: s * the tile-wide factors (* scale_a of the row).
    const float sa = q.scale_a == nullptr || q.row_scale_a ? 1.f : q.scale_a[0];
    const float sb = q.scale_b == nullptr || q.col_scale_b ? 1.f : q.scale_b[0];
    const float g = s * sa * sb;
    const int r0 = m0 + 16 * (t / 32) + (t % 32) / 4;
    float rm[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = min(r0 + 8 * h, p.M - 1);
      rm[h] = q.row_scale_a ? g * q.scale_a[row] : g;
    }
    uint32_t* packed = reinterpret_cast<uint32_t*>(scratch);
    uint32_t codes = 0;
    if (p.out_kind == kOutF16) {
      bad = q.col_scale_b ? epilogue_packed_fp8<__half, BN, true>(q, acc, packed, m0, n0, consumer, t, rm, check, codes)
                          : epilogue_packed_fp8<__half, BN, false>(q, acc, packed, m0, n0, consumer, t, rm, check,
                                                                   codes);
      amax.add(code_magnitude<__half>(codes));
    } else {
      bad = q.col_scale_b
                ? epilogue_packed_fp8<__nv_bfloat16, BN, true>(q, acc, packed, m0, n0, consumer, t, rm, check, codes)
                : epilogue_packed_fp8<__nv_bfloat16, BN, false>(q, acc, packed, m0, n0, consumer, t, rm, check, codes);
      amax.add(code_magnitude<__nv_bfloat16>(codes));
    }
  } else {
#pragma unroll 1
    for (int chunk = 0; chunk < BN / 32; ++chunk) {
      stash_chunk_at<BN>(acc, scratch, t, chunk);
      warpgroup_sync(consumer);
#pragma unroll
      for (int i = 0; i < 2; ++i) {  // 64 rows x 4 groups of 8 columns, two per thread
        const int qi = t + 128 * i;
        const int r = qi / 4, c8 = (qi % 4) * 8;
        const int row = m0 + r, col = n0 + 32 * chunk + c8;
        if (row < p.M && col < p.N) {
          const float4 lo = *reinterpret_cast<const float4*>(scratch + scratch_index(r, c8));
          const float4 hi = *reinterpret_cast<const float4*>(scratch + scratch_index(r, c8 + 4));
          float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
          const int n = min(8, p.N - col);
          // The dequantization, in the reference's order: (a @ b) * scale_a, then * scale_b.
          const float ra = q.scale_a == nullptr ? 1.f : q.scale_a[q.row_scale_a ? row : 0];
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const float cb = q.scale_b == nullptr ? 1.f : (q.col_scale_b ? (j < n ? q.scale_b[col + j] : 0.f)
                                                                         : q.scale_b[0]);
            v[j] = v[j] * ra * cb;
          }
          const int64_t offset = static_cast<int64_t>(row) * p.N + col;
          if (simple) {  // an fp32 output (16-bit ones are packed above); out_vec: the 8 columns are whole
            store8_scaled(static_cast<float*>(p.out) + offset, v, s, check, bad, amax);
          } else {
            // The bias is fp32 or the output's dtype: store8 reads a non-fp32 bias as its first type.
            switch (p.out_kind) {
              case kOutF32: wmma_mm::store8<float, float>(p, row, col, n, v, bad, amax); break;
              case kOutF16: wmma_mm::store8<__half, __half>(p, row, col, n, v, bad, amax); break;
              default: wmma_mm::store8<__nv_bfloat16, __nv_bfloat16>(p, row, col, n, v, bad, amax); break;
            }
          }
        }
      }
      warpgroup_sync(consumer);  // the scratch is rewritten by the next chunk
    }
  }
  // Only warps that stored a non-finite value write found_inf: no extra pass, no atomics.
  if (check && __any_sync(0xffffffffu, bad) && t % 32 == 0) *p.found_inf = 1.f;
  if (q.amax_out != nullptr) {
    const int warp_max = static_cast<int>(__reduce_max_sync(0xffffffffu, static_cast<unsigned>(amax.bits)));
    // The bits of a non-negative float (or NaN) against amax_out's: signed order is their float order.
    if (t % 32 == 0) atomicMax(reinterpret_cast<int*>(q.amax_out), warp_max);
  }
}

#endif  // sm_90a

template <int BN, int kA, int kB>
__global__ void __launch_bounds__(kThreads, 1)
    scaled_matmul_fp8_wgmma_kernel(const __grid_constant__ CUtensorMap map_a,
                                   const __grid_constant__ CUtensorMap map_b, const Fp8Params q) {
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

  const Params& p = q.p;
  const int tiles_m = p.tiles_m, tiles_n = p.tiles_n;
  const int num_tiles = tiles_m * tiles_n;
  const int k_tiles = (p.K + kBKFp8 - 1) / kBKFp8;  // K > 0 (checked): every tile has a last stage for the scratch

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
        mbar_expect_tx(&full[s], C::kStageBytes);  // whole boxes, also where TMA zero-fills past M, N or K
        uint8_t* a_st = ring + s * C::kStageBytes;
        const int k0 = kt * kBKFp8;
        tma_load(a_st, &map_a, k0, m0, &full[s]);
        tma_load(a_st + kAStageBytes, &map_b, k0, n0, &full[s]);
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
      for (int k = 0; k < kBKFp8 / 32; ++k) {
        // K-major slices: the 16-bit kernel's descriptors (32 bytes along the 128-byte row per slice).
        mma_slice_fp8<BN, kA, kB>(acc, slice_desc<false>(a_st, k), slice_desc<false>(b_st, k), kt > 0 || k > 0);
      }
      wgmma_commit();
      wgmma_wait<1>();  // one group in flight; the stage before it goes back
      if (kt > 0 && t == 0) mbar_arrive(&empty[(it - 1) % S]);
    }
    wgmma_wait<0>();
    fence_registers(acc);
    // The last stage stays taken through the epilogue (scratch); the producer meanwhile fills the others.
    uint8_t* last = ring + ((it - 1) % S) * C::kStageBytes;
    float* scratch = reinterpret_cast<float*>(last + consumer * kHalfABytes);
    epilogue_fp8<BN>(q, acc, scratch, m0 + consumer * 64, n0, consumer, t);
    if (t == 0) mbar_arrive(&empty[(it - 1) % S]);
  }
#endif
}

// `grid` persistent blocks: scaled_matmul_wgmma_schedule's (min(tiles, SMs)). Instantiated per (width, operand
// types) in generated/wgmma_fp8_<a>_<b>_tile128x<width>.cu.
template <int BN, int kA, int kB>
void launch_fp8(const Fp8Params& q, const CUtensorMap& map_a, const CUtensorMap& map_b, int dev, int grid,
                cudaStream_t stream) {
  auto* kernel = scaled_matmul_fp8_wgmma_kernel<BN, kA, kB>;
  static bool raised[64] = {};  // per instantiation and device
  wmma_mm::raise_smem_limit(reinterpret_cast<const void*>(kernel), Tile<BN>::kSmem, dev, raised);
  kernel<<<grid, kThreads, Tile<BN>::kSmem, stream>>>(map_a, map_b, q);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace wgmma_mm
}  // namespace ampkernels
