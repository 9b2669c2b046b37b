// ampkernels::scaled_matmul_wmma_, ampkernels::scaled_matmul_wgmma_ and ampkernels::scaled_matmul_fp8_wgmma_: argument
// checks and registration of the native scaled matmuls (kernels: wmma.cuh, wgmma.cuh, wgmma_fp8.cuh). The Python op
// ampkernels.scaled_matmul calls them as its "wmma" and "wgmma" backends (the float8 one for float8 operands). Also
// the configurations forced for the probes and tests (set_matmul_tuning: scaled_matmul.h).
#include <torch/library.h>

#include <atomic>
#include <iterator>
#include <limits>
#include <optional>
#include <string>
#include <utility>

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

// The bytes from x's first element to its last (empty for no elements): every element lies in it.
std::pair<uintptr_t, uintptr_t> byte_range(const at::Tensor& x) {
  if (x.numel() == 0) return {0, 0};
  int64_t extent = 0;
  for (int64_t d = 0; d < x.dim(); ++d)
    if (x.size(d) > 1) extent += (x.size(d) - 1) * x.stride(d);
  const auto begin = reinterpret_cast<uintptr_t>(x.data_ptr());
  return {begin, begin + static_cast<uintptr_t>(extent + 1) * x.element_size()};
}

// `out` is written while the kernels still read `in` (a and b, the epilogue's factors and bias) or write it
// (found_inf, amax_out): their ranges of memory must be apart. Ranges, not elements (as the Python wrapper checks):
// get_overlap_status gives up ("too hard") on views with gaps, such as an operand with padded rows.
void check_no_overlap(const at::Tensor& out, const at::Tensor& in, const char* in_arg) {
  if (!in.defined() || in.device() != out.device()) return;  // other devices: refused by check_devices
  const auto [o0, o1] = byte_range(out);
  const auto [i0, i1] = byte_range(in);
  AMPK_CHECK_ARG(!(o0 < i1 && i0 < o1), "out", "must not overlap '", in_arg, "' in memory");
}

// Checks the epilogue's arguments of an M x N product (errors name them) into `args`: scale (scale_mode), alpha, bias
// (float32 or `bias_dtype`, named `bias_dtype_name`), out, accumulate, found_inf.
void check_epilogue(ScaledMatmulArgs& args, int64_t M, int64_t N, const std::optional<at::Tensor>& scale,
                    int64_t scale_mode, double alpha, const std::optional<at::Tensor>& bias, at::ScalarType bias_dtype,
                    const char* bias_dtype_name, const at::Tensor& out, bool accumulate,
                    const std::optional<at::Tensor>& found_inf) {
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
    AMPK_CHECK_ARG(t.scalar_type() == at::kFloat || t.scalar_type() == bias_dtype, "bias", "expected float32 or ",
                   bias_dtype_name, " (", bias_dtype, "), got ", t.scalar_type());
    AMPK_CHECK_ARG(t.is_contiguous(), "bias", "expected a contiguous tensor");
    args.bias = t;
  }

  AMPK_CHECK_ARG(out.dim() == 2 && out.size(0) == M && out.size(1) == N, "out", "expected shape [", M, ", ", N,
                 "], got ", list_of(out.sizes()));
  AMPK_CHECK_ARG(out.scalar_type() == at::kFloat || is_half_or_bf16(out.scalar_type()), "out",
                 "expected float32, float16 or bfloat16, got ", out.scalar_type());
  AMPK_CHECK_ARG(out.is_contiguous(), "out", "expected a row-major contiguous tensor, got strides ",
                 strides_of(out));
  args.out = out;
  args.accumulate = accumulate;

  if (found_inf.has_value()) {
    AMPK_CHECK_SCALAR_FLOAT(*found_inf, "found_inf");
    args.found_inf = *found_inf;
  }
  check_no_overlap(out, args.a, "a");
  check_no_overlap(out, args.b, "b");
  check_no_overlap(out, args.scale, "scale");
  check_no_overlap(out, args.bias, "bias");
  check_no_overlap(out, args.found_inf, "found_inf");
}

