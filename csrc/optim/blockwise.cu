// The blockwise Adam step on CUDA (blockwise.h): a one-thread-per-tensor prologue (step counts, bias corrections,
// rounding keys), then one pass in which each warp owns a contiguous range of 128-element blocks and, per block,
// reads the gradient once, reads and writes the parameter and its moments once (decoding and encoding codes in
// registers: a max over the block's lanes gives its new exponent). A group of 8 lanes holds a block, lane l of a
// group its elements 16l..16l+15, so accesses are contiguous and 16 bytes wide on the aligned path. Both kernels
// return at once when found_inf is non-zero: a skipped step writes nothing.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <type_traits>

#include "common/vector_access.cuh"
#include "optim/blockwise.h"

namespace ampkernels {
namespace cuda {
namespace {

constexpr int kWarps = 8;  // per CTA
// NOTE: 16 elements per lane, so a group of 8 lanes holds a block and a warp 4 blocks at a time: a lane has 4
// 16-byte loads of float32 parameters and as many of gradients in flight. With 4 per lane (a warp per block)
// the kernel needed 70-80 registers for 10 B of loads in flight per element and reached 26-36% of copy bandwidth.
constexpr int kPerLane = 16;
constexpr int kGroup = kQuantBlock / kPerLane;  // lanes per block
constexpr int kBlocksPerWarp = 32 / kGroup;

struct Args {
  const int64_t* meta;
  int64_t num_tensors, num_blocks;
  float4* scalars;
  const float* grad_scale;
  const float* found_inf;
  const float* lr_ptr;
  double lr;
  AdamCoefficients adam;
  uint64_t seed;
  bool stochastic_rounding;
};

__device__ __forceinline__ bool skipped(const float* found_inf) { return found_inf != nullptr && *found_inf != 0.f; }

__device__ __forceinline__ double read_lr(const Args& a) {
  return a.lr_ptr != nullptr ? static_cast<double>(*a.lr_ptr) : a.lr;
}

__global__ void prologue_kernel(Args a) {
  if (skipped(a.found_inf)) return;
  const double lr = read_lr(a);
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < a.num_tensors;
       t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t* m = a.meta + t * kMetaCount;
    float* step = reinterpret_cast<float*>(m[kMetaStep]);
    const float s = *step + 1.f;
    *step = s;
    float step_size, bc2_sqrt;
    adam_step_constants(lr, a.adam.beta1, a.adam.beta2, s, &step_size, &bc2_sqrt);
    const uint32_t key = a.stochastic_rounding ? rounding_key(a.seed, m[kMetaSalt], s) : 0u;
    a.scalars[t] = make_float4(step_size, bc2_sqrt, __uint_as_float(key), 0.f);
  }
}

// One tensor's description, re-read when a warp's range crosses into the next tensor.
struct Tensor {
  int64_t first_block, end_block, cols, blocks_per_row, offset;
  int fmt_m, fmt_v;
  bool aligned;
  void *p, *m, *v, *vmax;
  const void* g;
  uint8_t *m_scale, *v_scale;
  float* master;
  float4 sc;
};

__device__ __forceinline__ Tensor read_tensor(const Args& a, int64_t t) {
  const int64_t* m = a.meta + t * kMetaCount;
  Tensor x;
  x.first_block = m[kMetaFirstBlock];
  x.end_block = m[kMetaCount + kMetaFirstBlock];
  x.cols = m[kMetaCols];
  x.blocks_per_row = (x.cols + kQuantBlock - 1) / kQuantBlock;
  x.offset = m[kMetaOffset];
  const int64_t formats = m[kMetaFormats];
  x.fmt_m = static_cast<int>(formats & 0xFF);
  x.fmt_v = static_cast<int>((formats >> 8) & 0xFF);
  x.aligned = ((formats >> 16) & 1) != 0;
  x.p = reinterpret_cast<void*>(m[kMetaParam]);
  x.g = reinterpret_cast<const void*>(m[kMetaGrad]);
  x.m = reinterpret_cast<void*>(m[kMetaExpAvg]);
  x.m_scale = reinterpret_cast<uint8_t*>(m[kMetaExpAvgScale]);
  x.v = reinterpret_cast<void*>(m[kMetaExpAvgSq]);
  x.v_scale = reinterpret_cast<uint8_t*>(m[kMetaExpAvgSqScale]);
  x.vmax = reinterpret_cast<void*>(m[kMetaMaxExpAvgSq]);
  x.master = reinterpret_cast<float*>(m[kMetaMaster]);
  x.sc = a.scalars[t];
  return x;
}

// kPerLane values of an array of T converted to float32, 16 bytes per access when `full` (else element-wise, the
// first n only).
template <typename T>
__device__ __forceinline__ void load_values(float (&dst)[kPerLane], const T* base, int64_t i, int n, bool full) {
  constexpr int kVec = 16 / sizeof(T) < kPerLane ? 16 / sizeof(T) : kPerLane;
  if (full) {
#pragma unroll
    for (int j = 0; j < kPerLane; j += kVec) {
      const Vec<T, kVec> r = *reinterpret_cast<const Vec<T, kVec>*>(base + i + j);
#pragma unroll
      for (int k = 0; k < kVec; ++k) dst[j + k] = static_cast<float>(r.v[k]);
    }
  } else {
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) dst[k] = k < n ? static_cast<float>(base[i + k]) : 0.f;
  }
}

template <typename T>
__device__ __forceinline__ void store_values(T* base, int64_t i, const float (&src)[kPerLane], int n, bool full) {
  constexpr int kVec = 16 / sizeof(T) < kPerLane ? 16 / sizeof(T) : kPerLane;
  if (full) {
#pragma unroll
    for (int j = 0; j < kPerLane; j += kVec) {
      Vec<T, kVec> r;
#pragma unroll
      for (int k = 0; k < kVec; ++k) r.v[k] = static_cast<T>(src[j + k]);
      *reinterpret_cast<Vec<T, kVec>*>(base + i + j) = r;
    }
  } else {
#pragma unroll
    for (int k = 0; k < kPerLane; ++k)
      if (k < n) base[i + k] = static_cast<T>(src[k]);
  }
}

// Where a lane's codes start: the byte of element `col` of row `row` (4-bit rows are ceil(cols / 2) bytes).
__device__ __forceinline__ int64_t code_byte(int fmt, int64_t row, int64_t cols, int64_t col) {
  return fmt == kQ4 ? row * ((cols + 1) / 2) + col / 2 : row * cols + col;
}

// A lane's codes: 16 bytes of 8-bit codes, or 8 bytes of 4-bit codes (element k in bits [k w, (k + 1) w) of the
// little-endian byte string).
struct Codes {
  uint32_t w[kPerLane / 4];
};

__device__ __forceinline__ uint32_t code_at(const Codes& c, int k, int width) {
  const int bit = k * width;
  return (c.w[bit / 32] >> (bit % 32)) & ((1u << width) - 1);
}

// Reads this lane's values of one moment (n valid of kPerLane, starting at element `col` of `row`). `lut`: the
// values of the codes (code_value) in shared memory, or null to compute them.
__device__ __forceinline__ void load_moment(float (&dst)[kPerLane], int fmt, bool second, void* base,
                                            const uint8_t* scales, int64_t row, int64_t cols, int64_t col,
                                            int64_t block, int64_t flat, int n, bool full, const float* lut) {
  if (fmt == kF32) return load_values(dst, static_cast<const float*>(base), flat, n, full);
  if (fmt == kBF16) return load_values(dst, static_cast<const at::BFloat16*>(base), flat, n, full);
  const Code c = code_of(fmt, second);
  const int width = fmt == kQ8 ? 8 : 4;
  const int bytes = kPerLane * width / 8;
  Codes codes{};
  int e = 0;
  if (n > 0) {
    e = scales[block];
    const uint8_t* src = static_cast<const uint8_t*>(base) + code_byte(fmt, row, cols, col);
    if (full) {
      if (fmt == kQ8) {
        const uint4 r = *reinterpret_cast<const uint4*>(src);
        codes.w[0] = r.x, codes.w[1] = r.y, codes.w[2] = r.z, codes.w[3] = r.w;
      } else {
        const uint2 r = *reinterpret_cast<const uint2*>(src);
        codes.w[0] = r.x, codes.w[1] = r.y;
      }
    } else {
      const int used = (n * width + 7) / 8;
#pragma unroll
      for (int k = 0; k < bytes; ++k)
        if (k < used) codes.w[k / 4] |= static_cast<uint32_t>(src[k]) << (8 * (k % 4));
    }
  }
  const float scale = pow2_biased(e);
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const uint32_t code = code_at(codes, k, width);
    dst[k] = k < n ? (lut != nullptr ? lut[code] : code_value(code, c)) * scale : 0.f;
  }
}

