// Kernel templates of the WMMA scaled matmul (measurements: dev/matmul/wmma/NOTES.md).
//
//     out = alpha * scale * (a @ b) + bias            (accumulate = false)
//     out = out_old + alpha * scale * (a @ b) + bias  (accumulate = true)
//
// fp32 accumulation, the epilogue in fp32, found_inf[0] = 1 when a value as stored is not finite.
//
// One thread block per BM x BN output tile (grouped block order for L2 reuse), each warp owning a WM x WN warp tile
// of 16x16x16 wmma fragments with fp32 accumulators (tuned: 4 warps of 64x64, two blocks per SM).
// - Tuned path (sm_80+, operands with 16-byte-aligned rows): A and B tiles are staged in shared memory in their global
//   orientation, so every layout gets 16-byte cp.async copies (zero-filled past the edges), through a STAGES-deep
//   pipeline with one barrier per k-tile. Rows are padded by 8 halfs (16 B): ldm stays a multiple of 8 and the eight
//   16-byte rows a fragment load touches fall in distinct banks.
// - Portable path (sm_75, or rows that are not 16-byte aligned, e.g. K odd): scalar predicated loads, coalesced along
//   whichever dimension is contiguous in memory, into row-major tiles; double-buffered.
// Epilogue: accumulators -> shared memory, one 16-row strip per warp at a time -> scale / bias / accumulate / convert
// in fp32 -> 16-byte stores where the output rows allow; found_inf from the values as stored.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace ampkernels {

struct ScaledMatmulArgs;  // scaled_matmul.h

namespace wmma_mm {

constexpr int kPad = 8;     // halfs of padding per shared-memory row
constexpr int kGroupM = 8;  // tile rows per group in the block order (consecutive blocks share B tiles in L2)

enum OutKind : int { kOutF32 = 0, kOutF16 = 1, kOutBF16 = 2 };
enum BiasKind : int { kBiasNone = 0, kBiasF32 = 1, kBiasInput = 2 };

struct Params {
  const uint16_t* a;  // raw 16-bit elements: the loads never look at their values
  const uint16_t* b;
  int64_t lda, ldb;   // stride of the strided dimension (MatLayout::ld)
  bool row_a, row_b;  // the portable kernel's layouts (the tuned ones take them as template arguments)
  int M, N, K;
  int tiles_m, tiles_n;
  const float* scale;
  int scale_mode;  // 0 none, 1 one element, 2 per row, 3 per column
  float alpha;
  const void* bias;
  int bias_kind;
  void* out;
  int out_kind;
  bool accumulate;
  bool out_vec;  // out 16-byte aligned and N % 8 == 0: full 8-column chunks use 16-byte accesses
  float* found_inf;
};

// FRAG_BUFFERS_ 2: the fragments of the next 16-deep k-step are loaded (ldmatrix) while this one's mma run, also
// across k-tiles (the barrier moves to the last k-step of a tile), so no warp waits on a fragment load.
template <int BM_, int BN_, int BK_, int WM_, int WN_, int STAGES_, int MIN_BLOCKS_, int FRAG_BUFFERS_ = 1>
struct Config {
  static constexpr int BM = BM_, BN = BN_, BK = BK_, WM = WM_, WN = WN_, STAGES = STAGES_;
  static constexpr int kMinBlocks = MIN_BLOCKS_, kFragBuffers = FRAG_BUFFERS_;
  static constexpr int kWarpsM = BM / WM, kWarpsN = BN / WN;
  static constexpr int kThreads = 32 * kWarpsM * kWarpsN;
  static constexpr int FM = WM / 16, FN = WN / 16;
  static_assert(BM % WM == 0 && BN % WN == 0 && WM % 16 == 0 && WN % 16 == 0 && BK % 16 == 0, "tile shape");
};

// Tuned configurations (sm_80+, aligned operands), chosen by the launcher, and the portable one. The tuned ones are
// 128x128 tiles of 4 warps (64x64 warp tiles), two blocks per SM, so one block's barrier wait overlaps the other's
// math. NOTE (H200, dev/matmul/wmma/NOTES.md "Tile configurations by bench"): 8 warps in 128x256 tiles, one block
// per SM, ran at 281-316 TFLOP/s bf16 on 8192^3 where these reach 349-357.
using CfgW = Config<128, 128, 32, 64, 64, 4, 2>;      // 74 KB x 2 blocks
using CfgX = Config<128, 128, 64, 64, 64, 3, 2>;      // 108 KB x 2 blocks: half the barriers per FLOP of W
using CfgXD = Config<128, 128, 64, 64, 64, 3, 2, 2>;  // X with double-buffered fragments
using CfgP = Config<128, 128, 32, 64, 32, 2, 1>;  // portable: 40 KB, fits sm_75's 48 KB without opting in

// Shared-memory elements of one stage of a tile of `rows` strided rows of `cols` contiguous elements, padded.
__host__ __device__ constexpr int tile_elems(int rows, int cols) { return rows * (cols + kPad); }

template <typename C, bool kRowA>
__host__ __device__ constexpr int a_stage_elems() {
  return kRowA ? tile_elems(C::BM, C::BK) : tile_elems(C::BK, C::BM);
}
template <typename C, bool kRowB>
__host__ __device__ constexpr int b_stage_elems() {
  return kRowB ? tile_elems(C::BK, C::BN) : tile_elems(C::BN, C::BK);
}
template <typename C, bool kRowA, bool kRowB>
__host__ __device__ constexpr int smem_bytes() {
  constexpr int pipeline = (a_stage_elems<C, kRowA>() + b_stage_elems<C, kRowB>()) * C::STAGES * 2;
  constexpr int epilogue = (C::kThreads / 32) * 16 * (C::WN + 4) * 4;
  return pipeline > epilogue ? pipeline : epilogue;
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// Copies the first `valid` (0..8) halfs of the 16 aligned bytes at src to dst and zero-fills the rest.
__device__ __forceinline__ void copy16(uint16_t* dst, const uint16_t* src, int valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(valid * 2));
#else
  if (valid == 8) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) dst[j] = j < valid ? src[j] : uint16_t(0);
  }
