#!/usr/bin/env bash
# This session's first device call: build, the long-replay test, the replay probe, the BERT probe with kernel profiles.
set -uo pipefail
OUT=${OUT:-/tmp/out}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SKIP_TESTS=1 SKIP_BENCH=1 bash scripts/device_run.sh || exit 1
timeout 120 python3 -m pytest tests/test_cuda_graph.py -q -x -p no:cacheprovider 2>&1 | tail -n 30
tf=$(python3 -c 'import transformers,os;print(transformers.__version__, os.path.dirname(transformers.__file__))')
echo "transformers $tf"; dir=${tf#* }
grep -n "def is_tracing\|is_cuda_stream_capturing" -A6 "$dir/utils/import_utils.py" | head -40 > "$OUT/tf_tracing.txt"
cp "$dir/masking_utils.py" "$OUT/" 2>/dev/null; cp "$dir/models/bert/modeling_bert.py" "$OUT/" 2>/dev/null
timeout 200 python3 dev/graph_replay_probe.py mlp-800 tiny-gpt2 2>&1 | tail -n 40
timeout 120 python3 dev/graph_bert_probe.py '{"optimizer": "ampkernels", "scaler": "fused", "dropout": 0.1, "profile": true}' 2>&1 | tail -n 5
