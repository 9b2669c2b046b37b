// The loss-scaler ops ampkernels::unscale_reduce_ and ampkernels::update_scale_: schemas, argument checks and
// CPU/CUDA registrations, and the helpers GradTable (scaler/grad_table.h) shares with them.
#include <ATen/MemoryOverlap.h>
#include <torch/library.h>

#include <algorithm>
#include <deque>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "common/checks.h"
#include "scaler/scaler.h"

namespace ampkernels {

void launch_unscale_reduce(const TensorTable& table, const UnscaleReduceArgs& call) {
  // The scratch is this call's, not the table's: a cached table is shared by every call on its list, and two of
  // them in flight at once (two threads, or two streams) would fold each other's partial norms. On CUDA it comes
  // from the caching allocator on the current stream (a graph's private pool while capturing).
  UnscaleReduceArgs args = call;
  args.partials = at::empty({std::max<int64_t>(table.num_chunks(), 1), 2},
                            at::TensorOptions().dtype(at::kDouble).device(table.device()));
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
                            const std::optional<at::Tensor>& factor, bool write, int64_t norm_kind, double max_norm) {
  AMPK_CHECK_ARG(norm_kind >= static_cast<int>(NormKind::kNone) && norm_kind <= static_cast<int>(NormKind::kInf),
                 "norm_kind", "expected a NormKind: 0 (none), 1 (2-norm) or 2 (inf-norm), got ", norm_kind);
  // NaN fails both tests.
  AMPK_CHECK_ARG(max_norm >= 0 || max_norm == kNoClip, "max_norm", "expected >= 0, or ", kNoClip,
                 " (no clip coefficient), got ", max_norm);
  UnscaleReduceArgs a;
  a.scale = scale;
  a.found_inf = found_inf;
  if (factor.has_value()) a.factor = *factor;
  a.write = write;
  a.norm = static_cast<NormKind>(norm_kind);
  a.max_norm = max_norm;
  return a;
}

// Outputs requested by (norm_kind, per_tensor, max_norm); empty tensors stand for "not requested".
std::tuple<at::Tensor, at::Tensor, at::Tensor> make_outputs(UnscaleReduceArgs& a, int64_t num_per_tensor,
                                                            bool per_tensor, at::Device device) {
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(device);
  at::Tensor norm = at::empty({0}, opts), each = at::empty({0}, opts), coef = at::empty({0}, opts);
  if (a.norm != NormKind::kNone) {
    norm = a.norm_out = at::empty({}, opts);
    // zeros: entries of parameters without a gradient stay 0
    if (per_tensor) each = a.per_tensor_out = at::zeros({num_per_tensor}, opts);
    if (a.max_norm != kNoClip) coef = a.coef_out = at::empty({}, opts);
  }
  return {norm, each, coef};
}

namespace {

// ---- ampkernels::unscale_reduce_ (list form, for any list of tensors) ----

// A launch table, and two of its tensors that share memory ({-1, -1}: none do; see overlap_of).
struct CachedTable {
  std::shared_ptr<TensorTable> table;
  std::pair<int64_t, int64_t> overlap;
};

// Two of `dense` (non-overlapping and dense tensors, in the caller's order) whose memory intersects, or {-1, -1}.
std::pair<int64_t, int64_t> overlap_of(const std::vector<at::Tensor>& dense) {
  std::vector<MemorySpan> spans;
  spans.reserve(dense.size());
  for (size_t i = 0; i < dense.size(); ++i) spans.push_back(memory_span(dense[i], static_cast<int64_t>(i)));
  return find_intersecting(std::move(spans));
}

// Tables of recent lists, so a caller that passes the same tensors every step skips the rebuild and the upload.
// The overlap check is kept with its table: it depends only on what the table is keyed by (addresses, sizes, dtypes).
struct TableCache {
  static constexpr size_t kEntries = 8;
  std::deque<CachedTable> entries;

  CachedTable get(const std::vector<at::Tensor>& tensors, at::Device device) {
    for (auto it = entries.begin(); it != entries.end(); ++it) {
      if (it->table->device() == device && it->table->matches(tensors)) {
        CachedTable hit = *it;
        entries.erase(it);
        entries.push_front(hit);
        return hit;
      }
    }
    CachedTable made{std::make_shared<TensorTable>(tensors, device), overlap_of(tensors)};
    entries.push_front(made);
    if (entries.size() > kEntries) entries.pop_back();
    return made;
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> unscale_reduce_(at::TensorList tensors, const at::Tensor& scale,
                                                               const at::Tensor& found_inf,
                                                               const std::optional<at::Tensor>& factor, bool write,
                                                               int64_t norm_kind, bool per_tensor, double max_norm) {
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
      // Refused before anything is written: the copy back would fail after the other tensors were unscaled.
      AMPK_CHECK_ARG(!write || at::has_internal_overlap(t) != at::MemOverlap::Yes, "tensors", "element ", i,
                     " has elements that share memory (an expanded tensor?) and cannot be written in place; pass "
                     "write=False or a tensor of its own (.clone())");
      staged.emplace_back(t, t.contiguous());
      dense.push_back(staged.back().second);
    }
  }
  // Never destroyed: its device tensors must not be freed by a static destructor after CUDA has shut down
  // (which aborts the process at exit).
  static TableCache& cache = *new TableCache();
  static std::mutex cache_mutex;
  CachedTable cached;
  if (staged.empty()) {
    const std::lock_guard<std::mutex> lock(cache_mutex);
    cached = cache.get(dense, device);
  } else {  // staged copies are fresh allocations every call: keep them out of the cache
    cached = {std::make_shared<TensorTable>(dense, device), overlap_of(dense)};
  }
  // Tensors the kernels write in place must be disjoint: memory reached twice would be unscaled twice (by
  // concurrent blocks on CUDA) and counted twice in the norms. Staged copies are fresh memory, never reported.
  const auto [first, second] = cached.overlap;
  AMPK_CHECK_ARG(!write || first < 0, "tensors", "elements ", first, " and ", second,
                 " share memory (the same tensor twice, or overlapping views) and would be unscaled twice; pass "
                 "each tensor once, or write=False");
  const TensorTable* table = cached.table.get();

  UnscaleReduceArgs a = make_args(scale, found_inf, factor, write, norm_kind, max_norm);
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
  // The trackers are int32: a larger count would be truncated when stored (hysteresis) or never reached.
  constexpr int64_t kMaxCount = std::numeric_limits<int32_t>::max();
  AMPK_CHECK_ARG(growth_interval > 0 && growth_interval <= kMaxCount, "growth_interval",
                 "must be in [1, 2**31), got ", growth_interval);
  AMPK_CHECK_ARG(hysteresis > 0 && hysteresis <= kMaxCount, "hysteresis", "must be in [1, 2**31), got ", hysteresis);
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
}  // namespace ampkernels

TORCH_LIBRARY_FRAGMENT(ampkernels, m) {
  m.def(
      "unscale_reduce_(Tensor(a!)[] tensors, Tensor scale, Tensor(b!) found_inf, Tensor? factor, bool write, "
      "int norm_kind, bool per_tensor, float max_norm) -> (Tensor, Tensor, Tensor)");
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
