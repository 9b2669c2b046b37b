// Standalone timing of current tensorwise FP8 scaling (amax pass, then cast), bf16 -> e4m3, no torch:
//   nvcc -O3 -std=c++17 -arch=sm_90a dev/float8/amax_bench.cu -o /tmp/amax_bench && /tmp/amax_bench
//
// Question: what separates the shipped two launches (memset + amax pass + cast walked backwards: 1.72-1.77x the
// one-pass floor on the H200) from a 1.6x target? cast_bench.cu measured the amax pass alone at 3.8 TB/s read
// only, below the 4.26 TB/s copy, and each launch's ramp and tail are ~2-3 us of a ~40 us kernel. Variants:
//   read      the amax pass alone: grid-stride with U 16-byte loads in flight (shipped U = 4), the same through
//             ld.global.nc.L1::no_allocate.L2::256B (a 256-byte L2 prefetch per load), and the bulk copy engine
//             (cp.async.bulk into a ring of shared-memory stages completing on mbarriers, one thread issuing);
//   two-pass  the whole current-scaling cast, each checked bit for bit against the shipped design's codes:
//             shipped (memset + amax atomics + cast); PDL (the cast launched as a programmatic dependent: its
//             blocks start as the amax pass's retire and wait at griddepcontrol.wait); partials (no memset: each
//             amax block writes its own partial, each cast block reduces them after the wait), the cast plain, PDL
//             waiting first (branch float8-cast-pdl's library design), or PDL loading its first vectors of x (which
//             the amax pass does not write) before the wait; and partials with each amax reader above.
//             Each as back-to-back stream launches and as a CUDA-graph replay (capture_step's path).
#include <functional>
#include <tuple>

#include "probe_common.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int kCastLoads = 4;

__device__ __forceinline__ V8 load_nc_256(const V8* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  V8 r;
  memcpy(&r, &v, sizeof r);
  return r;
}

__device__ __forceinline__ void allow_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void wait_for_producer() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// A block's (acc, bad): atomics into a zeroed scratch (kPartials false) or its own slot of `partials` (no zeroing).
template <bool kPartials>
__device__ __forceinline__ void publish(float acc, bool bad, unsigned* g_amax, int* g_bad, uint2* partials) {
  if constexpr (!kPartials) {
    reduce_to_global<kThreads>(acc, bad, g_amax, g_bad);
  } else {
    acc = block_max<kThreads>(acc, bad);
    if (threadIdx.x == 0) partials[blockIdx.x] = make_uint2(__float_as_uint(acc), bad ? 1u : 0u);
  }
}

// ---- amax readers ----
template <int U, bool kNc, bool kPartials>
__global__ void __launch_bounds__(kThreads)
    amax_grid_u(const V8* __restrict__ x, int64_t nvec, unsigned* g_amax, int* g_bad, uint2* partials) {
  allow_dependents();
  float acc = 0.0f;
  bool bad = false;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  for (; i + (U - 1) * stride < nvec; i += U * stride) {
    V8 r[U];
#pragma unroll
    for (int u = 0; u < U; ++u) r[u] = kNc ? load_nc_256(x + i + u * stride) : x[i + u * stride];
#pragma unroll
    for (int u = 0; u < U; ++u) acc8(r[u], acc, bad);
  }
  for (; i < nvec; i += stride) acc8(x[i], acc, bad);
  publish<kPartials>(acc, bad, g_amax, g_bad, partials);
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Stage j of the grid-stride walk over whole stages: block b reads stages b, b + G, b + 2G, ... into a ring of
// kStages shared-memory buffers, thread 0 issuing each bulk copy once every thread has read that buffer.
template <int kStages, int kStageBytes, bool kPartials>
__global__ void __launch_bounds__(kThreads)
    amax_bulk(const V8* __restrict__ x, int64_t nvec, unsigned* g_amax, int* g_bad, uint2* partials) {
  allow_dependents();
  extern __shared__ __align__(128) uint8_t ring[];
  __shared__ __align__(8) uint64_t full[kStages];
  constexpr int kStageVecs = kStageBytes / 16;
  constexpr int kPerThread = kStageVecs / kThreads;
  static_assert(kStageVecs % kThreads == 0, "a stage is whole vectors of every thread");
  const int64_t stages = nvec / kStageVecs;
  const int64_t G = gridDim.x;
  auto issue = [&](int slot, int64_t j) {
    const uint32_t bar = smem_addr(&full[slot]);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(kStageBytes) : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            smem_addr(ring + slot * kStageBytes)),
        "l"(x + j * kStageVecs), "r"(kStageBytes), "r"(bar)
        : "memory");
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&full[s])));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    for (int s = 0; s < kStages; ++s)
      if (blockIdx.x + s * G < stages) issue(s, blockIdx.x + s * G);
  }
  __syncthreads();
  float acc = 0.0f;
  bool bad = false;
  for (int64_t k = 0;; ++k) {
    const int64_t j = blockIdx.x + k * G;
    if (j >= stages) break;
    const int slot = int(k % kStages);
    const uint32_t phase = uint32_t(k / kStages) & 1u;
    uint32_t done = 0;
    while (!done) {
      asm volatile(
          "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
          : "=r"(done)
          : "r"(smem_addr(&full[slot])), "r"(phase)
          : "memory");
    }
    const V8* buf = reinterpret_cast<const V8*>(ring + slot * kStageBytes);
#pragma unroll
    for (int v = 0; v < kPerThread; ++v) acc8(buf[v * kThreads + threadIdx.x], acc, bad);
    __syncthreads();  // every thread has read the buffer before it is refilled
    if (threadIdx.x == 0 && j + kStages * G < stages) issue(slot, j + kStages * G);
  }
  for (int64_t i = stages * kStageVecs + int64_t(blockIdx.x) * kThreads + threadIdx.x; i < nvec; i += G * kThreads)
    acc8(x[i], acc, bad);
  publish<kPartials>(acc, bad, g_amax, g_bad, partials);
}

