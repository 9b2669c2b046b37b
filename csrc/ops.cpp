// Every ampkernels op in one place: the torch.library schemas, their CPU/CUDA registrations, and the GradTable
// class that FusedGradScaler keeps per optimizer so that a step's host work does not grow tensor by tensor.
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/extension.h>

#include <atomic>
#include <cmath>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <tuple>
#include <vector>

#include "checks.h"
#include "multi_tensor.h"
#include "scaled_matmul.h"

namespace ampkernels {
namespace {

NormKind norm_kind_of(double norm_type) {
  if (norm_type == 0.0) return NormKind::kNone;
  if (norm_type == 2.0) return NormKind::kL2;
  if (std::isinf(norm_type) && norm_type > 0) return NormKind::kInf;
  AMPK_CHECK_ARG(false, "norm_type", "the fused kernels compute the 2-norm and the inf-norm, got ", norm_type);
  return NormKind::kNone;  // unreachable
}

void launch_unscale_reduce(const TensorTable& table, const UnscaleReduceArgs& args) {
  if (table.device().is_cuda()) {
#ifdef AMPK_WITH_CUDA
    unscale_reduce_cuda(table, args);
#else
    TORCH_CHECK(false, "ampkernels: the native extension was built without CUDA; rebuild it with a CUDA toolkit "
                       "(pip install --no-build-isolation -e .) or use the Triton backend");
#endif
  } else {
    TORCH_CHECK(table.device().is_cpu(), "ampkernels: no kernel for tensors on ", table.device());
    unscale_reduce_cpu(table, args);
  }
}

void check_scalars(const at::Tensor& scale, const at::Tensor& found_inf, const std::optional<at::Tensor>& factor,
                   at::Device device) {
  AMPK_CHECK_SCALAR_FLOAT(scale, "scale");
  AMPK_CHECK_SCALAR_FLOAT(found_inf, "found_inf");
  AMPK_CHECK_ARG(scale.device() == device, "scale", "expected a tensor on ", device, ", got one on ", scale.device());
  AMPK_CHECK_ARG(found_inf.device() == device, "found_inf", "expected a tensor on ", device, ", got one on ",
                 found_inf.device());
  if (factor.has_value()) {
    AMPK_CHECK_SCALAR_FLOAT(*factor, "factor");
    AMPK_CHECK_ARG(factor->device() == device, "factor", "expected a tensor on ", device, ", got one on ",
                   factor->device());
  }
}

UnscaleReduceArgs make_args(const at::Tensor& scale, const at::Tensor& found_inf,
                            const std::optional<at::Tensor>& factor, bool write, double norm_type, double max_norm) {
  UnscaleReduceArgs a;
  a.scale = scale;
  a.found_inf = found_inf;
  if (factor.has_value()) a.factor = *factor;
  a.write = write;
  a.norm = norm_kind_of(norm_type);
  a.max_norm = max_norm;
  return a;
}

// Outputs requested by (norm_type, per_tensor, max_norm); empty tensors stand for "not requested".
std::tuple<at::Tensor, at::Tensor, at::Tensor> make_outputs(UnscaleReduceArgs& a, int64_t num_per_tensor,
                                                            bool per_tensor, at::Device device) {
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(device);
  at::Tensor norm = at::empty({0}, opts), each = at::empty({0}, opts), coef = at::empty({0}, opts);
  if (a.norm != NormKind::kNone) {
    norm = a.norm_out = at::empty({}, opts);
    // zeros: entries of parameters without a gradient stay 0
    if (per_tensor) each = a.per_tensor_out = at::zeros({num_per_tensor}, opts);
    if (a.max_norm >= 0) coef = a.coef_out = at::empty({}, opts);
  }
  return {norm, each, coef};
}

// ---- ampkernels::unscale_reduce_ (list form, for any list of tensors) ----

// Tables of recent lists, so a caller that passes the same tensors every step skips the rebuild and the upload.
struct TableCache {
  static constexpr size_t kEntries = 8;
  std::deque<std::shared_ptr<TensorTable>> entries;

