#!/bin/sh
# Where do the double-buffered WMMA kernel's spills sit? Compiles the bf16 128x128x64w4db instantiation for sm_90
# (dev/wmma/nvcc_check.sh, resource report first), disassembles it, and prints the row/row kernel's local-memory
# accesses (STL/LDL), barriers and branches in program order, runs of HMMA folded into counts: spills between the
# HMMA runs of the k-loop cost every k-tile, spills before or after it once per tile.
# Usage (GPU machine, repository root; needs cuobjdump, which this CPU machine's minimal toolkit lacks; NVCC and
# CUOBJDUMP override where the tools are found):
#   sh dev/wmma/sass_spills.sh [OUT_DIR]
set -e
OUT_DIR=${1:-${OUT:-/tmp}}
CUOBJDUMP=${CUOBJDUMP:-$(command -v cuobjdump || echo "${CUDA_HOME:-/usr/local/cuda}/bin/cuobjdump")}
sh dev/wmma/nvcc_check.sh csrc/cuda/scaled_matmul_wmma_bf16_128x128x64w4db.cu 90 | grep -E "spill" | head -4
"$CUOBJDUMP" -sass /tmp/wmma_build/scaled_matmul_wmma_bf16_128x128x64w4db.cu.sm90.o \
  > "$OUT_DIR/wmma_db_sass.txt"
# Row/row layout (the benchmark's nn): template arguments <..., true, true, true>.
awk '/Function :/ { keep = ($0 ~ /Lb1ELb1ELb1EEEvNS0_6ParamsE/) } keep' "$OUT_DIR/wmma_db_sass.txt" |
  grep -E "Function|STL|LDL|HMMA|BAR\.SYNC|BRA" |
  awk '{ if ($0 ~ /HMMA/) { h++ } else { if (h) print "      ... " h " HMMA"; h = 0; print } }
       END { if (h) print "      ... " h " HMMA" }' | cut -c1-110 | head -150