#endif
}

// Tuned path: stages one ROWS x COLS tile (rows strided by ld, columns contiguous; g and ld 16-byte aligned) into
// shared memory with one 16-byte copy per 8-column chunk, zero-filling outside [0, rows_lim) x [0, cols_lim).
template <int ROWS, int COLS, int kThreads>
__device__ __forceinline__ void load_tile_vec(uint16_t* smem, const uint16_t* g, int64_t ld, int row0, int col0,
                                              int rows_lim, int cols_lim, int tid) {
  constexpr int kChunksPerRow = COLS / 8;
  constexpr int kChunks = ROWS * kChunksPerRow;
  static_assert(kChunks % kThreads == 0, "tile chunks must split evenly over the threads");
#pragma unroll
  for (int i = 0; i < kChunks / kThreads; ++i) {
    const int c = tid + i * kThreads;
    const int r = c / kChunksPerRow;
    const int cc = (c % kChunksPerRow) * 8;
    const int gr = row0 + r, gc = col0 + cc;
    int valid = gr < rows_lim ? cols_lim - gc : 0;
    valid = valid < 0 ? 0 : (valid > 8 ? 8 : valid);
    // An empty copy still needs a valid address: the (aligned) base.
    const uint16_t* src = valid > 0 ? g + static_cast<int64_t>(gr) * ld + gc : g;
    copy16(smem + r * (COLS + kPad) + cc, src, valid);
  }
}

// Tuned path, a tile wholly inside the matrix (every tile but the edge ones): the same copies without bounds checks,
// from one pointer per thread. NOTE: with bounds checks, the per-chunk index math and predicates are ~500 of the 676
// instructions of a 128x256x64 k-tile of 8 warps (SASS), next to 128 HMMA, with the scheduler issuing every 2.6
// cycles (ncu); 128x128x64 tiles of 4 warps: 358 instructions a k-tile, 128 of them HMMA.
template <int ROWS, int COLS, int kThreads>
__device__ __forceinline__ void load_tile_vec_interior(uint16_t* smem, const uint16_t* g, int64_t ld, int tid) {
  constexpr int kChunksPerRow = COLS / 8;
  static_assert(kThreads % kChunksPerRow == 0 && (ROWS * kChunksPerRow) % kThreads == 0, "tile split");
  constexpr int kRowsPerPass = kThreads / kChunksPerRow;
  const int r = tid / kChunksPerRow, cc = (tid % kChunksPerRow) * 8;
  const uint16_t* src = g + r * ld + cc;
  uint16_t* dst = smem + r * (COLS + kPad) + cc;
#pragma unroll
  for (int i = 0; i < ROWS / kRowsPerPass; ++i) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst + i * kRowsPerPass * (COLS + kPad)));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src + i * kRowsPerPass * ld));
