// OptimizerTable: the launch table of one (param group, device, dtype) bucket that FusedAdam/FusedAdamW/FusedSGD
// keep, so that a step's host work is one C++ pass over the parameters (no Python loop, no list conversion through
// the dispatcher). Bound to Python in bindings.cpp; kernels in optimizer_cpu.cpp and optimizer.cu.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/checks.h"
#include "optim/gradient_tracker.h"
#include "optim/optimizer.h"

namespace ampkernels {

inline void dispatch_launch(const OptimizerLaunch& l) {
  if (l.table->device().is_cuda()) {
#ifdef AMPK_WITH_CUDA
    optimizer_step_cuda(l);
#else
    TORCH_CHECK(false, "ampkernels: the native extension was built without CUDA; rebuild it with a CUDA toolkit "
                       "(pip install --no-build-isolation -e .) or use backend='triton'");
#endif
  } else {
    optimizer_step_cpu(l);
  }
}

inline bool is_optimizer_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

inline void check_optional_scalar(const std::optional<at::Tensor>& t, const char* name, at::Device device) {
  if (!t.has_value()) return;
  AMPK_CHECK_SCALAR_FLOAT(*t, name);
  AMPK_CHECK_ARG(t->device() == device, name, "expected a tensor on ", device, ", got one on ", t->device());
}

// The launch table of one (device, parameter dtype, gradient dtype) bucket: the parameters and their state are fixed
// at construction; the gradients are re-read on every step (their memory may move between steps).
class AMPK_HIDDEN OptimizerTable {
 public:
  // `state[k]` is list k + 1 of OptimizerList (exp_avg .. step), empty when absent, else one tensor per parameter.
  // `watch`: parameters of the same param group that had no gradient when the table was built; a step returns
  // false (nothing launched) once any of them has one, and the caller rebuilds.
  OptimizerTable(OptimizerKind kind, std::vector<at::Tensor> params, std::vector<std::vector<at::Tensor>> state,
                 std::vector<at::Tensor> watch, at::ScalarType grad_dtype)
      : kind_(kind), grads_(params, std::move(watch), grad_dtype), params_(std::move(params)),
        state_(std::move(state)), grad_dtype_(grad_dtype) {
    AMPK_CHECK_ARG(static_cast<int>(state_.size()) == kNumLists - 1, "state", "expected ", kNumLists - 1, " lists");
    device_ = params_[0].device();
    param_dtype_ = params_[0].scalar_type();
    state_dtype_ = param_dtype_;
    AMPK_CHECK_ARG(device_.is_cpu() || device_.is_cuda(), "params", "no kernels for parameters on ", device_);
    AMPK_CHECK_ARG(is_optimizer_dtype(param_dtype_), "params", "parameter dtype ", param_dtype_,
                   " is not supported (float32, float16, bfloat16)");
    AMPK_CHECK_ARG(is_optimizer_dtype(grad_dtype_), "grad_dtype", "gradient dtype ", grad_dtype_,
                   " is not supported (float32, float16, bfloat16)");
    const int64_t n = static_cast<int64_t>(params_.size());
    for (int64_t i = 0; i < n; ++i) {
      const at::Tensor& p = params_[i];
      AMPK_CHECK_ARG(p.device() == device_ && p.scalar_type() == param_dtype_, "params", "parameter ", i, " is ",
                     p.scalar_type(), " on ", p.device(), ", expected ", param_dtype_, " on ", device_);
      AMPK_CHECK_ARG(p.is_non_overlapping_and_dense(), "params", "parameter ", i,
                     " is not non-overlapping and dense (a strided view); the fused kernels walk its memory");
    }
    // Float32 state goes with master weights (the state of a float16/bfloat16 parameter is float32 then, and only
    // then); an SGD without momentum has the master copy as its only state.
    const bool has_master = !state_[kMasterList - 1].empty();
    state_dtype_ = has_master ? at::kFloat : param_dtype_;
    AMPK_CHECK_ARG(!has_master || param_dtype_ != at::kFloat, "master_param",
                   "master weights are for float16/bfloat16 parameters, these are float32");
    for (int k = 0; k < kNumLists - 1; ++k) {
      const auto& list = state_[k];
      if (list.empty()) continue;
      const int which = k + 1;
      const char* name = which == kStepList ? "step" : which == kMasterList ? "master_param" : "state";
      AMPK_CHECK_ARG(static_cast<int64_t>(list.size()) == n, name, "expected ", n, " tensors, got ", list.size());
      for (int64_t i = 0; i < n; ++i) {
        const at::Tensor& s = list[i];
        AMPK_CHECK_ARG(s.device() == device_, name, "tensor ", i, " is on ", s.device(), ", expected ", device_);
        if (which == kStepList) {
          AMPK_CHECK_ARG(s.scalar_type() == at::kFloat && s.numel() == 1, name, "tensor ", i,
                         " must be a 1-element float32 tensor");
          continue;
        }
        const at::ScalarType expected = which == kMasterList ? at::kFloat : state_dtype_;
        AMPK_CHECK_ARG(s.scalar_type() == expected, name, "tensor ", i, " has dtype ", s.scalar_type(), ", expected ",
                       expected, has_master ? " (master weights)" : " (the parameters' dtype, no master weights)");
        AMPK_CHECK_ARG(s.sizes() == params_[i].sizes() && s.strides() == params_[i].strides(), name, "tensor ", i,
                       " must have the shape and strides of its parameter");
      }
    }
    // The kernels read these lists without checking each pointer: Adam's moments and step counts (a null moment
    // would be dereferenced, a missing step leave the bias corrections unset), and SGD's step count with its
    // momentum buffers (it tells the kernels the first step).
    auto present = [&](int list) { return !state_[list - 1].empty(); };
    if (kind_ == OptimizerKind::kAdam) {
      AMPK_CHECK_ARG(present(kExpAvgList) && present(kExpAvgSqList) && present(kStepList), "state",
                     "Adam needs exp_avg, exp_avg_sq and step tensors (lists 1, 2 and 5)");
    } else {
      AMPK_CHECK_ARG(present(kExpAvgList) == present(kStepList), "state",
                     "SGD takes momentum_buffer and step tensors together (lists 1 and 5), or neither");
    }
    table_ = std::make_unique<TensorTable>(params_, device_);
    TORCH_INTERNAL_ASSERT(table_->groups().size() == 1, "one parameter dtype per table");
    check_distinct(grads_.param_ptrs(), params_);
    host_lists_.assign(kNumLists * n, 0);
    for (int k = 0; k < kNumLists - 1; ++k)
      for (size_t i = 0; i < state_[k].size(); ++i)
        host_lists_[(k + 1) * n + i] = reinterpret_cast<int64_t>(state_[k][i].data_ptr());
    scalars_ = at::empty({n, 2}, at::TensorOptions().dtype(at::kFloat).device(device_));
    retain_if_capturing(device_, {&scalars_});
  }

