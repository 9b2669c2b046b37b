// FP8 casts on CUDA (ampkernels::to_float8_native; semantics: ampkernels.reference.to_float8, bit for bit).
//
// Kernels, each a template over the input type T, the number VEC of elements per access (16 bytes, or 1 where x's
// strides or alignment forbid vectors) and the float8 format:
//   amax_flat_kernel     finite max |x| and the non-finite flag of a contiguous tensor (grid-stride, 8 loads in
//                        flight per thread), one atomic each per block into a zeroed int32 scratch, or a partial;
//   amax_columns_kernel  the same over a strided [M, K] matrix, per tensor or per column (the scales of a rowwise
//                        cast of x.T);
//   cast_flat_kernel     tensorwise cast of a contiguous tensor, walked backwards (the amax pass's tail is in L2);
//   cast_rows_kernel     a warp per row (a block per row past 2048 bf16): the row's amax and its cast, the row
//                        kept in registers up to 8192 bf16 (one read);
//   cast_tiles_kernel    128 x 128 tiles of a strided [M, K] matrix written as [M, K] (from registers) and/or
//                        [K, M] (through shared memory, 4 x 4 byte transposes), whole 128-byte lines in both
//                        layouts, per tensor or per column.
// Current scaling reads the amax pass's scratch and computes the scale in the kernel; delayed scaling (a given
// scale) records this pass's amax into the scratch, and the last block to finish (an atomic ticket) writes amax_out
// and found_inf. The scratch layout, int32 [2 * columns + 1] = (finite amax as float bits, non-finite flags, ticket),
// is the one the Triton casts and the fused producers of ampkernels.float8 use. A flat tensorwise cast's amax pass
// instead leaves one (amax, flag) partial per block, which every cast block reduces: no zeroed scratch, so no memset
// launch. On sm_90+ the cast after an amax pass is launched as its programmatic dependent: its blocks start as the
// pass's retire, not after a launch gap. Nothing here syncs with the host.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "common/checks.h"
#include "common/multi_tensor_apply.cuh"
#include "common/vector_access.cuh"
#include "float8/casts.h"

namespace ampkernels {
namespace cuda {
namespace {

// Floor of the amax a scale is computed from (ampkernels._constants.FLOAT8_AMAX_FLOOR).
constexpr float kAmaxFloor = 1e-12f;
constexpr int kLoadsInFlight = 4;
constexpr int kAmaxLoadsInFlight = 8;  // the flat amax pass: 8 x 16 bytes per thread, no registers to spare for more
// Blocks of kThreads resident on one SM at most (2048 threads per SM on every architecture since Volta).
constexpr int kMaxResidentBlocks = 2048 / kThreads;
// Tiles of the transposing casts: 128 x 128, so that both layouts are written in whole 128-byte lines. The codes
// of a tile pass through shared memory; each thread writes a run of 16 codes of one x.T row (one 16-byte store),
// 8 threads one 128-byte line.
constexpr int kTileM = 128;
constexpr int kTileK = 128;
constexpr int kTransposedRun = 16;
constexpr int kRunsPerRow = kTileM / kTransposedRun;

// The shared-memory column of code (m, k) of a tile: its 8-byte unit swizzled by the run of 16 rows it belongs to,
// so that the transposed write's reads (one byte from each of the 8 runs of a column, per warp 4 columns) hit 8
// different bank pairs, while the row stores of 1-8 codes stay whole and aligned.
__device__ __forceinline__ int swizzled(int m, int k) { return (((k >> 3) ^ ((m / kTransposedRun) & 7)) << 3) | (k & 7); }
// A rowwise cast keeps up to 32 * kWarpRowVecs vectors of a row in a warp's registers (2048 bf16), longer rows up
// to kThreads * kBlockRowVecs in a block's (8192 bf16); rows longer still are read twice.
constexpr int kWarpRowVecs = 8;
constexpr int kBlockRowVecs = 4;

template <bool kE4M3>
struct Fp8 {
  static constexpr float kMax = kE4M3 ? 448.0f : 57344.0f;
  static constexpr __nv_fp8_interpretation_t kKind = kE4M3 ? __NV_E4M3 : __NV_E5M2;
};

// The pointers of one cast's scalars (nullptr where absent).
struct CastState {
  const float* scale;      // delayed scaling: the given scale(s); nullptr: current scaling, from the scratch
  float* scale_inv;        // 1 / scale, one or per row of the written matrix
  unsigned* scratch_amax;  // finite amax as float bits (non-negative floats order as unsigned integers)
  int* scratch_bad;        // non-finite flags
  unsigned* ticket;        // blocks finished (the last one finishes a delayed pass's record)
  uint2* partials;         // current scaling of a flat tensor: the amax pass's (amax bits, non-finite) per block
  int parts;               // blocks of that pass; 0: the tensor's amax is in scratch_amax / scratch_bad
  float* amax_out;         // max(amax_out, amax) where the amax is finite
  float* found_inf;        // set to 1 when x holds an inf or NaN
  bool record;             // delayed: reduce this pass's amax into the scratch and finish it
};

// reference.float8_scale: 1 for a non-finite amax, else reciprocal(max(amax, floor)) * max, each step rounded.
__device__ __forceinline__ float scale_of(float amax, bool bad, float fp8_max) {
  return bad ? 1.0f : __frcp_rn(fmaxf(amax, kAmaxFloor)) * fp8_max;
}

// amax_out's new value: max(prev, amax), prev where the amax is not finite (or prev is NaN, as torch.maximum keeps).
__device__ __forceinline__ float recorded(float prev, float amax, bool bad) {
  return (bad || amax <= prev || prev != prev) ? prev : amax;
}

__device__ __forceinline__ void accumulate(float v, float& acc, bool& bad) {
  const float a = fabsf(v);
  const bool finite = a < INFINITY;
  acc = fmaxf(acc, finite ? a : 0.0f);
  bad |= !finite;
}

// x * scale, NaN where x is not finite. The reference's clamp to +-max is encode's: cvt.rn.satfinite writes +-max
// for every product beyond it, infinities included, and NaN for NaN, as clamp-then-convert does.
__device__ __forceinline__ float scaled(float x, float scale) {
  return fabsf(x) < INFINITY ? x * scale : __int_as_float(0x7fc00000);
}

// N float8 codes as one aligned store (N is 1, 2, 4 or 8: 16 bytes of x).
template <int N>
using Codes = std::conditional_t<N == 1, uint8_t,
                                 std::conditional_t<N == 2, uint16_t, std::conditional_t<N == 4, uint32_t, uint2>>>;

// Float8 codes of N scaled values, saturated and rounded to nearest even (cvt.rn.satfinite on sm_89+, two per
// instruction; NaN becomes 0x7F, what torch writes for the reference's NaN), packed as stored.
// NOTE (H200): built byte by byte into a uint8_t[N] (a shift, mask and byte permute per code), the block-per-row
// cast had 2.5x the instructions of dev/float8/cast_bench.cu's and took 71 us for 8192^2 bf16 against its 57; packed
// (and without the clamp), 56 us; the delayed cast 59 -> 53 us, the transposing tiles 76 -> 66 us.
template <bool kE4M3, int N>
__device__ __forceinline__ Codes<N> encode(const float (&p)[N]) {
  static_assert(N == 1 || N == 2 || N == 4 || N == 8, "16 bytes of x: 1, 2, 4 or 8 elements");
  constexpr __nv_fp8_interpretation_t kKind = Fp8<kE4M3>::kKind;
  if constexpr (N == 1) {
    return __nv_cvt_float_to_fp8(p[0], __NV_SATFINITE, kKind);
  } else {
    uint32_t pairs[N / 2];
#pragma unroll
    for (int e = 0; e < N; e += 2)
      pairs[e / 2] = __nv_cvt_float2_to_fp8x2(make_float2(p[e], p[e + 1]), __NV_SATFINITE, kKind);
    if constexpr (N == 2) return static_cast<uint16_t>(pairs[0]);
    if constexpr (N == 4) return pairs[0] | (pairs[1] << 16);
    if constexpr (N == 8) return make_uint2(pairs[0] | (pairs[1] << 16), pairs[2] | (pairs[3] << 16));
  }
}

// VEC elements of a row at element index `i` (a multiple of VEC) and column stride `stride` (1 when VEC > 1).
template <int VEC, typename T>
__device__ __forceinline__ Vec<T, VEC> load_vec(const T* row, int64_t i, int64_t stride) {
  if constexpr (VEC == 1) {
    return Vec<T, 1>{{row[i * stride]}};
  } else {
    return *reinterpret_cast<const Vec<T, VEC>*>(row + i);
  }
}

// A 16-byte vector of x read once by this kernel (the flat amax pass): through the read-only path, not kept in L1,
// L2 fetching the whole 256-byte sector group. Elsewhere (VEC 1, or before sm_80) a plain load.
// NOTE (H200, dev/float8/amax_bench.cu, 8192^2 bf16): with 8 loads in flight, 35.3 -> 34.8 us for the amax pass.
template <int VEC, typename T>
__device__ __forceinline__ Vec<T, VEC> load_once(const T* x, int64_t i) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (VEC * sizeof(T) == 16) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(x + i));
    Vec<T, VEC> r;
    static_assert(sizeof(r) == sizeof(v), "one 16-byte vector");
    memcpy(&r, &v, sizeof r);
    return r;
  }
#endif
  return load_vec<VEC>(x, i, 1);
}

