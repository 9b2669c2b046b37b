// Fused multi-tensor unscale + non-finite check + norm (dev/design.md, kernels 1 and 2).
// c10 headers only: ATen/cuda/CUDAContext.h pulls in cuSPARSE/cuBLAS headers a minimal toolkit lacks.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <type_traits>

#include "scaler/scaler.h"
#include "common/multi_tensor_apply.cuh"

namespace ampkernels {
namespace cuda {

namespace {

template <typename T, bool kWrite, NormKind kNorm, bool kFactor>
struct UnscaleOp {
  // Math and norms in float32, or float64 for float64 tensors (the unscale as torch's own kernel; the norm as
  // torch.linalg.vector_norm of a float64 tensor, which float32 would overflow from 1e20 and flush below 1e-23).
  using M = std::conditional_t<std::is_same<T, double>::value, double, float>;

  float inv, factor;
  bool bad = false;
  M acc = 0;

  __device__ __forceinline__ void operator()(T& x) {
    const M g = static_cast<M>(x);
    bad |= !isfinite(g);
    M v = g * static_cast<M>(inv);
    if (kFactor) v *= static_cast<M>(factor);
    // The norm is of the unscaled value as stored in T (what clip_grad_norm_ after unscale_ would see).
    const T stored = static_cast<T>(v);
    if (kWrite) x = stored;
    const M vf = static_cast<M>(stored);
    if (kNorm == NormKind::kL2) acc = fma(vf, vf, acc);
    if (kNorm == NormKind::kInf) acc = nan_max(acc, static_cast<M>(fabs(vf)));
  }
};

// 16-byte loads a thread issues before using any. NOTE (H200, dev/scaler/NOTES.md, Llama-1B set, fp32, one block
// per chunk, % of torch's copy_ in the same run): writing, 4 / 8 / 16 loads (a thread's whole share of the chunk)
// 92.4 / 94.4 / 97.7%; read-only, 4 / 8 loads 109.1 / 108.4%.
template <typename T, bool kWrite>
constexpr int loads_in_flight() {
  constexpr int per_chunk = static_cast<int>(kChunkSize / Pack<T>::kSize / kThreads);  // fp32 16, 16-bit 8, fp64 32
  return kWrite ? (per_chunk < 16 ? per_chunk : 16) : 4;
}

// One block per chunk of [c_begin, c_end) (chunk_grid; the loop also covers a smaller grid).
template <typename T, bool kWrite, NormKind kNorm, bool kFactor>
__global__ void __launch_bounds__(kThreads) unscale_reduce_kernel(TableView tv, int64_t c_begin, int64_t c_end,
                                                                 const float* __restrict__ scale,
                                                                 const float* __restrict__ factor,
                                                                 double2* __restrict__ partials) {
  using P = Pack<T>;
  constexpr int kVec = P::kSize;
  UnscaleOp<T, kWrite, kNorm, kFactor> op;
  // Same rounding as GradScaler.unscale_: reciprocal in float64, then float32.
  op.inv = static_cast<float>(1.0 / static_cast<double>(*scale));
  op.factor = kFactor ? *factor : 1.f;

  for (int64_t c = c_begin + blockIdx.x; c < c_end; c += gridDim.x) {
    const Chunk<T> ch = chunk_at<T>(tv, c);
    op.bad = false;
    op.acc = 0;
    if (reinterpret_cast<uintptr_t>(ch.data) % 16 == 0) {
      // Vector body: kLoads independent 16-byte loads per thread before any use.
      constexpr int kLoads = loads_in_flight<T, kWrite>();
      const int64_t num_packs = ch.size / kVec;
      P* packs = reinterpret_cast<P*>(ch.data);
      for (int64_t base = threadIdx.x; base < num_packs; base += int64_t(kThreads) * kLoads) {
        P regs[kLoads];
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
          const int64_t i = base + int64_t(u) * kThreads;
          if (i < num_packs) regs[u] = packs[i];
        }
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
          const int64_t i = base + int64_t(u) * kThreads;
          if (i < num_packs) {
#pragma unroll
            for (int k = 0; k < kVec; ++k) op(regs[u].v[k]);
            if (kWrite) packs[i] = regs[u];
          }
        }
      }
      for (int64_t i = num_packs * kVec + threadIdx.x; i < ch.size; i += kThreads) op(ch.data[i]);
    } else {
      // Misaligned views (a tensor starting mid-allocation): plain coalesced element access.
      for (int64_t i = threadIdx.x; i < ch.size; i += kThreads) op(ch.data[i]);
    }
    block_reduce<kNorm == NormKind::kInf>(op.bad, op.acc);
    if (threadIdx.x == 0) partials[c] = make_double2(op.bad ? 1.0 : 0.0, static_cast<double>(op.acc));
  }
}

constexpr int kFinalizeThreads = 1024;

// Single block: folds the per-chunk partials into found_inf, the norms and the clip coefficient, in a fixed order.
// A: float64 when a float64 tensor is in the table, else float32 (the partials are then float32 values, so this is
// a float32 fold of float32 partials).
template <NormKind kNorm, typename A>
__global__ void __launch_bounds__(kFinalizeThreads)
    finalize_kernel(const double2* __restrict__ partials, int64_t num_chunks, TableView tv, int64_t num_tensors,
                    float* found_inf, float* norm_out, float* per_tensor_out, float max_norm, float* coef_out) {
  constexpr bool kMax = kNorm == NormKind::kInf;
  bool bad = false;
  A acc = 0;
  for (int64_t c = threadIdx.x; c < num_chunks; c += kFinalizeThreads) {
    const double2 p = partials[c];
    bad |= p.x != 0.0;
    acc = kMax ? nan_max(acc, static_cast<A>(p.y)) : acc + static_cast<A>(p.y);
  }
  __shared__ A s_acc[kFinalizeThreads / 32];
  bad = __syncthreads_or(bad);
  for (int offset = 16; offset > 0; offset >>= 1) {
    const A other = __shfl_down_sync(0xffffffffu, acc, offset);
    acc = kMax ? nan_max(acc, other) : acc + other;
  }
  if ((threadIdx.x & 31) == 0) s_acc[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x < 32) {
    acc = s_acc[threadIdx.x];
    for (int offset = 16; offset > 0; offset >>= 1) {
      const A other = __shfl_down_sync(0xffffffffu, acc, offset);
      acc = kMax ? nan_max(acc, other) : acc + other;
    }
  }
  if (threadIdx.x == 0) {
    if (bad) *found_inf = 1.f;
    if (kNorm != NormKind::kNone) {
      const float norm = static_cast<float>(kNorm == NormKind::kL2 ? sqrt(acc) : acc);
      if (norm_out != nullptr) *norm_out = norm;
      if (coef_out != nullptr) {
        // torch: clamp(max_norm / (norm + 1e-6), max=1), where `float / tensor` is reciprocal(tensor) * float.
        const float coef = (1.f / (norm + 1e-6f)) * max_norm;
        *coef_out = coef > 1.f ? 1.f : coef;  // NaN stays NaN, as torch.clamp leaves it
      }
    }
  }
  if (kNorm != NormKind::kNone && per_tensor_out != nullptr) {
    for (int64_t t = threadIdx.x; t < num_tensors; t += kFinalizeThreads) {
      A s = 0;
      for (int64_t c = tv.first_chunk[t]; c < tv.first_chunk[t + 1]; ++c) {
        const A p = static_cast<A>(partials[c].y);
        s = kMax ? nan_max(s, p) : s + p;
      }
      per_tensor_out[tv.out_index[t]] = static_cast<float>(kNorm == NormKind::kL2 ? sqrt(s) : s);
    }
  }
}

template <typename T, bool kWrite, NormKind kNorm, bool kFactor>
void launch_group(const TensorTable& table, const TableGroup& g, const UnscaleReduceArgs& a, cudaStream_t stream) {
  const int64_t chunks = g.c_end - g.c_begin;
  if (chunks == 0) return;
  const int64_t blocks = chunk_grid(chunks);
  unscale_reduce_kernel<T, kWrite, kNorm, kFactor><<<blocks, kThreads, 0, stream>>>(
      table.view(), g.c_begin, g.c_end, a.scale.data_ptr<float>(),
      kFactor ? a.factor.data_ptr<float>() : nullptr, reinterpret_cast<double2*>(a.partials.data_ptr<double>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void dispatch_group(const TensorTable& table, const TableGroup& g, const UnscaleReduceArgs& a, cudaStream_t s) {
  const bool f = a.factor.defined();
#define AMPK_LAUNCH(W, N)                                \
  (f ? launch_group<T, W, N, true>(table, g, a, s) : launch_group<T, W, N, false>(table, g, a, s))
  if (a.write) {
    switch (a.norm) {
      case NormKind::kNone: AMPK_LAUNCH(true, NormKind::kNone); break;
      case NormKind::kL2: AMPK_LAUNCH(true, NormKind::kL2); break;
      case NormKind::kInf: AMPK_LAUNCH(true, NormKind::kInf); break;
    }
  } else {
    switch (a.norm) {
      case NormKind::kNone: AMPK_LAUNCH(false, NormKind::kNone); break;
      case NormKind::kL2: AMPK_LAUNCH(false, NormKind::kL2); break;
      case NormKind::kInf: AMPK_LAUNCH(false, NormKind::kInf); break;
    }
  }
#undef AMPK_LAUNCH
}

template <typename P>
P* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<P>() : nullptr;
}

struct FinalizeArgs {
  const double2* partials;
  int64_t num_chunks;
  TableView tv;
  int64_t num_tensors;
  float *found_inf, *norm_out, *per_tensor_out;
  float max_norm;
  float* coef_out;
};

template <NormKind kNorm>
void launch_finalize(const FinalizeArgs& f, bool has_double, cudaStream_t stream) {
  auto kernel = has_double ? finalize_kernel<kNorm, double> : finalize_kernel<kNorm, float>;
  kernel<<<1, kFinalizeThreads, 0, stream>>>(f.partials, f.num_chunks, f.tv, f.num_tensors, f.found_inf, f.norm_out,
                                             f.per_tensor_out, f.max_norm, f.coef_out);
}

}  // namespace

}  // namespace cuda

void unscale_reduce_cuda(const TensorTable& table, const UnscaleReduceArgs& a) {
  const c10::cuda::CUDAGuard guard(table.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  for (const TableGroup& g : table.groups()) {
    switch (g.dtype) {
      case at::kFloat: cuda::dispatch_group<float>(table, g, a, stream); break;
      case at::kHalf: cuda::dispatch_group<at::Half>(table, g, a, stream); break;
      case at::kBFloat16: cuda::dispatch_group<at::BFloat16>(table, g, a, stream); break;
      case at::kDouble: cuda::dispatch_group<double>(table, g, a, stream); break;
      default: TORCH_CHECK(false, "ampkernels: unsupported gradient dtype ", g.dtype);
    }
  }
  bool has_double = false;
  for (const TableGroup& g : table.groups()) has_double |= g.dtype == at::kDouble;
  cuda::FinalizeArgs f{reinterpret_cast<const double2*>(a.partials.data_ptr<double>()),
                       table.num_chunks(),
                       table.view(),
                       table.num_tensors(),
                       a.found_inf.data_ptr<float>(),
                       cuda::ptr_or_null<float>(a.norm_out),
                       cuda::ptr_or_null<float>(a.per_tensor_out),
                       static_cast<float>(a.max_norm),
                       cuda::ptr_or_null<float>(a.coef_out)};
  switch (a.norm) {
    case NormKind::kNone: cuda::launch_finalize<NormKind::kNone>(f, has_double, stream); break;
    case NormKind::kL2: cuda::launch_finalize<NormKind::kL2>(f, has_double, stream); break;
    case NormKind::kInf: cuda::launch_finalize<NormKind::kInf>(f, has_double, stream); break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace ampkernels