  // Re-reads the parameters and their gradients (GradientTracker::refresh) before a step; false: the caller
  // rebuilds the table. Re-uploads the gradient addresses when a gradient moved. Each step needs one since the last
  // step, so that a caller with several tables checks all of them before it launches any.
  bool refresh() {
    ready_ = false;
    const auto state = grads_.refresh();
    if (state == GradientTracker::kStale) return false;
    const size_t n = params_.size();
    if (state == GradientTracker::kMoved)
      for (size_t i = 0; i < n; ++i) host_lists_[kGradList * n + i] = grads_.grad_address(i);
    if (state == GradientTracker::kMoved || !lists_.defined()) upload();
    ready_ = true;
    return true;
  }

  // One Adam/AdamW step of every parameter (after a refresh() that returned true).
  void step_adam(double lr, const std::optional<at::Tensor>& lr_tensor, const AdamHyperparameters& h,
                 const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
    AMPK_CHECK_ARG(kind_ == OptimizerKind::kAdam, "step_adam", "this table was built for SGD");
    AMPK_CHECK_ARG(!h.amsgrad || !state_[kMaxExpAvgSqList - 1].empty(), "amsgrad",
                   "the table has no max_exp_avg_sq tensors");
    OptimizerLaunch l = make_launch(lr, lr_tensor, grad_scale, found_inf);
    l.adam = adam_coefficients(h);
    launch(l);
  }

