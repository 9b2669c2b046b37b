"""FP8 pretraining of a Llama model (Hugging Face `LlamaForCausalLM` from its config, random weights, synthetic
tokens), with everything ampkernels adds turned on:

- `ampkernels.float8.convert_to_float8`: the large `nn.Linear` layers run their GEMMs in FP8 (tensorwise scaling);
- `FusedAdamW` with 8-bit moments (2 bytes of optimizer state per parameter instead of 8);
- `ampkernels.capture_step`: the whole step (forward, backward, clip, optimizer) captured in one CUDA graph.

Stock is the usual bf16 recipe: bf16 autocast, `clip_grad_norm_`, `torch.optim.AdamW(fused=True)`, eager. Both start
from the same weights and see the same batches; the script prints ms/step of each and the ratio.

    python examples/fp8_llama_pretrain.py            # ~1.1B parameters (TinyLlama's shape), 4 x 2048 tokens, GPU
    python examples/fp8_llama_pretrain.py --smoke    # a tiny Llama on the CPU (FP8 math in plain PyTorch, no graph)

FP8 GEMMs need a GPU of compute capability 8.9 or newer (Ada, Hopper); elsewhere the converted layers compute the
same FP8 math with PyTorch's reference ops, which is only for checking, not speed.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import torch

import ampkernels
from ampkernels.float8 import Float8Linear, convert_to_float8

try:
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError:
    sys.exit("fp8_llama_pretrain.py needs Hugging Face transformers: pip install transformers")


def make_config(smoke: bool) -> LlamaConfig:
    if smoke:
        shape = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4)
        return LlamaConfig(vocab_size=256, num_key_value_heads=2, max_position_embeddings=64, **shape)
    # TinyLlama-1.1B's shape
    shape = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32)
    return LlamaConfig(vocab_size=32000, num_key_value_heads=4, max_position_embeddings=2048, **shape)


def lr_at(step: int, args) -> float:
    """Linear warm-up to --lr, then constant (a real run would decay it)."""
    return args.lr * min(1.0, (step + 1) / args.warmup_lr_steps)


def build(recipe: str, config: LlamaConfig, args, device: torch.device):
    """(model, optimizer, step function, lr setter) for ``recipe``, from the same seed."""
    torch.manual_seed(0)
    with device:  # initialized where it trains (a 1.1B model initialized on the CPU takes a while)
        model = LlamaForCausalLM(config)
    model.train()
    if recipe == "stock":
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=lr_at(0, args), weight_decay=0.1, fused=device.type == "cuda"
        )

        def set_lr(value: float) -> None:
            for group in optimizer.param_groups:
                group["lr"] = value

    else:
        # min_features=0 on the smoke model only: by default convert_to_float8 converts only layers large enough
        # for FP8 to pay (docs/float8.md), and the tiny model has none.
        convert_to_float8(model, "tensorwise", min_features=0 if args.smoke else None)
        # A device tensor lr: the captured step reads it at every replay, so a schedule can change it in place.
        lr = torch.tensor(lr_at(0, args), device=device)
        optimizer = ampkernels.FusedAdamW(
            model.parameters(), lr=lr, weight_decay=0.1, exp_avg_dtype="8bit", exp_avg_sq_dtype="8bit"
        )
        set_lr = lr.fill_

    def step(input_ids: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)  # no host sync: fine inside a graph
        optimizer.step()
        return loss.detach()

    return model, optimizer, step, set_lr


def run(recipe: str, config, batches, args, device) -> tuple[float, list[float]]:
    model, optimizer, step, set_lr = build(recipe, config, args, device)
    if recipe == "ampkernels":
        layers = sum(isinstance(m, Float8Linear) for m in model.modules())
        graphed = device.type == "cuda" and not args.no_graph
        how = "one CUDA graph" if graphed else "eager"
        print(f"  ampkernels: {layers} Linear layers in FP8, 8-bit AdamW state, {how}")
        if graphed:
            # Warm-up and capture leave weights and optimizer state as they were: the first replay is step 0.
            # transformers_mask_skip: no attention mask is materialized during capture (docs/cuda-graphs.md).
            step = ampkernels.capture_step(step, batches[0], transformers_mask_skip=True)
    losses = []
    for i in range(args.steps):
        if i == args.warmup:
            _sync(device)
            start = time.perf_counter()
        set_lr(lr_at(i, args))
        losses.append(step(batches[i % len(batches)]))
    _sync(device)
    ms = (time.perf_counter() - start) * 1e3 / (args.steps - args.warmup)
    peak = f", peak {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB" if device.type == "cuda" else ""
    losses = [float(x) for x in losses]
    print(f"  {recipe:>10}: {ms:8.2f} ms/step{peak}, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    del model, optimizer, step, set_lr  # before the next recipe builds its own
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return ms, losses


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a tiny Llama on the CPU, a few steps (for CI)")
    parser.add_argument("--recipe", choices=("both", "stock", "ampkernels"), default="both")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="untimed first steps")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup-lr-steps", type=int, default=100)
    parser.add_argument("--max-norm", type=float, default=1.0)
    parser.add_argument("--no-graph", action="store_true", help="run the ampkernels step eagerly")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must be larger than --warmup ({args.warmup})")
    if args.smoke:
        args.batch_size, args.seq_len, args.steps, args.warmup = 2, 32, 4, 1
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")

    config = make_config(args.smoke)
    generator = torch.Generator(device=device).manual_seed(1)
    batches = [
        torch.randint(config.vocab_size, (args.batch_size, args.seq_len), device=device, generator=generator)
        for _ in range(4)
    ]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    h, kv = config.hidden_size, config.num_key_value_heads * config.hidden_size // config.num_attention_heads
    layer = 2 * h * h + 2 * h * kv + 3 * h * config.intermediate_size + 2 * h  # q, o; k, v; gate, up, down; norms
    params = 2 * config.vocab_size * h + config.num_hidden_layers * layer + h
    print(
        f"fp8_llama_pretrain on {name}: Llama, {params / 1e6:,.1f}M parameters ({config.num_hidden_layers} layers of "
        f"{config.hidden_size}), batch {args.batch_size} x {args.seq_len} tokens, bf16 autocast, "
        f"{args.steps - args.warmup} timed steps after {args.warmup}"
    )
    recipes = ("stock", "ampkernels") if args.recipe == "both" else (args.recipe,)
    results = {recipe: run(recipe, config, batches, args, device) for recipe in recipes}
    if len(results) == 2:
        (stock_ms, stock_losses), (ours_ms, ours_losses) = results["stock"], results["ampkernels"]
        gap = max(abs(a - b) / abs(a) for a, b in zip(stock_losses, ours_losses))
        note = " (CPU smoke run: these sizes say nothing about speed)" if device.type == "cpu" else ""
        print(
            f"  speedup over stock bf16 eager: {stock_ms / ours_ms:.2f}x{note}; "
            f"largest relative loss gap {gap:.1e} (FP8 rounds differently from bf16)"
        )


if __name__ == "__main__":
    main()