#else
    copy16(dst + i * kRowsPerPass * (COLS + kPad), src + i * kRowsPerPass * ld, 8);
#endif
  }
}

// Portable path: stages the ROWS x COLS tile at (row0, col0) of a matrix with element (r, c) at g[r * sr + c * sc]
// into a row-major shared tile, one element at a time. Consecutive threads take consecutive elements along the
// dimension that is contiguous in memory (`cols_contig`), so the global loads coalesce either way.
template <int ROWS, int COLS, int kThreads>
__device__ __forceinline__ void load_tile_scalar(uint16_t* smem, const uint16_t* g, int64_t sr, int64_t sc,
                                                 bool cols_contig, int row0, int col0, int rows_lim, int cols_lim,
                                                 int tid) {
  static_assert((ROWS * COLS) % kThreads == 0, "tile elements must split evenly over the threads");
#pragma unroll 4
  for (int i = 0; i < ROWS * COLS / kThreads; ++i) {
    const int e = tid + i * kThreads;
    const int r = cols_contig ? e / COLS : e % ROWS;
    const int c = cols_contig ? e % COLS : e / ROWS;
    const int gr = row0 + r, gc = col0 + c;
    smem[r * (COLS + kPad) + c] = (gr < rows_lim && gc < cols_lim) ? g[gr * sr + gc * sc] : uint16_t(0);
  }
}

template <typename T>
__device__ __forceinline__ float to_f32(T v);
template <>
__device__ __forceinline__ float to_f32<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ float to_f32<__half>(__half v) {
  return __half2float(v);
}
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

template <typename O>
__device__ __forceinline__ O from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Collects nothing: store8's default, the 16-bit kernels' case.
struct NoAmax {
  __device__ __forceinline__ void add(float) {}
};

// max |v| over the values it is given, as the bits of a non-negative float: integer order is float order there, and
// a NaN (exponent all ones, mantissa not zero) sorts above inf, so the max propagates NaN as torch.maximum does.
struct AmaxBits {
  int bits = 0;
  __device__ __forceinline__ void add(float v) { bits = max(bits, __float_as_int(v) & 0x7FFFFFFF); }
};

// Finishes the outputs (row, col .. col + n - 1), n <= 8: scale, bias, accumulate, convert, store. `bad` collects
// whether a value as stored is not finite (fp16 overflow included), `amax` the values as stored (AmaxBits).
template <typename T, typename O, typename Amax>
__device__ __forceinline__ void store8(const Params& p, int row, int col, int n, const float (&v)[8], bool& bad,
                                       Amax& amax) {
  constexpr int kPerVec = 16 / sizeof(O);        // outputs per 16-byte access
  constexpr int kVecs = 8 / kPerVec;             // 16-byte accesses per 8 outputs
  O* o = static_cast<O*>(p.out) + static_cast<int64_t>(row) * p.N + col;
  const bool full = p.out_vec && n == 8;
  float s = p.alpha;
  if (p.scale_mode == 1) s *= p.scale[0];
  if (p.scale_mode == 2) s *= p.scale[row];
  float old[8];
  if (p.accumulate) {
    if (full) {
#pragma unroll
      for (int u = 0; u < kVecs; ++u) {
        const uint4 w = reinterpret_cast<const uint4*>(o)[u];
        O tmp[kPerVec];
        memcpy(tmp, &w, 16);
#pragma unroll
        for (int j = 0; j < kPerVec; ++j) old[u * kPerVec + j] = to_f32<O>(tmp[j]);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) old[j] = j < n ? to_f32<O>(o[j]) : 0.f;
    }
  }
  O res[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (j < n) {
      const float sj = p.scale_mode == 3 ? p.alpha * p.scale[col + j] : s;
      float x = v[j] * sj;
      if (p.bias_kind == kBiasF32) x += static_cast<const float*>(p.bias)[col + j];
      if (p.bias_kind == kBiasInput) x += to_f32<T>(static_cast<const T*>(p.bias)[col + j]);
      if (p.accumulate) x = old[j] + x;
      res[j] = from_f32<O>(x);
      bad |= !isfinite(to_f32<O>(res[j]));
      amax.add(to_f32<O>(res[j]));
    } else {
      res[j] = from_f32<O>(0.f);
    }
  }
  if (full) {
#pragma unroll
    for (int u = 0; u < kVecs; ++u) {
      uint4 w;
      memcpy(&w, &res[u * kPerVec], 16);
      reinterpret_cast<uint4*>(o)[u] = w;
    }
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (j < n) o[j] = res[j];
  }
}

