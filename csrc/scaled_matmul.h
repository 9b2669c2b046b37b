// Shared between the scaled_matmul_wmma_ / scaled_matmul_wgmma_ ops (scaled_matmul_ops.cpp: checks, registration) and
// their CUDA launchers (cuda/scaled_matmul_wmma.cu, cuda/scaled_matmul_wgmma.cu).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>

#ifndef AMPK_CUDA_ARCH_LIST  // setup.py defines it in CUDA builds
#define AMPK_CUDA_ARCH_LIST ""
#endif

namespace ampkernels {

// Whether this build compiled the wgmma kernel (TORCH_CUDA_ARCH_LIST holds 9.0a): guards the op, and is
// ampkernels._C.wgmma_built for Python (which reports it without touching the GPU).
inline bool scaled_matmul_wgmma_built() { return std::strstr(AMPK_CUDA_ARCH_LIST, "9.0a") != nullptr; }

// How the wgmma kernel covers an M x N x K product (cuda/scaled_matmul_wgmma.cuh): tiles of 128 x `bn`, and
// `grid` persistent blocks. The first `stream_k_tiles` tiles (grouped order) are shared out by k-iterations, one
// contiguous range per block (stream-K), the rest go round-robin whole.
struct WgmmaSchedule {
  int bn = 256;
  int64_t stream_k_tiles = 0;
  int64_t grid = 0;
};

// The schedule whose waves cost least, in k-steps of the tile width times that width's cost per column (192 and
// 128 pay 3% and 8% for keeping the tensor cores less busy per shared-memory byte than 256). Stream-K takes the
// last, partial wave's tiles (all of them when there are fewer than SMs) and pays per block a segment boundary and
// ~1 k-step per fp32 partial tile written or read. Environment (dev knobs; read per call): AMPKERNELS_WGMMA_BN
// forces a width, AMPKERNELS_WGMMA_STREAMK=0/1 never / always (where a wave is partial) shares out.
// NOTE: 3072x768x8192 on 132 SMs: 72 tiles of 128x256 (96 of 128x192) leave 36-60 SMs idle for the whole product.
inline WgmmaSchedule scaled_matmul_wgmma_schedule(int64_t M, int64_t N, int64_t K, int64_t sms) {
  constexpr int64_t kBM = 128, kBK = 64;
  constexpr double kSegmentCost = 2.0, kPartialCost = 1.0;  // k-steps (estimates)
  constexpr int64_t kMinShare = 4;                        // k-steps per block below which stream-K never pays
  int forced_bn = 0;
  if (const char* env = std::getenv("AMPKERNELS_WGMMA_BN")) {
    const int bn = std::atoi(env);
    if (bn == 128 || bn == 192 || bn == 256) forced_bn = bn;
  }
  int forced_sk = -1;
  if (const char* env = std::getenv("AMPKERNELS_WGMMA_STREAMK")) {
    if (env[0] == '0' || env[0] == '1') forced_sk = env[0] - '0';
  }
  const int64_t tiles_m = (M + kBM - 1) / kBM;
  const int64_t k_tiles = (K + kBK - 1) / kBK;
  WgmmaSchedule best;
  double best_cost = -1;
  for (int bn : {256, 192, 128}) {
    if (forced_bn != 0 && bn != forced_bn) continue;
    const double per_step = bn * (bn == 256 ? 1.0 : (bn == 192 ? 1.03 : 1.08));
    const int64_t tiles = tiles_m * ((N + bn - 1) / bn);
    const int64_t waves = (tiles + sms - 1) / sms;
    auto consider = [&](double steps, int64_t stream_k_tiles, int64_t grid) {
      const double cost = steps * per_step;
      if (best_cost < 0 || cost < best_cost) {
        best = WgmmaSchedule{bn, stream_k_tiles, grid};
        best_cost = cost;
      }
    };
    const int64_t shared_tiles = tiles < sms ? tiles : tiles % sms;
    const int64_t share = (shared_tiles * k_tiles + sms - 1) / sms;  // k-steps per block
    const bool can_share = tiles % sms != 0 && k_tiles > 1 && forced_sk != 0 && (share >= kMinShare || forced_sk == 1);
    if (can_share) {
      const int64_t parts = (k_tiles + share - 1) / share + 1;  // blocks a tile is cut between, at most
      consider((tiles / sms) * k_tiles + share + kSegmentCost + kPartialCost * parts, shared_tiles, sms);
    }
    if (!can_share || forced_sk != 1) consider(double(waves * k_tiles), 0, tiles < sms ? tiles : sms);
  }
  return best;
}

// How a 2-D operand is stored: element (i, j) is at data[i * ld + j] (row-major) or data[j * ld + i] (column-major).
struct MatLayout {
  bool row_major = true;
  int64_t ld = 0;
};

// Everything the launcher needs, already checked by scaled_matmul_wmma_ (scaled_matmul_ops.cpp).
struct ScaledMatmulArgs {
  at::Tensor a, b;          // [M, K], [K, N]: fp16 or bf16, same dtype
  MatLayout la, lb;         // their layouts
  at::Tensor scale;         // undefined (mode 0) or float32: 1 element (1), [M] (2), [N] (3)
  int64_t scale_mode = 0;
  double alpha = 1.0;
  at::Tensor bias;          // undefined or [N], float32 or a's dtype
  at::Tensor out;           // [M, N] row-major contiguous, fp16 / bf16 / fp32
  bool accumulate = false;
  at::Tensor found_inf;     // undefined or 1-element float32
};

#ifdef AMPK_WITH_CUDA
void scaled_matmul_wmma_cuda(const ScaledMatmulArgs& args);
// The sm_90a wgmma kernel (cuda/scaled_matmul_wgmma.cu): false, without launching, when the operands do not suit TMA.
bool scaled_matmul_wgmma_cuda(const ScaledMatmulArgs& args);
#endif

}  // namespace ampkernels
