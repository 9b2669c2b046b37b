// The blockwise Adam step on CUDA (blockwise.h): a one-thread-per-tensor prologue (step counts, bias corrections,
// rounding keys), then one pass in which each warp owns a contiguous range of 128-element blocks and, per block,
// reads the gradient once, reads and writes the parameter and its moments once (decoding and encoding codes in
// registers: a warp-wide max gives the block's new exponent). Lane l holds elements 4l..4l+3 of a block, so a
// warp's accesses are contiguous: 16-byte float32, 4-byte 8-bit-code and 2-byte 4-bit-code accesses per lane on
// the aligned path. Both kernels return at once when found_inf is non-zero: a skipped step writes nothing.
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
constexpr int kPerLane = kQuantBlock / 32;

struct Args {
  const int64_t* meta;
  int64_t num_tensors, num_blocks;
  float4* scalars;
  const float* grad_scale;
  const float* found_inf;
  const float* lr_ptr;
  double lr;
  AdamHyper adam;
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

// Loads kPerLane values of a float32/bfloat16 array at element i (vector access when `full`).
template <typename T>
__device__ __forceinline__ void load_values(float (&dst)[kPerLane], const T* base, int64_t i, int n, bool full) {
  if (full) {
    load<kPerLane>(dst, base + i);
  } else {
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) dst[k] = k < n ? static_cast<float>(base[i + k]) : 0.f;
  }
}

template <typename T>
__device__ __forceinline__ void store_values(T* base, int64_t i, const float (&src)[kPerLane], int n, bool full) {
  if (full) {
    store<kPerLane>(base + i, src);
  } else {
#pragma unroll
    for (int k = 0; k < kPerLane; ++k)
      if (k < n) base[i + k] = static_cast<T>(src[k]);
  }
}

// Where a block's codes start: the byte of element `col0` of row `row` (4-bit rows are ceil(cols / 2) bytes).
__device__ __forceinline__ int64_t code_byte(int fmt, int64_t row, int64_t cols, int64_t col) {
  return fmt == kQ4 ? row * ((cols + 1) / 2) + col / 2 : row * cols + col;
}

// Reads this lane's values of one moment (n valid of kPerLane, starting at element `col` of `row`).
__device__ __forceinline__ void load_moment(float (&dst)[kPerLane], int fmt, bool second, void* base,
                                            const uint8_t* scales, int64_t row, int64_t cols, int64_t col,
                                            int64_t block, int64_t flat, int n, bool full) {
  if (fmt == kF32) return load_values(dst, static_cast<const float*>(base), flat, n, full);
  if (fmt == kBF16) return load_values(dst, static_cast<const at::BFloat16*>(base), flat, n, full);
  const Code c = code_of(fmt, second);
  const int e = scales[block];
  const uint8_t* codes = static_cast<const uint8_t*>(base) + code_byte(fmt, row, cols, col);
  uint32_t word = 0;  // kPerLane codes, element k in bits [k * width, (k + 1) * width)
  if (fmt == kQ8) {
    if (full) {
      word = *reinterpret_cast<const uint32_t*>(codes);
    } else {
#pragma unroll
      for (int k = 0; k < kPerLane; ++k)
        if (k < n) word |= static_cast<uint32_t>(codes[k]) << (8 * k);
    }
  } else {
    if (full) {
      word = *reinterpret_cast<const uint16_t*>(codes);
    } else {
#pragma unroll
      for (int k = 0; k < kPerLane / 2; ++k)
        if (2 * k < n) word |= static_cast<uint32_t>(codes[k]) << (8 * k);
    }
  }
  const int width = fmt == kQ8 ? 8 : 4;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) dst[k] = k < n ? decode((word >> (width * k)) & ((1u << width) - 1), e, c) : 0.f;
}

