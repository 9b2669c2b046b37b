#!/usr/bin/env bash
# Everything in one run on a GPU machine: build the extension for the GPU that is there, run the GPU tests (8
# workers), then benchmark jobs, each under its own time limit so that one that overruns cannot take the others'
# results with it. The wall time of each goes to stdout and $OUT/times.txt; JSON, PNG and the printed tables go to
# $OUT/results.tgz (one file: results/<job>/...); logs to $OUT/*.log.
# Usage: bash scripts/device_all.sh [TEST_LIMIT_S] [job:limit_s ...]
#   jobs: default (python -m benchmarks), precision (--only precision), full (--full), a module name
#   (grad_scaler, optimizers, training, scaled_matmul, float8, models: --only NAME), full-NAME (--only NAME
#   --full), or a Python probe dev/.../NAME.py (run with PROBE_ARGS; output to results/NAME/). No job named:
#   default:200 precision:140. BENCH_ARGS="--quick ..." is added to every job's arguments.
#   TEST_LIMIT_S 0: no tests. TESTS="tests/test_a.py tests/test_b.py" runs only those test files (default: tests/);
#   TEST_MARK="" runs the CPU tests too (default: gpu).
#   CUDA_PROBES="dev/float8/cast_bench.cu ...": standalone CUDA probes compiled and run first (no build needed), each
#   under 240 s; output to $OUT/<name>.txt.
# NOTE (H200): the build takes ~75 s (H100: ~130 s) and the GPU tests ~170 s; the default run is estimated at ~160 s
# and the precision table at ~60 s from the per-module times of the complete sweep. With the default limits
# (170 + 200 + 140 s) build, tests and both runs stay under 10 minutes; results.tgz is rewritten after every job, so
# that a run cut short still returns what finished.
set -uo pipefail
OUT=${OUT:-/tmp/ampkernels-device-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
test_limit=${1:-170}; shift || true
jobs=("$@")
[ ${#jobs[@]} -eq 0 ] && jobs=(default:200 precision:140)
# Optional extras of the benchmarks (torchao) travel as wheels in .device-wheels/ (the machine has no internet).
for wheel in .device-wheels/*.whl; do
  [ -e "$wheel" ] && python3 -m pip install -q --no-deps "$wheel" > "$OUT/wheels.log" 2>&1
done
for probe in ${CUDA_PROBES:-}; do
  name=$(basename "$probe" .cu)
  start=$(date +%s)
  "$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")" -O3 -std=c++17 -arch=native "$probe" \
    -o "/tmp/$name" > "$OUT/$name.txt" 2>&1 \
    && timeout 240 "/tmp/$name" >> "$OUT/$name.txt" 2>&1
  echo "probe $probe: exit $? in $(( $(date +%s) - start )) s"
  tail -n 80 "$OUT/$name.txt"
done
# Build for the GPU in the machine only: one architecture compiles in a fraction of the time (Hopper as 9.0a, which
# the wgmma kernel needs).
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$(python3 -c \
  'import torch; c = torch.cuda.get_device_capability(); print("%d.%d%s" % (*c, "a" if c == (9, 0) else ""))')}
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
: > "$OUT/times.txt"
if [ "$test_limit" -gt 0 ]; then
  start=$(date +%s)
  # shellcheck disable=SC2086 # TESTS is a list of paths
  timeout "$test_limit" python3 -m pytest ${TESTS:-tests} -q -m "${TEST_MARK-gpu}" -n 8 -p no:cacheprovider \
    > "$OUT/tests.log" 2>&1
  status=$?
  echo "tests: exit $status in $(( $(date +%s) - start )) s" | tee -a "$OUT/times.txt"
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -30
  tail -n 3 "$OUT/tests.log"
fi
mkdir -p "$OUT/results"
for entry in "${jobs[@]}"; do
  name=${entry%%:*} limit=${entry##*:}
  if [[ $name == dev/*.py ]]; then  # a Python probe: python3 PATH $PROBE_ARGS
    out="$OUT/results/$(basename "$name" .py)"
    mkdir -p "$out"
    start=$(date +%s)
    # shellcheck disable=SC2086 # PROBE_ARGS is a list of arguments
    timeout "$limit" python3 "$name" ${PROBE_ARGS:-} > "$out/stdout.txt" 2> "$out/stderr.txt"
    status=$?
    echo "== $name ${PROBE_ARGS:-}: exit $status in $(( $(date +%s) - start )) s" | tee -a "$OUT/times.txt"
    cat "$out/stdout.txt"
    [ "$status" -eq 0 ] || tail -n 20 "$out/stderr.txt"
    tar -czf "$OUT/results.tgz" -C "$OUT" results
    continue
  fi
  case $name in
    default) args=() ;;
    full) args=(--full) ;;
    full-*) args=(--only "${name#full-}" --full) ;;
    *) args=(--only "$name") ;;
  esac
  mkdir -p "$OUT/results/$name"
  # shellcheck disable=SC2206 # BENCH_ARGS is a list of arguments
  args+=(${BENCH_ARGS:-})
  start=$(date +%s)
  timeout "$limit" python3 -m benchmarks "${args[@]}" --out "$OUT/results/$name" \
    > "$OUT/results/$name/stdout.txt" 2> "$OUT/results/$name/stderr.txt"
  status=$?
  echo "== $name (python -m benchmarks ${args[*]}): exit $status in $(( $(date +%s) - start )) s" \
    | tee -a "$OUT/times.txt"
  sed -n '/== summary/,$p' "$OUT/results/$name/stdout.txt"
  [ "$status" -eq 0 ] || tail -n 20 "$OUT/results/$name/stderr.txt"
  tar -czf "$OUT/results.tgz" -C "$OUT" results
done
rm -rf "$OUT/results"