template <typename T, typename O>
__device__ __forceinline__ void store8(const Params& p, int row, int col, int n, const float (&v)[8], bool& bad) {
  NoAmax none;
  store8<T, O>(p, row, col, n, v, bad, none);
}

// wmma::load_matrix_sync from shared memory. NOTE: nvcc 13.0 infers the shared state space of wmma.load only for
// fp16 (which ptxas then turns into ldmatrix, LDSM); for bf16 it emits generic 32-bit loads (LD.E, 4 per fragment,
// seen in the SASS). bf16 fragments are therefore loaded with the same PTX instruction, .shared stated explicitly:
// LDSM again, and the fragment's registers are filled exactly as wmma::load_matrix_sync would fill them.
template <typename Use, typename Layout, typename T>
__device__ __forceinline__ void load_frag(nvcuda::wmma::fragment<Use, 16, 16, 16, T, Layout>& f, const T* p,
                                          unsigned ldm) {
  if constexpr (std::is_same<T, __half>::value) {
    nvcuda::wmma::load_matrix_sync(f, p, ldm);
  } else {
    static_assert(sizeof(f.x) == 16, "a bf16 m16n16k16 A/B fragment is four 32-bit registers");
    unsigned* r = reinterpret_cast<unsigned*>(&f.x[0]);
    const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(p));
    constexpr bool kA = std::is_same<Use, nvcuda::wmma::matrix_a>::value;
    constexpr bool kRow = std::is_same<Layout, nvcuda::wmma::row_major>::value;
#define AMPK_WMMA_LD(AB, LAYOUT)                                                                         \
  asm volatile("wmma.load." AB ".sync.aligned." LAYOUT ".m16n16k16.shared.bf16 {%0, %1, %2, %3}, [%4], %5;\n" \
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])                                          \
               : "r"(addr), "r"(ldm))
    if constexpr (kA && kRow) AMPK_WMMA_LD("a", "row");
    if constexpr (kA && !kRow) AMPK_WMMA_LD("a", "col");
    if constexpr (!kA && kRow) AMPK_WMMA_LD("b", "row");
    if constexpr (!kA && !kRow) AMPK_WMMA_LD("b", "col");
#undef AMPK_WMMA_LD
  }
}

// Stages k-tile kt of A and B into one pipeline stage (a_st, b_st).
// `interior`: the block's output tile lies inside [0, M) x [0, N) (its k-tiles are checked here).
template <typename C, bool kRowA, bool kRowB, bool kVec>
__device__ __forceinline__ void load_stage(const Params& p, uint16_t* a_st, uint16_t* b_st, int m0, int n0, int kt,
                                           int tid, bool interior) {
  const int k0 = kt * C::BK;
  if constexpr (kVec) {
    if (interior && k0 + C::BK <= p.K) {
      if constexpr (kRowA)
        load_tile_vec_interior<C::BM, C::BK, C::kThreads>(a_st, p.a + m0 * p.lda + k0, p.lda, tid);
      else
        load_tile_vec_interior<C::BK, C::BM, C::kThreads>(a_st, p.a + k0 * p.lda + m0, p.lda, tid);
      if constexpr (kRowB)
        load_tile_vec_interior<C::BK, C::BN, C::kThreads>(b_st, p.b + k0 * p.ldb + n0, p.ldb, tid);
      else
        load_tile_vec_interior<C::BN, C::BK, C::kThreads>(b_st, p.b + n0 * p.ldb + k0, p.ldb, tid);
      return;
    }
    if constexpr (kRowA)
      load_tile_vec<C::BM, C::BK, C::kThreads>(a_st, p.a, p.lda, m0, k0, p.M, p.K, tid);
    else
      load_tile_vec<C::BK, C::BM, C::kThreads>(a_st, p.a, p.lda, k0, m0, p.K, p.M, tid);
    if constexpr (kRowB)
      load_tile_vec<C::BK, C::BN, C::kThreads>(b_st, p.b, p.ldb, k0, n0, p.K, p.N, tid);
    else
      load_tile_vec<C::BN, C::BK, C::kThreads>(b_st, p.b, p.ldb, n0, k0, p.N, p.K, tid);
  } else {
    const int64_t a_sm = p.row_a ? p.lda : 1, a_sk = p.row_a ? 1 : p.lda;
    const int64_t b_sk = p.row_b ? p.ldb : 1, b_sn = p.row_b ? 1 : p.ldb;
    load_tile_scalar<C::BM, C::BK, C::kThreads>(a_st, p.a, a_sm, a_sk, p.row_a, m0, k0, p.M, p.K, tid);
    load_tile_scalar<C::BK, C::BN, C::kThreads>(b_st, p.b, b_sk, b_sn, p.row_b, k0, n0, p.K, p.N, tid);
  }
}