// Every tensor of `args` on a's CUDA device (last, so that everything else can be tested with CPU tensors).
void check_devices(const ScaledMatmulArgs& args, const char* kernel) {
  const at::Tensor& a = args.a;
  AMPK_CHECK_ARG(a.is_cuda(), "a", "the ", kernel, " kernel runs on CUDA tensors, got one on ", a.device());
  AMPK_CHECK_SAME_DEVICE(args.b, a, "b");
  AMPK_CHECK_SAME_DEVICE(args.out, a, "out");
  if (args.scale.defined()) AMPK_CHECK_SAME_DEVICE(args.scale, a, "scale");
  if (args.bias.defined()) AMPK_CHECK_SAME_DEVICE(args.bias, a, "bias");
  if (args.found_inf.defined()) AMPK_CHECK_SAME_DEVICE(args.found_inf, a, "found_inf");
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
  check_epilogue(args, M, N, scale, scale_mode, alpha, bias, a.scalar_type(), "the dtype of 'a'", out, accumulate,
                 found_inf);
  check_devices(args, kernel);
  return args;
}

bool is_float8(at::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }

// A dequantization factor of torch._scaled_mm: float32, contiguous, one element or `per` (one per row of a or
// column of b).
at::Tensor check_dequant_scale(const std::optional<at::Tensor>& scale, int64_t per, const char* arg,
                               const char* what) {
  if (!scale.has_value()) return {};
  const at::Tensor& s = *scale;
  AMPK_CHECK_ARG(s.scalar_type() == at::kFloat, arg, "expected float32, got ", s.scalar_type());
  AMPK_CHECK_ARG(s.is_contiguous(), arg, "expected a contiguous tensor");
  AMPK_CHECK_ARG(s.numel() == 1 || s.numel() == per, arg, "expected 1 element (tensorwise) or ", per, " (", what,
                 "), got shape ", list_of(s.sizes()));
  return s;
}

