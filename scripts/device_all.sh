#!/usr/bin/env bash
# One device call for everything: build for the GPU that is there, run the GPU tests (8 workers), then every
# benchmark module under its own time limit, so that one slow module cannot take the others' results with it.
# Results (JSON, no PNG: plots are drawn from the JSON afterwards) go to $OUT/results.tgz; logs to $OUT/*.log.
# Usage (device tool): bash scripts/device_all.sh [TEST_LIMIT_S] [module:limit_s ... | all]
# TESTS="tests/test_a.py tests/test_b.py" runs only those test files (default: all of tests/).
# No module named: no benchmark (twice a session spent ~5 min of device time on an unintended full run). `all`:
# grad_scaler:130 optimizers:40 training:170 scaled_matmul:200 (136 s measured), over one call's 10 min: split it, e.g.
# `bash scripts/device_all.sh 200 training:200`, then `bash scripts/device_all.sh 0 grad_scaler:130 optimizers:40
# scaled_matmul:200`.
set -uo pipefail
OUT=${OUT:-/tmp/ampkernels-device-out}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
test_limit=${1:-170}; shift || true
modules=("$@")
[ "${modules[*]:-}" = "all" ] && modules=(grad_scaler:130 optimizers:40 training:170 scaled_matmul:200)
SKIP_TESTS=1 SKIP_BENCH=1 bash scripts/device_run.sh || exit 1
if [ "$test_limit" -gt 0 ]; then  # 0: no tests (a second call for the remaining benchmarks)
  start=$(date +%s)
  # shellcheck disable=SC2086 # TESTS is a list of paths
  timeout "$test_limit" python3 -m pytest ${TESTS:-tests} -q -m gpu -n 8 -p no:cacheprovider > "$OUT/tests.log" 2>&1
  echo "tests: exit $? in $(( $(date +%s) - start )) s"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -30
  tail -n 3 "$OUT/tests.log"
fi
mkdir -p "$OUT/results"
for entry in "${modules[@]}"; do
  name=${entry%%:*} limit=${entry##*:}
  start=$(date +%s)
  timeout "$limit" python3 -m benchmarks --only "$name" --quick --no-plot --out "$OUT/results" \
    > "$OUT/results/$name.txt" 2> "$OUT/results/$name.err"
  echo "== $name: exit $? in $(( $(date +%s) - start )) s"; cat "$OUT/results/$name.txt"
done
tar -czf "$OUT/results.tgz" -C "$OUT" results && rm -rf "$OUT/results"
