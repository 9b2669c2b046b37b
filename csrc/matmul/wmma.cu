// Launcher of the WMMA scaled matmul (kernels: wmma.cuh; tuned instantiations:
// generated/wmma_<dtype>_<tile>.cu). The portable kernels are instantiated here.
// c10 headers only: ATen/cuda/CUDAContext.h pulls in cuSPARSE/cuBLAS headers a minimal toolkit lacks.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common/checks.h"
#include "matmul/scaled_matmul.h"
#include "matmul/wmma.cuh"

namespace ampkernels {
namespace wmma_mm {

void raise_smem_limit(const void* kernel, int bytes, int dev, bool* raised_per_device) {
  if (dev < 64 && raised_per_device[dev]) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  if (dev < 64) raised_per_device[dev] = true;
}

void check_grid(int64_t blocks, int M, int N) {
  TORCH_CHECK(blocks < (int64_t(1) << 31),
              ::ampkernels::message("ampkernels: scaled_matmul_wmma_: an output of ", M, " x ", N,
                                    " needs more thread blocks than one launch takes"));
}

void check_last_launch() { C10_CUDA_KERNEL_LAUNCH_CHECK(); }

// The tuned instantiations live in their own files (parallel compilation).
extern template void launch_tuned<__half, CfgW>(const Params&, bool, bool, int, cudaStream_t);
extern template void launch_tuned<__nv_bfloat16, CfgW>(const Params&, bool, bool, int, cudaStream_t);
extern template void launch_tuned<__half, CfgX>(const Params&, bool, bool, int, cudaStream_t);
extern template void launch_tuned<__nv_bfloat16, CfgX>(const Params&, bool, bool, int, cudaStream_t);
extern template void launch_tuned<__half, CfgXD>(const Params&, bool, bool, int, cudaStream_t);
extern template void launch_tuned<__nv_bfloat16, CfgXD>(const Params&, bool, bool, int, cudaStream_t);

DeviceInfo device_info(int dev) {
  static DeviceInfo cached[64];
  if (dev < 64 && cached[dev].major > 0) return cached[dev];
  DeviceInfo info;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.major, cudaDevAttrComputeCapabilityMajor, dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.minor, cudaDevAttrComputeCapabilityMinor, dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.sms, cudaDevAttrMultiProcessorCount, dev));
  if (dev < 64) cached[dev] = info;
  return info;
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

Params params_of(const ScaledMatmulArgs& args) {
  Params p{};
  p.a = static_cast<const uint16_t*>(args.a.data_ptr());
  p.b = static_cast<const uint16_t*>(args.b.data_ptr());
  p.lda = args.la.ld;
  p.ldb = args.lb.ld;
  p.row_a = args.la.row_major;
  p.row_b = args.lb.row_major;
  p.M = static_cast<int>(args.a.size(0));
  p.N = static_cast<int>(args.b.size(1));
  p.K = static_cast<int>(args.a.size(1));
  p.scale = args.scale.defined() ? args.scale.data_ptr<float>() : nullptr;
  p.scale_mode = static_cast<int>(args.scale_mode);
  p.alpha = static_cast<float>(args.alpha);
  p.bias = args.bias.defined() ? args.bias.data_ptr() : nullptr;
  p.bias_kind = !args.bias.defined() ? kBiasNone : (args.bias.scalar_type() == at::kFloat ? kBiasF32 : kBiasInput);
  p.out = args.out.data_ptr();
  const at::ScalarType od = args.out.scalar_type();
  p.out_kind = od == at::kFloat ? kOutF32 : (od == at::kHalf ? kOutF16 : kOutBF16);
  p.accumulate = args.accumulate;
  p.out_vec = aligned16(p.out) && p.N % 8 == 0;
  p.found_inf = args.found_inf.defined() ? args.found_inf.data_ptr<float>() : nullptr;
  return p;
}

namespace {

template <typename C>
bool fits(int max_smem) {
  return smem_bytes<C, true, true>() <= max_smem && smem_bytes<C, true, false>() <= max_smem &&
         smem_bytes<C, false, true>() <= max_smem && smem_bytes<C, false, false>() <= max_smem;
}

template <typename C>
void set_tiles(Params& p) {
  p.tiles_m = (p.M + C::BM - 1) / C::BM;
  p.tiles_n = (p.N + C::BN - 1) / C::BN;
}

template <typename C>
int64_t num_tiles(const Params& p) {
  return int64_t((p.M + C::BM - 1) / C::BM) * ((p.N + C::BN - 1) / C::BN);
}

template <typename T, typename C>
bool try_tuned(Params& p, const DeviceInfo& info, int dev, cudaStream_t stream) {
  if (!fits<C>(info.max_smem)) return false;
  set_tiles<C>(p);
  launch_tuned<T, C>(p, p.row_a, p.row_b, dev, stream);
  return true;
}

template <typename T>
void dispatch(Params p, bool vec, int dev, cudaStream_t stream) {
  const DeviceInfo info = device_info(dev);
  // The configuration forced for the probes and tests (forced_wmma_tile: scaled_matmul.h), else kAuto.
  const WmmaTile tile = forced_wmma_tile();
  if (info.major >= 8 && vec && tile != WmmaTile::kPortable) {
    if (tile == WmmaTile::k128x128x32w4 && try_tuned<T, CfgW>(p, info, dev, stream)) return;
    if (tile == WmmaTile::k128x128x64w4 && try_tuned<T, CfgX>(p, info, dev, stream)) return;
    if (tile == WmmaTile::k128x128x64w4db && try_tuned<T, CfgXD>(p, info, dev, stream)) return;
    // auto, by waves of two blocks per SM, each configuration where it measured fastest (dev/matmul/wmma/NOTES.md):
    // 2 waves or more 128x128x64w4db, 1-2 waves 128x128x64w4, fewer 128x128x32w4.
    const int64_t waves = num_tiles<CfgX>(p) / (2 * int64_t(info.sms));
    if (waves >= 2 && try_tuned<T, CfgXD>(p, info, dev, stream)) return;
    if (waves >= 1 && try_tuned<T, CfgX>(p, info, dev, stream)) return;
    if (try_tuned<T, CfgW>(p, info, dev, stream)) return;
  }
  set_tiles<CfgP>(p);
  launch_one<T, CfgP, true, true, false>(p, dev, stream);
}

}  // namespace
}  // namespace wmma_mm

// Args: the checked arguments of ampkernels::scaled_matmul_wmma_ (scaled_matmul_ops.cpp), on one CUDA device.
// Returns: nothing; writes out (and found_inf[0] = 1 if a stored value is not finite) on the current stream.
void scaled_matmul_wmma_cuda(const ScaledMatmulArgs& args) {
  using namespace wmma_mm;
  const at::Tensor& a = args.a;
  if (a.size(0) == 0 || args.b.size(1) == 0) return;
  const c10::cuda::CUDAGuard guard(a.device());
  const int dev = a.get_device();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev);
  const bool bf16 = a.scalar_type() == at::kBFloat16;
  AMPK_CHECK_ARG(!bf16 || device_info(dev).major >= 8, "a",
                 "bfloat16 tensor-core matmul needs compute capability 8.0 or newer; use float16 on this GPU");

  const Params p = params_of(args);
  // 16-byte copies need 16-byte-aligned bases and row strides (a multiple of 8 elements).
  const bool vec = aligned16(p.a) && aligned16(p.b) && p.lda % 8 == 0 && p.ldb % 8 == 0;
  if (bf16)
    dispatch<__nv_bfloat16>(p, vec, dev, stream);
  else
    dispatch<__half>(p, vec, dev, stream);
}

}  // namespace ampkernels
