// Device-side loss-scale update (dev/design.md, kernel 3): one thread, no host synchronization.
// c10 headers only: ATen/cuda/CUDAContext.h pulls in cuSPARSE/cuBLAS headers a minimal toolkit lacks.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "scaler/scaler.h"

namespace ampkernels {
namespace cuda {
namespace {

__global__ void update_scale_kernel(float* scale, int* growth_tracker, int* hysteresis_tracker,
                                    const float* found_inf, double growth_factor, double backoff_factor,
                                    int64_t growth_interval, int64_t hysteresis, double min_scale, double max_scale,
                                    int64_t* counters, float* history, int64_t history_len) {
  update_scale_step<int>(scale, growth_tracker, hysteresis_tracker, *found_inf, growth_factor, backoff_factor,
                         growth_interval, hysteresis, min_scale, max_scale, counters, history, history_len);
}

}  // namespace
}  // namespace cuda

void update_scale_cuda(const UpdateScaleArgs& a) {
  const c10::cuda::CUDAGuard guard(a.scale.device());
  cuda::update_scale_kernel<<<1, 1, 0, c10::cuda::getCurrentCUDAStream()>>>(
      a.scale.data_ptr<float>(), a.growth_tracker.data_ptr<int>(), a.hysteresis_tracker.data_ptr<int>(),
      a.found_inf.data_ptr<float>(), a.growth_factor, a.backoff_factor, a.growth_interval, a.hysteresis, a.min_scale,
      a.max_scale, a.counters.defined() ? a.counters.data_ptr<int64_t>() : nullptr,
      a.history.defined() ? a.history.data_ptr<float>() : nullptr, a.history.defined() ? a.history.numel() : 0);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace ampkernels
