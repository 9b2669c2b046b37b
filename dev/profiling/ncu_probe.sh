#!/usr/bin/env bash
# Nsight Compute on the kernels the notes leave open (dev/profiling/ncu_targets.py): speed of light, memory, warp stall
# reasons, occupancy. Run after a build on the GPU machine: bash dev/profiling/ncu_probe.sh [unscale] [wmma] [wgmma] [wgmma_small_k]
# (default: the first three); reports in $OUT/ncu_*.txt.
# ncu reads counters only on the Firecracker machines (KINDS.md); clocks left alone as METHOD.md asks.
set -uo pipefail
OUT=${OUT:-/tmp/ampkernels-device-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
sections=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy
  --section LaunchStats --section SchedulerStats)
# target, kernel name pattern, launches to skip, launches to profile
declare -A specs=([unscale]="unscale_reduce_kernel 1 1" [wmma]="wmma 1 3"
  [wgmma]="scaled_matmul_wgmma 1 3" [wgmma_small_k]="scaled_matmul_wgmma 1 1")
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(unscale wmma)
for target in "${targets[@]}"; do
  read -r kernel skip count <<< "${specs[$target]}"
  timeout 150 ncu --clock-control none "${sections[@]}" -k "regex:$kernel" -s "$skip" -c "$count" \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    python3 dev/profiling/ncu_targets.py "$target" > "$OUT/ncu_$target.txt" 2>&1
  echo "== $target: exit $?"; grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Registers|Achieved Occupancy" \
    "$OUT/ncu_$target.txt" | head -20
done