// The float8 op's checks: a [M, K] row-major and b [K, N] column-major (both K-major, as fp8 wgmma reads them;
// TMA: rows of a multiple of 16 bytes, 16-byte-aligned bases), then the 16-bit ops' epilogue checks with a bias of
// float32 or out's dtype, then scale_a, scale_b, amax_out, devices.
ScaledMatmulFp8Args check_fp8_args(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& scale_a,
                                   const std::optional<at::Tensor>& scale_b, const std::optional<at::Tensor>& scale,
                                   int64_t scale_mode, double alpha, const std::optional<at::Tensor>& bias,
                                   const at::Tensor& out, bool accumulate, const std::optional<at::Tensor>& found_inf,
                                   const std::optional<at::Tensor>& amax_out) {
  AMPK_CHECK_ARG(a.dim() == 2, "a", "expected a 2-D tensor, got ", a.dim(), " dimensions");
  AMPK_CHECK_ARG(b.dim() == 2, "b", "expected a 2-D tensor, got ", b.dim(), " dimensions");
  AMPK_CHECK_ARG(is_float8(a.scalar_type()), "a", "expected float8_e4m3fn or float8_e5m2, got ", a.scalar_type());
  AMPK_CHECK_ARG(is_float8(b.scalar_type()), "b", "expected float8_e4m3fn or float8_e5m2, got ", b.scalar_type());
  AMPK_CHECK_ARG(!(a.scalar_type() == at::kFloat8_e5m2 && b.scalar_type() == at::kFloat8_e5m2), "b",
                 "float8_e5m2 x float8_e5m2 is not supported (as in torch._scaled_mm): make one operand "
                 "float8_e4m3fn");
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  AMPK_CHECK_ARG(b.size(0) == K, "b", "expected ", K, " rows (a is ", M, " x ", K, "), got ", b.size(0));
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  AMPK_CHECK_ARG(M <= kMax && K <= kMax, "a", "each dimension must be below 2^31, got ", M, " x ", K);
  AMPK_CHECK_ARG(N <= kMax, "b", "each dimension must be below 2^31, got ", K, " x ", N);
  AMPK_CHECK_ARG(K > 0 && K % 16 == 0, "a", "K = a.size(1) must be a positive multiple of 16 (TMA copies rows of a "
                 "multiple of 16 bytes), got ", K);
  // Rows of K bytes, `ld` apart (a single row or column may have any stride).
  const int64_t lda = M <= 1 ? K : a.stride(0);
  const int64_t ldb = N <= 1 ? K : b.stride(1);
  AMPK_CHECK_ARG(a.stride(1) == 1 && lda >= K && lda % 16 == 0, "a",
                 "expected a row-major [M, K] matrix (stride(1) == 1, stride(0) >= K and a multiple of 16), got "
                 "strides ", strides_of(a), "; pass a.contiguous()");
  AMPK_CHECK_ARG(b.stride(0) == 1 && ldb >= K && ldb % 16 == 0, "b",
                 "expected a column-major [K, N] matrix (b.t() contiguous: stride(0) == 1, stride(1) >= K and a "
                 "multiple of 16), got strides ", strides_of(b), "; pass b.t().contiguous().t()");
  AMPK_CHECK_ARG(reinterpret_cast<uintptr_t>(a.data_ptr()) % 16 == 0, "a",
                 "expected a 16-byte-aligned data pointer (TMA), got a view at byte offset ",
                 a.storage_offset() * a.element_size(), "; pass a.clone()");
  AMPK_CHECK_ARG(reinterpret_cast<uintptr_t>(b.data_ptr()) % 16 == 0, "b",
                 "expected a 16-byte-aligned data pointer (TMA), got a view at byte offset ",
                 b.storage_offset() * b.element_size(), "; pass b.t().contiguous().t()");

  ScaledMatmulFp8Args args;
  ScaledMatmulArgs& mm = args.mm;
  mm.a = a;
  mm.b = b;
  mm.la = {true, lda};
  mm.lb = {false, ldb};
  check_epilogue(mm, M, N, scale, scale_mode, alpha, bias, out.scalar_type(), "the dtype of 'out'", out, accumulate,
                 found_inf);
  args.scale_a = check_dequant_scale(scale_a, M, "scale_a", "one per row of a");
  args.scale_b = check_dequant_scale(scale_b, N, "scale_b", "one per column of b");
  if (amax_out.has_value()) {
    AMPK_CHECK_SCALAR_FLOAT(*amax_out, "amax_out");
    args.amax_out = *amax_out;
  }
  check_no_overlap(mm.out, args.scale_a, "scale_a");
  check_no_overlap(mm.out, args.scale_b, "scale_b");
  check_no_overlap(mm.out, args.amax_out, "amax_out");
  check_devices(mm, "FP8 wgmma");
  if (args.scale_a.defined()) AMPK_CHECK_SAME_DEVICE(args.scale_a, a, "scale_a");
  if (args.scale_b.defined()) AMPK_CHECK_SAME_DEVICE(args.scale_b, a, "scale_b");
  if (args.amax_out.defined()) AMPK_CHECK_SAME_DEVICE(args.amax_out, a, "amax_out");
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

// Args: a [M, K] row-major, b [K, N] column-major (b.t() contiguous), float8_e4m3fn or float8_e5m2 (not both e5m2),
// K a positive multiple of 16; scale_a (1 or M elements) and scale_b (1 or N) float32 dequantization factors or
// None (torch._scaled_mm's); scale per scale_mode, alpha, out, accumulate, found_inf as for scaled_matmul_wmma_;
// bias [N] float32 or out's dtype, or None; amax_out 1-element float32 or None.
// Returns: nothing. out (+)= (alpha * scale * (a.float() @ b.float()) * scale_a * scale_b + bias).to(out.dtype),
// fp32 math (ampkernels.reference.scaled_matmul_float8); found_inf[0] = 1 when a stored value is not finite;
// amax_out[0] = max(amax_out[0], max |out as stored|), NaN-propagating. Only the sm_90a wgmma kernel runs it.
void scaled_matmul_fp8_wgmma_(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& scale_a,
                              const std::optional<at::Tensor>& scale_b, const std::optional<at::Tensor>& scale,
                              int64_t scale_mode, double alpha, const std::optional<at::Tensor>& bias,
                              const at::Tensor& out, bool accumulate, const std::optional<at::Tensor>& found_inf,
                              const std::optional<at::Tensor>& amax_out) {
  const ScaledMatmulFp8Args args = check_fp8_args(a, b, scale_a, scale_b, scale, scale_mode, alpha, bias, out,
                                                  accumulate, found_inf, amax_out);
#ifdef AMPK_WITH_CUDA
  scaled_matmul_fp8_wgmma_cuda(args);
#else
  TORCH_CHECK(false, "ampkernels: the native extension was built without CUDA; rebuild it with a CUDA toolkit "
                     "(pip install --no-build-isolation -e .) to use scaled_matmul_fp8_wgmma_");
#endif
}

constexpr const char* kWmmaTileNames[] = {"auto", "128x128x32w4", "128x128x64w4", "128x128x64w4db", "portable"};
std::atomic<int> forced_wmma_tile_value{static_cast<int>(WmmaTile::kAuto)};
std::atomic<int> forced_wgmma_bn_value{0};

}  // namespace

