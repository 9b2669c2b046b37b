// The blockwise Adam step: Adam/AdamW with the moments stored as float32, bfloat16, or 8-bit / 4-bit block floating
// point codes, and optional stochastic rounding of bfloat16 parameters (FusedAdam's exp_avg_dtype,
// exp_avg_sq_dtype, stochastic_rounding). The codes, their layout and the random stream are those of
// ampkernels/reference.py ("low-precision optimizer state"): integer arithmetic on float32 bit patterns, so every
// backend encodes the same float32 value to the same code. The element math is optimizer.h's adam_element.
#pragma once

#include <ATen/ATen.h>
#include <c10/macros/Macros.h>

#include <cstdint>
#include <cstring>

#include "optim/optimizer.h"

namespace ampkernels {

// Storage formats (ampkernels/_constants.py STATE_*).
enum MomentFormat : int { kF32 = 0, kBF16 = 1, kQ8 = 2, kQ4 = 3 };
constexpr int kQuantBlock = 128;  // elements per block, along the last dimension (_constants.QUANT_BLOCK)

// Per-tensor metadata, int64 [T, kMetaCols] on the device (BlockwiseAdamTable builds it).
enum BlockwiseMeta : int {
  kMetaFirstBlock = 0,  // index of the tensor's first block in the launch (a prefix sum; entry T = total blocks)
  kMetaCols,            // row length: the last dimension when a moment is quantized, else numel (one row)
  kMetaFormats,         // first moment format | second moment format << 8 | vector-aligned << 16
  kMetaSalt,
  kMetaOffset,          // flat index of element 0 in the full (unsharded) tensor
  kMetaParam,           // addresses
  kMetaGrad,
  kMetaExpAvg,
  kMetaExpAvgScale,
  kMetaExpAvgSq,
  kMetaExpAvgSqScale,
  kMetaMaxExpAvgSq,
  kMetaMaster,
  kMetaStep,
  kMetaCount = 16,  // (two unused columns: rows of 128 bytes)
};

struct BlockwiseLaunch {
  at::Device device = at::kCPU;
  int64_t num_tensors = 0, num_blocks = 0;
  at::Tensor meta;     // int64 [T + 1, kMetaCount] (row T: kMetaFirstBlock = num_blocks)
  at::Tensor scalars;  // float32 [T, 4] scratch: step_size, bc2_sqrt, rounding key (bits), unused
  at::ScalarType param_dtype = at::kFloat, grad_dtype = at::kFloat;
  int fmt_m = -1, fmt_v = -1;  // the formats every tensor of the launch has, or -1 (they differ)
  bool stochastic_rounding = false;  // master weights: a tensor's kMetaMaster address is non-zero
  uint64_t seed = 0;
  at::Tensor grad_scale, found_inf, lr_tensor;  // as OptimizerLaunch
  double lr = 0.0;
  AdamCoefficients adam{};
};

void blockwise_adam_cpu(const BlockwiseLaunch& launch);
#ifdef AMPK_WITH_CUDA
void blockwise_adam_cuda(const BlockwiseLaunch& launch);
#endif

// ---- codes (reference.py: _encode, _decode, _block_exponent, quant_code) ----

struct Code {
  int exp_bits, man_bits;
  bool is_signed;
};

C10_HOST_DEVICE constexpr Code code_of(int format, bool second_moment) {
  if (format == kQ8) return second_moment ? Code{5, 3, false} : Code{4, 3, true};
  return second_moment ? Code{4, 0, false} : Code{2, 1, true};
}

C10_HOST_DEVICE inline uint32_t bits_of(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
#endif
}

C10_HOST_DEVICE inline float float_of(uint32_t b) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(b);
#else
  float x;
  std::memcpy(&x, &b, 4);
  return x;
#endif
}

// The biased exponent in [1, 253] that puts `absmax`, rounded to `man_bits`, in [1, 2).
C10_HOST_DEVICE inline int block_exponent(float absmax, int man_bits) {
  // absmax >= 0, so its bits are below 2^31 and the sum does not wrap: NaN and inf give 255 or 256 -> 253.
  const int e = static_cast<int>((bits_of(absmax) + (1u << (22 - man_bits))) >> 23);
  return e < 1 ? 1 : (e > 253 ? 253 : e);
}

// 2^(e - 127) for a biased exponent e in [1, 254]; 0 for e = 0.
C10_HOST_DEVICE inline float pow2_biased(int e) { return float_of(static_cast<uint32_t>(e) << 23); }

