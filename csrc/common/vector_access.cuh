// Aligned vector loads and stores of N elements converted to and from float32 (16 bytes at most per access).
#pragma once

namespace ampkernels {
namespace cuda {

// N elements of T in one aligned access (N * sizeof(T) <= 16 bytes).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <int N, typename T>
__device__ __forceinline__ void load(float (&dst)[N], const T* src) {
  const Vec<T, N> r = *reinterpret_cast<const Vec<T, N>*>(src);
#pragma unroll
  for (int k = 0; k < N; ++k) dst[k] = static_cast<float>(r.v[k]);
}

template <int N, typename T>
__device__ __forceinline__ void store(T* dst, const float (&src)[N]) {
  Vec<T, N> r;
#pragma unroll
  for (int k = 0; k < N; ++k) r.v[k] = static_cast<T>(src[k]);
  *reinterpret_cast<Vec<T, N>*>(dst) = r;
}

}  // namespace cuda
}  // namespace ampkernels