// ---- casts (walked backwards: the amax pass's last reads are still in L2) ----
// The scale from the amax pass's result, in every thread: its atomics (g_amax, g_bad) or its per-block partials.
template <bool kPartials>
__device__ __forceinline__ float scale_after(const unsigned* g_amax, const int* g_bad, const uint2* partials,
                                             int nparts) {
  if constexpr (!kPartials) return scale_of(__uint_as_float(*g_amax), *g_bad != 0);
  float acc = 0.0f;
  bool bad = false;
  for (int p = threadIdx.x; p < nparts; p += kThreads) {
    const uint2 v = partials[p];
    acc = fmaxf(acc, __uint_as_float(v.x));
    bad |= v.y != 0;
  }
  acc = block_max<kThreads>(acc, bad);
  return scale_of(acc, bad);
}

// kWait: launched as a programmatic dependent of the amax pass; kPartials: the scale from the amax blocks' partials;
// kPreload: the first vectors of x loaded before the wait (the amax pass does not write x), else the shipped loop
// after the wait (the library's design: fewer registers).
template <bool kWait, bool kPartials, bool kPreload = true>
__global__ void __launch_bounds__(kThreads)
    cast_after(const V8* __restrict__ x, uint2* __restrict__ out, int64_t nvec, const unsigned* g_amax,
               const int* g_bad, const uint2* partials, int nparts) {
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  float scale;
  if constexpr (!kPreload) {
    if constexpr (kWait) wait_for_producer();
    scale = scale_after<kPartials>(g_amax, g_bad, partials, nparts);
    for (; i + (kCastLoads - 1) * stride < nvec; i += kCastLoads * stride) {
      V8 r[kCastLoads];
#pragma unroll
      for (int u = 0; u < kCastLoads; ++u) r[u] = x[nvec - 1 - (i + u * stride)];
#pragma unroll
      for (int u = 0; u < kCastLoads; ++u) out[nvec - 1 - (i + u * stride)] = cast8(r[u], scale);
    }
  } else {
    V8 r[kCastLoads];
    bool more = i + (kCastLoads - 1) * stride < nvec;
    if (more) {
#pragma unroll
      for (int u = 0; u < kCastLoads; ++u) r[u] = x[nvec - 1 - (i + u * stride)];
    }
    if constexpr (kWait) wait_for_producer();
    scale = scale_after<kPartials>(g_amax, g_bad, partials, nparts);
    while (more) {
#pragma unroll
      for (int u = 0; u < kCastLoads; ++u) out[nvec - 1 - (i + u * stride)] = cast8(r[u], scale);
      i += kCastLoads * stride;
      more = i + (kCastLoads - 1) * stride < nvec;
      if (more) {
#pragma unroll
        for (int u = 0; u < kCastLoads; ++u) r[u] = x[nvec - 1 - (i + u * stride)];
      }
    }
  }
  for (; i < nvec; i += stride) out[nvec - 1 - i] = cast8(x[nvec - 1 - i], scale);
}

template <auto kKernel>
int resident_grid(int sms, int smem, int64_t work_blocks) {
  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, kThreads, smem));
  return int(std::max<int64_t>(1, std::min<int64_t>(work_blocks, int64_t(sms) * std::max(per_sm, 1))));
}