// The kernel body. T: __half or __nv_bfloat16 (the wmma element type). kVec: the tuned path (cp.async, layouts as
// template arguments); otherwise the portable path (scalar loads into row-major tiles; kRowA and kRowB are true).
template <typename T, typename C, bool kRowA, bool kRowB, bool kVec>
__device__ __forceinline__ void gemm_body(const Params& p) {
  namespace wmma = nvcuda::wmma;
  using LayoutA = std::conditional_t<kRowA, wmma::row_major, wmma::col_major>;
  using LayoutB = std::conditional_t<kRowB, wmma::row_major, wmma::col_major>;
  static_assert(kVec || (kRowA && kRowB), "the portable path stages row-major tiles");
  constexpr int kA = a_stage_elems<C, kRowA>(), kB = b_stage_elems<C, kRowB>();
  constexpr int kLdA = kRowA ? C::BK + kPad : C::BM + kPad;
  constexpr int kLdB = kRowB ? C::BN + kPad : C::BK + kPad;
  static_assert((kA * 2) % 128 == 0 && (kB * 2) % 128 == 0, "stages must stay 128-byte aligned");

  extern __shared__ __align__(128) unsigned char smem_raw[];
  uint16_t* sA = reinterpret_cast<uint16_t*>(smem_raw);
  uint16_t* sB = sA + C::STAGES * kA;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / C::kWarpsN, wn = warp % C::kWarpsN;

  // Grouped block order (as in the Triton matmul tutorial): kGroupM consecutive tile rows sweep the tile columns
  // together, so the B tiles they share come from L2.
  const int pid = blockIdx.x;
  const int in_group = kGroupM * p.tiles_n;
  const int first_m = (pid / in_group) * kGroupM;
  const int group_m = min(p.tiles_m - first_m, kGroupM);
  const int tm = first_m + (pid % in_group) % group_m;
  const int tn = (pid % in_group) / group_m;
  const int m0 = tm * C::BM, n0 = tn * C::BN;

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[C::FM][C::FN];
#pragma unroll
  for (int i = 0; i < C::FM; ++i)
#pragma unroll
    for (int j = 0; j < C::FN; ++j) wmma::fill_fragment(acc[i][j], 0.f);

  const int num_k = (p.K + C::BK - 1) / C::BK;
  const bool interior = m0 + C::BM <= p.M && n0 + C::BN <= p.N;
#pragma unroll
  for (int s = 0; s < C::STAGES - 1; ++s) {
    if (s < num_k) load_stage<C, kRowA, kRowB, kVec>(p, sA + s * kA, sB + s * kB, m0, n0, s, tid, interior);
    cp_async_commit();
  }
  const T* tiles = reinterpret_cast<const T*>(smem_raw);
  // Where fragment i of A, and fragment j of B, of k-step kk start in a stage's tiles a_st / b_st.
  auto a_frag = [&](const T* a_st, int i, int kk) {
    const int m = wm * C::WM + i * 16;
    return a_st + (kRowA ? m * kLdA + kk : kk * kLdA + m);
  };
  auto b_frag = [&](const T* b_st, int j, int kk) {
    const int n = wn * C::WN + j * 16;
    return b_st + (kRowB ? kk * kLdB + n : n * kLdB + kk);
  };
  if constexpr (C::kFragBuffers == 2) {
    constexpr int kSteps = C::BK / 16;
    static_assert(kSteps % 2 == 0, "k-step 0 of every tile must read fragment buffer 0");
    // The A and B fragments of k-step kk of the tile in stage st.
    auto load_frags = [&](wmma::fragment<wmma::matrix_a, 16, 16, 16, T, LayoutA>(&fa)[C::FM],
                          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, LayoutB>(&fb)[C::FN], int st, int kk) {
      const T* a_st = tiles + st * kA;
      const T* b_st = tiles + C::STAGES * kA + st * kB;
#pragma unroll
      for (int i = 0; i < C::FM; ++i) load_frag(fa[i], a_frag(a_st, i, kk), kLdA);
#pragma unroll
      for (int j = 0; j < C::FN; ++j) load_frag(fb[j], b_frag(b_st, j, kk), kLdB);
    };
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, LayoutA> fa[2][C::FM];
    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, LayoutB> fb[2][C::FN];
    cp_async_wait<C::STAGES - 2>();
    __syncthreads();
    if (num_k > 0) load_frags(fa[0], fb[0], 0, 0);
    for (int kt = 0; kt < num_k; ++kt) {
      // Stage (kt - 1) % STAGES is free: every warp read its last fragments before the barrier of tile kt - 1.
      const int next = kt + C::STAGES - 1;
      if (next < num_k) {
        const int st = next % C::STAGES;
        load_stage<C, kRowA, kRowB, kVec>(p, sA + st * kA, sB + st * kB, m0, n0, next, tid, interior);
      }
      cp_async_commit();
      const int st = kt % C::STAGES;
#pragma unroll
      for (int kk = 0; kk < kSteps; ++kk) {
        const int cur = kk & 1;
        if (kk + 1 < kSteps) {
          load_frags(fa[cur ^ 1], fb[cur ^ 1], st, (kk + 1) * 16);
        } else if (kt + 1 < num_k) {
          // Tile kt + 1 has landed for every thread after these two; the fragments of its first k-step load while
          // this tile's last k-step multiplies.
          cp_async_wait<C::STAGES - 2>();
          __syncthreads();
          load_frags(fa[cur ^ 1], fb[cur ^ 1], (kt + 1) % C::STAGES, 0);
        }
#pragma unroll
        for (int i = 0; i < C::FM; ++i)
#pragma unroll
          for (int j = 0; j < C::FN; ++j) wmma::mma_sync(acc[i][j], fa[cur][i], fb[cur][j], acc[i][j]);
      }
    }
  } else {
    for (int kt = 0; kt < num_k; ++kt) {
      // After the wait this thread's copies of tile kt have landed, after the barrier everyone's; every warp is also
      // done reading the stage of tile kt - 1, which the load below overwrites.
      cp_async_wait<C::STAGES - 2>();
      __syncthreads();
      const int next = kt + C::STAGES - 1;
      if (next < num_k) {
        const int st = next % C::STAGES;
        load_stage<C, kRowA, kRowB, kVec>(p, sA + st * kA, sB + st * kB, m0, n0, next, tid, interior);
      }
      cp_async_commit();

      const T* a_st = tiles + (kt % C::STAGES) * kA;
      const T* b_st = tiles + C::STAGES * kA + (kt % C::STAGES) * kB;
#pragma unroll
      for (int kk = 0; kk < C::BK; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, LayoutA> fa[C::FM];
#pragma unroll
        for (int i = 0; i < C::FM; ++i) load_frag(fa[i], a_frag(a_st, i, kk), kLdA);
#pragma unroll
        for (int j = 0; j < C::FN; ++j) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, LayoutB> fb;
          load_frag(fb, b_frag(b_st, j, kk), kLdB);
#pragma unroll
          for (int i = 0; i < C::FM; ++i) wmma::mma_sync(acc[i][j], fa[i], fb, acc[i][j]);
        }
      }
    }
  }

  // Epilogue, in the pipeline's shared memory: drain the (empty) copy groups and wait for every warp first.
  cp_async_wait<0>();
  __syncthreads();
  constexpr int kLdC = C::WN + 4;  // floats; store_matrix_sync wants a multiple of 4
  constexpr int kChunksPerRow = C::WN / 8;
  float* sC = reinterpret_cast<float*>(smem_raw) + warp * 16 * kLdC;
  bool bad = false;