WmmaTile forced_wmma_tile() { return static_cast<WmmaTile>(forced_wmma_tile_value.load(std::memory_order_relaxed)); }

int forced_wgmma_bn() { return forced_wgmma_bn_value.load(std::memory_order_relaxed); }

const char* wmma_tile_name(WmmaTile tile) { return kWmmaTileNames[static_cast<int>(tile)]; }

void set_matmul_tuning(const std::string& wmma_tile, int64_t wgmma_bn) {
  int tile = -1;
  for (int i = 0; i < static_cast<int>(std::size(kWmmaTileNames)); ++i)
    if (wmma_tile == kWmmaTileNames[i]) tile = i;
  TORCH_CHECK_VALUE(tile >= 0, "ampkernels: unknown WMMA tile configuration '", wmma_tile,
                    "': expected auto, 128x128x32w4, 128x128x64w4, 128x128x64w4db or portable");
  TORCH_CHECK_VALUE(wgmma_bn == 0 || wgmma_bn == 128 || wgmma_bn == 192 || wgmma_bn == 256,
                    "ampkernels: the wgmma kernels have no tile width ", wgmma_bn, ": expected 128, 192, 256 or 0 (the "
                    "launcher's own choice)");
  forced_wmma_tile_value.store(tile, std::memory_order_relaxed);
  forced_wgmma_bn_value.store(static_cast<int>(wgmma_bn), std::memory_order_relaxed);
}

}  // namespace ampkernels

TORCH_LIBRARY_FRAGMENT(ampkernels, m) {
  m.def(
      "scaled_matmul_wmma_(Tensor a, Tensor b, Tensor? scale, int scale_mode, float alpha, Tensor? bias, "
      "Tensor(a!) out, bool accumulate, Tensor(b!)? found_inf) -> ()");
  m.def(
      "scaled_matmul_wgmma_(Tensor a, Tensor b, Tensor? scale, int scale_mode, float alpha, Tensor? bias, "
      "Tensor(a!) out, bool accumulate, Tensor(b!)? found_inf) -> ()");
  m.def(
      "scaled_matmul_fp8_wgmma_(Tensor a, Tensor b, Tensor? scale_a, Tensor? scale_b, Tensor? scale, int scale_mode, "
      "float alpha, Tensor? bias, Tensor(a!) out, bool accumulate, Tensor(b!)? found_inf, Tensor(c!)? amax_out) -> ()");
}

// The CPU registration only checks the arguments and then says the kernel needs CUDA tensors: a clear error instead
// of the dispatcher's, and argument checks testable without a GPU.
TORCH_LIBRARY_IMPL(ampkernels, CPU, m) {
  m.impl("scaled_matmul_wmma_", &ampkernels::scaled_matmul_wmma_);
  m.impl("scaled_matmul_wgmma_", &ampkernels::scaled_matmul_wgmma_);
  m.impl("scaled_matmul_fp8_wgmma_", &ampkernels::scaled_matmul_fp8_wgmma_);
}

#ifdef AMPK_WITH_CUDA
TORCH_LIBRARY_IMPL(ampkernels, CUDA, m) {
  m.impl("scaled_matmul_wmma_", &ampkernels::scaled_matmul_wmma_);
  m.impl("scaled_matmul_wgmma_", &ampkernels::scaled_matmul_wgmma_);
  m.impl("scaled_matmul_fp8_wgmma_", &ampkernels::scaled_matmul_fp8_wgmma_);
}
#endif
