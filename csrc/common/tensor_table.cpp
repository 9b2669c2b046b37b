#include "common/tensor_table.h"

#include <algorithm>
#include <mutex>

#ifdef AMPK_WITH_CUDA
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace ampkernels {

bool capturing(at::Device device) {
#ifdef AMPK_WITH_CUDA
  if (!device.is_cuda()) return false;
  const c10::cuda::CUDAGuard guard(device);
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
#else
  (void)device;
  return false;
#endif
}

void retain_if_capturing(at::Device device, std::initializer_list<const at::Tensor*> tensors) {
  if (!capturing(device)) return;
  static std::mutex mutex;
  static auto& retained = *new std::vector<at::Tensor>();  // never destroyed: see TableCache in scaler_ops.cpp
  const std::lock_guard<std::mutex> lock(mutex);
  for (const at::Tensor* t : tensors)
    if (t->defined()) retained.push_back(*t);
}

namespace {
// Order in which dtype groups are laid out (any fixed order works; this one is stable across calls).
constexpr at::ScalarType kGroupOrder[] = {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble};
}  // namespace

TensorTable::TensorTable(const std::vector<at::Tensor>& tensors, at::Device device, const std::vector<int64_t>& out_index)
    : device_(device) {
  const int64_t n = static_cast<int64_t>(tensors.size());
  TORCH_INTERNAL_ASSERT(out_index.empty() || static_cast<int64_t>(out_index.size()) == n);
  keys_.reserve(n);
  for (const auto& t : tensors) keys_.push_back({t.data_ptr(), t.numel(), t.scalar_type()});

  // Table order: grouped by dtype, caller's order inside a group.
  std::vector<int64_t> order;
  order.reserve(n);
  for (at::ScalarType dt : kGroupOrder) {
    TableGroup g{dt, static_cast<int64_t>(order.size()), 0, 0, 0};
    for (int64_t i = 0; i < n; ++i)
      if (keys_[i].dtype == dt) order.push_back(i);
    g.t_end = static_cast<int64_t>(order.size());
    if (g.t_end > g.t_begin) groups_.push_back(g);
  }
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(order.size()) == n, "tensor table: unsupported dtype reached the table");

  std::vector<int64_t> first_chunk(n + 1, 0);
  for (int64_t k = 0; k < n; ++k) {
    const int64_t numel = keys_[order[k]].numel;
    first_chunk[k + 1] = first_chunk[k] + (numel + kChunkSize - 1) / kChunkSize;
  }
  num_chunks_ = first_chunk[n];
  for (auto& g : groups_) {
    g.c_begin = first_chunk[g.t_begin];
    g.c_end = first_chunk[g.t_end];
  }

  const int64_t total = 4 * n + 2 * num_chunks_ + 1;
  meta_host_ = at::empty({std::max<int64_t>(total, 1)},
                         at::TensorOptions().dtype(at::kLong).pinned_memory(device.is_cuda()));
  int64_t* m = meta_host_.data_ptr<int64_t>();
  int64_t* addrs = m;
  int64_t* numels = addrs + n;
  int64_t* chunk_tensor = numels + n;
  int64_t* chunk_start = chunk_tensor + num_chunks_;
  int64_t* first = chunk_start + num_chunks_;
  int64_t* out = first + n + 1;
  for (int64_t k = 0; k < n; ++k) {
    const TensorKey& key = keys_[order[k]];
    addrs[k] = reinterpret_cast<int64_t>(key.ptr);
    numels[k] = key.numel;
    out[k] = out_index.empty() ? order[k] : out_index[order[k]];
    for (int64_t c = first_chunk[k]; c < first_chunk[k + 1]; ++c) {
      chunk_tensor[c] = k;
      chunk_start[c] = (c - first_chunk[k]) * kChunkSize;
    }
  }
  std::copy(first_chunk.begin(), first_chunk.end(), first);

  meta_ = device.is_cpu() ? meta_host_ : meta_host_.to(device, /*non_blocking=*/true);
  retain_if_capturing(device, {&meta_host_, &meta_});
}

bool TensorTable::matches(const std::vector<at::Tensor>& tensors) const {
  if (tensors.size() != keys_.size()) return false;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    if (!(keys_[i] == TensorKey{t.data_ptr(), t.numel(), t.scalar_type()})) return false;
  }
  return true;
}

TableView TensorTable::view() const {
  const int64_t n = num_tensors();
  const int64_t* m = meta_.data_ptr<int64_t>();
  TableView v;
  v.addrs = m;
  v.numels = m + n;
  v.chunk_tensor = m + 2 * n;
  v.chunk_start = v.chunk_tensor + num_chunks_;
  v.first_chunk = v.chunk_start + num_chunks_;
  v.out_index = v.first_chunk + n + 1;
  return v;
}

}  // namespace ampkernels
