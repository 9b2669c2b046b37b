// ampkernels::to_float8_native: argument checks and registration of the native FP8 casts (kernels: casts.cu). The
// Python wrappers ampkernels.float8.to_float8 / to_float8_pair call it as their "native" backend; its fake is in
// ampkernels/_native_fakes.py.
#include <torch/library.h>

#include <limits>

#include "common/checks.h"
#include "float8/casts.h"

namespace ampkernels {
namespace {

#ifdef AMPK_WITH_CUDA
// float64 x in float32 as ampkernels.reference.saturate_to_float32 takes it: float(x) would make finite values
// beyond float32's range inf (NaN codes, found_inf set); inf and NaN stay as they are.
at::Tensor saturate_to_float32(const at::Tensor& x) {
  const double largest = std::numeric_limits<float>::max();
  return at::where(x.isinf(), x, x.clamp(-largest, largest)).to(at::kFloat);
}
#endif

void check_per_row_vector(const std::optional<at::Tensor>& t, const char* arg, const at::Tensor& x, int64_t count,
                          bool contiguous) {
  if (!t.has_value()) return;
  AMPK_CHECK_ARG(t->scalar_type() == at::kFloat, arg, "expected a float32 tensor, got ", t->scalar_type());
  AMPK_CHECK_SAME_DEVICE(*t, x, arg);
  AMPK_CHECK_ARG(t->numel() == count, arg, "expected ", count, " elements, got ", t->numel());
  AMPK_CHECK_ARG(!contiguous || t->is_contiguous(), arg, "must be contiguous, got strides ", list_of(t->strides()));
}

// Args: x [M, K] float32/bfloat16/float16/float64 (taken in float32, finite values beyond its range saturated) with
// at least one element, any strides; dtype float8_e4m3fn or float8_e5m2; per_row (one scale per row of the written
// matrix: of x, or of x.T with write_t); write_data / write_t: write [M, K] / [K, M] (both: the tensorwise pair);
// scale: float32 contiguous, 1 element or one per row (delayed scaling) or None (current scaling); amax_out: float32
// contiguous of the amax's size or None; found_inf: float32, 1 element, or None; amax_scratch: int32 [3] holding x's
// amax as a producer kernel reduced it (tensorwise current scaling only) or None.
// Returns: (data [M, K] or [0], data_t [K, M] or [0], scale_inv 0-d or [R, 1]) as ampkernels.reference.to_float8,
// bit for bit; amax_out and found_inf updated in place on the device.
std::tuple<at::Tensor, at::Tensor, at::Tensor> to_float8_native(
    const at::Tensor& x, at::ScalarType dtype, bool per_row, bool write_data, bool write_t,
    const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& amax_out,
    const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& amax_scratch) {
  const at::ScalarType t = x.scalar_type();
  AMPK_CHECK_ARG(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf || t == at::kDouble, "x",
                 "expected float32, bfloat16, float16 or float64, got ", t);
  AMPK_CHECK_ARG(x.dim() == 2, "x", "expected a 2-D tensor [M, K], got ", x.dim(), " dimensions");
  AMPK_CHECK_ARG(x.numel() > 0, "x", "expected at least one element, got shape ", list_of(x.sizes()));
  AMPK_CHECK_ARG(dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2, "dtype",
                 "expected float8_e4m3fn or float8_e5m2, got ", dtype);
  AMPK_CHECK_ARG(write_data || write_t, "write_data", "nothing to write: write_data and write_t are both false");
  AMPK_CHECK_ARG(!(per_row && write_data && write_t), "per_row", "the pair (both layouts) is tensorwise only");
  const int64_t count = per_row ? (write_t ? x.size(1) : x.size(0)) : 1;
  check_per_row_vector(scale, "scale", x, count, true);
  check_per_row_vector(amax_out, "amax_out", x, count, true);
  check_per_row_vector(found_inf, "found_inf", x, 1, false);
  if (amax_scratch.has_value()) {
    AMPK_CHECK_ARG(!per_row && !scale.has_value(), "amax_scratch", "only for tensorwise current scaling");
    AMPK_CHECK_ARG(amax_scratch->scalar_type() == at::kInt && amax_scratch->numel() == 3 &&
                       amax_scratch->is_contiguous(),
                   "amax_scratch", "expected a contiguous int32 tensor of 3 elements");
    AMPK_CHECK_SAME_DEVICE(*amax_scratch, x, "amax_scratch");
  }
#ifdef AMPK_WITH_CUDA
  if (x.is_cuda()) {
    const at::Tensor xs = t == at::kDouble ? saturate_to_float32(x) : x;
    Float8CastArgs args{xs, dtype, per_row, write_data, write_t, scale, amax_out, found_inf, amax_scratch};
    return float8_cast_cuda(args);
  }
#endif
  TORCH_CHECK(false, "ampkernels: to_float8_native runs CUDA tensors only (in a CUDA build of the extension); ",
              "ampkernels.float8.to_float8 casts ", x.device(), " tensors with its 'torch' backend");
}

}  // namespace
}  // namespace ampkernels

TORCH_LIBRARY_FRAGMENT(ampkernels, m) {
  m.def(
      "to_float8_native(Tensor x, ScalarType dtype, bool per_row, bool write_data, bool write_t, Tensor? scale, "
      "Tensor(a!)? amax_out, Tensor(b!)? found_inf, Tensor? amax_scratch) -> (Tensor, Tensor, Tensor)");
}

// The CPU registration only checks the arguments and then says the kernel needs CUDA tensors: a clear error instead
// of the dispatcher's, and argument checks testable without a GPU.
TORCH_LIBRARY_IMPL(ampkernels, CPU, m) { m.impl("to_float8_native", &ampkernels::to_float8_native); }

#ifdef AMPK_WITH_CUDA
TORCH_LIBRARY_IMPL(ampkernels, CUDA, m) { m.impl("to_float8_native", &ampkernels::to_float8_native); }
#endif
