// Constants shared by the native kernels and their Python callers (ampkernels._C exports them). The Triton kernels
// use the same values (ampkernels/triton): keep the two in step.
#pragma once

#include <cstdint>

namespace ampkernels {

// Which norm a reduction computes. The numbers are part of the interface: the ops take them (argument norm_kind)
// from ampkernels._constants.NormKind, which mirrors this enum.
enum class NormKind : int { kNone = 0, kL2 = 1, kInf = 2 };

// The max_norm that asks for no clip coefficient (ampkernels._constants.NO_CLIP; Python APIs say None).
constexpr double kNoClip = -1.0;

// Elements per chunk of a tensor table (one CUDA block, one CPU task). NOTE: 16K elements keeps a grid's last round
// short (BERT-base: 6.7k chunks over ~1k resident blocks) and is 16 loads of 16 bytes per thread of 256 for fp32,
// all issued at once by the unscale kernel; per-chunk overhead is one block reduction, ~1% of a chunk's memory time.
constexpr int64_t kChunkSize = 16384;

// Parameters per intra-op task when a table re-checks its parameters' gradients each step (GradTable,
// OptimizerTable). NOTE (H200 host, 16 threads, 10k parameters): checking on the intra-op pool takes
// FusedGradScaler.unscale_ from 0.40 to 0.10 ms, and the whole post-backward phase with FusedAdamW from 1.00 to
// 0.19 ms, against one thread.
constexpr int64_t kParamCheckGrain = 512;

}  // namespace ampkernels