template <int VEC>
__device__ __forceinline__ void store_codes(uint8_t* dst, Codes<VEC> c) {
  *reinterpret_cast<Codes<VEC>*>(dst) = c;
}

// The codes of one vector under one scale (and, with record, its amax into acc/bad).
template <bool kE4M3, int VEC, typename T>
__device__ __forceinline__ Codes<VEC> cast_vec(const Vec<T, VEC>& r, float scale, bool record, float& acc,
                                               bool& bad) {
  float p[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    const float v = static_cast<float>(r.v[e]);
    p[e] = scaled(v, scale);
    if (record) accumulate(v, acc, bad);
  }
  return encode<kE4M3>(p);
}

// Programmatic dependent launch (sm_90+): a cast launched as a dependent of its amax pass (launch_cast) starts
// as the pass's blocks retire instead of after its last one, and waits at wait_for_amax_pass() before it reads
// what the pass wrote; it may load x before (the pass does not write x, and the pass itself started only after
// x's producers finished). Both are no-ops in a kernel launched the ordinary way.
__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_amax_pass() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// The tensor's (finite amax, non-finite flag) from the amax pass's per-block partials, in every thread.
__device__ __forceinline__ void reduce_partials(const uint2* __restrict__ partials, int parts, float& amax,
                                                bool& bad) {
  __shared__ float s_amax;
  float acc = 0.0f;
  bool b = false;
#pragma unroll 4
  for (int p = threadIdx.x; p < parts; p += kThreads) {
    const uint2 v = partials[p];
    acc = fmaxf(acc, __uint_as_float(v.x));
    b |= v.y != 0;
  }
  block_reduce<true>(b, acc);  // b: in every thread; acc: in thread 0
  if (threadIdx.x == 0) s_amax = acc;
  __syncthreads();
  amax = s_amax;
  bad = b;
}

// The scale of a tensorwise cast; the leader (one thread of the launch) writes scale_inv, and for current scaling
// amax_out and found_inf. Every thread of the block calls it.
template <bool kE4M3>
__device__ __forceinline__ float tensor_scale(const CastState& s, bool leader) {
  if (s.scale != nullptr) {
    const float scale = *s.scale;
    if (leader) *s.scale_inv = __frcp_rn(scale);
    return scale;
  }
  float amax;
  bool bad;
  if (s.parts > 0) {
    reduce_partials(s.partials, s.parts, amax, bad);
  } else {
    amax = __uint_as_float(*s.scratch_amax);
    bad = *s.scratch_bad != 0;
  }
  const float scale = scale_of(amax, bad, Fp8<kE4M3>::kMax);
  if (leader) {
    *s.scale_inv = __frcp_rn(scale);
    if (s.amax_out != nullptr) *s.amax_out = recorded(*s.amax_out, amax, bad);
    if (s.found_inf != nullptr && bad) *s.found_inf = 1.0f;
  }
  return scale;
}

