// BlockwiseAdamTable: the launch table of one bucket of FusedAdam's blockwise step (low-precision moments or
// stochastic rounding; blockwise.h). Built once per bucket; each step re-reads the gradients in one C++ pass
// (GradientTracker) and launches the prologue and the step kernel. Bound to Python in bindings.cpp.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "common/checks.h"
#include "optim/blockwise.h"
#include "optim/gradient_tracker.h"
#include "optim/optimizer_table.h"

namespace ampkernels {

// Order of the state lists (ampkernels/optim/optimizers.py _BLOCKWISE_KEYS).
enum BlockwiseList : int { kBwExpAvg, kBwExpAvgScale, kBwExpAvgSq, kBwExpAvgSqScale, kBwMax, kBwMaster, kBwStep, kBwLists };

class AMPK_HIDDEN BlockwiseAdamTable {
 public:
  using Layout = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>;  // fmt_m, fmt_v, cols, salt, offset

  BlockwiseAdamTable(std::vector<at::Tensor> params, std::vector<std::vector<at::Tensor>> state,
                     std::vector<Layout> layout, std::vector<at::Tensor> watch, at::ScalarType grad_dtype)
      : grads_(params, std::move(watch), grad_dtype), state_(std::move(state)) {
    const auto& ps = grads_.params();
    const int64_t n = grads_.size();
    device_ = grads_.device();
    param_dtype_ = ps[0].scalar_type();
    AMPK_CHECK_ARG(device_.is_cpu() || device_.is_cuda(), "params", "no kernels for parameters on ", device_);
    AMPK_CHECK_ARG(is_optimizer_dtype(param_dtype_), "params", "parameter dtype ", param_dtype_,
                   " is not supported (float32, float16, bfloat16)");
    AMPK_CHECK_ARG(is_optimizer_dtype(grad_dtype), "grad_dtype", "gradient dtype ", grad_dtype,
                   " is not supported (float32, float16, bfloat16)");
    AMPK_CHECK_ARG(static_cast<int>(state_.size()) == kBwLists, "state", "expected ", int(kBwLists), " lists");
    AMPK_CHECK_ARG(static_cast<int64_t>(layout.size()) == n, "layout", "expected ", n, " entries");
    for (int k = 0; k < kBwLists; ++k) {
      const bool optional = k == kBwMax || k == kBwMaster;
      AMPK_CHECK_ARG(static_cast<int64_t>(state_[k].size()) == n || (optional && state_[k].empty()), "state",
                     "list ", k, " has ", state_[k].size(), " tensors for ", n, " parameters");
    }
    master_ = !state_[kBwMaster].empty();
    AMPK_CHECK_ARG(!master_ || param_dtype_ != at::kFloat, "master_param", "float32 parameters have no master");
    check_distinct(grads_.param_ptrs(), ps);
    std::vector<std::vector<int64_t>> rows(n, std::vector<int64_t>(kMetaCount, 0));
    std::vector<bool> aligned_rows(n);
    for (int64_t i = 0; i < n; ++i) {
      const at::Tensor& p = ps[i];
      const auto [fmt_m, fmt_v, cols, salt, offset] = layout[i];
      AMPK_CHECK_ARG(p.device() == device_ && p.scalar_type() == param_dtype_, "params", "parameter ", i, " is ",
                     p.scalar_type(), " on ", p.device(), ", expected ", param_dtype_, " on ", device_);
      AMPK_CHECK_ARG(p.is_non_overlapping_and_dense(), "params", "parameter ", i,
                     " is not non-overlapping and dense (a strided view); the fused kernels walk its memory");
      AMPK_CHECK_ARG(fmt_m >= kF32 && fmt_m <= kQ4 && fmt_v >= kF32 && fmt_v <= kQ4, "layout", "entry ", i,
                     ": unknown formats (", fmt_m, ", ", fmt_v, ")");
      const bool quantized = fmt_m >= kQ8 || fmt_v >= kQ8;
      if (quantized) {
        AMPK_CHECK_ARG(p.dim() >= 1 && p.is_contiguous() && cols == p.size(-1), "layout", "entry ", i,
                       ": quantized moments need a contiguous parameter and cols = its last dimension");
      } else {
        AMPK_CHECK_ARG(cols == p.numel(), "layout", "entry ", i, ": cols must be numel without quantized moments");
      }
      const int64_t rows_of = cols > 0 ? p.numel() / cols : 0;
      check_moment(i, kBwExpAvg, static_cast<int>(fmt_m), rows_of, cols);
      check_moment(i, kBwExpAvgSq, static_cast<int>(fmt_v), rows_of, cols);
      if (!state_[kBwMax].empty()) {
        AMPK_CHECK_ARG(fmt_v <= kBF16, "max_exp_avg_sq", "amsgrad needs a float32 or bfloat16 second moment");
        check_like(state_[kBwMax][i], p, fmt_v == kF32 ? at::kFloat : at::kBFloat16, "max_exp_avg_sq", i);
      }
      if (master_) check_like(state_[kBwMaster][i], p, at::kFloat, "master_param", i);
      const at::Tensor& step = state_[kBwStep][i];
      AMPK_CHECK_ARG(step.device() == device_ && step.scalar_type() == at::kFloat && step.numel() == 1, "step",
                     "tensor ", i, " must be a 1-element float32 tensor on ", device_);
      int64_t* row = rows[i].data();
      row[kMetaFirstBlock] = rows_of * ((cols + kQuantBlock - 1) / kQuantBlock);  // this tensor's blocks, for now
      row[kMetaCols] = cols;
      // The CUDA kernel's vector path: 16-element lane slices of whole rows start 16-byte aligned (codes too).
      bool aligned = rows_of <= 1 || cols % 16 == 0;
      auto address = [&](int column, const at::Tensor& t) {
        const auto a = reinterpret_cast<int64_t>(t.numel() > 0 ? t.data_ptr() : nullptr);
        aligned = aligned && a % 16 == 0;
        row[column] = a;
      };
      address(kMetaParam, p);
      address(kMetaExpAvg, state_[kBwExpAvg][i]);
      address(kMetaExpAvgSq, state_[kBwExpAvgSq][i]);
      if (fmt_m >= kQ8) address(kMetaExpAvgScale, state_[kBwExpAvgScale][i]);
      if (fmt_v >= kQ8) address(kMetaExpAvgSqScale, state_[kBwExpAvgSqScale][i]);
      if (!state_[kBwMax].empty()) address(kMetaMaxExpAvgSq, state_[kBwMax][i]);
      if (master_) address(kMetaMaster, state_[kBwMaster][i]);
      row[kMetaStep] = reinterpret_cast<int64_t>(step.data_ptr());
      aligned_rows[i] = aligned;
      row[kMetaFormats] = fmt_m | (fmt_v << 8);
      row[kMetaSalt] = salt;
      row[kMetaOffset] = offset;
    }
    // One launch per pair of formats (each compiled for its pair: blockwise.cu), tensors in table order within.
    for (int64_t i = 0; i < n; ++i) {
      const int fmt_m = static_cast<int>(rows[i][kMetaFormats] & 0xFF);
      const int fmt_v = static_cast<int>(rows[i][kMetaFormats] >> 8);
      auto it = std::find_if(groups_.begin(), groups_.end(),
                             [&](const Group& g) { return g.fmt_m == fmt_m && g.fmt_v == fmt_v; });
      if (it == groups_.end()) it = groups_.insert(groups_.end(), Group{fmt_m, fmt_v});
      it->members.push_back(i);
    }
    for (Group& g : groups_) {
      const int64_t t = static_cast<int64_t>(g.members.size());
      g.meta_host_values.assign((t + 1) * kMetaCount, 0);
      for (int64_t k = 0; k < t; ++k) {
        std::vector<int64_t>& row = rows[g.members[k]];
        const int64_t blocks = row[kMetaFirstBlock];
        row[kMetaFirstBlock] = g.num_blocks;
        g.num_blocks += blocks;
        std::copy(row.begin(), row.end(), g.meta_host_values.begin() + k * kMetaCount);
        g.aligned.push_back(aligned_rows[g.members[k]]);
      }
      g.meta_host_values[t * kMetaCount + kMetaFirstBlock] = g.num_blocks;
      g.scalars = at::empty({t, 4}, at::TensorOptions().dtype(at::kFloat).device(device_));
      retain_if_capturing(device_, {&g.scalars});
    }
  }

