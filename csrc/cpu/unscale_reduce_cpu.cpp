// CPU implementation of the fused multi-tensor unscale + non-finite check + norm: vectorized with at::vec,
// parallel over chunks with at::parallel_for, each chunk writing its own partial (deterministic).
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <type_traits>

#include "../multi_tensor.h"

namespace ampkernels {
namespace {

using FVec = at::vec::Vectorized<float>;

float nan_max(float a, float b) { return (b > a || std::isnan(b)) && !std::isnan(a) ? b : a; }

template <bool kWrite, NormKind kNorm, bool kFactor>
struct ChunkAccumulator {
  float inv, factor;
  FVec vbad{0.f}, vacc{0.f};
  bool bad = false;
  float acc = 0.f;

  // 8 floats at a time; returns the values to store when writing.
  FVec vec(FVec g) {
    vbad = vbad | (g - g).isnan();  // g - g is NaN exactly when g is inf or NaN
    FVec v = g * FVec(inv);
    if (kFactor) v = v * FVec(factor);
    if (kNorm == NormKind::kL2) vacc = at::vec::fmadd(v, v, vacc);
    if (kNorm == NormKind::kInf) vacc = at::vec::maximum(vacc, v.abs());  // maximum() propagates NaN
    return v;
  }
  // M is float, or double for float64 tensors (unscaled in float64 like torch's own kernel).
  template <typename M>
  M scalar(M g) {
    bad |= !std::isfinite(g);
    M v = g * static_cast<M>(inv);
    if (kFactor) v *= static_cast<M>(factor);
    const float vf = static_cast<float>(v);
    if (kNorm == NormKind::kL2) acc = std::fma(vf, vf, acc);
    if (kNorm == NormKind::kInf) acc = nan_max(acc, std::fabs(vf));
    return v;
  }
  void finish(bool& out_bad, float& out_acc) {
    float lanes[FVec::size()], flags[FVec::size()];
    vacc.store(lanes);
    vbad.store(flags);
    for (int k = 0; k < FVec::size(); ++k) {
      bad |= flags[k] != 0.f;
      acc = kNorm == NormKind::kInf ? nan_max(acc, lanes[k]) : acc + lanes[k];
    }
    out_bad = bad;
    out_acc = acc;
  }
};

template <typename T, bool kWrite, NormKind kNorm, bool kFactor>
void run_chunk(T* p, int64_t n, float inv, float factor, float* partial) {
  ChunkAccumulator<kWrite, kNorm, kFactor> op{inv, factor};
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; i + FVec::size() <= n; i += FVec::size()) {
      FVec v = op.vec(FVec::loadu(p + i));
      if (kWrite) v.store(p + i);
    }
  } else if constexpr (std::is_same_v<T, at::Half> || std::is_same_v<T, at::BFloat16>) {
    using LVec = at::vec::Vectorized<T>;
    for (; i + LVec::size() <= n; i += LVec::size()) {
      auto [lo, hi] = at::vec::convert_to_float<T>(LVec::loadu(p + i));
      FVec vlo = op.vec(lo), vhi = op.vec(hi);
      if (kWrite) at::vec::convert_from_float<T>(vlo, vhi).store(p + i);
    }
  }
  using M = std::conditional_t<std::is_same_v<T, double>, double, float>;
  for (; i < n; ++i) {  // tails, and float64
    const M v = op.scalar(static_cast<M>(p[i]));
    if (kWrite) p[i] = static_cast<T>(v);
  }
  bool bad;
  float acc;
  op.finish(bad, acc);
  partial[0] = bad ? 1.f : 0.f;
  partial[1] = acc;
}

template <typename T, bool kWrite, NormKind kNorm, bool kFactor>
void run_group(const TensorTable& table, const TableGroup& g, float inv, float factor) {
  const int64_t n = table.num_tensors();
  const int64_t* m = table.meta().data_ptr<int64_t>();
  const int64_t *addrs = m, *numels = m + n, *chunk_tensor = m + 2 * n;
  const int64_t* chunk_start = chunk_tensor + table.num_chunks();
  float* partials = table.partials().data_ptr<float>();
  at::parallel_for(g.c_begin, g.c_end, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t t = chunk_tensor[c], start = chunk_start[c];
      const int64_t size = std::min(kChunkSize, numels[t] - start);
      run_chunk<T, kWrite, kNorm, kFactor>(reinterpret_cast<T*>(addrs[t]) + start, size, inv, factor,
                                           partials + 2 * c);
    }
  });
}

