// Launcher of the wgmma scaled matmul (kernels: wgmma.cuh; instantiations:
// generated/wgmma_<dtype>_tile128x<width>.cu, one file each so that ninja compiles them in parallel): TMA tensor maps,
// dispatch over dtype x tile width (scaled_matmul_wgmma_schedule) x layouts.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <cudaTypedefs.h>

#include <cstring>

#include "common/checks.h"
#include "matmul/scaled_matmul.h"
#include "matmul/wgmma.cuh"

namespace ampkernels {
namespace wgmma_mm {

extern template void launch_layouts<__nv_bfloat16, 256>(const Params&, const CUtensorMap&, const CUtensorMap&, int,
                                                        int, cudaStream_t);
extern template void launch_layouts<__nv_bfloat16, 192>(const Params&, const CUtensorMap&, const CUtensorMap&, int,
                                                        int, cudaStream_t);
extern template void launch_layouts<__nv_bfloat16, 128>(const Params&, const CUtensorMap&, const CUtensorMap&, int,
                                                        int, cudaStream_t);
extern template void launch_layouts<__half, 256>(const Params&, const CUtensorMap&, const CUtensorMap&, int, int,
                                                 cudaStream_t);
extern template void launch_layouts<__half, 192>(const Params&, const CUtensorMap&, const CUtensorMap&, int, int,
                                                 cudaStream_t);
extern template void launch_layouts<__half, 128>(const Params&, const CUtensorMap&, const CUtensorMap&, int, int,
                                                 cudaStream_t);

namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_tiled(const char* op) {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  if (fn == nullptr) {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult found{};
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &found));
    TORCH_CHECK(found == cudaDriverEntryPointSuccess && ptr != nullptr, "ampkernels: ", op,
                ": the CUDA driver has no cuTensorMapEncodeTiled (needs CUDA 12+)");
    fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }
  return fn;
}

// A 2-D tensor map over 16-bit elements (tensor_map_2d).
CUtensorMap tensor_map(const void* base, bool bf16, int64_t inner, int64_t outer, int64_t ld, int box_inner,
                       int box_outer) {
  return tensor_map_2d(base, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, inner,
                       outer, ld, box_inner, box_outer, "scaled_matmul_wgmma_");
}

}  // namespace

CUtensorMap tensor_map_2d(const void* base, CUtensorMapDataType type, int elem_bytes, int64_t inner, int64_t outer,
                          int64_t ld, int box_inner, int box_outer, const char* op) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(inner), static_cast<cuuint64_t>(outer)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld) * elem_bytes};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_inner), static_cast<cuuint32_t>(box_outer)};
  const cuuint32_t steps[2] = {1, 1};
  const CUresult r = encode_tiled(op)(&map, type, 2, const_cast<void*>(base), dims, strides, box, steps,
                                      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(r == CUDA_SUCCESS, ::ampkernels::message("ampkernels: ", op, ": cuTensorMapEncodeTiled failed (error ",
                                                      static_cast<int>(r), ") for a ", outer, " x ", inner,
                                                      " operand with leading dimension ", ld));
  return map;
}

}  // namespace wgmma_mm

// Args: the checked arguments of ampkernels::scaled_matmul_wgmma_ (scaled_matmul_ops.cpp), on one CUDA device.
// Returns: true when the wgmma kernel ran; false when it cannot take these operands (TMA needs 16-byte-aligned bases
// and leading dimensions, and K > 0), and the caller runs the WMMA kernel instead.
bool scaled_matmul_wgmma_cuda(const ScaledMatmulArgs& args) {
  using namespace wgmma_mm;
  const at::Tensor& a = args.a;
  const int64_t M = a.size(0), K = a.size(1), N = args.b.size(1);
  AMPK_CHECK_ARG(scaled_matmul_wgmma_built(), "a",
                 "this build of ampkernels has no wgmma kernel: rebuild with TORCH_CUDA_ARCH_LIST including 9.0a "
                 "(built for \"", AMPK_CUDA_ARCH_LIST, "\")");
  const int dev = a.get_device();
  const wmma_mm::DeviceInfo info = wmma_mm::device_info(dev);
  AMPK_CHECK_ARG(info.major == 9 && info.minor == 0, "a",
                 "the wgmma kernel needs a compute capability 9.0 GPU (H100, H200), got ", info.major, ".", info.minor,
                 " on ", a.device());
  if (M == 0 || N == 0) return true;
  const void* pa = a.data_ptr();
  const void* pb = args.b.data_ptr();
  using wmma_mm::aligned16;
  if (K == 0 || !aligned16(pa) || !aligned16(pb) || args.la.ld % 8 != 0 || args.lb.ld % 8 != 0) return false;
  const c10::cuda::CUDAGuard guard(a.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev);
  const bool bf16 = a.scalar_type() == at::kBFloat16;
  const int sms = info.sms;

  Params p = wmma_mm::params_of(args);
  const WgmmaSchedule schedule = scaled_matmul_wgmma_schedule(M, N, sms);
  const int bn = schedule.bn;
  const int grid = static_cast<int>(schedule.grid);
  p.tiles_m = (p.M + kBM - 1) / kBM;
  p.tiles_n = (p.N + bn - 1) / bn;
  // a: row-major [M, K] -> lines of K, boxes 64 (K) x 128 (M); column-major -> lines of M, boxes 64 (M) x 64 (K).
  const CUtensorMap ma =
      p.row_a ? tensor_map(pa, bf16, K, M, p.lda, kBK, kBM) : tensor_map(pa, bf16, M, K, p.lda, kBox, kBK);
  // b: row-major [K, N] -> lines of N, boxes 64 (N) x 64 (K); column-major -> lines of K, boxes 64 (K) x BN (N).
  const CUtensorMap mb =
      p.row_b ? tensor_map(pb, bf16, N, K, p.ldb, kBox, kBK) : tensor_map(pb, bf16, K, N, p.ldb, kBK, bn);
  if (bf16) {
    if (bn == 256) launch_layouts<__nv_bfloat16, 256>(p, ma, mb, dev, grid, stream);
    else if (bn == 192) launch_layouts<__nv_bfloat16, 192>(p, ma, mb, dev, grid, stream);
    else launch_layouts<__nv_bfloat16, 128>(p, ma, mb, dev, grid, stream);
  } else {
    if (bn == 256) launch_layouts<__half, 256>(p, ma, mb, dev, grid, stream);
    else if (bn == 192) launch_layouts<__half, 192>(p, ma, mb, dev, grid, stream);
    else launch_layouts<__half, 128>(p, ma, mb, dev, grid, stream);
  }
  return true;
}

}  // namespace ampkernels
