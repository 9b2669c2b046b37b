// ampkernels::scaled_matmul_wmma_ and ampkernels::scaled_matmul_wgmma_: argument checks and registration of the
// native scaled matmuls (kernels: wmma.cuh, wgmma.cuh). The Python op
// ampkernels.scaled_matmul calls them as its "wmma" and "wgmma" backends.
#include <ATen/MemoryOverlap.h>
#include <torch/library.h>

#include <limits>
#include <optional>
#include <string>

#include "common/checks.h"
#include "matmul/scaled_matmul.h"

namespace ampkernels {
namespace {

std::string strides_of(const at::Tensor& t) { return list_of(t.strides()); }

// Row-major when the column stride is 1, column-major when the row stride is 1 (a dimension of size 1 may have any
// stride); anything else is refused.
MatLayout layout_of(const at::Tensor& t, const char* arg) {
  const int64_t rows = t.size(0), cols = t.size(1);
  if (t.stride(1) == 1 || cols <= 1) return {true, rows <= 1 ? std::max<int64_t>(cols, 1) : t.stride(0)};
  if (t.stride(0) == 1 || rows <= 1) return {false, cols <= 1 ? std::max<int64_t>(rows, 1) : t.stride(1)};
  AMPK_CHECK_ARG(false, arg, "expected a row-major (stride(1) == 1) or column-major (stride(0) == 1) matrix, got "
                 "strides ", strides_of(t), "; make it contiguous first");
  return {};
}

bool is_half_or_bf16(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

void check_no_overlap(const at::Tensor& out, const at::Tensor& in, const char* in_arg) {
  const at::MemOverlapStatus s = at::get_overlap_status(out, in);
  AMPK_CHECK_ARG(s != at::MemOverlapStatus::Full && s != at::MemOverlapStatus::Partial, "out",
                 "must not overlap '", in_arg, "' in memory");
}

// Checks every argument (errors name it) and collects them for the launcher. Device checks come last, so that
// everything else can be tested with CPU tensors.
ScaledMatmulArgs check_args(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& scale,
                            int64_t scale_mode, double alpha, const std::optional<at::Tensor>& bias,
                            const at::Tensor& out, bool accumulate, const std::optional<at::Tensor>& found_inf,
                            const char* kernel) {
  AMPK_CHECK_ARG(a.dim() == 2, "a", "expected a 2-D tensor, got ", a.dim(), " dimensions");
  AMPK_CHECK_ARG(b.dim() == 2, "b", "expected a 2-D tensor, got ", b.dim(), " dimensions");
  AMPK_CHECK_ARG(is_half_or_bf16(a.scalar_type()), "a", "expected float16 or bfloat16, got ", a.scalar_type());
  AMPK_CHECK_ARG(b.scalar_type() == a.scalar_type(), "b", "expected the dtype of 'a' (", a.scalar_type(), "), got ",
                 b.scalar_type());
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  AMPK_CHECK_ARG(b.size(0) == K, "b", "expected ", K, " rows (a is ", M, " x ", K, "), got ", b.size(0));
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  AMPK_CHECK_ARG(M <= kMax && K <= kMax, "a", "each dimension must be below 2^31, got ", M, " x ", K);
  AMPK_CHECK_ARG(N <= kMax, "b", "each dimension must be below 2^31, got ", K, " x ", N);

  ScaledMatmulArgs args;
  args.a = a;
  args.b = b;
  args.la = layout_of(a, "a");
  args.lb = layout_of(b, "b");

  AMPK_CHECK_ARG(scale_mode >= 0 && scale_mode <= 3, "scale_mode",
                 "expected 0 (no scale), 1 (one element), 2 (per row) or 3 (per column), got ", scale_mode);
  if (scale_mode == 0) {
    AMPK_CHECK_ARG(!scale.has_value(), "scale", "expected None with scale_mode 0");
  } else {
    AMPK_CHECK_ARG(scale.has_value(), "scale", "expected a tensor with scale_mode ", scale_mode, ", got None");
    const at::Tensor& s = *scale;
    AMPK_CHECK_ARG(s.scalar_type() == at::kFloat, "scale", "expected float32, got ", s.scalar_type());
    AMPK_CHECK_ARG(s.is_contiguous(), "scale", "expected a contiguous tensor");
    if (scale_mode == 1) {
      AMPK_CHECK_ARG(s.numel() == 1, "scale", "expected 1 element with scale_mode 1, got ", s.numel());
    } else {
      const int64_t want = scale_mode == 2 ? M : N;
      AMPK_CHECK_ARG(s.dim() == 1 && s.size(0) == want, "scale", "expected a 1-D tensor of ", want, " elements (",
                     scale_mode == 2 ? "one per row of a" : "one per column of b", "), got shape ", list_of(s.sizes()));
    }
    args.scale = s;
  }
  args.scale_mode = scale_mode;
  args.alpha = alpha;

  if (bias.has_value()) {
    const at::Tensor& t = *bias;
    AMPK_CHECK_ARG(t.dim() == 1 && t.size(0) == N, "bias", "expected a 1-D tensor of ", N, " elements, got shape ",
                   list_of(t.sizes()));
    AMPK_CHECK_ARG(t.scalar_type() == at::kFloat || t.scalar_type() == a.scalar_type(), "bias",
                   "expected float32 or the dtype of 'a' (", a.scalar_type(), "), got ", t.scalar_type());
    AMPK_CHECK_ARG(t.is_contiguous(), "bias", "expected a contiguous tensor");
    args.bias = t;
  }

  AMPK_CHECK_ARG(out.dim() == 2 && out.size(0) == M && out.size(1) == N, "out", "expected shape [", M, ", ", N,
                 "], got ", list_of(out.sizes()));
  AMPK_CHECK_ARG(out.scalar_type() == at::kFloat || is_half_or_bf16(out.scalar_type()), "out",
                 "expected float32, float16 or bfloat16, got ", out.scalar_type());
  AMPK_CHECK_ARG(out.is_contiguous(), "out", "expected a row-major contiguous tensor, got strides ",
                 strides_of(out));
  check_no_overlap(out, a, "a");
  check_no_overlap(out, b, "b");
  args.out = out;
  args.accumulate = accumulate;

  if (found_inf.has_value()) {
    AMPK_CHECK_SCALAR_FLOAT(*found_inf, "found_inf");
    args.found_inf = *found_inf;
  }

  AMPK_CHECK_ARG(a.is_cuda(), "a", "the ", kernel, " kernel runs on CUDA tensors, got one on ", a.device());
  AMPK_CHECK_SAME_DEVICE(b, a, "b");
  AMPK_CHECK_SAME_DEVICE(out, a, "out");
  if (args.scale.defined()) AMPK_CHECK_SAME_DEVICE(args.scale, a, "scale");
  if (args.bias.defined()) AMPK_CHECK_SAME_DEVICE(args.bias, a, "bias");
  if (args.found_inf.defined()) AMPK_CHECK_SAME_DEVICE(args.found_inf, a, "found_inf");
  return args;
}

// Args: a [M, K], b [K, N] (fp16 or bf16, row- or column-major); scale per scale_mode (0 none, 1 one element,
// 2 [M], 3 [N]; float32); alpha (host float); bias [N] or None; out [M, N] (fp16/bf16/fp32, contiguous);
// accumulate; found_inf (1-element float32) or None.
// Returns: nothing. out = alpha * scale * (a @ b) + bias (+ out when accumulate), fp32 math; found_inf[0] = 1 when
// a stored value is not finite (never cleared). Equivalent to `out (+)= (alpha * scale * (a.float() @ b.float()) +
// bias).to(out.dtype)`.
void scaled_matmul_wmma_(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& scale,
                         int64_t scale_mode, double alpha, const std::optional<at::Tensor>& bias,
                         const at::Tensor& out, bool accumulate, const std::optional<at::Tensor>& found_inf) {
  const ScaledMatmulArgs args = check_args(a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf, "WMMA");
#ifdef AMPK_WITH_CUDA
  scaled_matmul_wmma_cuda(args);
#else
  TORCH_CHECK(false, "ampkernels: the native extension was built without CUDA; rebuild it with a CUDA toolkit "
                     "(pip install --no-build-isolation -e .) to use scaled_matmul_wmma_");
#endif
}

// The same contract as scaled_matmul_wmma_, on the sm_90a wgmma kernel (warp-specialized, TMA, Hopper only).
// Operands TMA cannot read (a base or leading dimension not 16-byte aligned) and K == 0 run the WMMA kernel.
void scaled_matmul_wgmma_(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& scale,
                          int64_t scale_mode, double alpha, const std::optional<at::Tensor>& bias,
                          const at::Tensor& out, bool accumulate, const std::optional<at::Tensor>& found_inf) {
  const ScaledMatmulArgs args = check_args(a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf, "wgmma");
#ifdef AMPK_WITH_CUDA
  if (!scaled_matmul_wgmma_cuda(args)) scaled_matmul_wmma_cuda(args);
#else
  TORCH_CHECK(false, "ampkernels: the native extension was built without CUDA; rebuild it with a CUDA toolkit "
                     "(pip install --no-build-isolation -e .) to use scaled_matmul_wgmma_");
#endif
}

}  // namespace
}  // namespace ampkernels

TORCH_LIBRARY_FRAGMENT(ampkernels, m) {
  m.def(
      "scaled_matmul_wmma_(Tensor a, Tensor b, Tensor? scale, int scale_mode, float alpha, Tensor? bias, "
      "Tensor(a!) out, bool accumulate, Tensor(b!)? found_inf) -> ()");
  m.def(
      "scaled_matmul_wgmma_(Tensor a, Tensor b, Tensor? scale, int scale_mode, float alpha, Tensor? bias, "
      "Tensor(a!) out, bool accumulate, Tensor(b!)? found_inf) -> ()");
}

// The CPU registration only checks the arguments and then says the kernel needs CUDA tensors: a clear error instead
// of the dispatcher's, and argument checks testable without a GPU.
TORCH_LIBRARY_IMPL(ampkernels, CPU, m) {
  m.impl("scaled_matmul_wmma_", &ampkernels::scaled_matmul_wmma_);
  m.impl("scaled_matmul_wgmma_", &ampkernels::scaled_matmul_wgmma_);
}

#ifdef AMPK_WITH_CUDA
TORCH_LIBRARY_IMPL(ampkernels, CUDA, m) {
  m.impl("scaled_matmul_wmma_", &ampkernels::scaled_matmul_wmma_);
  m.impl("scaled_matmul_wgmma_", &ampkernels::scaled_matmul_wgmma_);
}
#endif
