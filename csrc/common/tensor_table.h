// The tensor table: launch metadata for a list of tensors, built once and reused while the list is unchanged.
// Layout (dev/design.md): tensors grouped by dtype, each cut into chunks of kChunkSize elements; one packed int64
// tensor on the tensors' device holds addrs | numels | chunk_tensor | chunk_start | first_chunk | out_index.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <utility>
#include <vector>

#include "common/constants.h"

namespace ampkernels {

// True while the current CUDA stream of `device` is being captured into a CUDA graph.
bool capturing(at::Device device);

// Keeps `tensors` for the life of the process when a graph is being captured on `device` now. A captured graph
// reads (and writes) a launch table's memory at every replay, including the pinned host source of its upload, but
// holds no reference to it; the table itself may be rebuilt or evicted while the graph still replays (a second
// graph over the same optimizer, an eager step whose gradients moved, the op caches' LRU). A few tensors per
// capture, so never freeing them costs little.
void retain_if_capturing(at::Device device, std::initializer_list<const at::Tensor*> tensors);

// True when `check(i)` holds for every i in [0, n). Each parameter is checked on its own (dependent cache misses:
// parameter, autograd meta, gradient), so the checks are spread over the intra-op pool; a task stops at its first
// failure.
template <typename Check>
bool all_params_pass(int64_t n, const Check& check) {
  std::atomic<bool> ok{true};
  at::parallel_for(0, n, kParamCheckGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (!check(i)) {
        ok.store(false, std::memory_order_relaxed);
        return;
      }
    }
  });
  return ok.load();
}

// The bytes [begin, end) some of a tensor's elements occupy, and an index naming the tensor (the caller's choice).
struct MemorySpan {
  uintptr_t begin, end;
  int64_t owner;
};

// All the memory of a non-overlapping and dense tensor (its elements fill it); of any other tensor only its first
// element, a subset, so that an intersection found with it is a real one. Empty for zero elements.
inline MemorySpan memory_span(const void* ptr, int64_t numel, size_t itemsize, bool dense, int64_t owner) {
  const auto begin = reinterpret_cast<uintptr_t>(ptr);
  const uintptr_t bytes = numel <= 0 ? 0 : (dense ? static_cast<uintptr_t>(numel) : 1) * itemsize;
  return {begin, begin + bytes, owner};
}

inline MemorySpan memory_span(const at::Tensor& t, int64_t owner) {
  return memory_span(t.data_ptr(), t.numel(), t.element_size(), t.is_non_overlapping_and_dense(), owner);
}

// Two owners whose spans share a byte (the smaller owner first), or {-1, -1} when no two do. O(n log n).
inline std::pair<int64_t, int64_t> find_intersecting(std::vector<MemorySpan> spans) {
  spans.erase(std::remove_if(spans.begin(), spans.end(), [](const MemorySpan& s) { return s.begin == s.end; }),
              spans.end());
  std::sort(spans.begin(), spans.end(), [](const MemorySpan& a, const MemorySpan& b) { return a.begin < b.begin; });
  uintptr_t reach = 0;  // the furthest end of the spans so far, and whose it is
  int64_t reach_owner = -1;
  for (const MemorySpan& s : spans) {
    if (reach_owner >= 0 && s.begin < reach) return {std::min(reach_owner, s.owner), std::max(reach_owner, s.owner)};
    if (s.end > reach) reach = s.end, reach_owner = s.owner;
  }
  return {-1, -1};
}

struct TableGroup {
  at::ScalarType dtype;
  int64_t t_begin, t_end;  // tensors of this dtype, in table order
  int64_t c_begin, c_end;  // their chunks
};

// Raw device pointers into the packed metadata, passed to kernels by value.
struct TableView {
  const int64_t* addrs;
  const int64_t* numels;
  const int64_t* chunk_tensor;
  const int64_t* chunk_start;
  const int64_t* first_chunk;
  const int64_t* out_index;
};

// One entry of a table's identity: the table is valid while every tensor keeps its storage, size and dtype.
struct TensorKey {
  const void* ptr;
  int64_t numel;
  at::ScalarType dtype;
  bool operator==(const TensorKey& o) const { return ptr == o.ptr && numel == o.numel && dtype == o.dtype; }
};

class TensorTable {
 public:
  TensorTable() = default;
  // `tensors` must all live on `device` and be non-overlapping and dense (checked by the caller). `out_index[i]`
  // is where tensor i's per-tensor norm goes (default: i).
  TensorTable(const std::vector<at::Tensor>& tensors, at::Device device, const std::vector<int64_t>& out_index = {});

  bool matches(const std::vector<at::Tensor>& tensors) const;

  int64_t num_tensors() const { return static_cast<int64_t>(keys_.size()); }
  int64_t num_chunks() const { return num_chunks_; }
  const std::vector<TableGroup>& groups() const { return groups_; }
  const at::Tensor& meta() const { return meta_; }
  at::Device device() const { return device_; }
  TableView view() const;

 private:
  std::vector<TensorKey> keys_;
  std::vector<TableGroup> groups_;
  int64_t num_chunks_ = 0;
  at::Device device_ = at::kCPU;
  at::Tensor meta_;       // packed int64 metadata on device_
  at::Tensor meta_host_;  // pinned host copy kept alive for the asynchronous upload
};

}  // namespace ampkernels
