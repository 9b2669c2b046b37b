// GradientTracker: what the optimizer tables (OptimizerTable, BlockwiseAdamTable) know about their parameters and
// gradients between steps, so that a step's host work is one C++ pass over the parameters.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <utility>
#include <vector>

#include "common/checks.h"
#include "common/grad.h"
#include "common/tensor_table.h"

namespace ampkernels {

class AMPK_HIDDEN GradientTracker {
 public:
  enum Refresh { kStale, kSame, kMoved };

  // `watch`: parameters of the same param group without a gradient when the table was built.
  GradientTracker(std::vector<at::Tensor> params, std::vector<at::Tensor> watch, at::ScalarType grad_dtype)
      : params_(std::move(params)), watch_(std::move(watch)), grad_dtype_(grad_dtype) {
    AMPK_CHECK_ARG(!params_.empty(), "params", "expected at least one parameter");
    device_ = params_[0].device();
    const size_t n = params_.size();
    param_ptrs_.reserve(n);
    for (const auto& p : params_) {
      param_ptrs_.push_back(p.data_ptr());
      param_sizes_.emplace_back(p.sizes().begin(), p.sizes().end());
      param_strides_.emplace_back(p.strides().begin(), p.strides().end());
    }
    grad_ptrs_.assign(n, nullptr);
    grad_same_layout_.assign(n, 0);
    staged_.assign(n, at::Tensor());
  }

  // Re-reads the parameters and their gradients. kStale (the caller rebuilds its table): a parameter's memory,
  // shape or strides changed (`p.data = ...`, `p.data.resize_()`: its state no longer matches, and the kernels
  // would walk the old extent), a parameter lost its gradient, a watched one gained one, or a gradient changed
  // dtype or layout type. kMoved: a gradient moved or its strides changed since the last refresh (a gradient laid
  // out unlike its parameter is read through a copy in the parameter's layout); grad_address() has the new
  // addresses. Raises when a gradient's shape is not its parameter's. The check runs on the intra-op pool
  // (all_params_pass); only the gradients that changed are then updated, serially.
  Refresh refresh() {
    for (const auto& w : watch_)
      if (grad_of(w) != nullptr) return kStale;
    const int64_t n = static_cast<int64_t>(params_.size());
    std::atomic<bool> any_moved{false};
    std::atomic<int64_t> bad_shape{-1};
    moved_.assign(n, 0);
    const bool fresh = all_params_pass(n, [&](int64_t i) {
      const at::Tensor& p = params_[i];
      if (p.data_ptr() != param_ptrs_[i] || p.sizes() != at::IntArrayRef(param_sizes_[i]) ||
          p.strides() != at::IntArrayRef(param_strides_[i]))
        return false;
      const at::Tensor* g = grad_of(p);
      if (g == nullptr || g->layout() != at::kStrided || g->scalar_type() != grad_dtype_ || g->device() != device_)
        return false;
      if (g->sizes() != p.sizes()) {
        bad_shape.store(i, std::memory_order_relaxed);
        return false;
      }
      const bool same_layout = g->strides() == p.strides();
      if (g->data_ptr() != grad_ptrs_[i] || same_layout != static_cast<bool>(grad_same_layout_[i])) {
        moved_[i] = 1;
        any_moved.store(true, std::memory_order_relaxed);
      }
      return true;
    });
    const int64_t bad = bad_shape.load();
    if (bad >= 0)
      AMPK_CHECK_ARG(false, "params", "parameter ", bad, " has shape ", list_of(params_[bad].sizes()),
                     " but its gradient has shape ", list_of(grad_of(params_[bad])->sizes()));
    if (!fresh) return kStale;
    if (!any_moved.load()) return kSame;
    for (int64_t i = 0; i < n; ++i) {
      if (!moved_[i]) continue;
      const at::Tensor& p = params_[i];
      const at::Tensor& g = *grad_of(p);
      const bool same_layout = g.strides() == p.strides();
      if (!same_layout && !staged_[i].defined()) {
        staged_[i] = at::empty_like(p, p.options().dtype(grad_dtype_));
        retain_if_capturing(device_, {&staged_[i]});
      }
      if (same_layout) staged_[i] = at::Tensor();
      grad_ptrs_[i] = g.data_ptr();
      grad_same_layout_[i] = same_layout;
    }
    return kMoved;
  }

