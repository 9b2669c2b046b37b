// Input checks shared by every op. Each message names the argument it is about.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#define AMPK_CHECK_ARG(cond, arg, ...) TORCH_CHECK(cond, "ampkernels: argument '", arg, "': ", __VA_ARGS__)

#define AMPK_CHECK_SCALAR_FLOAT(t, arg)                                                                   \
  do {                                                                                                    \
    AMPK_CHECK_ARG((t).scalar_type() == at::kFloat, arg, "expected a float32 tensor, got ", (t).scalar_type()); \
    AMPK_CHECK_ARG((t).numel() == 1, arg, "expected a 1-element tensor, got ", (t).numel(), " elements");  \
  } while (0)

#define AMPK_CHECK_SAME_DEVICE(t, ref, arg)                                                                  \
  AMPK_CHECK_ARG((t).device() == (ref).device(), arg, "expected a tensor on ", (ref).device(), ", got one on ", \
                 (t).device())

namespace ampkernels {

// The gradient dtypes the multi-tensor kernels take (mixed freely in one call).
inline bool is_supported_grad_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
}

}  // namespace ampkernels