  // Re-reads the parameters and their gradients before a step; false: the caller rebuilds the table. Each step
  // needs one since the last step (as OptimizerTable::refresh).
  bool refresh() {
    ready_ = false;
    const auto state = grads_.refresh();
    if (state == GradientTracker::kStale) return false;
    for (Group& g : groups_) {
      if (state == GradientTracker::kMoved) {
        for (size_t k = 0; k < g.members.size(); ++k) {
          int64_t* row = &g.meta_host_values[k * kMetaCount];
          row[kMetaGrad] = grads_.grad_address(g.members[k]);
          const bool aligned = g.aligned[k] && row[kMetaGrad] % 16 == 0;
          row[kMetaFormats] = (row[kMetaFormats] & 0xFFFF) | (int64_t(aligned) << 16);
        }
      }
      if (state == GradientTracker::kMoved || !g.meta.defined()) {
        upload_int64(g.meta_host_values, device_, g.meta_host, g.meta);
        ++uploads_;
      }
    }
    ready_ = true;
    return true;
  }

  // One Adam/AdamW step of every parameter (after a refresh() that returned true).
  void step_adam(double lr, const std::optional<at::Tensor>& lr_tensor, const AdamHyperparameters& h,
                 const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
    AMPK_CHECK_ARG(!h.amsgrad || !state_[kBwMax].empty(), "amsgrad", "the table has no max_exp_avg_sq tensors");
    AMPK_CHECK_ARG(!h.stochastic_rounding || !master_, "stochastic_rounding", "excludes master weights");
    check_optional_scalar(grad_scale, "grad_scale", device_);
    check_optional_scalar(found_inf, "found_inf", device_);
    check_optional_scalar(lr_tensor, "lr", device_);
    BlockwiseLaunch l;
    l.device = device_;
    l.param_dtype = param_dtype_;
    l.grad_dtype = grads_.grad_dtype();
    l.stochastic_rounding = h.stochastic_rounding && param_dtype_ == at::kBFloat16;
    l.seed = h.seed;
    if (grad_scale.has_value()) l.grad_scale = *grad_scale;
    if (found_inf.has_value()) l.found_inf = *found_inf;
    if (lr_tensor.has_value()) l.lr_tensor = *lr_tensor;
    l.lr = lr;
    l.adam = adam_coefficients(h);
    AMPK_CHECK_ARG(ready_, "refresh", "a step needs refresh() to have returned true since the last step");
    ready_ = false;
    grads_.stage();
    for (const Group& g : groups_) {
      l.meta = g.meta;
      l.scalars = g.scalars;
      l.num_tensors = static_cast<int64_t>(g.members.size());
      l.num_blocks = g.num_blocks;
      l.fmt_m = g.fmt_m;
      l.fmt_v = g.fmt_v;
      if (device_.is_cuda()) {
#ifdef AMPK_WITH_CUDA
        blockwise_adam_cuda(l);
#else
        TORCH_CHECK(false, "ampkernels: the native extension was built without CUDA; rebuild it with a CUDA "
                           "toolkit (pip install --no-build-isolation -e .) or use backend='triton'");
#endif
      } else {
        blockwise_adam_cpu(l);
      }
    }
  }

