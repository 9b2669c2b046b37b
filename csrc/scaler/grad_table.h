// GradTable: the gradients of one optimizer's parameters on one device, re-read in C++ every step, so that
// FusedGradScaler's host work per step does not grow tensor by tensor. Bound to Python in bindings.cpp.
#pragma once

#include <ATen/MemoryOverlap.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/checks.h"
#include "common/grad.h"
#include "scaler/scaler.h"

namespace ampkernels {

class AMPK_HIDDEN GradTable {
 public:
  GradTable(std::vector<at::Tensor> params, at::Device device) : params_(std::move(params)), device_(device) {
    for (size_t i = 0; i < params_.size(); ++i)
      AMPK_CHECK_ARG(params_[i].device() == device_, "params", "parameter ", i, " is on ", params_[i].device(),
                     ", expected ", device_);
  }

  // Re-reads every parameter's .grad; rebuilds the launch table when any gradient's storage, size, dtype or
  // layout changed, or a gradient appeared or disappeared. Returns true when it rebuilt.
  bool refresh() {
    if (table_ && unchanged()) return false;
    rebuild();
    return true;
  }

  std::tuple<at::Tensor, at::Tensor, at::Tensor> unscale_reduce(const at::Tensor& scale, const at::Tensor& found_inf,
                                                                const std::optional<at::Tensor>& factor, bool write,
                                                                int64_t norm_kind, bool per_tensor, double max_norm,
                                                                bool revalidate) {
    // revalidate=false: the caller knows the gradients cannot have changed since the last call (two passes of one
    // clip_grad_norm_), which saves re-reading every parameter.
    if (revalidate || !table_) refresh();
    check_scalars(scale, found_inf, factor, device_);
    // Refused before anything is written: the copy back would fail after the other gradients were unscaled.
    if (write)
      for (const auto& [i, copy] : staged_)
        AMPK_CHECK_ARG(at::has_internal_overlap(params_[i].grad()) != at::MemOverlap::Yes, "params", "parameter ",
                       i, " has a gradient whose elements share memory (an expanded tensor?), which cannot be "
                       "unscaled in place; give it a gradient of its own (.clone())");
    UnscaleReduceArgs a = make_args(scale, found_inf, factor, write, norm_kind, max_norm);
    auto outputs = make_outputs(a, static_cast<int64_t>(params_.size()), per_tensor, device_);
    for (auto& [i, copy] : staged_) copy.copy_(params_[i].grad());
    launch_unscale_reduce(*table_, a);
    if (write)
      for (auto& [i, copy] : staged_) params_[i].grad().copy_(copy);
    return outputs;
  }

  // Parameters whose gradient is sparse: the caller handles those the way torch.amp.GradScaler does.
  std::vector<int64_t> sparse_params() const { return sparse_; }
  int64_t rebuilds() const { return rebuilds_; }

  // Every device address the kernels use (gradients, staged copies, the table): see OptimizerTable::addresses.
  std::vector<std::pair<std::string, int64_t>> addresses() const {
    std::vector<std::pair<std::string, int64_t>> out;
    if (!table_) return out;
    for (const auto& key : keys_) out.emplace_back("grad", reinterpret_cast<int64_t>(key.ptr));
    for (const auto& [i, copy] : staged_) out.emplace_back("staged", reinterpret_cast<int64_t>(copy.data_ptr()));
    if (table_->meta().is_cuda()) out.emplace_back("table", reinterpret_cast<int64_t>(table_->meta().data_ptr()));
    return out;
  }

 private:
  static const c10::TensorImpl* grad_impl(const at::Tensor& p) {
    const at::Tensor* g = grad_of(p);
    return g == nullptr ? nullptr : g->unsafeGetTensorImpl();
  }

  // Where parameter i's gradient sits in the table, or why it is not there.
  static constexpr int64_t kNoGrad = -1, kSparse = -2;

  // NOTE: ~40 ns a parameter on one thread of the H200 machine's host (dependent cache misses: parameter, autograd
  // meta, gradient, storage): 0.44 ms for 10k parameters serially; each parameter is checked on its own, so the
  // checks spread over the intra-op pool (all_params_pass).
  bool unchanged() const {
    return all_params_pass(static_cast<int64_t>(params_.size()), [this](int64_t i) { return param_unchanged(i); });
  }

