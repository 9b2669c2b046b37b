#!/usr/bin/env bash
# On a GPU machine: build the extension for the GPU that is there, run the GPU tests and the benchmarks, and leave
# logs and results under $OUT. Usage: bash scripts/device_run.sh [pytest args] -- [benchmark args]
set -uo pipefail
OUT=${OUT:-/tmp/ampkernels-device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
# Build for the GPU in the machine only: one architecture compiles in a fraction of the time (Hopper as 9.0a, which
# the wgmma kernel needs).
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$(python3 -c \
  'import torch; c = torch.cuda.get_device_capability(); print("%d.%d%s" % (*c, "a" if c == (9, 0) else ""))')}

pytest_args=() bench_args=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do pytest_args+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
bench_args=("$@")

{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

start=$(date +%s)
if ! python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1; then
  tail -n 60 "$OUT/build.log"
  exit 1
fi
echo "build: $(( $(date +%s) - start )) s"
python3 -m ampkernels.info >> "$OUT/env.txt" 2>&1

if [ "${SKIP_TESTS:-0}" != "1" ]; then
  python3 -m pytest tests -q -rs -p no:cacheprovider "${pytest_args[@]}" > "$OUT/tests.log" 2>&1
  echo "tests: exit $?"; tail -n 25 "$OUT/tests.log"
fi
if [ "${SKIP_BENCH:-0}" != "1" ]; then
  python3 -m benchmarks --out "$OUT" "${bench_args[@]}" 2>&1 | tee "$OUT/bench.log" | grep -v '%|' | tail -n 60
fi
