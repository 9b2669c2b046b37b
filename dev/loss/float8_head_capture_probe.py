"""Does a captured FP8 stack step with the fused loss (its head in FP8) replay what the eager step computes?

A small LlamaStack (fused producers) converted to FP8 tensorwise, FusedAdamW, the head and loss as
``linear_cross_entropy(..., float8=head_float8(head))``: the losses of the first four steps eager and captured
(``capture_step``), with the head in FP8 and in bf16, with the weight-cast cache on and off. Each pair must agree from
the first step (the capture's warm-up is undone before the first replay).

Run: ``python3 dev/loss/float8_head_capture_probe.py`` (CUDA needed).
"""

from __future__ import annotations

import torch

import ampkernels
from ampkernels.float8 import convert_to_float8, weight_casts
from ampkernels.loss import head_float8
from benchmarks.models import LlamaStack

CONFIG = dict(dim=512, layers=2, heads=8, kv_heads=8, ffn=2048, vocab=4096)
BATCH = (4, 256)
STEPS = 4


def losses(graphed: bool, float8_head: bool) -> list[float]:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaStack(**CONFIG, fused=True)
    convert_to_float8(model, "tensorwise", min_features=0)
    lr = torch.tensor(1e-3, device="cuda") if graphed else 1e-3
    optimizer = ampkernels.FusedAdamW(model.parameters(), lr=lr)
    generator = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(CONFIG["vocab"], BATCH, device="cuda", generator=generator)
    targets = torch.randint(CONFIG["vocab"], BATCH, device="cuda", generator=generator)

    def step(tokens, targets):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            hidden = model.hidden_states(tokens).flatten(0, 1)
            head = model.head
            float8 = head_float8(head) if float8_head else None
            loss = ampkernels.linear_cross_entropy(hidden, head.weight, targets.flatten(), float8=float8)
        loss.backward()
        optimizer.step()
        return loss.detach()

    if graphed:
        step = ampkernels.capture_step(step, tokens, targets, models=model, optimizers=optimizer)
    return [float(step(tokens, targets)) for _ in range(STEPS)]


def main() -> None:
    print(torch.cuda.get_device_name())
    for cache in (True, False):
        weight_casts.ENABLED = cache
        for float8_head in (True, False):
            eager, graphed = losses(False, float8_head), losses(True, float8_head)
            same = all(abs(a - b) <= 1e-3 * abs(a) for a, b in zip(eager, graphed))
            print(f"cache {cache}, FP8 head {float8_head}: eager {[round(x, 4) for x in eager]} "
                  f"graphed {[round(x, 4) for x in graphed]} {'ok' if same else 'DIFFER'}")  # fmt: skip
    weight_casts.ENABLED = True


if __name__ == "__main__":
    main()
