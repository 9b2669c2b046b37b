// Tuned WMMA kernels (scaled_matmul_wmma.cuh) for __half operands and 128x128x64w4bulk tiles, all four layouts; one file per
// (dtype, tile) so that ninja compiles them in parallel.
#include "scaled_matmul_wmma.cuh"

namespace ampkernels {
namespace wmma_mm {

template void launch_tuned<__half, CfgXB>(const Params&, bool, bool, int, cudaStream_t);

}  // namespace wmma_mm
}  // namespace ampkernels