// A block's (acc, bad) into the tensorwise scratch. Every thread calls it.
__device__ __forceinline__ void reduce_into_scratch(float acc, bool bad, unsigned* scratch_amax, int* scratch_bad) {
  block_reduce<true>(bad, acc);
  if (threadIdx.x == 0) {
    atomicMax(scratch_amax, __float_as_uint(acc));
    if (bad) atomicOr(scratch_bad, 1);
  }
}

// Whether this block is the last of the launch to get here; its thread 0's scratch atomics come before the ticket.
__device__ __forceinline__ bool last_block(unsigned* ticket) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(ticket, 1u) == gridDim.x * gridDim.y - 1;
  }
  __syncthreads();
  if (last) __threadfence();
  return last;
}

// amax_out and found_inf from the complete tensorwise scratch (thread 0 of the last block).
__device__ __forceinline__ void finish_tensor(const CastState& s) {
  if (threadIdx.x != 0) return;
  const float amax = __uint_as_float(atomicOr(s.scratch_amax, 0u));  // atomic reads: the partials were atomics
  const bool bad = atomicOr(s.scratch_bad, 0) != 0;
  if (s.amax_out != nullptr) *s.amax_out = recorded(*s.amax_out, amax, bad);
  if (s.found_inf != nullptr && bad) *s.found_inf = 1.0f;
}

// The block's result goes to its own slot of `partials` (no zeroed scratch needed), or with atomics into the
// scratch where partials is null.
template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads)
    amax_flat_kernel(const T* __restrict__ x, int64_t n, unsigned* scratch_amax, int* scratch_bad,
                     uint2* partials) {
  allow_dependents();
  float acc = 0.0f;
  bool bad = false;
  const int64_t nvec = n / VEC;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  for (; i + (kAmaxLoadsInFlight - 1) * stride < nvec; i += kAmaxLoadsInFlight * stride) {
    Vec<T, VEC> r[kAmaxLoadsInFlight];
#pragma unroll
    for (int u = 0; u < kAmaxLoadsInFlight; ++u) r[u] = load_once<VEC>(x, (i + u * stride) * VEC);
#pragma unroll
    for (int u = 0; u < kAmaxLoadsInFlight; ++u)
#pragma unroll
      for (int e = 0; e < VEC; ++e) accumulate(static_cast<float>(r[u].v[e]), acc, bad);
  }
  for (; i < nvec; i += stride) {
    const Vec<T, VEC> r = load_vec<VEC>(x, i * VEC, 1);
#pragma unroll
    for (int e = 0; e < VEC; ++e) accumulate(static_cast<float>(r.v[e]), acc, bad);
  }
  for (int64_t e = nvec * VEC + int64_t(blockIdx.x) * kThreads + threadIdx.x; e < n; e += stride)
    accumulate(static_cast<float>(x[e]), acc, bad);
  if (partials == nullptr) {
    reduce_into_scratch(acc, bad, scratch_amax, scratch_bad);
    return;
  }
  block_reduce<true>(bad, acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = make_uint2(__float_as_uint(acc), bad ? 1u : 0u);
}

// Grid (column blocks of 32 * VEC, row strips of `rows_per_block`): each warp reads whole 32-vector row segments
// (coalesced), the 8 warps of a block take every 8th row of the strip. The column blocks go on x, which takes up to
// 2^31 - 1 blocks: K past 65535 * 32 * VEC (a strided row of 2.1M elements) would not fit on y.
template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads)
    amax_columns_kernel(const T* __restrict__ x, int64_t M, int64_t K, int64_t stride_m, int64_t stride_k,
                        int64_t rows_per_block, unsigned* scratch_amax, int* scratch_bad, bool per_column) {
  allow_dependents();
  constexpr int kWarps = kThreads / 32;
  __shared__ float s_acc[kWarps][32 * VEC];
  __shared__ int s_bad[kWarps][32 * VEC];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t c0 = (int64_t(blockIdx.x) * 32 + lane) * VEC;
  const int64_t strip_end = (int64_t(blockIdx.y) + 1) * rows_per_block;
  const int64_t m_end = strip_end < M ? strip_end : M;
  float acc[VEC];
  bool bad[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) acc[e] = 0.0f, bad[e] = false;
  if (c0 < K) {
#pragma unroll 4
    for (int64_t m = int64_t(blockIdx.y) * rows_per_block + warp; m < m_end; m += kWarps) {
      const Vec<T, VEC> r = load_vec<VEC>(x + m * stride_m, c0, stride_k);
#pragma unroll
      for (int e = 0; e < VEC; ++e) accumulate(static_cast<float>(r.v[e]), acc[e], bad[e]);
    }
  }
  if (!per_column) {
    float a = 0.0f;
    bool b = false;
#pragma unroll
    for (int e = 0; e < VEC; ++e) a = fmaxf(a, acc[e]), b |= bad[e];
    reduce_into_scratch(a, b, scratch_amax, scratch_bad);
    return;
  }
#pragma unroll
  for (int e = 0; e < VEC; ++e) s_acc[warp][lane * VEC + e] = acc[e], s_bad[warp][lane * VEC + e] = bad[e];
  __syncthreads();
  for (int c = threadIdx.x; c < 32 * VEC; c += kThreads) {
    const int64_t col = int64_t(blockIdx.x) * 32 * VEC + c;
    if (col >= K) continue;
    float a = 0.0f;
    int b = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) a = fmaxf(a, s_acc[w][c]), b |= s_bad[w][c];
    atomicMax(scratch_amax + col, __float_as_uint(a));
    if (b) atomicOr(scratch_bad + col, 1);
  }
}

