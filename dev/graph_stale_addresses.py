"""Do the launch tables captured in a graph point at freed memory? (the graphed benchmark run diverges at step 58)

Builds the benchmark's graphed step the way bench_training does (after the eager numerics run) and checks every
device address of the scaler's and the optimizer's tables against the allocator's snapshot; repeats after 60 steps.
Usage on the GPU machine: python3 dev/graph_stale_addresses.py [model]
"""

from __future__ import annotations

import bisect
import math
import sys

import torch

from benchmarks import bench_training as bt
from benchmarks.common import RunContext


def block_states() -> tuple[list[int], list[tuple[int, int, str, str]]]:
    blocks = []
    for segment in torch.cuda.memory._snapshot()["segments"]:
        offset = segment["address"]
        for block in segment["blocks"]:
            blocks.append((offset, block["size"], block["state"], str(segment["segment_pool_id"])))
            offset += block["size"]
    blocks.sort()
    return [b[0] for b in blocks], blocks


def report(scaler, opt, when: str) -> None:
    starts, blocks = block_states()
    tables = [("scaler", t) for _, t, _ in scaler._grad_tables[opt][1]]
    tables += [("optimizer", b.table) for plan in opt._plans.values() for b in plan.buckets]
    bad = {}
    for owner, table in tables:
        for role, address in table.addresses():
            i = bisect.bisect_right(starts, address) - 1
            state = "unmapped"
            if i >= 0 and address < blocks[i][0] + blocks[i][1]:
                state = f"{blocks[i][2]} pool {blocks[i][3]}"
            if not state.startswith("active_allocated"):
                bad.setdefault((owner, role, state), []).append(hex(address))
    print(when, "stale:", {k: (len(v), v[:3]) for k, v in bad.items()} or "none", flush=True)


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "tiny-gpt2"
    ctx = RunContext(torch.device("cuda"), [], 1, 3, 0.2, 0.0, None)
    bt._numerics_run(model, "ampkernels", ctx)
    step, scaler, inputs, _ = bt._build(model, "ampkernels-graphed", ctx, 0.0, bt.NUMERICS_SCALER)
    opt = next(iter(scaler._grad_tables.keys()))
    report(scaler, opt, "after capture")
    scales = []
    for i in range(1, 61):
        step(*inputs(i, math.inf if i in bt.OVERFLOW_STEPS else 1.0)).clone()
        scales.append(scaler._scale.clone())
    report(scaler, opt, "after 60 steps")
    print("scales 56..60", [float(s) for s in scales[55:60]])


if __name__ == "__main__":
    main()
