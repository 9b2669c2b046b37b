#!/usr/bin/env bash
# Everything in one run on a GPU machine: build for the GPU that is there, run the GPU tests (8 workers), then the
# default benchmark run (`python -m benchmarks`) and `python -m benchmarks --only precision`, each under its own time
# limit so that one that overruns cannot take the others' results with it. The wall time of each goes to stdout
# and $OUT/times.txt; JSON, PNG and the printed tables go to $OUT/results.tgz (one file: results/<job>/...); logs to
# $OUT/*.log.
# Usage: bash scripts/device_all.sh [TEST_LIMIT_S] [job:limit_s ...]
#   jobs: default (python -m benchmarks), precision (--only precision), full (--full), a module name
#   (grad_scaler, optimizers, training, scaled_matmul, float8: --only NAME), or full-NAME (--only NAME --full). No job named: default:200 precision:140.
#   TEST_LIMIT_S 0: no tests. TESTS="tests/test_a.py tests/test_b.py" runs only those test files (default: tests/).
#   CUDA_PROBES="dev/float8/cast_bench.cu ...": standalone CUDA probes compiled and run first (no build needed), each
#   under 240 s; output to $OUT/<name>.txt.
# NOTE (H200): the build takes ~75 s and the GPU tests ~170 s; the default run is estimated at ~160 s and the
# precision table at ~60 s from the per-module times of the complete sweep. With the default limits (170 + 200 + 140
# s) build, tests and both runs stay under 10 minutes; results.tgz is rewritten after every job, so that a run cut
# short still returns what finished.
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
SKIP_TESTS=1 SKIP_BENCH=1 bash scripts/device_run.sh || exit 1
: > "$OUT/times.txt"
if [ "$test_limit" -gt 0 ]; then
  start=$(date +%s)
  # shellcheck disable=SC2086 # TESTS is a list of paths
  timeout "$test_limit" python3 -m pytest ${TESTS:-tests} -q -m gpu -n 8 -p no:cacheprovider > "$OUT/tests.log" 2>&1
  status=$?
  echo "tests: exit $status in $(( $(date +%s) - start )) s" | tee -a "$OUT/times.txt"
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -30
  tail -n 3 "$OUT/tests.log"
fi
mkdir -p "$OUT/results"
for entry in "${jobs[@]}"; do
  name=${entry%%:*} limit=${entry##*:}
  case $name in
    default) args=() ;;
    full) args=(--full) ;;
    full-*) args=(--only "${name#full-}" --full) ;;
    *) args=(--only "$name") ;;
  esac
  mkdir -p "$OUT/results/$name"
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
