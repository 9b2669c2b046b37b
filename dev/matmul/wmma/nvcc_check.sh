#!/bin/sh
# Compiles one file of the WMMA op alone (no link) for one arch and prints ptxas's resource report and its
# performance notices (C7xxx, e.g. "warpgroup.wait is injected": wgmmas serialized).
# Usage (repository root): dev/matmul/wmma/nvcc_check.sh FILE.cu ARCH [extra nvcc flags]   e.g. ... csrc/matmul/wmma.cu 90
# NVCC: the compiler (default: $CUDA_HOME/bin/nvcc, this machine's /usr/local/cuda-13.0/bin/nvcc, or the one on PATH).
set -e
FILE=$1; ARCH=$2; shift 2
if [ -z "${NVCC:-}" ]; then
  for NVCC in "${CUDA_HOME:-/nonexistent}/bin/nvcc" /usr/local/cuda-13.0/bin/nvcc "$(command -v nvcc)"; do
    [ -x "$NVCC" ] && break
  done
fi
TORCH_INC=$(python3 -c "import torch.utils.cpp_extension as c; print(' '.join('-I'+p for p in c.include_paths('cuda')))" 2>/dev/null)
PYINC=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
mkdir -p /tmp/wmma_build
"$NVCC" -c "$FILE" -o /tmp/wmma_build/$(basename "$FILE").sm$ARCH.o $TORCH_INC -I"$PYINC" \
  -Icsrc -Icsrc/matmul -DAMPK_WITH_CUDA -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ --expt-relaxed-constexpr -O3 -lineinfo -std=c++20 -gencode=arch=compute_$ARCH,code=sm_$ARCH -Xptxas -v "$@" 2>&1 |
  grep -E "error|warning|registers|spill|Compiling entry|\(C7[0-9]+\)" | sed 's/_ZN10ampkernels7wmma_mm25scaled_matmul_wmma_kernel/K/' | head -80
