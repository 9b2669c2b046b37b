// Shared between ampkernels::to_float8_native (float8_ops.cpp: checks, registration) and its CUDA launcher
// (casts.cu). Semantics: ampkernels.reference.to_float8 / to_float8_pair.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace ampkernels {

// The checked arguments of one cast of a [M, K] matrix x (any strides) to float8.
struct Float8CastArgs {
  at::Tensor x;                         // [M, K], float32 / bfloat16 / float16, at least one element
  at::ScalarType dtype;                 // kFloat8_e4m3fn or kFloat8_e5m2
  bool per_row = false;                 // one scale per row of the written matrix (of x, or of x.T with write_t)
  bool write_data = true;               // write [M, K]
  bool write_t = false;                 // write [K, M] (x.T); with write_data: the pair (tensorwise only)
  std::optional<at::Tensor> scale;      // delayed scaling: float32 contiguous, 1 or R elements; none: current
  std::optional<at::Tensor> amax_out;   // float32 contiguous, 1 or R elements: max(amax_out, finite amax)
  std::optional<at::Tensor> found_inf;  // float32, 1 element: set to 1 when x holds an inf or NaN
  std::optional<at::Tensor> amax_scratch;  // int32 [3]: the amax a producer kernel reduced (tensorwise current)
};

// Returns (data [M, K] or empty, data_t [K, M] or empty, scale_inv: 0-d, or [R, 1] per row).
std::tuple<at::Tensor, at::Tensor, at::Tensor> float8_cast_cuda(const Float8CastArgs& args);

}  // namespace ampkernels
