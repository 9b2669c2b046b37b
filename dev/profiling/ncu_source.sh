#!/usr/bin/env bash
# Nsight Compute's warp-stall samples per CUDA source line for one target of dev/profiling/ncu_targets.py: where the warps of
# a kernel wait, line by line (the extension is built with -lineinfo). Run after a build on the GPU machine:
#   bash dev/profiling/ncu_source.sh TARGET KERNEL_REGEX [SKIP] [TOP]
# e.g. bash dev/profiling/ncu_source.sh wgmma_small_k scaled_matmul_wgmma 1 30; report in $OUT/ncu_source_TARGET.{ncu-rep,csv}.
set -uo pipefail
OUT=${OUT:-/tmp/ampkernels-device-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
target=$1 kernel=$2 skip=${3:-1} top=${4:-30}
report="$OUT/ncu_source_$target"
timeout 150 ncu --clock-control none --section SourceCounters --section WarpStateStats --import-source yes \
  -k "regex:$kernel" -s "$skip" -c 1 -f -o "$report" python3 dev/profiling/ncu_targets.py "$target" > "$report.log" 2>&1
echo "== ncu: exit $?"; tail -n 3 "$report.log"
ncu -i "$report.ncu-rep" --page source --csv --print-source cuda > "$report.csv" 2> "$report.err"
ncu -i "$report.ncu-rep" --page source --csv --print-source sass > "$report.sass.csv" 2>> "$report.err"
for view in "$report.csv" "$report.sass.csv"; do
python3 - "$view" "$top" <<'PY'
import csv, sys

print("==", sys.argv[1])
lines = [x for x in open(sys.argv[1]) if x.strip()]
start = next((i for i, x in enumerate(lines) if "Warp Stall Sampling" in x), None)
if start is None:
    sys.exit(f"no stall-sampling header; first lines: {lines[:3]}")
rows = list(csv.DictReader(lines[start:]))
cols = list(rows[0])
stall = next(c for c in cols if "Warp Stall Sampling" in c and "Not" not in c)
def num(x):
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0
total = sum(num(r[stall]) for r in rows) or 1.0
src = next((c for c in cols if c.lower() in ("source", "# source")), cols[1])
line = next((c for c in cols if c.lower() in ("line", "#", "# address", "address")), cols[0])
print(f"{stall}: {total:.0f} samples; columns {cols[:6]}...; top lines")
for r in sorted(rows, key=lambda r: -num(r[stall]))[: int(sys.argv[2])]:
    print(f"{100 * num(r[stall]) / total:5.1f}%  {r[line]:>5}  {r[src].strip()[:110]}")
PY
done