// The vectors from the last (memory the amax pass read last), kLoadsInFlight at a time, the next ones loaded as
// soon as these are stored. The first are loaded before wait_for_amax_pass(): the pass does not write x, and a
// dependent launch's blocks then have loads in flight while the pass's last blocks finish.
// NOTE (H200, dev/float8/amax_bench.cu, 8192^2 bf16): loading before the wait takes the bf16 kernel from 40 to 62
// registers (6 blocks per SM to 4) and still saves 1.6 us of the 82 us current cast.
template <typename T, int VEC, bool kE4M3>
__global__ void __launch_bounds__(kThreads)
    cast_flat_kernel(const T* __restrict__ x, uint8_t* __restrict__ out, int64_t n, CastState s) {
  const int64_t nvec = n / VEC;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  const int64_t first = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  int64_t i = first;
  Vec<T, VEC> r[kLoadsInFlight];
  bool more = i + (kLoadsInFlight - 1) * stride < nvec;
  if (more) {
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) r[u] = load_vec<VEC>(x, (nvec - 1 - (i + u * stride)) * VEC, 1);
  }
  wait_for_amax_pass();
  const float scale = tensor_scale<kE4M3>(s, blockIdx.x == 0 && threadIdx.x == 0);
  const bool record = s.record;
  float acc = 0.0f;
  bool bad = false;
  // The tail past the last whole vector.
  for (int64_t e = nvec * VEC + first; e < n; e += stride) {
    out[e] = cast_vec<kE4M3, 1>(Vec<T, 1>{{x[e]}}, scale, record, acc, bad);
  }
  while (more) {
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      store_codes<VEC>(out + (nvec - 1 - (i + u * stride)) * VEC, cast_vec<kE4M3>(r[u], scale, record, acc, bad));
    }
    i += kLoadsInFlight * stride;
    more = i + (kLoadsInFlight - 1) * stride < nvec;
    if (more) {
#pragma unroll
      for (int u = 0; u < kLoadsInFlight; ++u) r[u] = load_vec<VEC>(x, (nvec - 1 - (i + u * stride)) * VEC, 1);
    }
  }
  for (; i < nvec; i += stride) {
    const Vec<T, VEC> r = load_vec<VEC>(x, (nvec - 1 - i) * VEC, 1);
    store_codes<VEC>(out + (nvec - 1 - i) * VEC, cast_vec<kE4M3>(r, scale, record, acc, bad));
  }
  if (!record) return;
  reduce_into_scratch(acc, bad, s.scratch_amax, s.scratch_bad);
  if (last_block(s.ticket)) finish_tensor(s);
}

// Warp-wide (max |x| over finite values, non-finite flag), in every lane.
__device__ __forceinline__ void warp_reduce(float& acc, bool& bad) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) acc = fmaxf(acc, __shfl_xor_sync(0xffffffffu, acc, offset));
  bad = __any_sync(0xffffffffu, bad);
}

// The same over the kLanes threads of a row (a warp, or the whole block), in every one of them.
template <int kLanes>
__device__ __forceinline__ void row_reduce(float& acc, bool& bad) {
  warp_reduce(acc, bad);
  if constexpr (kLanes > 32) {
    static_assert(kLanes == kThreads, "a row is a warp or the whole block");
    constexpr int kWarps = kThreads / 32;
    __shared__ float s_acc[kWarps];
    __shared__ bool s_bad[kWarps];
    if (threadIdx.x % 32 == 0) s_acc[threadIdx.x / 32] = acc, s_bad[threadIdx.x / 32] = bad;
    __syncthreads();
    acc = s_acc[0];
    bad = s_bad[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) acc = fmaxf(acc, s_acc[w]), bad |= s_bad[w];
    __syncthreads();  // the next row writes s_acc only after every thread has read it
  }
}

