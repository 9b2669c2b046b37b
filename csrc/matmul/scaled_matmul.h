// Shared between the scaled_matmul_wmma_ / scaled_matmul_wgmma_ / scaled_matmul_fp8_wgmma_ ops (scaled_matmul_ops.cpp:
// checks, registration) and their CUDA launchers (wmma.cu, wgmma.cu, wgmma_fp8.cu).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

#ifndef AMPK_CUDA_ARCH_LIST  // setup.py defines it in CUDA builds
#define AMPK_CUDA_ARCH_LIST ""
#endif

namespace ampkernels {

// Whether this build compiled the wgmma kernel (TORCH_CUDA_ARCH_LIST holds 9.0a): guards the op, and is
// ampkernels._C.wgmma_built for Python (which reports it without touching the GPU).
inline bool scaled_matmul_wgmma_built() { return std::strstr(AMPK_CUDA_ARCH_LIST, "9.0a") != nullptr; }

// How the wgmma kernel covers an M x N output (wgmma.cuh): tiles of 128 x `bn`, and
// `grid` persistent blocks, each taking whole tiles round-robin.
struct WgmmaSchedule {
  int bn = 256;
  int64_t grid = 0;
};

// Configurations forced for the probes in dev/matmul/ and the tests, else the launchers' own choice. Process-wide
// settings that Python sets (ampkernels.matmul.tuning, through ampkernels._C._set_matmul_tuning) and the launchers
// read with one relaxed atomic load: no environment lookup nor string compare per launch for a switch that only the
// probes use. Defined in scaled_matmul_ops.cpp.
enum class WmmaTile : int { kAuto = 0, k128x128x32w4, k128x128x64w4, k128x128x64w4db, kPortable };
// The WMMA launcher's configuration (wmma.cu): kAuto chooses by waves.
WmmaTile forced_wmma_tile();
// The wgmma kernels' tile width, 16-bit and FP8: 128, 192 or 256; 0 lets scaled_matmul_wgmma_schedule choose.
int forced_wgmma_bn();
// Sets both: `wmma_tile` auto, 128x128x32w4, 128x128x64w4, 128x128x64w4db or portable; `wgmma_bn` 0, 128, 192 or
// 256. Anything else throws (ValueError in Python) and changes nothing.
void set_matmul_tuning(const std::string& wmma_tile, int64_t wgmma_bn);
// The name set_matmul_tuning takes for `tile`.
const char* wmma_tile_name(WmmaTile tile);

// The tile width whose waves cost least: waves x the width x its cost per column (every width takes the same
// k-steps), 3% and 8% more for 192 and 128, which give the tensor cores less work per shared-memory byte (operand
// reads of m64n256k16 39 B per 1K multiply-adds, n192 41.7, n128 46.9). forced_wgmma_bn() forces a width. E.g.
// 8192^3 -> 256; 8192 x 768 -> 192 (256 tiles, 1.94 waves, where 256 leaves 1.45); 3072 x 768 -> 192 (96 tiles for
// 132 SMs against 72 of 256). Stream-K over the idle SMs and 160-wide tiles were tried and lost; the measurements
// are in dev/matmul/wgmma/NOTES.md.
inline WgmmaSchedule scaled_matmul_wgmma_schedule(int64_t M, int64_t N, int64_t sms) {
  constexpr int64_t kBM = 128;
  const int forced = forced_wgmma_bn();
  const int64_t tiles_m = (M + kBM - 1) / kBM;
  WgmmaSchedule best;
  double best_cost = -1;
  for (int bn : {256, 192, 128}) {
    if (forced != 0 && bn != forced) continue;
    const double per_column = bn == 256 ? 1.0 : (bn == 192 ? 1.03 : 1.08);
    const int64_t tiles = tiles_m * ((N + bn - 1) / bn);
    const double cost = double((tiles + sms - 1) / sms) * bn * per_column;
    if (best_cost < 0 || cost < best_cost) {
      best = WgmmaSchedule{bn, tiles < sms ? tiles : sms};
      best_cost = cost;
    }
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

// The float8 op's arguments, checked by scaled_matmul_fp8_wgmma_ (scaled_matmul_ops.cpp).
struct ScaledMatmulFp8Args {
  ScaledMatmulArgs mm;  // a [M, K] row-major, b [K, N] column-major, float8 (K % 16 == 0, K > 0, 16-byte aligned);
                        // bias float32 or out's dtype; the rest as for the 16-bit ops
  at::Tensor scale_a;   // undefined (1) or float32 contiguous: 1 element, or M (one per row of a)
  at::Tensor scale_b;   // undefined (1) or float32 contiguous: 1 element, or N (one per column of b)
  at::Tensor amax_out;  // undefined or 1-element float32
};

#ifdef AMPK_WITH_CUDA
// The sm_90a FP8 wgmma kernel (wgmma_fp8.cu).
void scaled_matmul_fp8_wgmma_cuda(const ScaledMatmulFp8Args& args);
void scaled_matmul_wmma_cuda(const ScaledMatmulArgs& args);
// The sm_90a wgmma kernel (wgmma.cu): false, without launching, when the operands do not suit TMA.
bool scaled_matmul_wgmma_cuda(const ScaledMatmulArgs& args);
#endif

}  // namespace ampkernels
