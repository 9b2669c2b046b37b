#!/usr/bin/env bash
# Nsight Compute on the kernels the notes leave open (dev/ncu_targets.py): speed of light, memory, warp stall
# reasons, occupancy. Run after a build on the GPU machine: bash dev/ncu_probe.sh; reports in $OUT/ncu_*.txt.
# ncu reads counters only on the Firecracker machines (KINDS.md); clocks left alone as METHOD.md asks.
set -uo pipefail
OUT=${OUT:-/tmp/ampkernels-device-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
sections=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy
  --section LaunchStats --section SchedulerStats)
# target, kernel name pattern, launches to skip, launches to profile
for spec in "unscale unscale_reduce_kernel 1 1" "streamk scaled_mm_tma_kernel 1 3" "wmma wmma 1 1"; do
  read -r target kernel skip count <<< "$spec"
  timeout 150 ncu --clock-control none "${sections[@]}" -k "regex:$kernel" -s "$skip" -c "$count" \
    python3 dev/ncu_targets.py "$target" > "$OUT/ncu_$target.txt" 2>&1
  echo "== $target: exit $?"; grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Registers|Achieved Occupancy" \
    "$OUT/ncu_$target.txt" | head -20
done