template <typename T>
void dispatch_group(const TensorTable& table, const TableGroup& g, const UnscaleReduceArgs& a, float inv,
                    float factor) {
  const bool f = a.factor.defined();
#define AMPK_RUN(W, N) \
  (f ? run_group<T, W, N, true>(table, g, inv, factor) : run_group<T, W, N, false>(table, g, inv, factor))
  if (a.write) {
    switch (a.norm) {
      case NormKind::kNone: AMPK_RUN(true, NormKind::kNone); break;
      case NormKind::kL2: AMPK_RUN(true, NormKind::kL2); break;
      case NormKind::kInf: AMPK_RUN(true, NormKind::kInf); break;
    }
  } else {
    switch (a.norm) {
      case NormKind::kNone: AMPK_RUN(false, NormKind::kNone); break;
      case NormKind::kL2: AMPK_RUN(false, NormKind::kL2); break;
      case NormKind::kInf: AMPK_RUN(false, NormKind::kInf); break;
    }
  }
#undef AMPK_RUN
}

}  // namespace

void unscale_reduce_cpu(const TensorTable& table, const UnscaleReduceArgs& a) {
  const float inv = static_cast<float>(1.0 / static_cast<double>(a.scale.item<float>()));
  const float factor = a.factor.defined() ? a.factor.item<float>() : 1.f;
  for (const TableGroup& g : table.groups()) {
    switch (g.dtype) {
      case at::kFloat: dispatch_group<float>(table, g, a, inv, factor); break;
      case at::kHalf: dispatch_group<at::Half>(table, g, a, inv, factor); break;
      case at::kBFloat16: dispatch_group<at::BFloat16>(table, g, a, inv, factor); break;
      case at::kDouble: dispatch_group<double>(table, g, a, inv, factor); break;
      default: TORCH_CHECK(false, "ampkernels: unsupported gradient dtype ", g.dtype);
    }
  }
  // Fold the partials in a fixed order (same definition as the CUDA finalize kernel).
  const bool is_max = a.norm == NormKind::kInf;
  const float* partials = table.partials().data_ptr<float>();
  bool bad = false;
  float acc = 0.f;
  for (int64_t c = 0; c < table.num_chunks(); ++c) {
    bad |= partials[2 * c] != 0.f;
    acc = is_max ? nan_max(acc, partials[2 * c + 1]) : acc + partials[2 * c + 1];
  }
  if (bad) a.found_inf.fill_(1.f);
  if (a.norm == NormKind::kNone) return;
  const float norm = a.norm == NormKind::kL2 ? std::sqrt(acc) : acc;
  if (a.norm_out.defined()) a.norm_out.fill_(norm);
  if (a.coef_out.defined()) {
    const float coef = (1.f / (norm + 1e-6f)) * static_cast<float>(a.max_norm);
    a.coef_out.fill_(coef > 1.f ? 1.f : coef);
  }
  if (a.per_tensor_out.defined()) {
    const int64_t n = table.num_tensors();
    const int64_t* m = table.meta().data_ptr<int64_t>();
    const int64_t* first_chunk = m + 2 * n + 2 * table.num_chunks();
    const int64_t* out_index = first_chunk + n + 1;
    float* out = a.per_tensor_out.data_ptr<float>();
    for (int64_t t = 0; t < n; ++t) {
      float s = 0.f;
      for (int64_t c = first_chunk[t]; c < first_chunk[t + 1]; ++c)
        s = is_max ? nan_max(s, partials[2 * c + 1]) : s + partials[2 * c + 1];
      out[out_index[t]] = a.norm == NormKind::kL2 ? std::sqrt(s) : s;
    }
  }
}

void update_scale_cpu(const UpdateScaleArgs& a) {
  update_scale_step<int>(a.scale.data_ptr<float>(), a.growth_tracker.data_ptr<int>(),
                         a.hysteresis_tracker.data_ptr<int>(), a.found_inf.item<float>(), a.growth_factor,
                         a.backoff_factor, a.growth_interval, a.hysteresis, a.min_scale, a.max_scale,
                         a.counters.defined() ? a.counters.data_ptr<int64_t>() : nullptr,
                         a.history.defined() ? a.history.data_ptr<float>() : nullptr,
                         a.history.defined() ? a.history.numel() : 0);
}

}  // namespace ampkernels