  // Compares what the kernels depend on: the data pointer, numel, dtype, device and density. NOTE: no identity
  // shortcut (skipping the pointer check for the same TensorImpl): it needs a weak reference per gradient, since a
  // freed TensorImpl's address can come back for the next step's gradient, and zero_grad(set_to_none=True), the
  // default, brings new TensorImpls every step; renewing the references costs 1.9 ms for 10k parameters there, where
  // these checks take 0.55-0.73 ms (median, 2-core CPU machine, dev/scaler/NOTES.md).
  bool param_unchanged(int64_t i) const {
    const c10::TensorImpl* g = grad_impl(params_[i]);
    const int64_t slot = slot_[i];
    if (g == nullptr) return slot == kNoGrad;
    if (g->layout() != at::kStrided) return slot == kSparse;
    if (slot < 0 || !g->has_storage()) return false;
    const TensorKey& key = keys_[slot];
    return g->numel() == key.numel && c10::typeMetaToScalarType(g->dtype()) == key.dtype &&
           g->is_non_overlapping_and_dense() == dense_[slot] && g->device() == device_ && g->data() == key.ptr;
  }

  void rebuild() {
    param_index_.clear();
    slot_.assign(params_.size(), kNoGrad);
    keys_.clear();
    dense_.clear();
    staged_.clear();
    sparse_.clear();
    std::vector<at::Tensor> kernel_tensors;
    for (size_t i = 0; i < params_.size(); ++i) {
      const at::Tensor& g = params_[i].grad();
      if (!g.defined()) continue;
      AMPK_CHECK_ARG(g.device() == device_, "params", "parameter ", i, " has its gradient on ", g.device(),
                     ", expected ", device_);
      const at::ScalarType dt = g.scalar_type();
      AMPK_CHECK_ARG(is_supported_grad_dtype(dt), "params", "parameter ", i, " has a gradient of dtype ", dt,
                     "; gradients must be float32, float16, bfloat16 or float64");
      if (g.layout() != at::kStrided) {
        sparse_.push_back(static_cast<int64_t>(i));
        slot_[i] = kSparse;
        continue;
      }
      slot_[i] = static_cast<int64_t>(keys_.size());
      const bool dense = g.is_non_overlapping_and_dense();
      if (!dense) {
        staged_.emplace_back(static_cast<int64_t>(i), g.contiguous());
        retain_if_capturing(device_, {&staged_.back().second});
      }
      kernel_tensors.push_back(dense ? g : staged_.back().second);
      keys_.push_back({g.data_ptr(), g.numel(), dt});
      dense_.push_back(dense);
      param_index_.push_back(static_cast<int64_t>(i));
    }
    check_distinct();
    table_ = std::make_unique<TensorTable>(kernel_tensors, device_, param_index_);
    ++rebuilds_;
  }

  // One gradient reached through two parameters (two parameters sharing a .grad, one parameter twice, or views of
  // one buffer that overlap) would be unscaled twice, by concurrent blocks on CUDA, and counted twice in the norms.
  void check_distinct() const {
    std::vector<MemorySpan> spans;
    spans.reserve(keys_.size());
    for (size_t k = 0; k < keys_.size(); ++k)
      spans.push_back(memory_span(keys_[k].ptr, keys_[k].numel, c10::elementSize(keys_[k].dtype), dense_[k] != 0,
                                  param_index_[k]));
    const auto [first, second] = find_intersecting(std::move(spans));
    AMPK_CHECK_ARG(first < 0, "params", "parameters ", first, " and ", second, " have gradients that share memory "
                   "(the same gradient tensor twice: one parameter twice, or a shared .grad; or overlapping views of "
                   "one buffer); each gradient must belong to one parameter");
  }

  std::vector<at::Tensor> params_;
  at::Device device_;
  std::unique_ptr<TensorTable> table_;
  // No strong reference to any gradient is kept between calls: that would pin last step's memory.
  std::vector<int64_t> param_index_;  // parameters whose gradient is in the table, in table-input order
  std::vector<int64_t> slot_;         // per parameter: its index in keys_/dense_, kNoGrad or kSparse
  std::vector<TensorKey> keys_;
  std::vector<char> dense_;  // per slot: the gradient was non-overlapping and dense (read in place, not staged)
  std::vector<std::pair<int64_t, at::Tensor>> staged_;  // (parameter index, contiguous copy) for strided views
  std::vector<int64_t> sparse_;
  int64_t rebuilds_ = 0;
};

}  // namespace ampkernels