// Encodes and writes one moment of the block; the whole warp takes part (the block's absmax is a warp max).
__device__ __forceinline__ void store_moment(int fmt, bool second, void* base, uint8_t* scales, int64_t row,
                                             int64_t cols, int64_t col, int64_t block, int64_t flat,
                                             const float (&src)[kPerLane], int n, bool full) {
  if (fmt == kF32) return store_values(static_cast<float*>(base), flat, src, n, full);
  if (fmt == kBF16) return store_values(static_cast<at::BFloat16*>(base), flat, src, n, full);
  const Code c = code_of(fmt, second);
  float absmax = 0.f;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k)
    if (k < n) absmax = fmaxf(absmax, fabsf(src[k]));
#pragma unroll
  for (int delta = 16; delta > 0; delta /= 2) absmax = fmaxf(absmax, __shfl_xor_sync(0xffffffffu, absmax, delta));
  const int e = block_exponent(absmax, c.man_bits);
  const float multiplier = pow2_biased(254 - e);
  if ((threadIdx.x & 31) == 0) scales[block] = static_cast<uint8_t>(e);
  uint8_t* codes = static_cast<uint8_t*>(base) + code_byte(fmt, row, cols, col);
  const int width = fmt == kQ8 ? 8 : 4;
  uint32_t word = 0;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k)
    if (k < n) word |= encode(src[k], multiplier, c) << (width * k);
  if (fmt == kQ8) {
    if (full) {
      *reinterpret_cast<uint32_t*>(codes) = word;
    } else {
#pragma unroll
      for (int k = 0; k < kPerLane; ++k)
        if (k < n) codes[k] = static_cast<uint8_t>(word >> (8 * k));
    }
  } else {
    if (full) {
      *reinterpret_cast<uint16_t*>(codes) = static_cast<uint16_t>(word);
    } else {
#pragma unroll
      for (int k = 0; k < kPerLane / 2; ++k)
        if (2 * k < n) codes[k] = static_cast<uint8_t>(word >> (8 * k));  // an odd row's last high nibble is 0
    }
  }
}