// kLanes threads per row: a warp (kLanes 32; grid-stride over rows, 8 rows in flight per block, shuffles only) for
// rows of up to 32 * kWarpRowVecs vectors, the whole block (kLanes 256, one row per block) for longer ones. Current
// scaling takes the row's amax (from registers, or a first read for rows longer than kLanes * vectors-per-lane),
// delayed scaling the row's given scale (recording the row's amax as it casts); then the codes.
// NOTE (H200): one block per row looping over rows, 98 registers (2 blocks per SM), ran 16384 x 2048 bf16 at 0.8 TB/s
// (each row's load latency exposed); a warp per row ran it at 2.2 TB/s, but 8192-wide rows at 1.7 TB/s (read twice).
// A block per row held in registers is bound to 48 registers, 5 blocks per SM (80 KB of loads in flight per SM; a
// few bytes spill): at 69 registers, 3 per SM, it took 79.5 us for 8192^2 bf16; at 5 per SM, 71 us.
// VEC > 1 needs stride_k == 1 and K % VEC == 0.
template <typename T, int VEC, bool kE4M3, int kLanes, bool kInRegisters>
__global__ void __launch_bounds__(kThreads, kLanes == 32 ? 3 : (kInRegisters ? 5 : 4))
    cast_rows_kernel(const T* __restrict__ x, uint8_t* __restrict__ out, int64_t M, int64_t K, int64_t stride_m,
                     int64_t stride_k, CastState s) {
  constexpr int kRowVecs = kLanes == 32 ? kWarpRowVecs : kBlockRowVecs;
  constexpr int kRowsPerBlock = kThreads / kLanes;
  const int lane = threadIdx.x % kLanes;
  const int64_t nvec = K / VEC;
  const bool current = s.scale == nullptr;
  const bool record = s.record;  // delayed only
  const int64_t stride_rows = int64_t(gridDim.x) * kRowsPerBlock;
  for (int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kLanes; row < M; row += stride_rows) {
    const T* xr = x + row * stride_m;
    uint8_t* outr = out + row * K;
    float acc = 0.0f;
    bool bad = false;
    Vec<T, VEC> r[kRowVecs];
    if constexpr (kInRegisters) {
#pragma unroll
      for (int j = 0; j < kRowVecs; ++j) {
        const int64_t v = lane + int64_t(j) * kLanes;
        if (v < nvec) r[j] = load_vec<VEC>(xr, v * VEC, stride_k);
      }
    }
    float scale;
    if (current) {
      if constexpr (kInRegisters) {
#pragma unroll
        for (int j = 0; j < kRowVecs; ++j)
          if (lane + int64_t(j) * kLanes < nvec)
#pragma unroll
            for (int e = 0; e < VEC; ++e) accumulate(static_cast<float>(r[j].v[e]), acc, bad);
      } else {
        for (int64_t v0 = lane; v0 < nvec; v0 += kLanes * kRowVecs) {  // kRowVecs loads in flight per lane
#pragma unroll
          for (int j = 0; j < kRowVecs; ++j)
            if (v0 + j * kLanes < nvec) r[j] = load_vec<VEC>(xr, (v0 + j * kLanes) * VEC, stride_k);
#pragma unroll
          for (int j = 0; j < kRowVecs; ++j)
            if (v0 + j * kLanes < nvec)
#pragma unroll
              for (int e = 0; e < VEC; ++e) accumulate(static_cast<float>(r[j].v[e]), acc, bad);
        }
      }
      row_reduce<kLanes>(acc, bad);
      scale = scale_of(acc, bad, Fp8<kE4M3>::kMax);
    } else {
      scale = s.scale[row];
    }
    const float amax = acc;
    const bool row_bad = bad;
    if constexpr (kInRegisters) {
#pragma unroll
      for (int j = 0; j < kRowVecs; ++j) {
        const int64_t v = lane + int64_t(j) * kLanes;
        if (v < nvec) {
          store_codes<VEC>(outr + v * VEC, cast_vec<kE4M3>(r[j], scale, record, acc, bad));
        }
      }
    } else {
      for (int64_t v0 = lane; v0 < nvec; v0 += kLanes * kRowVecs) {  // current: the second read mostly hits L2
#pragma unroll
        for (int j = 0; j < kRowVecs; ++j)
          if (v0 + j * kLanes < nvec) r[j] = load_vec<VEC>(xr, (v0 + j * kLanes) * VEC, stride_k);
#pragma unroll
        for (int j = 0; j < kRowVecs; ++j) {
          if (v0 + j * kLanes < nvec) {
            store_codes<VEC>(outr + (v0 + j * kLanes) * VEC, cast_vec<kE4M3>(r[j], scale, record, acc, bad));
          }
        }
      }
    }
    if (record) row_reduce<kLanes>(acc, bad);
    if (lane == 0) {
      s.scale_inv[row] = __frcp_rn(scale);
      if (current || record) {
        const float a = current ? amax : acc;
        const bool b = current ? row_bad : bad;
        if (s.amax_out != nullptr) s.amax_out[row] = recorded(s.amax_out[row], a, b);
        if (s.found_inf != nullptr && b) *s.found_inf = 1.0f;
      }
    }
  }
}

