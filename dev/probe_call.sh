#!/usr/bin/env bash
# A session's probe call: build, GPU tests, bench_training, the BERT graph probe, the host profile of the 10k step.
set -uo pipefail
OUT=${OUT:-/tmp/out}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SKIP_TESTS=1 SKIP_BENCH=1 bash scripts/device_run.sh || exit 1
timeout 60 python3 dev/profile_step_host.py 10000 2>&1 | tail -n 4
timeout 100 python3 dev/graph_bert_probe.py '{"optimizer": "ampkernels", "scaler": "fused", "dropout": 0.1, "profile": true}' 2>&1 | tail -n 1
start=$(date +%s)
timeout 200 python3 -m pytest tests -q -m gpu -n 8 -p no:cacheprovider > "$OUT/tests.log" 2>&1
echo "tests: exit $? in $(( $(date +%s) - start )) s"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -30; tail -n 3 "$OUT/tests.log"
mkdir -p "$OUT/results"
timeout 180 python3 -m benchmarks --only training --quick --no-plot --out "$OUT/results" > "$OUT/results/training.txt" 2> "$OUT/results/training.err"
echo "training: exit $?"; cat "$OUT/results/training.txt"; tail -n 5 "$OUT/results/training.err"