  std::shared_ptr<TensorTable> get(const std::vector<at::Tensor>& tensors, at::Device device) {
    for (auto it = entries.begin(); it != entries.end(); ++it) {
      if ((*it)->device() == device && (*it)->matches(tensors)) {
        auto hit = *it;
        entries.erase(it);
        entries.push_front(hit);
        return hit;
      }
    }
    auto table = std::make_shared<TensorTable>(tensors, device);
    entries.push_front(table);
    if (entries.size() > kEntries) entries.pop_back();
    return table;
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> unscale_reduce_(at::TensorList tensors, const at::Tensor& scale,
                                                               const at::Tensor& found_inf,
                                                               const std::optional<at::Tensor>& factor, bool write,
                                                               double norm_type, bool per_tensor, double max_norm) {
  const at::Device device = found_inf.device();
  check_scalars(scale, found_inf, factor, device);
  std::vector<at::Tensor> dense;
  std::vector<std::pair<at::Tensor, at::Tensor>> staged;  // (original, dense copy)
  dense.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    AMPK_CHECK_ARG(t.defined(), "tensors", "element ", i, " is undefined");
    AMPK_CHECK_ARG(t.layout() == at::kStrided, "tensors", "element ", i, " has layout ", t.layout(),
                   "; pass the values of a sparse tensor");
    AMPK_CHECK_ARG(is_supported_grad_dtype(t.scalar_type()), "tensors", "element ", i, " has dtype ", t.scalar_type(),
                   "; supported: float32, float16, bfloat16, float64");
    AMPK_CHECK_ARG(t.device() == device, "tensors", "element ", i, " is on ", t.device(), " but found_inf is on ",
                   device);
    if (t.is_non_overlapping_and_dense()) {
      dense.push_back(t);
    } else {
      staged.emplace_back(t, t.contiguous());
      dense.push_back(staged.back().second);
    }
  }
  // Never destroyed: its device tensors must not be freed by a static destructor after CUDA has shut down
  // (that aborted the process at exit, seen on the GPU machine).
  static TableCache& cache = *new TableCache();
  static std::mutex cache_mutex;
  std::shared_ptr<TensorTable> table;
  if (staged.empty()) {
    const std::lock_guard<std::mutex> lock(cache_mutex);
    table = cache.get(dense, device);
  } else {  // staged copies are fresh allocations every call: keep them out of the cache
    table = std::make_shared<TensorTable>(dense, device);
  }

  UnscaleReduceArgs a = make_args(scale, found_inf, factor, write, norm_type, max_norm);
  auto outputs = make_outputs(a, static_cast<int64_t>(tensors.size()), per_tensor, device);
  launch_unscale_reduce(*table, a);
  if (write)
    for (auto& [orig, copy] : staged) orig.copy_(copy);
  return outputs;
}

// ---- ampkernels::update_scale_ ----

void update_scale_(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& hysteresis_tracker,
                   const at::Tensor& found_inf, double growth_factor, double backoff_factor, int64_t growth_interval,
                   int64_t hysteresis, double min_scale, double max_scale, const std::optional<at::Tensor>& counters,
                   const std::optional<at::Tensor>& history) {
  AMPK_CHECK_SCALAR_FLOAT(scale, "scale");
  AMPK_CHECK_SCALAR_FLOAT(found_inf, "found_inf");
  AMPK_CHECK_ARG(growth_tracker.scalar_type() == at::kInt && growth_tracker.numel() == 1, "growth_tracker",
                 "expected a 1-element int32 tensor");
  AMPK_CHECK_ARG(hysteresis_tracker.scalar_type() == at::kInt && hysteresis_tracker.numel() == 1,
                 "hysteresis_tracker", "expected a 1-element int32 tensor");
  AMPK_CHECK_SAME_DEVICE(growth_tracker, scale, "growth_tracker");
  AMPK_CHECK_SAME_DEVICE(hysteresis_tracker, scale, "hysteresis_tracker");
  AMPK_CHECK_SAME_DEVICE(found_inf, scale, "found_inf");
  AMPK_CHECK_ARG(growth_interval > 0, "growth_interval", "must be positive, got ", growth_interval);
  AMPK_CHECK_ARG(hysteresis > 0, "hysteresis", "must be positive, got ", hysteresis);
  UpdateScaleArgs a{scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor, backoff_factor,
                    growth_interval, hysteresis, min_scale, max_scale, {}, {}};
  if (counters.has_value()) {
    AMPK_CHECK_ARG(counters->scalar_type() == at::kLong && counters->numel() == 2 && counters->is_contiguous(),
                   "counters", "expected a contiguous int64 tensor of 2 elements");
    AMPK_CHECK_SAME_DEVICE(*counters, scale, "counters");
    a.counters = *counters;
  }
  if (history.has_value()) {
    AMPK_CHECK_ARG(counters.has_value(), "history", "needs 'counters' to know where to write");
    AMPK_CHECK_ARG(history->scalar_type() == at::kFloat && history->is_contiguous(), "history",
                   "expected a contiguous float32 tensor");
    AMPK_CHECK_SAME_DEVICE(*history, scale, "history");
    a.history = *history;
  }
  if (scale.is_cuda()) {
#ifdef AMPK_WITH_CUDA
    update_scale_cuda(a);
#else
    TORCH_CHECK(false, "ampkernels: the native extension was built without CUDA");
#endif
  } else {
    update_scale_cpu(a);
  }
}

}  // namespace

// ---- GradTable: the gradients of one optimizer on one device, re-read in C++ every step ----

class GradTable {
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
                                                                double norm_type, bool per_tensor, double max_norm,
                                                                bool revalidate) {
    // revalidate=false: the caller knows the gradients cannot have changed since the last call (two passes of one
    // clip_grad_norm_), which saves re-reading every parameter.
    if (revalidate || !table_) refresh();
    check_scalars(scale, found_inf, factor, device_);
    UnscaleReduceArgs a = make_args(scale, found_inf, factor, write, norm_type, max_norm);
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
    for (const auto* t : {&table_->meta(), &table_->partials()})
      if (t->is_cuda()) out.emplace_back("table", reinterpret_cast<int64_t>(t->data_ptr()));
    return out;
  }