// One 128 x 128 tile of x per block, in the reverse of memory order (the amax pass's last reads are still in L2):
// codes written as [M, K] (write_data) straight from registers and as [K, M] (write_t) through shared memory.
// The scale is per tensor, or per column of x (per_column: the rowwise cast of x.T). VEC > 1 needs stride_k == 1,
// K % VEC == 0 and 16-byte aligned rows.
// NOTE (H200): at 96 registers (2 blocks per SM) the bf16 pair of 8192 x 8192 ran at 2.1 TB/s; a bound of 3
// blocks per SM keeps more tiles' loads in flight (at 4, 64 registers, it spilled). Loading 4 of a thread's 8
// vectors at a time (48 KB per SM in flight), the transposing tiles of 8192^2 bf16 took 66 us, where
// dev/float8/cast_bench.cu's tile, loading all 8 first, took 54: the tensorwise kernels now load 8.
// kPerColumn and kRecord (s.record) are template parameters: the tensorwise kernels keep one scale and one amax
// instead of VEC of each, which leaves them the registers to load a whole tile at once.
template <typename T, int VEC, bool kE4M3, bool kPerColumn, bool kRecord>
__global__ void __launch_bounds__(kThreads, 3)
    cast_tiles_kernel(const T* __restrict__ x, uint8_t* __restrict__ out, uint8_t* __restrict__ out_t, int64_t M,
                      int64_t K, int64_t stride_m, int64_t stride_k, CastState s, bool write_data, bool write_t) {
  constexpr int kVecsPerRow = kTileK / VEC;
  constexpr int kVecsPerThread = kTileM * kVecsPerRow / kThreads;
  static_assert(kThreads % kVecsPerRow == 0, "a thread keeps its columns across the rows of a tile");
  __shared__ __align__(16) uint8_t codes[kTileM][kTileK];
  __shared__ float s_scale[kTileK];
  __shared__ unsigned s_colmax[kTileK];
  __shared__ int s_colbad[kTileK];
  const int64_t tiles_k = (K + kTileK - 1) / kTileK;
  const int64_t tile = int64_t(gridDim.x) - 1 - blockIdx.x;
  const int64_t m0 = (tile / tiles_k) * kTileM, k0 = (tile % tiles_k) * kTileK;
  constexpr bool record = kRecord;
  constexpr bool per_column = kPerColumn;
  const int cv = threadIdx.x % kVecsPerRow;  // this thread's columns: cv * VEC ... + VEC - 1 of the tile
  const int64_t k = k0 + int64_t(cv) * VEC;
  // This thread's rows of the tile: row0, row0 + kRowStep, ...; `rows` of them inside x.
  constexpr int kRowStep = kThreads / kVecsPerRow;
  const int row0 = threadIdx.x / kVecsPerRow;
  const int64_t rows = k < K ? (M - m0 - row0 + kRowStep - 1) / kRowStep : 0;
  const T* src = x + (m0 + row0) * stride_m;
  // Tensorwise: all 8 vectors of a bf16 tile loaded before the first is cast (128 bytes per thread in flight). Per
  // column, 8 spilled (VEC scales and amaxes per thread): 4. The first are loaded before the wait (see
  // wait_for_amax_pass).
  constexpr int kTileLoads = per_column ? kLoadsInFlight : 8;
  Vec<T, VEC> r[kTileLoads];
#pragma unroll
  for (int u = 0; u < kTileLoads; ++u) {
    if (u < rows) r[u] = load_vec<VEC>(src + int64_t(u) * kRowStep * stride_m, k, stride_k);
  }
  float scale = 1.0f;
  if (threadIdx.x < kTileK) s_colmax[threadIdx.x] = 0u, s_colbad[threadIdx.x] = 0;
  wait_for_amax_pass();
  if constexpr (per_column) {
    if (threadIdx.x < kTileK) {
      const int64_t k = k0 + threadIdx.x;
      float sc = 1.0f;
      if (k < K) {
        const bool leader = m0 == 0;  // the first row strip writes what is per column
        if (s.scale != nullptr) {
          sc = s.scale[k];
        } else {
          const float amax = __uint_as_float(s.scratch_amax[k]);
          const bool bad = s.scratch_bad[k] != 0;
          sc = scale_of(amax, bad, Fp8<kE4M3>::kMax);
          if (leader && s.amax_out != nullptr) s.amax_out[k] = recorded(s.amax_out[k], amax, bad);
          if (leader && s.found_inf != nullptr && bad) *s.found_inf = 1.0f;
        }
        if (leader) s.scale_inv[k] = __frcp_rn(sc);
      }
      s_scale[threadIdx.x] = sc;
    }
  } else {
    scale = tensor_scale<kE4M3>(s, tile == 0 && threadIdx.x == 0);
  }
  __syncthreads();

  // Per column: VEC scales and amaxes per thread; tensorwise: one of each (index 0).
  constexpr int kColumns = per_column ? VEC : 1;
  float col_scale[kColumns];
#pragma unroll
  for (int e = 0; e < kColumns; ++e) col_scale[e] = per_column ? s_scale[cv * VEC + e] : scale;
  float acc[kColumns];
  bool bad[kColumns];
#pragma unroll
  for (int e = 0; e < kColumns; ++e) acc[e] = 0.0f, bad[e] = false;
  uint8_t* dst_rows = write_data ? out + (m0 + row0) * K + k : nullptr;
#pragma unroll
  for (int i0 = 0; i0 < kVecsPerThread; i0 += kTileLoads) {
    if (i0 > 0) {
#pragma unroll
      for (int u = 0; u < kTileLoads; ++u) {
        if (i0 + u < rows) r[u] = load_vec<VEC>(src + int64_t(i0 + u) * kRowStep * stride_m, k, stride_k);
      }
    }
#pragma unroll
    for (int u = 0; u < kTileLoads; ++u) {
      if (i0 + u >= rows) continue;
      const int row = row0 + (i0 + u) * kRowStep;
      float p[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float v = static_cast<float>(r[u].v[e]);
        p[e] = scaled(v, col_scale[per_column ? e : 0]);
        if (record) accumulate(v, acc[per_column ? e : 0], bad[per_column ? e : 0]);
      }
      const Codes<VEC> c = encode<kE4M3>(p);
      if (write_data) store_codes<VEC>(dst_rows + int64_t(i0 + u) * kRowStep * K, c);
      if (write_t) store_codes<VEC>(&codes[row][swizzled(row, cv * VEC)], c);
    }
  }
  if (write_t) {
    __syncthreads();
    // Each thread writes 16 codes (one run) of 4 adjacent x.T rows: it reads 16 words of 4 codes (LDS.32) and
    // transposes them as 4 x 4 byte blocks in registers. 8 threads write one whole 128-byte line of a row, a warp
    // 4 lines per store.
    // NOTE (H200): one byte per shared-memory read (64 LDS.U8 per thread) ran the bf16 transpose of 8192 x 8192 at
    // 2.0 TB/s.
    static_assert(kTileK / 4 * kRunsPerRow == kThreads, "one thread per (4 columns, run)");
    const int run = threadIdx.x % kRunsPerRow;
    const int kk = (threadIdx.x / kRunsPerRow) * 4;
    const int64_t kt = k0 + kk, mt = m0 + int64_t(run) * kTransposedRun;
    if (kt < K && mt < M) {
      uint32_t o[4][4];  // [column j][rows 4q .. 4q + 3 of the run]
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        uint32_t w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int row = run * kTransposedRun + q * 4 + i;
          w[i] = *reinterpret_cast<const uint32_t*>(&codes[row][swizzled(row, kk)]);
        }
        const uint32_t t0 = __byte_perm(w[0], w[1], 0x5140), t1 = __byte_perm(w[0], w[1], 0x7362);
        const uint32_t t2 = __byte_perm(w[2], w[3], 0x5140), t3 = __byte_perm(w[2], w[3], 0x7362);
        o[0][q] = __byte_perm(t0, t2, 0x5410);
        o[1][q] = __byte_perm(t0, t2, 0x7632);
        o[2][q] = __byte_perm(t1, t3, 0x5410);
        o[3][q] = __byte_perm(t1, t3, 0x7632);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (kt + j >= K) break;
        uint8_t* dst = out_t + (kt + j) * M + mt;
        if (M % kTransposedRun == 0) {
          *reinterpret_cast<uint4*>(dst) = make_uint4(o[j][0], o[j][1], o[j][2], o[j][3]);
        } else {
#pragma unroll
          for (int e = 0; e < kTransposedRun; ++e)  // unrolled: o stays in registers
            if (mt + e < M) dst[e] = (o[j][e / 4] >> (8 * (e % 4))) & 0xffu;
        }
      }
    }
  }
  if constexpr (!record) return;
  if constexpr (per_column) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      atomicMax(&s_colmax[cv * VEC + e], __float_as_uint(acc[e]));
      if (bad[e]) atomicOr(&s_colbad[cv * VEC + e], 1);
    }
    __syncthreads();
    if (threadIdx.x < kTileK && k0 + threadIdx.x < K) {
      atomicMax(s.scratch_amax + k0 + threadIdx.x, s_colmax[threadIdx.x]);
      if (s_colbad[threadIdx.x]) atomicOr(s.scratch_bad + k0 + threadIdx.x, 1);
    }
    if (!last_block(s.ticket)) return;
    bool any_bad = false;
    for (int64_t c = threadIdx.x; c < K; c += kThreads) {
      const float amax = __uint_as_float(atomicOr(s.scratch_amax + c, 0u));
      const bool col_bad = atomicOr(s.scratch_bad + c, 0) != 0;
      if (s.amax_out != nullptr) s.amax_out[c] = recorded(s.amax_out[c], amax, col_bad);
      any_bad |= col_bad;
    }
    any_bad = __syncthreads_or(any_bad);
    if (threadIdx.x == 0 && any_bad && s.found_inf != nullptr) *s.found_inf = 1.0f;
  } else {
    reduce_into_scratch(acc[0], bad[0], s.scratch_amax, s.scratch_bad);
    if (last_block(s.ticket)) finish_tensor(s);
  }
}