#pragma unroll
  for (int i = 0; i < C::FM; ++i) {
#pragma unroll
    for (int j = 0; j < C::FN; ++j) wmma::store_matrix_sync(sC + j * 16, acc[i][j], kLdC, wmma::mem_row_major);
    __syncwarp();
    for (int q = lane; q < 16 * kChunksPerRow; q += 32) {
      const int r = q / kChunksPerRow, c8 = (q % kChunksPerRow) * 8;
      const int row = m0 + wm * C::WM + i * 16 + r, col = n0 + wn * C::WN + c8;
      if (row < p.M && col < p.N) {
        const float4 lo = *reinterpret_cast<const float4*>(sC + r * kLdC + c8);
        const float4 hi = *reinterpret_cast<const float4*>(sC + r * kLdC + c8 + 4);
        const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
        const int n = min(8, p.N - col);
        switch (p.out_kind) {
          case kOutF32: store8<T, float>(p, row, col, n, v, bad); break;
          case kOutF16: store8<T, __half>(p, row, col, n, v, bad); break;
          default: store8<T, __nv_bfloat16>(p, row, col, n, v, bad); break;
        }
      }
    }
    __syncwarp();
  }
  // Only warps that stored a non-finite value write found_inf: no extra pass, no atomics.
  if (p.found_inf != nullptr && __any_sync(0xffffffffu, bad) && lane == 0) *p.found_inf = 1.f;
}