 private:
  // p.grad() without the dispatch through VariableHooks (8 vs 24 ns a parameter, measured on a 2-core Xeon VM).
  static const c10::TensorImpl* grad_impl(const at::Tensor& p) {
    auto* meta = static_cast<torch::autograd::AutogradMeta*>(p.unsafeGetTensorImpl()->autograd_meta());
    if (meta == nullptr || !meta->grad_.defined()) return nullptr;
    return meta->grad_.unsafeGetTensorImpl();
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
  // shortcut. One that skipped the data pointer for the same TensorImpl needed a weak reference per gradient (a
  // freed TensorImpl's address can come back for the next step's gradient), and zero_grad(set_to_none=True), the
  // default, brings new TensorImpls every step: renewing the references (plus the .grad() dispatch) made that case
  // 1.9 ms for 10k parameters, 0.55-0.73 ms now; unchanged gradients 0.26 ms before and after (median, 2-core CPU
  // machine, dev/NOTES.md).
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
    table_ = std::make_unique<TensorTable>(kernel_tensors, device_, param_index_);
    ++rebuilds_;
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

// True when the parameter lists `groups` (a list of lists, as optimizer.param_groups hold them) contain exactly the
// objects of `flat`, in order. Compares object pointers without converting anything: 10k parameters in ~20 us,
// where a Python loop takes ~0.3 ms. Lets FusedGradScaler notice `group["params"][i] = new_param`.
bool same_params(const pybind11::list& groups, const pybind11::tuple& flat) {
  const Py_ssize_t total = PyTuple_GET_SIZE(flat.ptr());
  Py_ssize_t k = 0;
  for (const pybind11::handle group : groups) {
    if (!PyList_Check(group.ptr())) return false;
    const Py_ssize_t n = PyList_GET_SIZE(group.ptr());
    if (k + n > total) return false;
    for (Py_ssize_t i = 0; i < n; ++i, ++k)
      if (PyList_GET_ITEM(group.ptr(), i) != PyTuple_GET_ITEM(flat.ptr(), k)) return false;
  }
  return k == total;
}

// Defined in optimizer_ops.cpp (one PYBIND11_MODULE per extension, so the optimizer tables register from here).
void register_optimizer_bindings(pybind11::module& m);

}  // namespace ampkernels

TORCH_LIBRARY(ampkernels, m) {
  m.def(
      "unscale_reduce_(Tensor(a!)[] tensors, Tensor scale, Tensor(b!) found_inf, Tensor? factor, bool write, "
      "float norm_type, bool per_tensor, float max_norm) -> (Tensor, Tensor, Tensor)");
  m.def(
      "update_scale_(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor(c!) hysteresis_tracker, Tensor found_inf, "
      "float growth_factor, float backoff_factor, int growth_interval, int hysteresis, float min_scale, "
      "float max_scale, Tensor(d!)? counters, Tensor(e!)? history) -> ()");
}

TORCH_LIBRARY_IMPL(ampkernels, CPU, m) {
  m.impl("unscale_reduce_", &ampkernels::unscale_reduce_);
  m.impl("update_scale_", &ampkernels::update_scale_);
}

#ifdef AMPK_WITH_CUDA
TORCH_LIBRARY_IMPL(ampkernels, CUDA, m) {
  m.impl("unscale_reduce_", &ampkernels::unscale_reduce_);
  m.impl("update_scale_", &ampkernels::update_scale_);
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ampkernels native extension: CPU kernels always, CUDA kernels when built with a CUDA toolkit";
#ifdef AMPK_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  m.attr("cuda_arch_list") = AMPK_CUDA_ARCH_LIST;
  m.attr("wgmma_built") = ampkernels::scaled_matmul_wgmma_built();
  m.def(
      "wgmma_schedule",
      [](int64_t M, int64_t N, int64_t sms) {
        const ampkernels::WgmmaSchedule s = ampkernels::scaled_matmul_wgmma_schedule(M, N, sms);
        return pybind11::make_tuple(s.bn, s.grid);
      },
      "(tile width, grid) of the wgmma kernel for an M x N output on `sms` SMs", pybind11::arg("M"), pybind11::arg("N"),
      pybind11::arg("sms"));
  m.attr("chunk_size") = ampkernels::kChunkSize;
  // Threads that at::parallel_for runs `tasks` tasks of one item on here (1 when the extension was built without
  // intra-op parallelism: at::parallel_for is inline, so it depends on how this file was compiled, not on torch).
  m.def(
      "parallel_for_threads",
      [](int64_t tasks) {
        std::mutex mutex;
        std::set<int> seen;
        at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) {
          const std::lock_guard<std::mutex> lock(mutex);
          seen.insert(at::get_thread_num());
        });
        return static_cast<int64_t>(seen.size());
      },
      pybind11::arg("tasks"));
  m.def("same_params", &ampkernels::same_params, pybind11::arg("groups"), pybind11::arg("flat"));
  pybind11::class_<ampkernels::GradTable>(m, "GradTable")
      .def(pybind11::init([](std::vector<at::Tensor> params, const std::string& device) {
             return std::make_unique<ampkernels::GradTable>(std::move(params), at::Device(device));
           }),
           pybind11::arg("params"), pybind11::arg("device"))
      .def("refresh", &ampkernels::GradTable::refresh)
      .def("unscale_reduce", &ampkernels::GradTable::unscale_reduce, pybind11::arg("scale"),
           pybind11::arg("found_inf"), pybind11::arg("factor"), pybind11::arg("write"), pybind11::arg("norm_type"),
           pybind11::arg("per_tensor"), pybind11::arg("max_norm"), pybind11::arg("revalidate") = true)
      .def("sparse_params", &ampkernels::GradTable::sparse_params)
      .def_property_readonly("rebuilds", &ampkernels::GradTable::rebuilds)
      .def("addresses", &ampkernels::GradTable::addresses);
  ampkernels::register_optimizer_bindings(m);
}
