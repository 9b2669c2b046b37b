// CPU implementation of the fused optimizer steps: the same prologue and per-element math as the CUDA kernels
// (optimizer.h), parallel over chunks with at::parallel_for, each chunk one loop the compiler vectorizes.
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>

#include "optim/optimizer_cpu.h"

namespace ampkernels {
namespace {

template <typename T>
T* list_ptr(const int64_t* lists, int64_t num_tensors, int list, int64_t t) {
  return reinterpret_cast<T*>(lists[list * num_tensors + t]);
}

// Step counts and per-tensor constants; `scalars[t]` = (step_size, bc2_sqrt) for Adam, (first step ? 1 : 0, 0) for SGD.
void prologue(const OptimizerLaunch& l, double lr) {
  const int64_t n = l.table->num_tensors();
  const int64_t* lists = l.lists.data_ptr<int64_t>();
  float* scalars = l.scalars.data_ptr<float>();
  for (int64_t t = 0; t < n; ++t) {
    float* step = list_ptr<float>(lists, n, kStepList, t);
    if (step == nullptr) continue;  // SGD without momentum keeps no step count
    if (l.kind == OptimizerKind::kAdam) {
      *step += 1.f;
      adam_step_constants(lr, l.adam.beta1, l.adam.beta2, *step, &scalars[2 * t], &scalars[2 * t + 1]);
    } else {
      scalars[2 * t] = *step == 0.f ? 1.f : 0.f;
      *step += 1.f;
    }
  }
}

template <bool kMaster, bool kMaximize, bool kNesterov, bool kMomentum, typename P, typename G, typename S>
AMPK_CPU_VECTOR_CLONES void sgd_span(P* __restrict__ p, float* __restrict__ master, const G* __restrict__ g, S* __restrict__ buf,
              int64_t size, SgdCoefficients h, float inv_scale, float lr, bool first) {
  h.maximize = kMaximize, h.nesterov = kNesterov;
  for (int64_t i = 0; i < size; ++i) {
    float pi = kMaster ? master[i] : static_cast<float>(p[i]);
    float bi = kMomentum && !first ? static_cast<float>(buf[i]) : 0.f;
    sgd_element(pi, static_cast<float>(g[i]) * inv_scale, bi, h, lr, first);
    if (kMaster) master[i] = pi;
    p[i] = static_cast<P>(pi);
    if (kMomentum) buf[i] = static_cast<S>(bi);
  }
}

template <typename P, typename G, typename S>
void run(const OptimizerLaunch& l, double lr, float inv_scale) {
  constexpr bool kMaster = !std::is_same_v<P, S>;
  const TensorTable& table = *l.table;
  const int64_t n = table.num_tensors();
  const int64_t* meta = table.meta().data_ptr<int64_t>();
  const int64_t *addrs = meta, *numels = meta + n, *chunk_tensor = meta + 2 * n;
  const int64_t* chunk_start = chunk_tensor + table.num_chunks();
  const int64_t* lists = l.lists.data_ptr<int64_t>();
  const float* scalars = l.scalars.data_ptr<float>();
  const float lr_f = static_cast<float>(lr);
  const float decay = static_cast<float>(1.0 - lr * l.adam.weight_decay);
  const bool adam = l.kind == OptimizerKind::kAdam;
  at::parallel_for(0, table.num_chunks(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t t = chunk_tensor[c], start = chunk_start[c];
      const int64_t size = std::min(kChunkSize, numels[t] - start);
      P* p = reinterpret_cast<P*>(addrs[t]) + start;
      const G* g = list_ptr<const G>(lists, n, kGradList, t) + start;
      float* master = kMaster ? list_ptr<float>(lists, n, kMasterList, t) + start : nullptr;
      S* m = list_ptr<S>(lists, n, kExpAvgList, t);
      if (m != nullptr) m += start;
      if (adam) {
        S* v = list_ptr<S>(lists, n, kExpAvgSqList, t) + start;
        S* vmax = l.adam.amsgrad ? list_ptr<S>(lists, n, kMaxExpAvgSqList, t) + start : nullptr;
        const float step_size = scalars[2 * t], bc2_sqrt = scalars[2 * t + 1];
        const AdamCoefficients& h = l.adam;
        cpu::with_flags(h.maximize, h.decoupled_weight_decay, h.amsgrad, [&](auto mx, auto dec, auto ams) {
          cpu::adam_span<kMaster, mx, dec, ams>(p, master, g, m, v, vmax, size, h, inv_scale, decay, step_size,
                                                bc2_sqrt);
        });
      } else {
        const bool first = m != nullptr && scalars[2 * t] != 0.f;
        cpu::with_flags(l.sgd.maximize, l.sgd.nesterov, m != nullptr, [&](auto mx, auto nest, auto mom) {
          sgd_span<kMaster, mx, nest, mom>(p, master, g, m, size, l.sgd, inv_scale, lr_f, first);
        });
      }
    }
  });
}

template <typename P, typename G>
void dispatch_state(const OptimizerLaunch& l, double lr, float inv_scale) {
  if (l.state_dtype == at::kFloat)
    run<P, G, float>(l, lr, inv_scale);
  else if constexpr (!std::is_same_v<P, float>)
    run<P, G, P>(l, lr, inv_scale);
  else
    TORCH_CHECK(false, "ampkernels: optimizer state dtype ", l.state_dtype, " for float32 parameters");
}

template <typename P>
void dispatch_grad(const OptimizerLaunch& l, double lr, float inv_scale) {
  switch (l.grad_dtype) {
    case at::kFloat: dispatch_state<P, float>(l, lr, inv_scale); break;
    case at::kHalf: dispatch_state<P, at::Half>(l, lr, inv_scale); break;
    case at::kBFloat16: dispatch_state<P, at::BFloat16>(l, lr, inv_scale); break;
    default: TORCH_CHECK(false, "ampkernels: unsupported gradient dtype ", l.grad_dtype);
  }
}

}  // namespace

void optimizer_step_cpu(const OptimizerLaunch& l) {
  // The CPU reads found_inf directly: on the host this is a load, not a device synchronization.
  if (l.found_inf.defined() && l.found_inf.item<float>() != 0.f) return;
  const double lr = l.lr_tensor.defined() ? static_cast<double>(l.lr_tensor.item<float>()) : l.lr;
  // Same rounding as GradScaler.unscale_: reciprocal in float64, then float32.
  const float inv_scale =
      l.grad_scale.defined() ? static_cast<float>(1.0 / static_cast<double>(l.grad_scale.item<float>())) : 1.f;
  prologue(l, lr);
  switch (l.param_dtype) {
    case at::kFloat: dispatch_grad<float>(l, lr, inv_scale); break;
    case at::kHalf: dispatch_grad<at::Half>(l, lr, inv_scale); break;
    case at::kBFloat16: dispatch_grad<at::BFloat16>(l, lr, inv_scale); break;
    default: TORCH_CHECK(false, "ampkernels: unsupported parameter dtype ", l.param_dtype);
  }
}

}  // namespace ampkernels
