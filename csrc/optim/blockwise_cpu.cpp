// The blockwise Adam step on the CPU: the prologue and per-block math of blockwise.cu, block by block, parallel
// over ranges of blocks with at::parallel_for, each block's loops vectorized.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "optim/blockwise.h"
#include "optim/optimizer_cpu.h"

namespace ampkernels {
namespace {

struct Moment {
  int fmt;
  bool second;
  void* base;
  uint8_t* scales;
};

// Every loop below runs over one block (at most kQuantBlock elements) with its format, code and options fixed at
// compile time, through restrict pointers, so that the compiler vectorizes it.
// NOTE: with them read at run time element by element, the step with 8-bit moments took 149-152 ms on the
// scaled-down Llama set of python -m benchmarks --only optimizers (2-core CPU machine); now 31-32 ms, and 21 ms
// with the AVX2 clones (optimizer_cpu.h).

// max |src[k]|, NaN skipped (what std::fmax gives). The compiler keeps a select reduction scalar, one dependent
// max per element; on x86 maxps is the same select, four at a time (maxps(a, m) = a > m ? a : m), here into four
// accumulators, which hides its latency.
inline float block_absmax(const float* __restrict__ src, int n) {
  float absmax = 0.f;
  int k = 0;
#if defined(__SSE2__)
  const __m128 magnitude = _mm_castsi128_ps(_mm_set1_epi32(0x7FFFFFFF));
  __m128 acc[4] = {_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps()};
  for (; k + 16 <= n; k += 16)
    for (int u = 0; u < 4; ++u) acc[u] = _mm_max_ps(_mm_and_ps(_mm_loadu_ps(src + k + 4 * u), magnitude), acc[u]);
  alignas(16) float lanes[4][4];
  for (int u = 0; u < 4; ++u) _mm_store_ps(lanes[u], acc[u]);
  for (const auto& lane : lanes)
    for (const float a : lane) absmax = a > absmax ? a : absmax;
#endif
  for (; k < n; ++k) {
    const float a = std::fabs(src[k]);
    absmax = a > absmax ? a : absmax;
  }
  return absmax;
}

// Decodes (or reads) elements [col, col + n) of `row` into dst.
template <int kFormat, bool kSecond>
AMPK_CPU_VECTOR_CLONES void load_moment(float* __restrict__ dst, const Moment& x, int64_t row, int64_t cols, int64_t col, int64_t block,
                 int64_t flat, int n) {
  if constexpr (kFormat == kF32) {
    const float* __restrict__ src = static_cast<const float*>(x.base) + flat;
    for (int k = 0; k < n; ++k) dst[k] = src[k];
  } else if constexpr (kFormat == kBF16) {
    const at::BFloat16* __restrict__ src = static_cast<const at::BFloat16*>(x.base) + flat;
    for (int k = 0; k < n; ++k) dst[k] = static_cast<float>(src[k]);
  } else {
    constexpr Code c = code_of(kFormat, kSecond);
    const int e = x.scales[block];
    const auto* codes = static_cast<const uint8_t*>(x.base);
    if constexpr (kFormat == kQ8) {
      const uint8_t* __restrict__ src = codes + row * cols + col;
      for (int k = 0; k < n; ++k) dst[k] = decode(src[k], e, c);
    } else {  // two codes a byte, the even column's in the low nibble (blocks start at even columns)
      const uint8_t* __restrict__ src = codes + row * ((cols + 1) / 2) + col / 2;
      for (int k = 0; k < n / 2; ++k) {
        dst[2 * k] = decode(src[k] & 0xFu, e, c);
        dst[2 * k + 1] = decode(src[k] >> 4, e, c);
      }
      if (n % 2 != 0) dst[n - 1] = decode(src[n / 2] & 0xFu, e, c);
    }
  }
}

template <int kFormat, bool kSecond>
AMPK_CPU_VECTOR_CLONES void store_moment(const Moment& x, const float* __restrict__ src, int64_t row, int64_t cols, int64_t col,
                  int64_t block, int64_t flat, int n) {
  if constexpr (kFormat == kF32) {
    float* __restrict__ dst = static_cast<float*>(x.base) + flat;
    for (int k = 0; k < n; ++k) dst[k] = src[k];
  } else if constexpr (kFormat == kBF16) {
    at::BFloat16* __restrict__ dst = static_cast<at::BFloat16*>(x.base) + flat;
    for (int k = 0; k < n; ++k) dst[k] = static_cast<at::BFloat16>(src[k]);
  } else {
    constexpr Code c = code_of(kFormat, kSecond);
    const int e = block_exponent(block_absmax(src, n), c.man_bits);
    const float multiplier = pow2_biased(254 - e);
    x.scales[block] = static_cast<uint8_t>(e);
    auto* codes = static_cast<uint8_t*>(x.base);
    if constexpr (kFormat == kQ8) {
      uint8_t* __restrict__ dst = codes + row * cols + col;
      for (int k = 0; k < n; ++k) dst[k] = static_cast<uint8_t>(encode(src[k], multiplier, c));
    } else {  // an odd row's last byte keeps its high nibble 0
      uint8_t* __restrict__ dst = codes + row * ((cols + 1) / 2) + col / 2;
      for (int k = 0; k < n / 2; ++k)
        dst[k] = static_cast<uint8_t>(encode(src[2 * k], multiplier, c) | (encode(src[2 * k + 1], multiplier, c) << 4));
      if (n % 2 != 0) dst[n / 2] = static_cast<uint8_t>(encode(src[n - 1], multiplier, c));
    }
  }
}

// The bfloat16 bits of a block's updated parameters p, rounded stochastically (elements index .. index + n - 1).
AMPK_CPU_VECTOR_CLONES void round_stochastically(uint16_t* __restrict__ out, const float* __restrict__ p, int n,
                                                 uint32_t key, int64_t index) {
  if ((index >> 32) == ((index + n - 1) >> 32)) {  // one high word for the block (always, but at 2^32)
    const uint32_t high = rounding_high(index);
    for (int k = 0; k < n; ++k) out[k] = stochastic_round_bf16_bits(p[k], rounding_bits(key, index + k, high));
  } else {
    for (int k = 0; k < n; ++k) out[k] = stochastic_round_bf16_bits(p[k], rounding_bits(key, index + k));
  }
}

// f(std::integral_constant<int, format>).
template <typename F>
void with_format(int format, F&& f) {
  switch (format) {
    case kF32: f(std::integral_constant<int, kF32>{}); break;
    case kBF16: f(std::integral_constant<int, kBF16>{}); break;
    case kQ8: f(std::integral_constant<int, kQ8>{}); break;
    case kQ4: f(std::integral_constant<int, kQ4>{}); break;
    default: TORCH_CHECK(false, "ampkernels: unknown moment format ", format);
  }
}

void load(float* dst, const Moment& x, int64_t row, int64_t cols, int64_t col, int64_t block, int64_t flat, int n) {
  with_format(x.fmt, [&](auto fmt) {
    if (x.second)
      load_moment<fmt, true>(dst, x, row, cols, col, block, flat, n);
    else
      load_moment<fmt, false>(dst, x, row, cols, col, block, flat, n);
  });
}

void store(const Moment& x, const float* src, int64_t row, int64_t cols, int64_t col, int64_t block, int64_t flat,
           int n) {
  with_format(x.fmt, [&](auto fmt) {
    if (x.second)
      store_moment<fmt, true>(x, src, row, cols, col, block, flat, n);
    else
      store_moment<fmt, false>(x, src, row, cols, col, block, flat, n);
  });
}

template <typename P, typename G>
void run(const BlockwiseLaunch& l, double lr, float inv_scale) {
  const int64_t* meta = l.meta.data_ptr<int64_t>();
  const float* scalars = l.scalars.data_ptr<float>();
  const float decay = static_cast<float>(1.0 - lr * l.adam.weight_decay);
  const int64_t num_tensors = l.num_tensors;
  at::parallel_for(0, l.num_blocks, 64, [&](int64_t begin, int64_t end) {
    int64_t t = 0;  // the last tensor whose first block is <= begin
    while (t + 1 < num_tensors && meta[(t + 1) * kMetaCount + kMetaFirstBlock] <= begin) ++t;
    float p[kQuantBlock], g[kQuantBlock], m[kQuantBlock], v[kQuantBlock], vmax[kQuantBlock];
    for (int64_t b = begin; b < end; ++b) {
      while (b >= meta[(t + 1) * kMetaCount + kMetaFirstBlock]) ++t;
      const int64_t* x = meta + t * kMetaCount;
      const int64_t cols = x[kMetaCols];
      const int64_t blocks_per_row = (cols + kQuantBlock - 1) / kQuantBlock;
      const int64_t local = b - x[kMetaFirstBlock];
      const int64_t row = local / blocks_per_row;
      const int64_t col = (local - row * blocks_per_row) * kQuantBlock;
      const int64_t flat = row * cols + col;
      const int n = static_cast<int>(std::min<int64_t>(kQuantBlock, cols - col));
      const int64_t formats = x[kMetaFormats];
      const Moment mm{static_cast<int>(formats & 0xFF), false, reinterpret_cast<void*>(x[kMetaExpAvg]),
                      reinterpret_cast<uint8_t*>(x[kMetaExpAvgScale])};
      const Moment vv{static_cast<int>((formats >> 8) & 0xFF), true, reinterpret_cast<void*>(x[kMetaExpAvgSq]),
                      reinterpret_cast<uint8_t*>(x[kMetaExpAvgSqScale])};
      const Moment vm{vv.fmt, true, reinterpret_cast<void*>(x[kMetaMaxExpAvgSq]), nullptr};
      P* __restrict__ param = reinterpret_cast<P*>(x[kMetaParam]) + flat;
      const G* __restrict__ grad = reinterpret_cast<const G*>(x[kMetaGrad]) + flat;
      float* __restrict__ master = reinterpret_cast<float*>(x[kMetaMaster]);
      if (master != nullptr) {
        master += flat;
        for (int k = 0; k < n; ++k) p[k] = master[k];
      } else {
        for (int k = 0; k < n; ++k) p[k] = static_cast<float>(param[k]);
      }
      for (int k = 0; k < n; ++k) g[k] = static_cast<float>(grad[k]) * inv_scale;
      load(m, mm, row, cols, col, local, flat, n);
      load(v, vv, row, cols, col, local, flat, n);
      if (l.adam.amsgrad) load(vmax, vm, row, cols, col, local, flat, n);
      const float step_size = scalars[4 * t], bc2_sqrt = scalars[4 * t + 1];
      const AdamCoefficients& h = l.adam;
      cpu::with_flags(h.maximize, h.decoupled_weight_decay, h.amsgrad, [&](auto mx, auto dec, auto ams) {
        // the block's float32 copies; g is unscaled already (inv_scale 1: an exact product)
        cpu::adam_span<false, mx, dec, ams>(p, nullptr, g, m, v, vmax, n, h, 1.f, decay, step_size, bc2_sqrt);
      });
      store(mm, m, row, cols, col, local, flat, n);
      store(vv, v, row, cols, col, local, flat, n);
      if (l.adam.amsgrad) store(vm, vmax, row, cols, col, local, flat, n);
      if (master != nullptr)
        for (int k = 0; k < n; ++k) master[k] = p[k];
      if constexpr (std::is_same_v<P, at::BFloat16>) {
        if (l.stochastic_rounding) {
          uint32_t key;
          std::memcpy(&key, &scalars[4 * t + 2], 4);
          round_stochastically(reinterpret_cast<uint16_t*>(param), p, n, key, x[kMetaOffset] + flat);
          continue;
        }
      }
      for (int k = 0; k < n; ++k) param[k] = static_cast<P>(p[k]);
    }
  });
}

template <typename P>
void dispatch_grad(const BlockwiseLaunch& l, double lr, float inv_scale) {
  switch (l.grad_dtype) {
    case at::kFloat: run<P, float>(l, lr, inv_scale); break;
    case at::kHalf: run<P, at::Half>(l, lr, inv_scale); break;
    case at::kBFloat16: run<P, at::BFloat16>(l, lr, inv_scale); break;
    default: TORCH_CHECK(false, "ampkernels: unsupported gradient dtype ", l.grad_dtype);
  }
}

}  // namespace

void blockwise_adam_cpu(const BlockwiseLaunch& l) {
  // The CPU reads found_inf directly: on the host this is a load, not a device synchronization.
  if (l.found_inf.defined() && l.found_inf.item<float>() != 0.f) return;
  const double lr = l.lr_tensor.defined() ? static_cast<double>(l.lr_tensor.item<float>()) : l.lr;
  const float inv_scale =
      l.grad_scale.defined() ? static_cast<float>(1.0 / static_cast<double>(l.grad_scale.item<float>())) : 1.f;
  const int64_t* meta = l.meta.data_ptr<int64_t>();
  float* scalars = l.scalars.data_ptr<float>();
  for (int64_t t = 0; t < l.num_tensors; ++t) {
    float* step = reinterpret_cast<float*>(meta[t * kMetaCount + kMetaStep]);
    *step += 1.f;
    adam_step_constants(lr, l.adam.beta1, l.adam.beta2, *step, &scalars[4 * t], &scalars[4 * t + 1]);
    const uint32_t key = l.stochastic_rounding ? rounding_key(l.seed, meta[t * kMetaCount + kMetaSalt], *step) : 0u;
    std::memcpy(&scalars[4 * t + 2], &key, 4);
  }
  switch (l.param_dtype) {
    case at::kFloat: dispatch_grad<float>(l, lr, inv_scale); break;
    case at::kHalf: dispatch_grad<at::Half>(l, lr, inv_scale); break;
    case at::kBFloat16: dispatch_grad<at::BFloat16>(l, lr, inv_scale); break;
    default: TORCH_CHECK(false, "ampkernels: unsupported parameter dtype ", l.param_dtype);
  }
}

}  // namespace ampkernels
