// Fused optimizer steps on CUDA (optimizer.h): a one-thread-per-tensor prologue (step counts and bias
// corrections), then one pass over every chunk of every parameter of the launch (a block per chunk), reading the
// gradient once and reading + writing the parameter and its state once, with 16-byte accesses where the data allows.
// Both kernels return at once when found_inf is non-zero, so a skipped step writes nothing at all.
// c10 headers only: ATen/cuda/CUDAContext.h pulls in cuSPARSE/cuBLAS headers a minimal toolkit lacks.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <type_traits>

#include "optim/optimizer.h"
#include "common/multi_tensor_apply.cuh"
#include "common/vector_access.cuh"

namespace ampkernels {
namespace cuda {
namespace {

__device__ __forceinline__ bool skipped(const float* found_inf) { return found_inf != nullptr && *found_inf != 0.f; }

__device__ __forceinline__ double read_lr(const float* lr_ptr, double lr) {
  return lr_ptr != nullptr ? static_cast<double>(*lr_ptr) : lr;
}

template <typename T>
__device__ __forceinline__ T* list_ptr(const int64_t* lists, int64_t num_tensors, int list, int64_t t) {
  return reinterpret_cast<T*>(lists[list * num_tensors + t]);
}

struct KernelArgs {
  TableView tv;
  const int64_t* lists;
  int64_t num_tensors, num_chunks;
  float2* scalars;
  const float* grad_scale;
  const float* found_inf;
  const float* lr_ptr;
  double lr;
  AdamCoefficients adam;
  SgdCoefficients sgd;
};

// scalars[t] = (step_size, bc2_sqrt) for Adam, (first applied step ? 1 : 0, 0) for SGD; advances the step counts.
template <OptimizerKind kKind>
__global__ void prologue_kernel(KernelArgs a) {
  if (skipped(a.found_inf)) return;
  const double lr = read_lr(a.lr_ptr, a.lr);
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < a.num_tensors;
       t += int64_t(gridDim.x) * blockDim.x) {
    float* step = list_ptr<float>(a.lists, a.num_tensors, kStepList, t);
    if (step == nullptr) continue;
    if (kKind == OptimizerKind::kAdam) {
      const float s = *step + 1.f;
      *step = s;
      float step_size, bc2_sqrt;
      adam_step_constants(lr, a.adam.beta1, a.adam.beta2, s, &step_size, &bc2_sqrt);
      a.scalars[t] = make_float2(step_size, bc2_sqrt);
    } else {
      const float s = *step;
      a.scalars[t] = make_float2(s == 0.f ? 1.f : 0.f, 0.f);
      *step = s + 1.f;
    }
  }
}

// The pointers of one chunk, offset to its first element.
template <typename P, typename G, typename S>
struct ChunkPtrs {
  P* p;
  const G* g;
  S* m;  // exp_avg / momentum_buffer (may be null for SGD)
  S* v;
  S* vmax;
  float* master;
};

// Updates N consecutive elements starting at i (N = 1 for the element-wise paths).
template <OptimizerKind kKind, typename P, typename G, typename S, int N>
__device__ __forceinline__ void update(const ChunkPtrs<P, G, S>& c, int64_t i, const KernelArgs& a, float inv_scale,
                                       float decay, float lr_f, float2 sc) {
  constexpr bool kMaster = !std::is_same<P, S>::value;
  float p[N], g[N], m[N], v[N], vmax[N];
  if (kMaster)
    load<N>(p, c.master + i);
  else
    load<N>(p, c.p + i);
  load<N>(g, c.g + i);
  if (kKind == OptimizerKind::kAdam) {
    load<N>(m, c.m + i);
    load<N>(v, c.v + i);
    if (c.vmax != nullptr) load<N>(vmax, c.vmax + i);
#pragma unroll
    for (int k = 0; k < N; ++k) adam_element(p[k], g[k] * inv_scale, m[k], v[k], vmax[k], a.adam, decay, sc.x, sc.y);
    store<N>(c.m + i, m);
    store<N>(c.v + i, v);
    if (c.vmax != nullptr) store<N>(c.vmax + i, vmax);
  } else {
    const bool first = sc.x != 0.f;
    if (c.m != nullptr && !first) load<N>(m, c.m + i);
#pragma unroll
    for (int k = 0; k < N; ++k) sgd_element(p[k], g[k] * inv_scale, m[k], a.sgd, lr_f, first);
    if (c.m != nullptr) store<N>(c.m + i, m);
  }
  if (kMaster) store<N>(c.master + i, p);
  store<N>(c.p + i, p);
}

template <int kBytes>
__device__ __forceinline__ bool aligned(const void* ptr) {
  return reinterpret_cast<uintptr_t>(ptr) % kBytes == 0;
}

// One block per chunk of the launch (the loop also covers a smaller grid).
template <OptimizerKind kKind, typename P, typename G, typename S>
__global__ void __launch_bounds__(kThreads) step_kernel(KernelArgs a) {
  if (skipped(a.found_inf)) return;
  // Elements per vector access: 16 bytes of the widest type (float32 AdamW: 4 -> every access is 16 bytes).
  constexpr int kVec = 16 / std::max(sizeof(P), std::max(sizeof(G), sizeof(S)));
  // Same rounding as GradScaler.unscale_: reciprocal in float64, then float32.
  const float inv_scale = a.grad_scale != nullptr ? static_cast<float>(1.0 / static_cast<double>(*a.grad_scale)) : 1.f;
  const double lr = read_lr(a.lr_ptr, a.lr);
  const float decay = static_cast<float>(1.0 - lr * a.adam.weight_decay);
  const float lr_f = static_cast<float>(lr);
  const int64_t n = a.num_tensors;
  for (int64_t chunk = blockIdx.x; chunk < a.num_chunks; chunk += gridDim.x) {
    const int64_t t = a.tv.chunk_tensor[chunk];
    const int64_t start = a.tv.chunk_start[chunk];
    const int64_t remaining = a.tv.numels[t] - start;
    const int64_t size = remaining < kChunkSize ? remaining : kChunkSize;
    ChunkPtrs<P, G, S> c;
    c.p = reinterpret_cast<P*>(a.tv.addrs[t]) + start;
    c.g = list_ptr<const G>(a.lists, n, kGradList, t) + start;
    c.m = list_ptr<S>(a.lists, n, kExpAvgList, t);
    c.v = list_ptr<S>(a.lists, n, kExpAvgSqList, t);
    c.vmax = list_ptr<S>(a.lists, n, kMaxExpAvgSqList, t);
    c.master = list_ptr<float>(a.lists, n, kMasterList, t);
    // Offsets only for the pointers that exist (a null pointer stays null).
    if (c.m) c.m += start;
    if (c.v) c.v += start;
    if (c.vmax) c.vmax += start;
    if (c.master) c.master += start;
    const float2 sc = kKind == OptimizerKind::kAdam || c.m != nullptr ? a.scalars[t] : make_float2(0.f, 0.f);
    const bool vector_ok = aligned<kVec * sizeof(P)>(c.p) && aligned<kVec * sizeof(G)>(c.g) &&
                           aligned<kVec * sizeof(S)>(c.m) && aligned<kVec * sizeof(S)>(c.v) &&
                           aligned<kVec * sizeof(S)>(c.vmax) && aligned<kVec * 4>(c.master);
    int64_t done = 0;
    if (vector_ok) {
      done = size / kVec * kVec;
      for (int64_t i = int64_t(threadIdx.x) * kVec; i < done; i += int64_t(kThreads) * kVec)
        update<kKind, P, G, S, kVec>(c, i, a, inv_scale, decay, lr_f, sc);
    }
    // Tail (and views not aligned for vector access): element by element, still coalesced.
    for (int64_t i = done + threadIdx.x; i < size; i += kThreads)
      update<kKind, P, G, S, 1>(c, i, a, inv_scale, decay, lr_f, sc);
  }
}

template <OptimizerKind kKind, typename P, typename G, typename S>
void launch_step(const KernelArgs& a, cudaStream_t stream) {
  if (a.num_chunks == 0) return;
  const int64_t grid = chunk_grid(a.num_chunks);
  step_kernel<kKind, P, G, S><<<grid, kThreads, 0, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <OptimizerKind kKind, typename P, typename G>
void dispatch_state(const OptimizerLaunch& l, const KernelArgs& a, cudaStream_t s) {
  if (l.state_dtype == at::kFloat)
    launch_step<kKind, P, G, float>(a, s);
  else if constexpr (!std::is_same<P, float>::value)
    launch_step<kKind, P, G, P>(a, s);
  else
    TORCH_CHECK(false, "ampkernels: optimizer state dtype ", l.state_dtype, " for float32 parameters");
}

template <OptimizerKind kKind, typename P>
void dispatch_grad(const OptimizerLaunch& l, const KernelArgs& a, cudaStream_t s) {
  switch (l.grad_dtype) {
    case at::kFloat: dispatch_state<kKind, P, float>(l, a, s); break;
    case at::kHalf: dispatch_state<kKind, P, at::Half>(l, a, s); break;
    case at::kBFloat16: dispatch_state<kKind, P, at::BFloat16>(l, a, s); break;
    default: TORCH_CHECK(false, "ampkernels: unsupported gradient dtype ", l.grad_dtype);
  }
}

template <OptimizerKind kKind>
void dispatch(const OptimizerLaunch& l, const KernelArgs& a, cudaStream_t s) {
  constexpr int kPrologueThreads = 256;
  const int64_t blocks = std::min<int64_t>((a.num_tensors + kPrologueThreads - 1) / kPrologueThreads, 1024);
  if (blocks > 0) {
    prologue_kernel<kKind><<<blocks, kPrologueThreads, 0, s>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  switch (l.param_dtype) {
    case at::kFloat: dispatch_grad<kKind, float>(l, a, s); break;
    case at::kHalf: dispatch_grad<kKind, at::Half>(l, a, s); break;
    case at::kBFloat16: dispatch_grad<kKind, at::BFloat16>(l, a, s); break;
    default: TORCH_CHECK(false, "ampkernels: unsupported parameter dtype ", l.param_dtype);
  }
}

template <typename T>
const T* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

}  // namespace
}  // namespace cuda

void optimizer_step_cuda(const OptimizerLaunch& l) {
  const c10::cuda::CUDAGuard guard(l.table->device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cuda::KernelArgs a;
  a.tv = l.table->view();
  a.lists = l.lists.data_ptr<int64_t>();
  a.num_tensors = l.table->num_tensors();
  a.num_chunks = l.table->num_chunks();
  a.scalars = reinterpret_cast<float2*>(l.scalars.data_ptr<float>());
  a.grad_scale = cuda::ptr_or_null<float>(l.grad_scale);
  a.found_inf = cuda::ptr_or_null<float>(l.found_inf);
  a.lr_ptr = cuda::ptr_or_null<float>(l.lr_tensor);
  a.lr = l.lr;
  a.adam = l.adam;
  a.sgd = l.sgd;
  if (l.kind == OptimizerKind::kAdam)
    cuda::dispatch<OptimizerKind::kAdam>(l, a, stream);
  else
    cuda::dispatch<OptimizerKind::kSgd>(l, a, stream);
}

}  // namespace ampkernels
