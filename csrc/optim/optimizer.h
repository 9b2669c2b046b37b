// Fused optimizer steps (Adam/AdamW, SGD): launch description shared by the CPU and CUDA kernels, and the
// per-element math both use, so that the two backends round alike (dev/design.md, "Fused optimizers").
#pragma once

#include <ATen/ATen.h>
#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>

#include "common/tensor_table.h"

namespace ampkernels {

enum class OptimizerKind : int { kAdam = 0, kSgd = 1 };

// Row k of the per-tensor address array (int64 [kNumLists, T], table order): the data pointer of list k's tensor t,
// or 0 where the list is absent. The parameters themselves are the table's own `addrs`.
enum OptimizerList : int {
  kGradList = 0,
  kExpAvgList = 1,  // Adam: exp_avg; SGD: momentum_buffer
  kExpAvgSqList = 2,
  kMaxExpAvgSqList = 3,
  kMasterList = 4,  // float32 master copy of a float16/bfloat16 parameter
  kStepList = 5,    // float32 step count, one element
  kNumLists = 6,
};

// The options of one step, field for field the dataclasses of ampkernels/optim/hyperparameters.py, in their order:
// X(type, name) per field. bindings.cpp reads each field from the Python object by name and exports the lists,
// which tests/optim/test_hyperparameters.py compares with the dataclasses.
#define AMPK_ADAM_HYPERPARAMETERS(X) \
  X(double, beta1)                   \
  X(double, beta2)                   \
  X(double, eps)                     \
  X(double, weight_decay)            \
  X(bool, amsgrad)                   \
  X(bool, maximize)                  \
  X(bool, decoupled_weight_decay)    \
  X(bool, stochastic_rounding)       \
  X(uint64_t, seed)

#define AMPK_SGD_HYPERPARAMETERS(X) \
  X(double, momentum)               \
  X(double, dampening)              \
  X(double, weight_decay)           \
  X(bool, nesterov)                 \
  X(bool, maximize)

#define AMPK_DECLARE_FIELD(type, name) type name{};
struct AdamHyperparameters {
  AMPK_ADAM_HYPERPARAMETERS(AMPK_DECLARE_FIELD)
};
struct SgdHyperparameters {
  AMPK_SGD_HYPERPARAMETERS(AMPK_DECLARE_FIELD)
};
#undef AMPK_DECLARE_FIELD

// The hyperparameters as the element math reads them, made once per launch on the host. The coefficients are those
// torch passes to its tensor ops: `1 - beta` is taken in float64, then rounded (1 - 0.999 in float64 rounds to
// 0.001f; 1.f - 0.999f is 9.9998713e-4).
struct AdamCoefficients {
  double beta1, beta2;  // float64 for the bias corrections
  float beta2_f, one_minus_beta1, one_minus_beta2, eps, weight_decay;
  bool amsgrad, maximize, decoupled_weight_decay;
};

inline AdamCoefficients adam_coefficients(const AdamHyperparameters& h) {
  AdamCoefficients c{};
  c.beta1 = h.beta1;
  c.beta2 = h.beta2;
  c.beta2_f = static_cast<float>(h.beta2);
  c.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.eps = static_cast<float>(h.eps);
  c.weight_decay = static_cast<float>(h.weight_decay);
  c.amsgrad = h.amsgrad;
  c.maximize = h.maximize;
  c.decoupled_weight_decay = h.decoupled_weight_decay;
  return c;
}

struct SgdCoefficients {
  float momentum, one_minus_dampening, weight_decay;
  bool nesterov, maximize;
};

inline SgdCoefficients sgd_coefficients(const SgdHyperparameters& h) {
  SgdCoefficients c{};
  c.momentum = static_cast<float>(h.momentum);
  c.one_minus_dampening = static_cast<float>(1.0 - h.dampening);
  c.weight_decay = static_cast<float>(h.weight_decay);
  c.nesterov = h.nesterov;
  c.maximize = h.maximize;
  return c;
}

// Everything one launch needs. The table holds the parameters (one dtype); the step is skipped on the device
// when found_inf is non-zero.
struct OptimizerLaunch {
  OptimizerKind kind;
  const TensorTable* table;
  at::Tensor lists;    // int64 [kNumLists, T] on the device
  at::Tensor scalars;  // float32 [T, 2] scratch: the per-tensor constants the prologue computes from the step count
  at::ScalarType param_dtype, grad_dtype, state_dtype;  // master weights <=> state_dtype != param_dtype
  at::Tensor grad_scale;  // optional float32 [1]: gradients are divided by it (multiplied by fp32(1/fp64(scale)))
  at::Tensor found_inf;   // optional float32 [1]: non-zero -> nothing at all is written
  at::Tensor lr_tensor;   // optional float32 [1] on the device: read by the kernels (capturable); else `lr`
  double lr = 0.0;
  AdamCoefficients adam{};
  SgdCoefficients sgd{};
};

void optimizer_step_cpu(const OptimizerLaunch& launch);
#ifdef AMPK_WITH_CUDA
void optimizer_step_cuda(const OptimizerLaunch& launch);
#endif

// ---- per-tensor constants (the prologue), from the step count the step advances to ----

// Adam: (lr / (1 - beta1^step), sqrt(1 - beta2^step)), in float64 and rounded once, as torch's single-tensor and
// foreach Adam compute them on the host.
C10_HOST_DEVICE inline void adam_step_constants(double lr, double beta1, double beta2, float step, float* step_size,
                                                float* bias_correction2_sqrt) {
  const double bc1 = 1.0 - ::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - ::pow(beta2, static_cast<double>(step));
  *step_size = static_cast<float>(lr / bc1);
  *bias_correction2_sqrt = static_cast<float>(::sqrt(bc2));
}

// torch.lerp(start, end, weight) in float32: the formula torch uses on either side of weight 0.5.
C10_HOST_DEVICE inline float lerp(float start, float end, float weight) {
  return weight < 0.5f ? start + weight * (end - start) : end - (end - start) * (1.f - weight);
}

// One element of an Adam/AdamW step in float32: p, m, v, vmax updated in place; g already unscaled.
// `decay` = 1 - lr * weight_decay (AdamW), `step_size` and `bc2_sqrt` from adam_step_constants.
C10_HOST_DEVICE inline void adam_element(float& p, float g, float& m, float& v, float& vmax, const AdamCoefficients& h,
                                         float decay, float step_size, float bc2_sqrt) {
  if (h.maximize) g = -g;
  if (h.weight_decay != 0.f) {
    if (h.decoupled_weight_decay)
      p = p * decay;
    else
      g = g + h.weight_decay * p;
  }
  m = lerp(m, g, h.one_minus_beta1);
  v = v * h.beta2_f + h.one_minus_beta2 * g * g;  // torch's addcmul order: (value * g) * g
  float second = v;
  if (h.amsgrad) {
    vmax = (v > vmax || v != v) ? v : vmax;  // torch.maximum: NaN propagates
    second = vmax;
  }
  const float denom = ::sqrtf(second) / bc2_sqrt + h.eps;
  p = p - step_size * (m / denom);
}

// One element of an SGD step in float32 (torch.optim.SGD's math); `first` is true on the first applied step of a
// parameter, when the momentum buffer starts as the gradient itself.
C10_HOST_DEVICE inline void sgd_element(float& p, float g, float& buf, const SgdCoefficients& h, float lr, bool first) {
  if (h.maximize) g = -g;
  if (h.weight_decay != 0.f) g = g + h.weight_decay * p;
  if (h.momentum != 0.f) {
    buf = first ? g : buf * h.momentum + h.one_minus_dampening * g;
    g = h.nesterov ? g + h.momentum * buf : buf;
  }
  p = p - lr * g;
}

}  // namespace ampkernels