// NOTE: at most 80 registers, 3 CTAs (24 warps) per SM: unbounded, ptxas takes 114 and fits 2.
template <typename P, typename G>
__global__ void __launch_bounds__(kWarps * 32, 3) step_kernel(Args a) {
  if (skipped(a.found_inf)) return;
  const float inv_scale = a.grad_scale != nullptr ? static_cast<float>(1.0 / static_cast<double>(*a.grad_scale)) : 1.f;
  const double lr = read_lr(a);
  const float decay = static_cast<float>(1.0 - lr * a.adam.weight_decay);
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * kWarps;
  const int64_t warp = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  // A contiguous range of blocks per warp: the tensor changes rarely, and finding it is one binary search.
  const int64_t per_warp = (a.num_blocks + warps - 1) / warps;
  const int64_t begin = warp * per_warp;
  const int64_t end = begin + per_warp < a.num_blocks ? begin + per_warp : a.num_blocks;
  if (begin >= end) return;
  int64_t lo = 0, hi = a.num_tensors - 1;  // the last tensor whose first block is <= begin
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (a.meta[mid * kMetaCount + kMetaFirstBlock] <= begin)
      lo = mid;
    else
      hi = mid - 1;
  }
  int64_t t = lo;
  Tensor x = read_tensor(a, t);
  for (int64_t b = begin; b < end; ++b) {
    while (b >= x.end_block) x = read_tensor(a, ++t);
    const int64_t local = b - x.first_block;
    const int64_t row = local / x.blocks_per_row;
    const int64_t col0 = (local - row * x.blocks_per_row) * kQuantBlock;
    const int64_t col = col0 + kPerLane * lane;
    const int64_t flat = row * x.cols + col;
    const int64_t remaining = x.cols - col;
    const int n = remaining >= kPerLane ? kPerLane : (remaining > 0 ? static_cast<int>(remaining) : 0);
    const bool full = x.aligned && x.cols - col0 >= kQuantBlock;
    float p[kPerLane], g[kPerLane], m[kPerLane], v[kPerLane], vmax[kPerLane];
    if (x.master != nullptr)
      load_values(p, x.master, flat, n, full);
    else
      load_values(p, static_cast<const P*>(x.p), flat, n, full);
    load_values(g, static_cast<const G*>(x.g), flat, n, full);
    load_moment(m, x.fmt_m, false, x.m, x.m_scale, row, x.cols, col, local, flat, n, full);
    load_moment(v, x.fmt_v, true, x.v, x.v_scale, row, x.cols, col, local, flat, n, full);
    if (a.adam.amsgrad) load_moment(vmax, x.fmt_v, true, x.vmax, nullptr, row, x.cols, col, local, flat, n, full);
#pragma unroll
    for (int k = 0; k < kPerLane; ++k)
      adam_element(p[k], g[k] * inv_scale, m[k], v[k], vmax[k], a.adam, decay, x.sc.x, x.sc.y);
    store_moment(x.fmt_m, false, x.m, x.m_scale, row, x.cols, col, local, flat, m, n, full);
    store_moment(x.fmt_v, true, x.v, x.v_scale, row, x.cols, col, local, flat, v, n, full);
    if (a.adam.amsgrad) {
      if (x.fmt_v == kF32)
        store_values(static_cast<float*>(x.vmax), flat, vmax, n, full);
      else
        store_values(static_cast<at::BFloat16*>(x.vmax), flat, vmax, n, full);
    }
    if (x.master != nullptr) store_values(x.master, flat, p, n, full);
    if constexpr (std::is_same<P, at::BFloat16>::value) {
      if (a.stochastic_rounding) {
        const uint32_t key = __float_as_uint(x.sc.z);
        Vec<uint16_t, kPerLane> bits;
#pragma unroll
        for (int k = 0; k < kPerLane; ++k)
          bits.v[k] = stochastic_round_bf16_bits(p[k], rounding_bits(key, x.offset + flat + k));
        uint16_t* out = reinterpret_cast<uint16_t*>(x.p) + flat;
        if (full) {
          *reinterpret_cast<Vec<uint16_t, kPerLane>*>(out) = bits;
        } else {
#pragma unroll
          for (int k = 0; k < kPerLane; ++k)
            if (k < n) out[k] = bits.v[k];
        }
        continue;
      }
    }
    store_values(static_cast<P*>(x.p), flat, p, n, full);
  }
}

// One wave of resident CTAs: every warp owns one contiguous range of blocks, so a second, partial wave would
// leave most of the GPU idle while it runs.
template <typename P, typename G>
void launch_step(const BlockwiseLaunch& l, const Args& a, cudaStream_t s) {
  int sms = 0, per_sm = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, l.device.index()));
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, step_kernel<P, G>, kWarps * 32, 0));
  const int64_t needed = (a.num_blocks + kWarps - 1) / kWarps;
  const int64_t grid = std::max<int64_t>(1, std::min<int64_t>(needed, int64_t(sms) * std::max(per_sm, 1)));
  step_kernel<P, G><<<grid, kWarps * 32, 0, s>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename P>
void dispatch_grad(const BlockwiseLaunch& l, const Args& a, cudaStream_t s) {
  switch (l.grad_dtype) {
    case at::kFloat: launch_step<P, float>(l, a, s); break;
    case at::kHalf: launch_step<P, at::Half>(l, a, s); break;
    case at::kBFloat16: launch_step<P, at::BFloat16>(l, a, s); break;
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
    case at::kFloat: cuda::dispatch_grad<float>(l, a, stream); break;
    case at::kHalf: cuda::dispatch_grad<at::Half>(l, a, stream); break;
    case at::kBFloat16: cuda::dispatch_grad<at::BFloat16>(l, a, stream); break;
    default: TORCH_CHECK(false, "ampkernels: unsupported parameter dtype ", l.param_dtype);
  }
}

}  // namespace ampkernels