// The first launch error since the last check (a capture that refuses a launch is reported, not fatal).
cudaError_t g_launch_error = cudaSuccess;

template <typename K, typename... Args>
void launch(K kernel, int grid, int smem, cudaStream_t st, bool programmatic, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = programmatic ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, args...);
  if (g_launch_error == cudaSuccess) g_launch_error = err;
}

}  // namespace

int main() {
  int sms = 0, dev = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, dev));
  std::printf("%s, %d SMs, L2 %d MB\n", prop.name, sms, prop.l2CacheSize >> 20);
  cudaStream_t st;
  CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const double copy_gbs = copy_bandwidth(st);
  const int64_t shapes[][2] = {{8192, 8192}, {16384, 8192}, {16384, 2048}, {4096, 4096}};
  for (auto& s : shapes) {
    const int64_t n = s[0] * s[1], nvec = n / 8;
    V8* x;
    uint2 *ref, *out, *partials;
    unsigned* scratch;  // amax, bad
    CHECK(cudaMalloc(&x, n * 2));
    CHECK(cudaMalloc(&ref, n));
    CHECK(cudaMalloc(&out, n));
    CHECK(cudaMalloc(&scratch, 16));
    CHECK(cudaMalloc(&partials, 8 * 4096));
    fill<<<1024, 256>>>(x, nvec, 12345u);
    CHECK(cudaDeviceSynchronize());
    int* bad = reinterpret_cast<int*>(scratch + 1);
    const double floor_ms = 3.0 * n / (copy_gbs * 1e6);
    std::printf("== %lld x %lld bf16 (%.0f MB read + %.0f MB written; one-pass floor %.4f ms)\n", (long long)s[0],
                (long long)s[1], 2.0 * n / 1e6, 1.0 * n / 1e6, floor_ms);
    const int64_t work = (nvec + kThreads - 1) / kThreads;

    // ---- the amax pass alone (read only) ----
    std::vector<uint8_t> h_ref(n), h_out(n);
    unsigned ref_amax = 0;
    auto read_only = [&](const char* name, auto kernel, int grid, int smem) {
      CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      const float ms = time_ms([&] {
        CHECK(cudaMemsetAsync(scratch, 0, 8, st));
        launch(kernel, grid, smem, st, false, x, nvec, scratch, bad, partials);
      }, 20, st);
      CHECK(g_launch_error);
      unsigned got;
      CHECK(cudaMemcpy(&got, scratch, 4, cudaMemcpyDeviceToHost));
      if (ref_amax == 0) ref_amax = got;
      std::printf("  read  %-44s %3d/SM %.4f ms %6.0f GB/s  amax %s\n", name, grid / sms, ms, 2.0 * n / ms / 1e6,
                  got == ref_amax ? "same" : "DIFFERENT");
    };
#define GRID(U, NC, NAME) \
  read_only(NAME, amax_grid_u<U, NC, false>, resident_grid<amax_grid_u<U, NC, false>>(sms, 0, work), 0);
    GRID(4, false, "grid U4 (shipped)")
    GRID(8, false, "grid U8")
    GRID(4, true, "grid U4 nc.L2::256B")
    GRID(8, true, "grid U8 nc.L2::256B")
#define BULK(S, B)                                                                                              \
  {                                                                                                             \
    auto k = amax_bulk<S, B, false>;                                                                            \
    CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, S * B));                         \
    read_only("bulk " #S " x " #B " B", k, resident_grid<amax_bulk<S, B, false>>(sms, S * B, work), S * B);     \
  }
    BULK(4, 16384)
    BULK(8, 8192)
    BULK(4, 32768)
    BULK(6, 16384)
    BULK(3, 65536)

    // ---- the whole current-scaling cast ----
    const int cast_grid_blocks = resident_grid<cast_after<false, false, false>>(sms, 0, work);
    const int amax_blocks = resident_grid<amax_grid_u<4, false, false>>(sms, 0, work);
    auto shipped = [&](uint2* dst) {
      CHECK(cudaMemsetAsync(scratch, 0, 8, st));
      launch(amax_grid_u<4, false, false>, amax_blocks, 0, st, false, x, nvec, scratch, bad, partials);
      launch(cast_after<false, false, false>, cast_grid_blocks, 0, st, false, x, dst, nvec, (const unsigned*)scratch,
             (const int*)bad, (const uint2*)partials, 0);
    };
    shipped(ref);
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemcpy(h_ref.data(), ref, n, cudaMemcpyDeviceToHost));
    auto report = [&](const char* name, const std::function<void()>& pass) {
      CHECK(cudaMemset(out, 0, n));
      const float ms = time_ms(pass, 20, st);
      CHECK(g_launch_error);
      CHECK(cudaMemcpy(h_out.data(), out, n, cudaMemcpyDeviceToHost));
      bool ok = std::memcmp(h_out.data(), h_ref.data(), n) == 0;
      // the same pass, 20 times in one CUDA graph (capture_step's path); a refused capture is reported
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
      for (int i = 0; i < 20; ++i) pass();
      cudaError_t err = cudaStreamEndCapture(st, &graph);
      if (err == cudaSuccess) err = g_launch_error;
      if (err == cudaSuccess) err = cudaGraphInstantiate(&exec, graph, 0);
      float graph_ms = 0.0f;
      if (err == cudaSuccess) {
        CHECK(cudaMemset(out, 0, n));
        graph_ms = time_ms([&] { CHECK(cudaGraphLaunch(exec, st)); }, 1, st) / 20;
        CHECK(cudaMemcpy(h_out.data(), out, n, cudaMemcpyDeviceToHost));
        ok = ok && std::memcmp(h_out.data(), h_ref.data(), n) == 0;
      }
      if (exec) CHECK(cudaGraphExecDestroy(exec));
      if (graph) CHECK(cudaGraphDestroy(graph));
      g_launch_error = cudaSuccess;
      (void)cudaGetLastError();
      if (err != cudaSuccess) {
        std::printf("  cast  %-44s stream %.4f ms (x floor %.2f), graph refused: %s %s\n", name, ms, ms / floor_ms,
                    cudaGetErrorString(err), ok ? "bit-exact" : "MISMATCH");
        return;
      }
      std::printf("  cast  %-44s stream %.4f ms (x floor %.2f), graph %.4f ms (x floor %.2f) %s\n", name, ms,
                  ms / floor_ms, graph_ms, graph_ms / floor_ms, ok ? "bit-exact" : "MISMATCH");
    };
    report("memset + amax U4 + cast (shipped)", [&] { shipped(out); });
    report("memset + amax U4 + PDL cast", [&] {
      CHECK(cudaMemsetAsync(scratch, 0, 8, st));
      launch(amax_grid_u<4, false, false>, amax_blocks, 0, st, false, x, nvec, scratch, bad, partials);
      launch(cast_after<true, false, false>, cast_grid_blocks, 0, st, true, x, out, nvec, (const unsigned*)scratch,
             (const int*)bad, (const uint2*)partials, 0);
    });
