// wgmma scaled matmul kernels (scaled_matmul_wgmma.cuh) for __nv_bfloat16 operands and 128-wide tiles, all four
// layouts; one file per (dtype, width) so that ninja compiles them in parallel.
#include "scaled_matmul_wgmma.cuh"

namespace ampkernels {
namespace wgmma_mm {

template void launch_layouts<__nv_bfloat16, 128>(const Params&, const CUtensorMap&, const CUtensorMap&, int, int,
                                          cudaStream_t);

}  // namespace wgmma_mm
}  // namespace ampkernels
