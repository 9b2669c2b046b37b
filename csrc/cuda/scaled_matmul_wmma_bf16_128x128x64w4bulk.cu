// Tuned WMMA kernels (scaled_matmul_wmma.cuh) for __nv_bfloat16 operands and 128x128x64w4bulk tiles, all four layouts; one file per
// (dtype, tile) so that ninja compiles them in parallel.
#include "scaled_matmul_wmma.cuh"

namespace ampkernels {
namespace wmma_mm {

template void launch_tuned<__nv_bfloat16, CfgXB>(const Params&, bool, bool, int, cudaStream_t);

}  // namespace wmma_mm
}  // namespace ampkernels