// Fills `lut` with the value of every code of the format (once per CTA, before the first use).
__device__ __forceinline__ void fill_lut(float* lut, int fmt, bool second) {
  const Code c = code_of(fmt, second);
  const int codes = 1 << (c.exp_bits + c.man_bits + (c.is_signed ? 1 : 0));
  for (int i = threadIdx.x; i < codes; i += blockDim.x) lut[i] = code_value(static_cast<uint32_t>(i), c);
}

// Encodes and writes one moment of the lane group's block: the group's kGroup lanes take part in the max that
// gives the block's exponent (all 32 lanes run the shuffles; a lane without elements contributes 0).
__device__ __forceinline__ void store_moment(int fmt, bool second, void* base, uint8_t* scales, int64_t row,
                                             int64_t cols, int64_t col, int64_t block, int64_t flat,
                                             const float (&src)[kPerLane], int n, bool full, bool leader) {
  if (fmt == kF32) return store_values(static_cast<float*>(base), flat, src, n, full);
  if (fmt == kBF16) return store_values(static_cast<at::BFloat16*>(base), flat, src, n, full);
  const Code c = code_of(fmt, second);
  float absmax = 0.f;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k)
    if (k < n) absmax = fmaxf(absmax, fabsf(src[k]));
#pragma unroll
  for (int delta = kGroup / 2; delta > 0; delta /= 2)
    absmax = fmaxf(absmax, __shfl_xor_sync(0xffffffffu, absmax, delta));
  const int e = block_exponent(absmax, c.man_bits);
  const float multiplier = pow2_biased(254 - e);
  if (leader) scales[block] = static_cast<uint8_t>(e);
  if (n == 0) return;
  const int width = fmt == kQ8 ? 8 : 4;
  Codes codes{};
