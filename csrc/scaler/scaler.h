// The loss-scaler kernels: unscale + non-finite check + norms, and the scale update; one implementation per device
// (scaler_cpu.cpp; unscale_reduce.cu, update_scale.cu).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "common/constants.h"
#include "common/tensor_table.h"

namespace ampkernels {

// One fused pass over every tensor of a table (dev/design.md, kernels 1 and 2):
//   v = float(g) * fp32(1 / fp64(scale)) [* factor];  g = v if write;  found_inf = 1 if any g is non-finite;
//   norm_out = ||v|| over all tensors; per_tensor_out[i] = ||v|| of tensor i; coef_out = min(max_norm/(norm+1e-6), 1).
// Math in float32 (float64 for float64 tensors, norms included: their squares overflow float32 from 1e20); the
// outputs are float32. Outputs that are undefined tensors are not computed. No host synchronization.
struct UnscaleReduceArgs {
  at::Tensor scale;           // float32 [1], the loss scale
  at::Tensor found_inf;       // float32 [1], set to 1.0 when a non-finite input is seen, never cleared
  at::Tensor factor;          // optional float32 [1], applied after unscaling (e.g. a clip coefficient)
  bool write = true;          // false: read-only check and norm
  NormKind norm = NormKind::kNone;
  at::Tensor norm_out;        // float32 [] (needs norm != kNone)
  at::Tensor per_tensor_out;  // float32 [num_tensors] in the caller's order (needs norm != kNone)
  double max_norm = kNoClip;  // >= 0, or kNoClip: no clip coefficient
  at::Tensor coef_out;        // float32 [] clip coefficient (needs norm != kNone and max_norm != kNoClip)
  // float64 [num_chunks, 2]: per-chunk (non-finite flag, partial norm), this call's own (launch_unscale_reduce
  // allocates it). float64 so that float64 tensors' partial sums of squares neither overflow nor underflow (float32
  // partials are stored exactly).
  at::Tensor partials;
};

void unscale_reduce_cpu(const TensorTable& table, const UnscaleReduceArgs& args);
// The kernel of the table's device (scaler_ops.cpp).
void launch_unscale_reduce(const TensorTable& table, const UnscaleReduceArgs& args);

// Shared by the op and GradTable (scaler_ops.cpp). norm_kind: a NormKind value; max_norm: >= 0 or kNoClip.
void check_scalars(const at::Tensor& scale, const at::Tensor& found_inf, const std::optional<at::Tensor>& factor,
                   at::Device device);
UnscaleReduceArgs make_args(const at::Tensor& scale, const at::Tensor& found_inf,
                            const std::optional<at::Tensor>& factor, bool write, int64_t norm_kind, double max_norm);
// Allocates the outputs requested by (a.norm, per_tensor, a.max_norm) and points `a` at them; empty tensors stand
// for "not requested". Returns (norm, per-tensor norms, clip coefficient).
std::tuple<at::Tensor, at::Tensor, at::Tensor> make_outputs(UnscaleReduceArgs& a, int64_t num_per_tensor,
                                                            bool per_tensor, at::Device device);
#ifdef AMPK_WITH_CUDA
void unscale_reduce_cuda(const TensorTable& table, const UnscaleReduceArgs& args);
#endif

// The loss-scale update (dev/design.md, kernel 3); equals torch._amp_update_scale_ with the default options.
struct UpdateScaleArgs {
  at::Tensor scale;               // float32 [1]
  at::Tensor growth_tracker;      // int32 [1]
  at::Tensor hysteresis_tracker;  // int32 [1]
  at::Tensor found_inf;           // float32 [1]
  double growth_factor, backoff_factor;
  int64_t growth_interval, hysteresis;
  double min_scale, max_scale;
  at::Tensor counters;  // optional int64 [2]: updates, skipped steps
  at::Tensor history;   // optional float32 [N]: scale after each update, ring buffer
};

void update_scale_cpu(const UpdateScaleArgs& args);
#ifdef AMPK_WITH_CUDA
void update_scale_cuda(const UpdateScaleArgs& args);
#endif

// Scalar math shared by the CPU and CUDA scale update, so both round exactly alike.
template <typename I>
C10_HOST_DEVICE inline void update_scale_step(float* scale, I* growth_tracker, I* hysteresis_tracker, float found_inf,
                              double growth_factor, double backoff_factor, int64_t growth_interval,
                              int64_t hysteresis, double min_scale, double max_scale, int64_t* counters,
                              float* history, int64_t history_len) {
  const bool found = found_inf != 0.f;
  if (found) {
    *growth_tracker = 0;
    *hysteresis_tracker -= 1;
    if (*hysteresis_tracker <= 0) {
      const float backed_off = static_cast<float>(static_cast<double>(*scale) * backoff_factor);
      const float floor = static_cast<float>(min_scale);
      *scale = backed_off < floor ? floor : backed_off;
    }
  } else {
    const I successful = *growth_tracker + 1;
    if (successful == growth_interval) {
      const float grown = static_cast<float>(static_cast<double>(*scale) * growth_factor);
      // grown - grown is 0 only for finite values: isfinite without <cmath> differences between host and device.
      if (grown - grown == 0.f) {
        const float ceiling = static_cast<float>(max_scale);
        *scale = grown > ceiling ? ceiling : grown;
      }
      *growth_tracker = 0;
      *hysteresis_tracker = static_cast<I>(hysteresis);
    } else {
      *growth_tracker = successful;
    }
  }
  if (counters != nullptr) {
    const int64_t n = counters[0];
    counters[0] = n + 1;
    counters[1] += found ? 1 : 0;
    // The slot of update n, n mod history_len in [0, history_len) also for a negative count (a counter loaded
    // from elsewhere), as reference.update_scale_'s tensor remainder gives it: `%` alone would write before history.
    if (history != nullptr && history_len > 0) {
      const int64_t slot = n % history_len;
      history[slot < 0 ? slot + history_len : slot] = *scale;
    }
  }
}

}  // namespace ampkernels
