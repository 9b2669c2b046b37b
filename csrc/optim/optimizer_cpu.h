// The element loops of the CPU optimizer steps (optimizer_cpu.cpp, blockwise_cpu.cpp): optimizer.h's element math
// with the boolean options as template arguments, which is what lets the compiler vectorize it.
#pragma once

#include <type_traits>

#include "optim/optimizer.h"

// The element loops are compiled twice where the toolchain can dispatch at load time (GCC on x86-64 Linux: an
// ifunc): for AVX2 and for the baseline. AVX2 has the 32-bit integer multiply and unsigned compares that SSE2
// emulates (the codes, the rounding hash) and twice the lanes; no FMA is enabled, so the rounding is the same.
// NOTE: python -m benchmarks --only optimizers on the repository's 2-core CPU machine (scaled-down Llama set), with
// the clones against the baseline alone: 8-bit moments 21.1 ms against 31, 4-bit 24.2 against 32, bf16 +
// stochastic rounding 15.3 against 20.6 (the whole extension built with -mavx2: 19.6, 22.5, 13.6).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define AMPK_CPU_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define AMPK_CPU_VECTOR_CLONES
#endif

namespace ampkernels {
namespace cpu {

// The element loops take the boolean hyperparameters as template arguments and the tensors (distinct ones) as
// restrict pointers: with those branches fixed at compile time and no aliasing to fear, the compiler vectorizes
// them (the sqrt too, built with -fno-math-errno).
// NOTE: with the flags read at run time and the tensors' own pointers the loop stayed scalar: 30-32 ms for the
// scaled-down Llama set of python -m benchmarks --only optimizers on the repository's 2-core CPU machine, where
// torch's fused CPU AdamW takes 13-14 ms and this loop 12.2.
template <bool kMaster, bool kMaximize, bool kDecoupled, bool kAmsgrad, typename P, typename G, typename S>
AMPK_CPU_VECTOR_CLONES void adam_span(P* __restrict__ p, float* __restrict__ master, const G* __restrict__ g, S* __restrict__ m,
               S* __restrict__ v, S* __restrict__ vmax, int64_t size, AdamCoefficients h, float inv_scale, float decay,
               float step_size, float bc2_sqrt) {
  h.maximize = kMaximize, h.decoupled_weight_decay = kDecoupled, h.amsgrad = kAmsgrad;
  for (int64_t i = 0; i < size; ++i) {
    float pi = kMaster ? master[i] : static_cast<float>(p[i]);
    float mi = static_cast<float>(m[i]), vi = static_cast<float>(v[i]);
    float vmaxi = kAmsgrad ? static_cast<float>(vmax[i]) : 0.f;
    adam_element(pi, static_cast<float>(g[i]) * inv_scale, mi, vi, vmaxi, h, decay, step_size, bc2_sqrt);
    if (kMaster) master[i] = pi;
    p[i] = static_cast<P>(pi);
    m[i] = static_cast<S>(mi);
    v[i] = static_cast<S>(vi);
    if (kAmsgrad) vmax[i] = static_cast<S>(vmaxi);
  }
}

// Calls f with the values of a, b and c as std::bool_constant arguments (one instantiation per combination).
template <typename F>
void with_flags(bool a, bool b, bool c, F&& f) {
  auto third = [&](auto A, auto B) {
    if (c)
      f(A, B, std::true_type{});
    else
      f(A, B, std::false_type{});
  };
  auto second = [&](auto A) {
    if (b)
      third(A, std::true_type{});
    else
      third(A, std::false_type{});
  };
  if (a)
    second(std::true_type{});
  else
    second(std::false_type{});
}

}  // namespace cpu
}  // namespace ampkernels