// The code of magnitude y >= 0 (below 2 unless non-finite), rounded to nearest. Both paths are computed and one
// selected: no branch, so the 16 elements of a CUDA lane stay independent instruction streams.
C10_HOST_DEVICE inline uint32_t encode_magnitude(float y, Code c) {
  const int top = (1 << c.exp_bits) - 1;
  const uint32_t max_code = (1u << (c.exp_bits + c.man_bits)) - 1;
  // Below 2^(1 - top) the codes are a uniform grid: exact scaling by a power of two, then + 0.5 and floor (the
  // conversion's truncation: the sum is in [0.5, 2^man_bits + 0.5], so a signed one, which x86 vectors have). The
  // min is fminf's (a NaN y gives min_normal) as a select: library calls to floorf and fminf kept CPU loops scalar.
  const float grid = float_of(static_cast<uint32_t>(127 + top - 1 + c.man_bits) << 23);
  const float min_normal = float_of(static_cast<uint32_t>(128 - top) << 23);  // 2^(1 - top)
  const uint32_t sub = static_cast<int32_t>((y < min_normal ? y : min_normal) * grid + 0.5f);
  // Above it, the float32 bits rounded to man_bits (a carry moves into the exponent); NaN and inf land far above
  // max_code (exponent bits 255), and y >= 2^(1 - top) keeps the difference positive.
  const uint32_t normal =
      ((bits_of(y) + (1u << (22 - c.man_bits))) >> (23 - c.man_bits)) - (static_cast<uint32_t>(127 - top) << c.man_bits);
  const uint32_t code = y < min_normal ? sub : normal;
  return code > max_code ? max_code : code;
}

C10_HOST_DEVICE inline float decode_magnitude(uint32_t code, Code c) {
  const int top = (1 << c.exp_bits) - 1;
  const float sub = static_cast<float>(code) * float_of(static_cast<uint32_t>(127 + 1 - top - c.man_bits) << 23);
  const float normal = float_of((code + (static_cast<uint32_t>(127 - top) << c.man_bits)) << (23 - c.man_bits));
  return code < (1u << c.man_bits) ? sub : normal;
}

// The code of x in a block of biased exponent e (multiplier = 2^(127 - e), exact).
C10_HOST_DEVICE inline uint32_t encode(float x, float multiplier, Code c) {
  uint32_t code = encode_magnitude(::fabsf(x) * multiplier, c);
  if (c.is_signed) {
    if (x < 0.f && code > 0) code |= 1u << (c.exp_bits + c.man_bits);
  } else if (code == 0) {
    code = 1;  // the second moment is never zero (reference.py says why)
  }
  return code;
}

// The value of `code` relative to its block's scale (sign included).
C10_HOST_DEVICE inline float code_value(uint32_t code, Code c) {
  const uint32_t magnitude_bits = c.exp_bits + c.man_bits;
  const float y = decode_magnitude(code & ((1u << magnitude_bits) - 1), c);
  return c.is_signed && (code >> magnitude_bits) != 0 ? -y : y;
}

// The value of `code` in a block of biased exponent e; e = 0 (a fresh block) scales by 2^-127 as float32 bits 0,
// that is by zero.
C10_HOST_DEVICE inline float decode(uint32_t code, int e, Code c) { return code_value(code, c) * pow2_biased(e); }

// ---- stochastic rounding (reference.py: _mix32, rounding_key, rounding_bits, stochastic_round_to_bf16) ----

C10_HOST_DEVICE inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

C10_HOST_DEVICE inline uint32_t rounding_key(uint64_t seed, int64_t salt, float step) {
  uint32_t k = mix32(static_cast<uint32_t>(seed));
  k = mix32(k ^ static_cast<uint32_t>(seed >> 32));
  k = mix32(k ^ static_cast<uint32_t>(salt));
  return mix32(k + static_cast<uint32_t>(static_cast<int64_t>(step)));
}

// The mixed high word of an element index: the same for every index between two multiples of 2^32, so a loop
// over a block can compute it once.
C10_HOST_DEVICE inline uint32_t rounding_high(int64_t index) {
  return mix32(static_cast<uint32_t>(static_cast<uint64_t>(index) >> 32));
}

C10_HOST_DEVICE inline uint32_t rounding_bits(uint32_t key, int64_t index, uint32_t high) {
  return mix32((key + static_cast<uint32_t>(index)) ^ high) >> 16;
}

C10_HOST_DEVICE inline uint32_t rounding_bits(uint32_t key, int64_t index) {
  return rounding_bits(key, index, rounding_high(index));
}

// The bfloat16 bits of x rounded stochastically with 16 random bits (NaN: the quiet NaN torch's rounding gives).
C10_HOST_DEVICE inline uint16_t stochastic_round_bf16_bits(float x, uint32_t random16) {
  const uint32_t b = bits_of(x);
  if (x != x) return 0x7FC0;
  return static_cast<uint16_t>((b + random16) >> 16);
}

}  // namespace ampkernels