#define PARTIALS(NAME, KERNEL, SMEM)                                                                          \
  {                                                                                                           \
    auto k = KERNEL;                                                                                          \
    CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));                        \
    const int g = resident_grid<KERNEL>(sms, SMEM, work);                                                     \
    const int cast_g = resident_grid<cast_after<true, true>>(sms, 0, work);                                   \
    const int cast_g_wait_first = resident_grid<cast_after<true, true, false>>(sms, 0, work);                  \
    const auto pointers = std::make_tuple(x, out, nvec, (const unsigned*)scratch, (const int*)bad,             \
                                          (const uint2*)partials, g);                                         \
    for (int variant = 0; variant < 3; ++variant) {                                                           \
      static const char* kCasts[] = {"plain", "PDL, x preloaded", "PDL, wait first"};                         \
      char name[96];                                                                                          \
      std::snprintf(name, sizeof name, "partials %s + %s cast", NAME, kCasts[variant]);                       \
      report(name, [&] {                                                                                      \
        launch(k, g, SMEM, st, false, x, nvec, scratch, bad, partials);                                       \
        std::apply([&](auto... a) {                                                                           \
          if (variant == 0) launch(cast_after<false, true>, cast_g, 0, st, false, a...);                      \
          if (variant == 1) launch(cast_after<true, true>, cast_g, 0, st, true, a...);                        \
          if (variant == 2) launch(cast_after<true, true, false>, cast_g_wait_first, 0, st, true, a...);      \
        }, pointers);                                                                                         \
      });                                                                                                     \
    }                                                                                                         \
  }
    PARTIALS("amax U4", (amax_grid_u<4, false, true>), 0)
    PARTIALS("amax U8 nc", (amax_grid_u<8, true, true>), 0)
    PARTIALS("bulk 4x16KB", (amax_bulk<4, 16384, true>), 4 * 16384)
    PARTIALS("bulk 8x8KB", (amax_bulk<8, 8192, true>), 8 * 8192)
    CHECK(cudaFree(x));
    CHECK(cudaFree(ref));
    CHECK(cudaFree(out));
    CHECK(cudaFree(scratch));
    CHECK(cudaFree(partials));
  }
  return 0;
}
