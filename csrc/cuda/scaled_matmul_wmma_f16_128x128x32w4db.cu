// Tuned WMMA kernels (scaled_matmul_wmma.cuh) for __half operands and 128x128x32w4db tiles, all four layouts; one file per
// (dtype, tile) so that ninja compiles them in parallel.
#include "scaled_matmul_wmma.cuh"

namespace ampkernels {
namespace wmma_mm {

template void launch_tuned<__half, CfgWD>(const Params&, bool, bool, int, cudaStream_t);

}  // namespace wmma_mm
}  // namespace ampkernels
