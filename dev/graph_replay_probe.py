"""Where does a whole-step CUDA graph stop matching the eager step? (the 200-step runs of bench_training diverged)

For a model (mlp-800, tiny-gpt2), each (scaler, optimizer) pairing runs eager and graphed for STEPS steps with the
benchmark's overflow steps, and prints the first step at which the scale or the loss of the graphed run leaves the
eager run. Pairings isolate the parts: ampkernels scaler + FusedAdamW, ampkernels scaler + torch fused capturable
AdamW, stock scaler + FusedAdamW, stock scaler + torch fused capturable AdamW (stock parts only: a control).
Usage on the GPU machine: python3 dev/graph_replay_probe.py [model ...]      (one JSON line per pairing)
"""

from __future__ import annotations

import json
import math
import sys

import torch

import ampkernels
from benchmarks import bench_training as bt

STEPS = 120
PAIRINGS = [("fused", "ampk"), ("fused", "torch"), ("stock", "ampk"), ("stock", "torch")]


def run(model_name: str, scaler_kind: str, opt_kind: str, graphed: bool, hold: bool) -> tuple[list, list]:
    make_model, loss_fn, _ = bt.MODELS[model_name]
    torch.manual_seed(0)
    ctx = type("Ctx", (), {"cpu_small": False})()
    model, batch_of, _ = make_model(ctx, 0.0)
    model = model.cuda().train()
    if opt_kind == "ampk":
        opt = ampkernels.FusedAdamW(model.parameters(), lr=bt.LR)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=bt.LR, fused=True, capturable=True)
    cls = ampkernels.FusedGradScaler if scaler_kind == "fused" else torch.amp.GradScaler
    scaler = cls("cuda", **bt.NUMERICS_SCALER)

    def step(*inputs):
        *batch, poison = inputs
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = loss_fn(model, *batch) * poison
        scaler.scale(loss).backward()
        if scaler_kind == "stock":
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), bt.MAX_NORM)
        else:
            scaler.clip_grad_norm_(opt, bt.MAX_NORM)
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    def inputs(i: int, poison: float = 1.0) -> tuple:
        return (*(t.cuda() for t in batch_of(i)), torch.tensor(poison, device="cuda"))

    if graphed:
        step = ampkernels.capture_step(step, *inputs(0))
    else:
        for _ in range(3):
            step(*inputs(0))
    # hold=True: every batch made before the loop and kept, so no memory is freed or allocated between replays.
    batches = [inputs(i, math.inf if i in bt.OVERFLOW_STEPS else 1.0) for i in range(1, STEPS + 1)] if hold else None
    losses, scales = [], []
    for i in range(1, STEPS + 1):
        args = batches[i - 1] if hold else inputs(i, math.inf if i in bt.OVERFLOW_STEPS else 1.0)
        losses.append(step(*args).float().clone())
        scales.append(scaler._scale.detach().clone())
    return torch.stack(losses).tolist(), torch.stack(scales).tolist()


def first_difference(a: list, b: list, rtol: float) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if math.isnan(x) and math.isnan(y):
            continue
        if not (x == y or (math.isfinite(x) and abs(x - y) <= rtol * abs(x))):
            return i + 1
    return None


def main() -> None:
    models = sys.argv[1:] or ["mlp-800", "tiny-gpt2"]
    for name in models:
        for scaler_kind, opt_kind in PAIRINGS:
            for hold in (False, True):
                eager_loss, eager_scale = run(name, scaler_kind, opt_kind, graphed=False, hold=hold)
                graph_loss, graph_scale = run(name, scaler_kind, opt_kind, graphed=True, hold=hold)
                s = first_difference(eager_scale, graph_scale, 0.0)
                loss_step = first_difference(eager_loss, graph_loss, 1e-3)
                row = {
                    "model": name,
                    "scaler": scaler_kind,
                    "optimizer": opt_kind,
                    "hold_batches": hold,
                    "first_scale_difference": s,
                    "first_loss_difference": loss_step,
                }
                if s is not None:
                    row["scales_there"] = {"eager": eager_scale[s - 2 : s + 3], "graphed": graph_scale[s - 2 : s + 3]}
                if loss_step is not None:
                    k = loss_step - 1
                    row["losses_there"] = {"eager": eager_loss[k : k + 3], "graphed": graph_loss[k : k + 3]}
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
