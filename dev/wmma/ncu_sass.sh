#!/usr/bin/env bash
# Per-instruction warp-stall samples of the WMMA kernel (8192^3 bf16, 128x128x64 double-buffered fragments), from
# Nsight Compute's source page: which SASS instructions the "wait" and "long scoreboard" stalls sit on.
# Run after a build on the GPU machine: bash dev/wmma/ncu_sass.sh; writes $OUT/wmma_sass.csv and a summary.
set -uo pipefail
OUT=${OUT:-/tmp/ampkernels-device-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
# dev/ncu_targets.py wmma launches 128x128x64w4 twice, then 128x128x64w4db twice: profile the 4th launch.
timeout 200 ncu --clock-control none --section SourceCounters --section WarpStateStats --import-source no \
  -k regex:wmma -s 3 -c 1 -o "$OUT/wmma_src" -f python3 dev/ncu_targets.py wmma > "$OUT/ncu_wmma_src.log" 2>&1
echo "ncu record: exit $?"; tail -n 3 "$OUT/ncu_wmma_src.log"
ncu --import "$OUT/wmma_src.ncu-rep" --page source --csv --print-source sass > "$OUT/wmma_sass.csv" 2> "$OUT/wmma_sass.err"
echo "source page: exit $?, $(wc -l < "$OUT/wmma_sass.csv") lines"; head -c 600 "$OUT/wmma_sass.err"
python3 dev/wmma/sass_stalls.py "$OUT/wmma_sass.csv" | head -60
