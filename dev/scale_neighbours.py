"""Which allocations sit next to the loss scale in the graphed benchmark run that diverges at step 58, and does any
kernel of the eager step write out of bounds (compute-sanitizer with the caching allocator off)?

python3 dev/scale_neighbours.py neighbours [model]   -> the blocks around scaler._scale after capture, with the
                                                        Python frames that allocated them
python3 dev/scale_neighbours.py step [model]         -> 3 eager steps (run it under compute-sanitizer with
                                                        PYTORCH_NO_CUDA_MEMORY_CACHING=1)
"""

from __future__ import annotations

import sys

import torch

from benchmarks import bench_training as bt
from benchmarks.common import RunContext


def frames_of(block: dict) -> str:
    frames = block.get("frames") or []
    mine = [f for f in frames if "ampkernels" in f["filename"] or "benchmarks" in f["filename"]]
    shown = (mine or frames)[:3]
    return " <- ".join(f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}" for f in shown)


def main() -> None:
    mode = sys.argv[1]
    model = sys.argv[2] if len(sys.argv) > 2 else "tiny-gpt2"
    ctx = RunContext(torch.device("cuda"), [], 1, 3, 0.2, 0.0, None)
    if mode == "step":
        step, scaler, inputs, _ = bt._build(model, "ampkernels", ctx, dropout=0.0, scaler_settings=bt.NUMERICS_SCALER)
        for i in range(1, 4):
            step(*inputs(i))
        torch.cuda.synchronize()
        print("scale", float(scaler._scale))
        return
    bt._numerics_run(model, "ampkernels", ctx)  # as the benchmark: the eager run first
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    step, scaler, inputs, _ = bt._build(
        model, "ampkernels-graphed", ctx, dropout=0.0, scaler_settings=bt.NUMERICS_SCALER
    )
    snapshot = torch.cuda.memory._snapshot()
    address = scaler._scale.data_ptr()
    for segment in snapshot["segments"]:
        start = segment["address"]
        if not start <= address < start + segment["total_size"]:
            continue
        print(
            f"segment {start:#x} size {segment['total_size']} stream {segment['stream']}",
            f"pool {segment['segment_pool_id']}",
        )
        blocks, offset = segment["blocks"], start
        index = None
        placed = []
        for block in blocks:
            placed.append((offset, block))
            if offset <= address < offset + block["size"]:
                index = len(placed) - 1
            offset += block["size"]
        for offset, block in placed[max(0, index - 6) : index + 4]:
            mark = "  <== scale" if offset <= address < offset + block["size"] else ""
            print(f"  {offset:#x} {block['size']:>8} {block['state']:<16} {frames_of(block)}{mark}")
    losses = []
    for i in range(1, 70):
        losses.append(step(*inputs(i, float("inf") if i in bt.OVERFLOW_STEPS else 1.0)).clone())
        if i in (1, 57, 58, 59):
            print("step", i, "scale", float(scaler._scale))


if __name__ == "__main__":
    main()
