// Launcher of the FP8 wgmma scaled matmul (kernel: wgmma_fp8.cuh; instantiations:
// generated/wgmma_fp8_<a>_<b>_tile128x<width>.cu): TMA tensor maps, dispatch over operand types x tile width
// (scaled_matmul_wgmma_schedule, as the 16-bit kernel: an FP8 stage has its bytes and its MMA time per byte).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>

#include "common/checks.h"
#include "matmul/scaled_matmul.h"
#include "matmul/wgmma_fp8.cuh"

namespace ampkernels {
namespace wgmma_mm {

#define AMPK_FP8_EXTERN(BN, A, B)                                                                             \
  extern template void launch_fp8<BN, A, B>(const Fp8Params&, const CUtensorMap&, const CUtensorMap&, int, int, \
                                            cudaStream_t)
AMPK_FP8_EXTERN(256, kE4M3, kE4M3);
AMPK_FP8_EXTERN(192, kE4M3, kE4M3);
AMPK_FP8_EXTERN(128, kE4M3, kE4M3);
AMPK_FP8_EXTERN(256, kE4M3, kE5M2);
AMPK_FP8_EXTERN(192, kE4M3, kE5M2);
AMPK_FP8_EXTERN(128, kE4M3, kE5M2);
AMPK_FP8_EXTERN(256, kE5M2, kE4M3);
AMPK_FP8_EXTERN(192, kE5M2, kE4M3);
AMPK_FP8_EXTERN(128, kE5M2, kE4M3);
#undef AMPK_FP8_EXTERN

namespace {

template <int kA, int kB>
void launch_width(int bn, const Fp8Params& q, const CUtensorMap& ma, const CUtensorMap& mb, int dev, int grid,
                  cudaStream_t stream) {
  if (bn == 256) launch_fp8<256, kA, kB>(q, ma, mb, dev, grid, stream);
  else if (bn == 192) launch_fp8<192, kA, kB>(q, ma, mb, dev, grid, stream);
  else launch_fp8<128, kA, kB>(q, ma, mb, dev, grid, stream);
}

}  // namespace
}  // namespace wgmma_mm

// Args: the checked arguments of ampkernels::scaled_matmul_fp8_wgmma_ (scaled_matmul_ops.cpp), on one CUDA device.
// Returns: nothing; writes out (found_inf[0] = 1 if a stored value is not finite; amax_out[0] = max(amax_out[0],
// max |out|)) on the current stream.
void scaled_matmul_fp8_wgmma_cuda(const ScaledMatmulFp8Args& args) {
  using namespace wgmma_mm;
  const at::Tensor& a = args.mm.a;
  const at::Tensor& b = args.mm.b;
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  AMPK_CHECK_ARG(scaled_matmul_wgmma_built(), "a",
                 "this build of ampkernels has no wgmma kernel: rebuild with TORCH_CUDA_ARCH_LIST including 9.0a "
                 "(built for \"", AMPK_CUDA_ARCH_LIST, "\")");
  const int dev = a.get_device();
  const wmma_mm::DeviceInfo info = wmma_mm::device_info(dev);
  AMPK_CHECK_ARG(info.major == 9 && info.minor == 0, "a",
                 "the FP8 wgmma kernel needs a compute capability 9.0 GPU (H100, H200), got ", info.major, ".",
                 info.minor, " on ", a.device());
  if (M == 0 || N == 0) return;
  const c10::cuda::CUDAGuard guard(a.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev);

  Fp8Params q{};
  q.p = wmma_mm::params_of(args.mm);
  q.scale_a = args.scale_a.defined() ? args.scale_a.data_ptr<float>() : nullptr;
  q.scale_b = args.scale_b.defined() ? args.scale_b.data_ptr<float>() : nullptr;
  q.row_scale_a = args.scale_a.defined() && args.scale_a.numel() != 1;
  q.col_scale_b = args.scale_b.defined() && args.scale_b.numel() != 1;
  q.amax_out = args.amax_out.defined() ? args.amax_out.data_ptr<float>() : nullptr;

  const WgmmaSchedule schedule = scaled_matmul_wgmma_schedule(M, N, info.sms);
  const int bn = schedule.bn;
  const int grid = static_cast<int>(schedule.grid);
  q.p.tiles_m = (q.p.M + kBM - 1) / kBM;
  q.p.tiles_n = (q.p.N + bn - 1) / bn;
  // Both operands as lines of K bytes: a's M rows in boxes of 128 (K) x 128 (M), b's N columns in 128 x BN.
  constexpr const char* kOp = "scaled_matmul_fp8_wgmma_";
  const CUtensorMap ma =
      tensor_map_2d(a.data_ptr(), CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, K, M, q.p.lda, kBKFp8, kBM, kOp);
  const CUtensorMap mb =
      tensor_map_2d(b.data_ptr(), CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, K, N, q.p.ldb, kBKFp8, bn, kOp);
  const bool a_e5m2 = a.scalar_type() == at::kFloat8_e5m2;
  const bool b_e5m2 = b.scalar_type() == at::kFloat8_e5m2;
  if (a_e5m2) launch_width<kE5M2, kE4M3>(bn, q, ma, mb, dev, grid, stream);
  else if (b_e5m2) launch_width<kE4M3, kE5M2>(bn, q, ma, mb, dev, grid, stream);
  else launch_width<kE4M3, kE4M3>(bn, q, ma, mb, dev, grid, stream);
}

}  // namespace ampkernels
