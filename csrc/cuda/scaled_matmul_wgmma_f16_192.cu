// wgmma scaled matmul kernels (scaled_matmul_wgmma.cuh) for __half operands:
// 192-wide tiles, cooperative consumers, all four layouts. One file per (dtype, tile, schedule), compiled in parallel.
#include "scaled_matmul_wgmma.cuh"

namespace ampkernels {
namespace wgmma_mm {

template void launch_layouts<__half, 192, false>(const Params&, const CUtensorMap&, const CUtensorMap&, int, int,
                                                 cudaStream_t);

}  // namespace wgmma_mm
}  // namespace ampkernels