  int64_t uploads() const { return uploads_; }

  // Every device address the kernels use: to check that a captured graph points at live memory.
  std::vector<std::pair<std::string, int64_t>> addresses() const {
    std::vector<std::pair<std::string, int64_t>> out;
    static const std::pair<int, const char*> kNames[] = {
        {kMetaParam, "param"},        {kMetaGrad, "grad"},           {kMetaExpAvg, "exp_avg"},
        {kMetaExpAvgScale, "exp_avg_scale"}, {kMetaExpAvgSq, "exp_avg_sq"}, {kMetaExpAvgSqScale, "exp_avg_sq_scale"},
        {kMetaMaxExpAvgSq, "max_exp_avg_sq"}, {kMetaMaster, "master_param"}, {kMetaStep, "step"}};
    for (const Group& g : groups_) {
      for (size_t i = 0; i < g.members.size(); ++i)
        for (const auto& [column, name] : kNames)
          if (g.meta_host_values[i * kMetaCount + column] != 0)
            out.emplace_back(name, g.meta_host_values[i * kMetaCount + column]);
      for (const auto* t : {&g.meta, &g.scalars})
        if (t->defined() && t->is_cuda()) out.emplace_back("table", reinterpret_cast<int64_t>(t->data_ptr()));
    }
    return out;
  }