// Elements per 16-byte access of x's rows, or 1 where the strides or the alignment forbid it.
template <typename T>
int row_vector_width(const at::Tensor& x) {
  constexpr int kVec = 16 / sizeof(T);
  const int64_t M = x.size(0), K = x.size(1);
  const bool aligned = reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
  const bool rows_aligned = M == 1 || x.stride(0) % kVec == 0;
  return aligned && rows_aligned && (K == 1 || x.stride(1) == 1) && K % kVec == 0 ? kVec : 1;
}

// Blocks of kKernel resident at kThreads threads on `sms` SMs: a grid-stride kernel's grid, one wave. Cached per
// kernel (the query costs host time on every cast; a process runs one architecture).
// NOTE (H200): sized as 2048 / kThreads = 8 blocks per SM, the flat cast (40 registers: 6 fit) and the warp-per-row
// cast (80 registers: 3 fit) ran a second, partial wave; one wave took the rowwise cast of 16384 x 2048 bf16 from
// 43.8 to 37.6 us.
template <auto kKernel>
int64_t resident_blocks(int64_t sms) {
  static std::atomic<int> per_sm{0};
  int n = per_sm.load(std::memory_order_relaxed);
  if (n == 0) {
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kKernel, kThreads, 0));
    n = std::max(n, 1);
    per_sm.store(n, std::memory_order_relaxed);
  }
  return sms * n;
}