  // Where the kernels read parameter i's gradient: the gradient itself, or its staged copy.
  int64_t grad_address(size_t i) const {
    return reinterpret_cast<int64_t>(grad_same_layout_[i] ? grad_ptrs_[i] : staged_[i].data_ptr());
  }

  // Copies the gradients laid out unlike their parameters into their staged copies (before each launch).
  void stage() {
    for (size_t i = 0; i < staged_.size(); ++i)
      if (staged_[i].defined()) staged_[i].copy_(*grad_of(params_[i]));
  }

  const std::vector<at::Tensor>& params() const { return params_; }
  const std::vector<const void*>& param_ptrs() const { return param_ptrs_; }
  at::Device device() const { return device_; }
  at::ScalarType grad_dtype() const { return grad_dtype_; }
  int64_t size() const { return static_cast<int64_t>(params_.size()); }

 private:
  std::vector<at::Tensor> params_;
  std::vector<at::Tensor> watch_;
  at::ScalarType grad_dtype_;
  at::Device device_ = at::kCPU;
  std::vector<const void*> param_ptrs_, grad_ptrs_;
  std::vector<c10::DimVector> param_sizes_, param_strides_;  // what the state and the table were built for
  std::vector<uint8_t> grad_same_layout_;  // per parameter: its gradient had its strides at the last refresh
  std::vector<at::Tensor> staged_;  // per parameter: a copy of its gradient in its layout, when they differ
  std::vector<uint8_t> moved_;      // per parameter, during refresh(): its gradient moved since the last one
};

// Two entries for one parameter (torch.optim only warns about duplicates), or two parameters over overlapping memory,
// would be stepped twice by concurrent blocks, racing on the parameter and its state. Parameters sharing one gradient
// are fine: gradients are read-only.
inline void check_distinct(const std::vector<const void*>& ptrs, const std::vector<at::Tensor>& params) {
  std::vector<MemorySpan> spans;
  spans.reserve(ptrs.size());
  for (size_t i = 0; i < ptrs.size(); ++i)
    spans.push_back(memory_span(ptrs[i], params[i].numel(), params[i].element_size(),
                                params[i].is_non_overlapping_and_dense(), static_cast<int64_t>(i)));
  const auto [first, second] = find_intersecting(std::move(spans));
  AMPK_CHECK_ARG(first < 0, "params", "parameters ", first, " and ", second,
                 " share their memory (the same parameter twice in one param group, or overlapping views?); each "
                 "parameter must appear once");
}

// Uploads `values` to `device` as int64 (`host`: the source, `dev`: the copy the kernels read). A fresh pinned
// buffer every time: the previous one may still be read by an asynchronous copy. A copy captured in a CUDA graph
// reads it again at every replay, also after a later upload replaced it here (when it was freed, the pinned
// allocator handed it out again and replays read garbage addresses): retained while capturing.
inline void upload_int64(const std::vector<int64_t>& values, at::Device device, at::Tensor& host, at::Tensor& dev) {
  const auto opts = at::TensorOptions().dtype(at::kLong).pinned_memory(device.is_cuda());
  host = at::empty({static_cast<int64_t>(values.size())}, opts);
  std::copy(values.begin(), values.end(), host.data_ptr<int64_t>());
  dev = device.is_cpu() ? host : host.to(device, /*non_blocking=*/true);
  retain_if_capturing(device, {&host, &dev});
}

}  // namespace ampkernels