 private:
  // Moment `list` of parameter i in format `fmt`: float32/bfloat16 shaped like the parameter, or uint8 codes and
  // block exponents of rows x cols elements.
  void check_moment(int64_t i, int list, int fmt, int64_t rows, int64_t cols) const {
    const at::Tensor& p = grads_.params()[i];
    const char* name = list == kBwExpAvg ? "exp_avg" : "exp_avg_sq";
    const at::Tensor& x = state_[list][i];
    if (fmt <= kBF16) {
      check_like(x, p, fmt == kF32 ? at::kFloat : at::kBFloat16, name, i);
      return;
    }
    const at::Tensor& scales = state_[list + 1][i];
    const int64_t code_cols = fmt == kQ4 ? (cols + 1) / 2 : cols;
    const int64_t blocks = (cols + kQuantBlock - 1) / kQuantBlock;
    AMPK_CHECK_ARG(x.device() == device_ && x.scalar_type() == at::kByte && x.is_contiguous() &&
                       x.numel() == rows * code_cols,
                   name, "tensor ", i, ": expected contiguous uint8 codes of ", rows, " x ", code_cols, " on ",
                   device_);
    AMPK_CHECK_ARG(scales.device() == device_ && scales.scalar_type() == at::kByte && scales.is_contiguous() &&
                       scales.numel() == rows * blocks,
                   name, "tensor ", i, ": expected contiguous uint8 block exponents of ", rows, " x ", blocks);
  }

  void check_like(const at::Tensor& x, const at::Tensor& p, at::ScalarType dtype, const char* name, int64_t i) const {
    AMPK_CHECK_ARG(x.device() == device_ && x.scalar_type() == dtype, name, "tensor ", i, " is ", x.scalar_type(),
                   " on ", x.device(), ", expected ", dtype, " on ", device_);
    AMPK_CHECK_ARG(x.sizes() == p.sizes() && x.strides() == p.strides(), name, "tensor ", i,
                   " must have the shape and strides of its parameter");
  }

  // The tensors of one launch: those whose moments have one pair of formats.
  struct Group {
    int fmt_m, fmt_v;
    std::vector<int64_t> members;  // indices into the table's parameters
    std::vector<int64_t> meta_host_values;
    std::vector<bool> aligned;  // per member: its parameter and state addresses allow vector access
    int64_t num_blocks = 0;
    at::Tensor meta, meta_host, scalars;
  };

  GradientTracker grads_;
  std::vector<std::vector<at::Tensor>> state_;
  at::Device device_ = at::kCPU;
  at::ScalarType param_dtype_ = at::kFloat;
  bool master_ = false;
  std::vector<Group> groups_;
  int64_t uploads_ = 0;
  bool ready_ = false;  // refresh() returned true since the last step
};

}  // namespace ampkernels