  // One SGD step of every parameter (after a refresh() that returned true).
  void step_sgd(double lr, const std::optional<at::Tensor>& lr_tensor, const SgdHyperparameters& h,
                const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
    AMPK_CHECK_ARG(kind_ == OptimizerKind::kSgd, "step_sgd", "this table was built for Adam");
    AMPK_CHECK_ARG(h.momentum == 0.0 || (!state_[kExpAvgList - 1].empty() && !state_[kStepList - 1].empty()),
                   "momentum", "momentum needs momentum_buffer and step tensors");
    OptimizerLaunch l = make_launch(lr, lr_tensor, grad_scale, found_inf);
    l.sgd = sgd_coefficients(h);
    launch(l);
  }

  int64_t uploads() const { return uploads_; }

  // Every device address the step kernels use, by role: to check that a captured graph points at live memory.
  std::vector<std::pair<std::string, int64_t>> addresses() const {
    static const char* kNames[kNumLists] = {"grad", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param", "step"};
    std::vector<std::pair<std::string, int64_t>> out;
    for (const void* p : grads_.param_ptrs()) out.emplace_back("param", reinterpret_cast<int64_t>(p));
    const size_t n = params_.size();
    for (int k = 0; k < kNumLists; ++k)
      for (size_t i = 0; i < n; ++i)
        if (host_lists_[k * n + i] != 0) out.emplace_back(kNames[k], host_lists_[k * n + i]);
    for (const auto* t : {&lists_, &scalars_, &table_->meta()})
      if (t->defined() && t->is_cuda()) out.emplace_back("table", reinterpret_cast<int64_t>(t->data_ptr()));
    return out;
  }

 private:
  OptimizerLaunch make_launch(double lr, const std::optional<at::Tensor>& lr_tensor,
                              const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
    check_optional_scalar(grad_scale, "grad_scale", device_);
    check_optional_scalar(found_inf, "found_inf", device_);
    check_optional_scalar(lr_tensor, "lr", device_);
    OptimizerLaunch l;
    l.kind = kind_;
    l.table = table_.get();
    l.lists = lists_;
    l.scalars = scalars_;
    l.param_dtype = param_dtype_;
    l.grad_dtype = grad_dtype_;
    l.state_dtype = state_dtype_;
    if (grad_scale.has_value()) l.grad_scale = *grad_scale;
    if (found_inf.has_value()) l.found_inf = *found_inf;
    if (lr_tensor.has_value()) l.lr_tensor = *lr_tensor;
    l.lr = lr;
    return l;
  }

  void launch(const OptimizerLaunch& l) {
    AMPK_CHECK_ARG(ready_, "refresh", "a step needs refresh() to have returned true since the last step");
    ready_ = false;
    grads_.stage();
    dispatch_launch(l);
  }

  void upload() {
    upload_int64(host_lists_, device_, lists_host_, lists_);
    ++uploads_;
  }

  OptimizerKind kind_;
  GradientTracker grads_;
  std::vector<at::Tensor> params_;
  std::vector<std::vector<at::Tensor>> state_;
  at::ScalarType grad_dtype_, param_dtype_ = at::kFloat, state_dtype_ = at::kFloat;
  at::Device device_ = at::kCPU;
  std::unique_ptr<TensorTable> table_;
  std::vector<int64_t> host_lists_;
  at::Tensor lists_, lists_host_, scalars_;
  int64_t uploads_ = 0;
  bool ready_ = false;  // refresh() returned true since the last step
};

inline OptimizerKind kind_of(const std::string& kind) {
  if (kind == "adam") return OptimizerKind::kAdam;
  AMPK_CHECK_ARG(kind == "sgd", "kind", "expected 'adam' or 'sgd', got '", kind, "'");
  return OptimizerKind::kSgd;
}

}  // namespace ampkernels
