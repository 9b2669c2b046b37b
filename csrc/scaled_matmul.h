// Shared between the scaled_matmul_wmma_ / scaled_matmul_wgmma_ ops (scaled_matmul_ops.cpp: checks, registration) and
// their CUDA launchers (cuda/scaled_matmul_wmma.cu, cuda/scaled_matmul_wgmma.cu).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <optional>

#ifndef AMPK_CUDA_ARCH_LIST  // setup.py defines it in CUDA builds
#define AMPK_CUDA_ARCH_LIST ""
#endif

namespace ampkernels {

// Whether this build compiled the wgmma kernel (TORCH_CUDA_ARCH_LIST holds 9.0a): guards the op, and is
// ampkernels._C.wgmma_built for Python (which reports it without touching the GPU).
inline bool scaled_matmul_wgmma_built() { return std::strstr(AMPK_CUDA_ARCH_LIST, "9.0a") != nullptr; }

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