#pragma unroll
  for (int k = 0; k < kPerLane; ++k)
    if (k < n) codes.w[k * width / 32] |= encode(src[k], multiplier, c) << (k * width % 32);
  uint8_t* dst = static_cast<uint8_t*>(base) + code_byte(fmt, row, cols, col);
  if (full) {
    if (fmt == kQ8)
      *reinterpret_cast<uint4*>(dst) = make_uint4(codes.w[0], codes.w[1], codes.w[2], codes.w[3]);
    else
      *reinterpret_cast<uint2*>(dst) = make_uint2(codes.w[0], codes.w[1]);
  } else {
    // Whole bytes: an odd row's last byte gets a zero high nibble.
    const int used = (n * width + 7) / 8;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k)
      if (k < used) dst[k] = static_cast<uint8_t>(codes.w[k / 4] >> (8 * (k % 4)));
  }
}

constexpr int kAnyFormat = -1;  // the formats are read per tensor (mixed formats in one launch)

// FM, FV: the moments' formats when every tensor of the launch has them (compiled for the common pairs: fewer
// registers, so more warps in flight), else kAnyFormat.
template <typename P, typename G, int FM, int FV>
__global__ void __launch_bounds__(kWarps * 32, 2) step_kernel(Args a) {
  if (skipped(a.found_inf)) return;
  const float inv_scale = a.grad_scale != nullptr ? static_cast<float>(1.0 / static_cast<double>(*a.grad_scale)) : 1.f;
  const double lr = read_lr(a);
  const float decay = static_cast<float>(1.0 - lr * a.adam.weight_decay);
  // Decoding a code is a shared-memory lookup and a product with the block's scale (NOTE: the arithmetic decode
  // costs ~10 integer and float instructions per element and moment, which a launch with 16 warps per SM cannot
  // hide behind its loads).
  constexpr bool kLutM = FM == kQ8 || FM == kQ4, kLutV = FV == kQ8 || FV == kQ4;
  __shared__ float lut_m[kLutM ? 256 : 1], lut_v[kLutV ? 256 : 1];
  if constexpr (kLutM) fill_lut(lut_m, FM, false);
  if constexpr (kLutV) fill_lut(lut_v, FV, true);
  if constexpr (kLutM || kLutV) __syncthreads();
  const int lane = threadIdx.x & 31;
  const int sub = lane / kGroup, in_group = lane % kGroup;  // which of the warp's blocks, where in it
  const int64_t warps = int64_t(gridDim.x) * kWarps;
  const int64_t warp = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  // A contiguous range of blocks per warp, kBlocksPerWarp at a time: the tensor changes rarely, and finding it is
  // one binary search.
  const int64_t per_warp = (a.num_blocks + warps - 1) / warps;
  const int64_t begin = warp * per_warp;
  const int64_t end = begin + per_warp < a.num_blocks ? begin + per_warp : a.num_blocks;
  if (begin >= end) return;
  int64_t lo = 0, hi = a.num_tensors - 1;  // the last tensor whose first block is <= this lane's first block
  const int64_t first = begin + sub < end ? begin + sub : begin;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (a.meta[mid * kMetaCount + kMetaFirstBlock] <= first)
      lo = mid;
    else
      hi = mid - 1;
  }
  int64_t t = lo;
  Tensor x = read_tensor(a, t);
  for (int64_t base = begin; base < end; base += kBlocksPerWarp) {
    const int64_t b = base + sub;
    const bool valid = b < end;
    if (valid)
      while (b >= x.end_block) x = read_tensor(a, ++t);
    const int64_t local = b - x.first_block;
    const int64_t row = local / x.blocks_per_row;
    const int64_t col0 = (local - row * x.blocks_per_row) * kQuantBlock;
    const int64_t col = col0 + kPerLane * in_group;
    const int64_t flat = row * x.cols + col;
    const int64_t remaining = valid ? x.cols - col : 0;
    const int n = remaining >= kPerLane ? kPerLane : (remaining > 0 ? static_cast<int>(remaining) : 0);
    const bool full = valid && x.aligned && x.cols - col0 >= kQuantBlock;
    const bool leader = valid && in_group == 0;
    float p[kPerLane], g[kPerLane], m[kPerLane], v[kPerLane], vmax[kPerLane];
    if (x.master != nullptr)
      load_values(p, x.master, flat, n, full);
    else
      load_values(p, static_cast<const P*>(x.p), flat, n, full);
    load_values(g, static_cast<const G*>(x.g), flat, n, full);
    const int fmt_m = FM != kAnyFormat ? FM : x.fmt_m, fmt_v = FV != kAnyFormat ? FV : x.fmt_v;
    load_moment(m, fmt_m, false, x.m, x.m_scale, row, x.cols, col, local, flat, n, full, kLutM ? lut_m : nullptr);
    load_moment(v, fmt_v, true, x.v, x.v_scale, row, x.cols, col, local, flat, n, full, kLutV ? lut_v : nullptr);
    // amsgrad only with float32/bfloat16 second moments (checked by the table), so only in those kernels.
    constexpr bool kMayAmsgrad = FV == kAnyFormat || FV == kF32 || FV == kBF16;
    if (kMayAmsgrad && a.adam.amsgrad)
      load_moment(vmax, fmt_v, true, x.vmax, nullptr, row, x.cols, col, local, flat, n, full, nullptr);
#pragma unroll
    for (int k = 0; k < kPerLane; ++k)
      adam_element(p[k], g[k] * inv_scale, m[k], v[k], vmax[k], a.adam, decay, x.sc.x, x.sc.y);
    store_moment(fmt_m, false, x.m, x.m_scale, row, x.cols, col, local, flat, m, n, full, leader);
    store_moment(fmt_v, true, x.v, x.v_scale, row, x.cols, col, local, flat, v, n, full, leader);
    if (kMayAmsgrad && a.adam.amsgrad) {
      if (fmt_v == kF32)
        store_values(static_cast<float*>(x.vmax), flat, vmax, n, full);
      else
        store_values(static_cast<at::BFloat16*>(x.vmax), flat, vmax, n, full);
    }
    if (x.master != nullptr) store_values(x.master, flat, p, n, full);
    if constexpr (std::is_same<P, at::BFloat16>::value) {
      if (a.stochastic_rounding) {
        const uint32_t key = __float_as_uint(x.sc.z);
        uint16_t* out = reinterpret_cast<uint16_t*>(x.p) + flat;
        // rounding_bits(key, index) for index = first + j + k, with the mix of the index's high half once per lane.
        const int64_t first = x.offset + flat;
        const uint32_t lo = static_cast<uint32_t>(first);
        const uint32_t hi = static_cast<uint32_t>(static_cast<uint64_t>(first) >> 32);
        const uint32_t hi_mix = mix32(hi), next_mix = mix32(hi + 1);
        constexpr int kVec = 8;  // 16 bytes
#pragma unroll
        for (int j = 0; j < kPerLane; j += kVec) {
          Vec<uint16_t, kVec> bits;
#pragma unroll
          for (int k = 0; k < kVec; ++k) {
            const uint32_t low = lo + static_cast<uint32_t>(j + k);
            const uint32_t random = mix32((key + low) ^ (low < lo ? next_mix : hi_mix)) >> 16;
            bits.v[k] = stochastic_round_bf16_bits(p[j + k], random);
          }
          if (full) {
            *reinterpret_cast<Vec<uint16_t, kVec>*>(out + j) = bits;
          } else {
#pragma unroll
            for (int k = 0; k < kVec; ++k)
              if (j + k < n) out[j + k] = bits.v[k];
          }
        }
        continue;
      }
    }
    store_values(static_cast<P*>(x.p), flat, p, n, full);
  }
}