// sm_80 is needed by bf16 wmma and by the tuned path (cp.async, > 48 KB of shared memory); the launcher never picks
// those kernels below it, and their builds for older targets are empty.
template <typename T, typename C, bool kRowA, bool kRowB, bool kVec>
__global__ void __launch_bounds__(C::kThreads, C::kMinBlocks) scaled_matmul_wmma_kernel(const Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  if constexpr (!kVec && std::is_same<T, __half>::value) gemm_body<T, C, kRowA, kRowB, kVec>(p);
#else
  gemm_body<T, C, kRowA, kRowB, kVec>(p);
#endif
}

// Host side: launches one instantiation (raising its shared-memory limit first when it needs more than 48 KB).
void raise_smem_limit(const void* kernel, int bytes, int dev, bool* raised_per_device);
void check_grid(int64_t blocks, int M, int N);
void check_last_launch();

// Host helpers shared with the wgmma launcher (defined in wmma.cu).
struct DeviceInfo {  // read once per device: cudaDeviceGetAttribute is not free on the launch path
  int major = 0;
  int minor = 0;
  int max_smem = 0;  // opt-in shared memory per block
  int sms = 0;
};
DeviceInfo device_info(int dev);
bool aligned16(const void* ptr);
// Params of the checked op arguments, all but the tile counts (they depend on the tile the launcher picks).
Params params_of(const ScaledMatmulArgs& args);

template <typename T, typename C, bool kRowA, bool kRowB, bool kVec>
void launch_one(const Params& p, int dev, cudaStream_t stream) {
  auto kernel = scaled_matmul_wmma_kernel<T, C, kRowA, kRowB, kVec>;
  constexpr int kSmem = smem_bytes<C, kRowA, kRowB>();
  if (kSmem > 48 * 1024) {
    static bool raised[64] = {false};  // per device: the attribute is set once
    raise_smem_limit(reinterpret_cast<const void*>(kernel), kSmem, dev, raised);
  }
  const int64_t blocks = int64_t(p.tiles_m) * p.tiles_n;
  check_grid(blocks, p.M, p.N);
  kernel<<<static_cast<unsigned>(blocks), C::kThreads, kSmem, stream>>>(p);
  check_last_launch();
}

// The tuned kernels of one (dtype, configuration), all four layouts; instantiated in generated/wmma_<dtype>_<tile>.cu
// files so that ninja compiles them in parallel.
template <typename T, typename C>
void launch_tuned(const Params& p, bool row_a, bool row_b, int dev, cudaStream_t stream) {
  if (row_a && row_b) launch_one<T, C, true, true, true>(p, dev, stream);
  if (row_a && !row_b) launch_one<T, C, true, false, true>(p, dev, stream);
  if (!row_a && row_b) launch_one<T, C, false, true, true>(p, dev, stream);
  if (!row_a && !row_b) launch_one<T, C, false, false, true>(p, dev, stream);
}

}  // namespace wmma_mm
}  // namespace ampkernels
