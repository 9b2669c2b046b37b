// The blockwise Adam step on the CPU: the prologue and per-block math of blockwise.cu, block by block, parallel
// over ranges of blocks with at::parallel_for.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "optim/blockwise.h"

namespace ampkernels {
namespace {

struct Moment {
  int fmt;
  bool second;
  void* base;
  uint8_t* scales;
};

// Decodes (or reads) elements [col, col + n) of `row` into dst.
void load_moment(float* dst, const Moment& x, int64_t row, int64_t cols, int64_t col, int64_t block, int64_t flat,
                 int n) {
  if (x.fmt == kF32) {
    std::copy_n(static_cast<const float*>(x.base) + flat, n, dst);
    return;
  }
  if (x.fmt == kBF16) {
    const auto* src = static_cast<const at::BFloat16*>(x.base) + flat;
    for (int k = 0; k < n; ++k) dst[k] = static_cast<float>(src[k]);
    return;
  }
  const Code c = code_of(x.fmt, x.second);
  const int e = x.scales[block];
  const auto* codes = static_cast<const uint8_t*>(x.base);
  for (int k = 0; k < n; ++k) {
    const int64_t j = col + k;
    const uint32_t code =
        x.fmt == kQ8 ? codes[row * cols + j] : (codes[row * ((cols + 1) / 2) + j / 2] >> (4 * (j % 2))) & 0xF;
    dst[k] = decode(code, e, c);
  }
}

void store_moment(const Moment& x, const float* src, int64_t row, int64_t cols, int64_t col, int64_t block,
                  int64_t flat, int n) {
  if (x.fmt == kF32) {
    std::copy_n(src, n, static_cast<float*>(x.base) + flat);
    return;
  }
  if (x.fmt == kBF16) {
    auto* dst = static_cast<at::BFloat16*>(x.base) + flat;
    for (int k = 0; k < n; ++k) dst[k] = static_cast<at::BFloat16>(src[k]);
    return;
  }
  const Code c = code_of(x.fmt, x.second);
  float absmax = 0.f;
  for (int k = 0; k < n; ++k) absmax = std::fmax(absmax, std::fabs(src[k]));
  const int e = block_exponent(absmax, c.man_bits);
  const float multiplier = pow2_biased(254 - e);
  x.scales[block] = static_cast<uint8_t>(e);
  auto* codes = static_cast<uint8_t*>(x.base);
  for (int k = 0; k < n; ++k) {
    const int64_t j = col + k;
    const uint32_t code = encode(src[k], multiplier, c);
    if (x.fmt == kQ8) {
      codes[row * cols + j] = static_cast<uint8_t>(code);
    } else {
      uint8_t& byte = codes[row * ((cols + 1) / 2) + j / 2];
      // Blocks start at even columns, so the low nibble is written first: it clears the byte's high nibble,
      // which stays 0 at the end of an odd row.
      byte = j % 2 == 0 ? static_cast<uint8_t>(code) : static_cast<uint8_t>((byte & 0xF) | (code << 4));
    }
  }
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
      P* param = reinterpret_cast<P*>(x[kMetaParam]) + flat;
      const G* grad = reinterpret_cast<const G*>(x[kMetaGrad]) + flat;
      float* master = reinterpret_cast<float*>(x[kMetaMaster]);
      for (int k = 0; k < n; ++k) {
        p[k] = master != nullptr ? master[flat + k] : static_cast<float>(param[k]);
        g[k] = static_cast<float>(grad[k]) * inv_scale;
      }
      load_moment(m, mm, row, cols, col, local, flat, n);
      load_moment(v, vv, row, cols, col, local, flat, n);
      if (l.adam.amsgrad) load_moment(vmax, vm, row, cols, col, local, flat, n);
      const float step_size = scalars[4 * t], bc2_sqrt = scalars[4 * t + 1];
      for (int k = 0; k < n; ++k) adam_element(p[k], g[k], m[k], v[k], vmax[k], l.adam, decay, step_size, bc2_sqrt);
      store_moment(mm, m, row, cols, col, local, flat, n);
      store_moment(vv, v, row, cols, col, local, flat, n);
      if (l.adam.amsgrad) store_moment(vm, vmax, row, cols, col, local, flat, n);
      if (master != nullptr) std::copy_n(p, n, master + flat);
      if constexpr (std::is_same_v<P, at::BFloat16>) {
        if (l.stochastic_rounding) {
          uint32_t key;
          std::memcpy(&key, &scalars[4 * t + 2], 4);
          auto* out = reinterpret_cast<uint16_t*>(param);
          for (int k = 0; k < n; ++k)
            out[k] = stochastic_round_bf16_bits(p[k], rounding_bits(key, x[kMetaOffset] + flat + k));
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