// One wave of resident CTAs: every warp owns one contiguous range of blocks, so a second, partial wave would
// leave most of the GPU idle while it runs.
template <typename P, typename G, int FM, int FV>
void launch_step(const BlockwiseLaunch& l, const Args& a, cudaStream_t s) {
  int sms = 0, per_sm = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, l.device.index()));
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, step_kernel<P, G, FM, FV>, kWarps * 32, 0));
  const int64_t needed = (a.num_blocks + kWarps - 1) / kWarps;
  const int64_t grid = std::max<int64_t>(1, std::min<int64_t>(needed, int64_t(sms) * std::max(per_sm, 1)));
  step_kernel<P, G, FM, FV><<<grid, kWarps * 32, 0, s>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// A launch whose tensors share one format for both moments and whose gradients have the parameters' dtype (the
// usual case) gets a kernel compiled for it; anything else the kernel that reads the formats per tensor.
template <typename P>
void dispatch_formats(const BlockwiseLaunch& l, const Args& a, cudaStream_t s) {
  if (l.grad_dtype == c10::CppTypeToScalarType<P>::value && l.fmt_m == l.fmt_v) {
    switch (l.fmt_m) {
      case kF32: return launch_step<P, P, kF32, kF32>(l, a, s);
      case kBF16: return launch_step<P, P, kBF16, kBF16>(l, a, s);
      case kQ8: return launch_step<P, P, kQ8, kQ8>(l, a, s);
      case kQ4: return launch_step<P, P, kQ4, kQ4>(l, a, s);
      default: break;
    }
  }
  switch (l.grad_dtype) {
    case at::kFloat: return launch_step<P, float, kAnyFormat, kAnyFormat>(l, a, s);
    case at::kHalf: return launch_step<P, at::Half, kAnyFormat, kAnyFormat>(l, a, s);
    case at::kBFloat16: return launch_step<P, at::BFloat16, kAnyFormat, kAnyFormat>(l, a, s);
    default: TORCH_CHECK(false, "ampkernels: unsupported gradient dtype ", l.grad_dtype);
  }
}