// A cast kernel's launch; `dependent` (after an amax pass, on sm_90+): as the pass's programmatic dependent, which
// waits at wait_for_amax_pass().
template <typename... Params, typename... Args>
void launch_cast(void (*kernel)(Params...), int64_t blocks, bool dependent, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(kThreads);
  config.stream = stream;
  cudaLaunchAttribute programmatic[1];
  programmatic[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  programmatic[0].val.programmaticStreamSerializationAllowed = 1;
  if (dependent) {
    config.attrs = programmatic;
    config.numAttrs = 1;
  }
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

template <typename T, bool kE4M3, int VEC>
void launch(const at::Tensor& x, const Float8CastArgs& a, at::Tensor& data, at::Tensor& data_t, CastState s,
            bool current_amax_pass, int64_t sms, bool programmatic, cudaStream_t stream) {
  const T* xp = x.data_ptr<T>();
  const int64_t M = x.size(0), K = x.size(1), n = x.numel();
  const int64_t stride_m = x.stride(0), stride_k = x.stride(1);
  const bool per_column = a.per_row && a.write_t;
  const bool flat = x.is_contiguous();
  constexpr int kFlatVec = 16 / sizeof(T);
  const bool flat_aligned = reinterpret_cast<uintptr_t>(xp) % 16 == 0;
  uint8_t* out = a.write_data ? reinterpret_cast<uint8_t*>(data.data_ptr()) : nullptr;
  uint8_t* out_t = a.write_t ? reinterpret_cast<uint8_t*>(data_t.data_ptr()) : nullptr;
  // The cast after this call's amax pass starts as the pass's blocks retire (see wait_for_amax_pass).
  const bool dependent = current_amax_pass && programmatic;
  // Blocks of a flat grid-stride kernel: one per kThreads vectors, at most one wave.
  const auto flat_blocks = [&](int64_t resident) {
    return std::max<int64_t>(1, std::min((n / kFlatVec + kThreads - 1) / kThreads, resident));
  };

  if (a.per_row && !a.write_t) {
    if (K / VEC <= 32 * kWarpRowVecs) {
      constexpr auto kernel = cast_rows_kernel<T, VEC, kE4M3, 32, true>;
      const int64_t blocks = std::min((M + kThreads / 32 - 1) / (kThreads / 32), resident_blocks<kernel>(sms));
      kernel<<<blocks, kThreads, 0, stream>>>(xp, out, M, K, stride_m, stride_k, s);
    } else {
      const int64_t blocks = std::min<int64_t>(M, std::numeric_limits<int32_t>::max());
      if (K / VEC <= kThreads * kBlockRowVecs)
        cast_rows_kernel<T, VEC, kE4M3, kThreads, true>
            <<<blocks, kThreads, 0, stream>>>(xp, out, M, K, stride_m, stride_k, s);
      else
        cast_rows_kernel<T, VEC, kE4M3, kThreads, false>
            <<<blocks, kThreads, 0, stream>>>(xp, out, M, K, stride_m, stride_k, s);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  if (current_amax_pass) {
    if (flat && !per_column) {
      // With s.partials, one partial per block: the cast reduces s.parts of them.
      int64_t blocks;
      if (flat_aligned) {
        constexpr auto kernel = amax_flat_kernel<T, kFlatVec>;
        blocks = flat_blocks(resident_blocks<kernel>(sms));
        kernel<<<blocks, kThreads, 0, stream>>>(xp, n, s.scratch_amax, s.scratch_bad, s.partials);
      } else {
        constexpr auto kernel = amax_flat_kernel<T, 1>;
        blocks = flat_blocks(resident_blocks<kernel>(sms));
        kernel<<<blocks, kThreads, 0, stream>>>(xp, n, s.scratch_amax, s.scratch_bad, s.partials);
      }
      TORCH_INTERNAL_ASSERT(blocks <= sms * kMaxResidentBlocks);
      if (s.partials != nullptr) s.parts = static_cast<int>(blocks);
    } else {
      constexpr auto kernel = amax_columns_kernel<T, VEC>;
      const int64_t column_blocks = (K + 32 * VEC - 1) / (32 * VEC);
      const int64_t strips = std::max<int64_t>(1, std::min(M, resident_blocks<kernel>(sms) / column_blocks));
      const int64_t rows_per_block = (M + strips - 1) / strips;
      const dim3 grid(static_cast<unsigned>(column_blocks),  // strips <= resident blocks: y's 65535 is ample
                      static_cast<unsigned>((M + rows_per_block - 1) / rows_per_block));
      kernel<<<grid, kThreads, 0, stream>>>(xp, M, K, stride_m, stride_k, rows_per_block, s.scratch_amax,
                                            s.scratch_bad, per_column);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (!a.write_t && flat) {
    if (flat_aligned) {
      constexpr auto kernel = cast_flat_kernel<T, kFlatVec, kE4M3>;
      launch_cast(kernel, flat_blocks(resident_blocks<kernel>(sms)), dependent, stream, xp, out, n, s);
    } else {
      constexpr auto kernel = cast_flat_kernel<T, 1, kE4M3>;
      launch_cast(kernel, flat_blocks(resident_blocks<kernel>(sms)), dependent, stream, xp, out, n, s);
    }
  } else {
    const int64_t tiles = ((M + kTileM - 1) / kTileM) * ((K + kTileK - 1) / kTileK);
    TORCH_CHECK(tiles <= std::numeric_limits<int32_t>::max(), "ampkernels: to_float8_native: x is too large (",
                M, " x ", K, ")");
    const auto kernel = per_column ? (s.record ? cast_tiles_kernel<T, VEC, kE4M3, true, true>
                                               : cast_tiles_kernel<T, VEC, kE4M3, true, false>)
                                   : (s.record ? cast_tiles_kernel<T, VEC, kE4M3, false, true>
                                               : cast_tiles_kernel<T, VEC, kE4M3, false, false>);
    launch_cast(kernel, tiles, dependent, stream, xp, out, out_t, M, K, stride_m, stride_k, s, a.write_data,
                a.write_t);
  }
}

}  // namespace
}  // namespace cuda

std::tuple<at::Tensor, at::Tensor, at::Tensor> float8_cast_cuda(const Float8CastArgs& a) {
  const at::Tensor& x = a.x;
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t M = x.size(0), K = x.size(1);
  const at::TensorOptions f32 = x.options().dtype(at::kFloat);
  const at::TensorOptions fp8 = x.options().dtype(a.dtype);
  at::Tensor data = a.write_data ? at::empty({M, K}, fp8) : at::empty({0}, fp8);
  at::Tensor data_t = a.write_t ? at::empty({K, M}, fp8) : at::empty({0}, fp8);
  const int64_t rows = a.write_t ? K : M;
  at::Tensor scale_inv = a.per_row ? at::empty({rows, 1}, f32) : at::empty({}, f32);

  const bool current = !a.scale.has_value();
  const bool record = !current && (a.amax_out.has_value() || a.found_inf.has_value());
  const bool rows_kernel = a.per_row && !a.write_t;
  const bool amax_pass = current && !rows_kernel && !a.amax_scratch.has_value();
  // A flat tensorwise cast's amax pass leaves one partial per block: no zeroed scratch, so no memset launch.
  const bool flat_partials = amax_pass && !a.per_row && !a.write_t && x.is_contiguous();
  int sms = 0, major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, x.device().index()));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, x.device().index()));
  const bool programmatic = major >= 9;  // programmatic dependent launch: sm_90+
  const int64_t columns = a.per_row ? K : 1;
  at::Tensor scratch;
  if (a.amax_scratch.has_value()) {
    scratch = *a.amax_scratch;  // the amax a producer kernel reduced: no amax pass
  } else if (flat_partials) {
    scratch = at::empty({2 * sms * cuda::kMaxResidentBlocks}, x.options().dtype(at::kInt));
  } else if (!rows_kernel && (current || record)) {
    // NOTE: a memset, not at::zeros: one driver call instead of a TensorIterator fill (host time per cast).
    scratch = at::empty({2 * columns + 1}, x.options().dtype(at::kInt));
    C10_CUDA_CHECK(cudaMemsetAsync(scratch.data_ptr(), 0, scratch.nbytes(), stream));
  }
  cuda::CastState s{};
  s.scale = current ? nullptr : a.scale->data_ptr<float>();
  s.scale_inv = scale_inv.data_ptr<float>();
  if (flat_partials) {
    s.partials = reinterpret_cast<uint2*>(scratch.data_ptr<int>());
  } else if (scratch.defined()) {
    int* base = scratch.data_ptr<int>();
    s.scratch_amax = reinterpret_cast<unsigned*>(base);
    s.scratch_bad = base + columns;
    s.ticket = reinterpret_cast<unsigned*>(base + 2 * columns);
  }
  s.amax_out = a.amax_out.has_value() ? a.amax_out->data_ptr<float>() : nullptr;
  s.found_inf = a.found_inf.has_value() ? a.found_inf->data_ptr<float>() : nullptr;
  s.record = record;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "to_float8_native", [&] {
    const bool vectorized = cuda::row_vector_width<scalar_t>(x) > 1;
    constexpr int kVec = 16 / sizeof(scalar_t);
    if (a.dtype == at::kFloat8_e4m3fn) {
      if (vectorized)
        cuda::launch<scalar_t, true, kVec>(x, a, data, data_t, s, amax_pass, sms, programmatic, stream);
      else
        cuda::launch<scalar_t, true, 1>(x, a, data, data_t, s, amax_pass, sms, programmatic, stream);
    } else {
      if (vectorized)
        cuda::launch<scalar_t, false, kVec>(x, a, data, data_t, s, amax_pass, sms, programmatic, stream);
      else
        cuda::launch<scalar_t, false, 1>(x, a, data, data_t, s, amax_pass, sms, programmatic, stream);
    }
  });
  return {data, data_t, scale_inv};
}

}  // namespace ampkernels