template <typename T>
const T* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

}  // namespace
}  // namespace cuda

void blockwise_adam_cuda(const BlockwiseLaunch& l) {
  const c10::cuda::CUDAGuard guard(l.device);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cuda::Args a;
  a.meta = l.meta.data_ptr<int64_t>();
  a.num_tensors = l.num_tensors;
  a.num_blocks = l.num_blocks;
  a.scalars = reinterpret_cast<float4*>(l.scalars.data_ptr<float>());
  a.grad_scale = cuda::ptr_or_null<float>(l.grad_scale);
  a.found_inf = cuda::ptr_or_null<float>(l.found_inf);
  a.lr_ptr = cuda::ptr_or_null<float>(l.lr_tensor);
  a.lr = l.lr;
  a.adam = l.adam;
  a.seed = l.seed;
  a.stochastic_rounding = l.stochastic_rounding;
  if (l.num_tensors == 0) return;
  constexpr int kPrologueThreads = 256;
  const int64_t blocks = std::min<int64_t>((l.num_tensors + kPrologueThreads - 1) / kPrologueThreads, 1024);
  cuda::prologue_kernel<<<blocks, kPrologueThreads, 0, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (l.num_blocks == 0) return;
  switch (l.param_dtype) {
    case at::kFloat: cuda::dispatch_formats<float>(l, a, stream); break;
    case at::kHalf: cuda::dispatch_formats<at::Half>(l, a, stream); break;
    case at::kBFloat16: cuda::dispatch_formats<at::BFloat16>(l, a, stream); break;
    default: TORCH_CHECK(false, "ampkernels: unsupported parameter dtype ", l.param_dtype);
  }
}

}  // namespace ampkernels
