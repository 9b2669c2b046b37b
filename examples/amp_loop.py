"""The plain AMP training loop of PyTorch's AMP recipe, on ampkernels' FusedGradScaler and FusedAdamW.

Stock (the recipe as PyTorch documents it):

    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)          # torch.optim.AdamW(fused=True)
    scaler.update()

ampkernels: the same loop with `FusedGradScaler` and `FusedAdamW`; `scaler.clip_grad_norm_(optimizer, max_norm)`
does unscale + non-finite check + norm + clip in one pass with no host sync, and the optimizer applies the scale and
the clip factor inside its own pass.

    python examples/amp_loop.py            # full size on a GPU: ms/step of stock and of ampkernels, same seed
    python examples/amp_loop.py --smoke    # tiny, on the CPU, in seconds
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from ampkernels import FusedAdamW, FusedGradScaler


def make_model(in_size: int, out_size: int, num_layers: int) -> torch.nn.Module:
    """The AMP recipe's model: Linear + ReLU layers, then a Linear."""
    layers = []
    for _ in range(num_layers - 1):
        layers += [torch.nn.Linear(in_size, in_size), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(in_size, out_size))
    return torch.nn.Sequential(*layers)


def train(recipe: str, model, data, targets, args, device) -> tuple[float, list[float]]:
    """Trains ``model`` on the batches with ``recipe`` ("stock" or "ampkernels"); (ms per timed step, losses)."""
    if recipe == "stock":
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=device.type == "cuda")
        scaler = torch.amp.GradScaler(device.type, enabled=args.dtype == "fp16")
    else:
        optimizer = FusedAdamW(model.parameters(), lr=args.lr)
        scaler = FusedGradScaler(device.type, enabled=args.dtype == "fp16")
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    loss_fn = torch.nn.MSELoss()
    losses = []
    for step, (x, y) in enumerate(zip(data, targets)):
        if step == args.warmup:
            _sync(device)
            start = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        if recipe == "stock":
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
        else:
            scaler.clip_grad_norm_(optimizer, args.max_norm)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())  # read back at the end: no host sync inside the loop
    _sync(device)
    ms = (time.perf_counter() - start) * 1e3 / (len(data) - args.warmup)
    return ms, [float(x) for x in losses]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, a few steps (for CI)")
    parser.add_argument("--recipe", choices=("both", "stock", "ampkernels"), default="both")
    parser.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16", help="autocast dtype (bf16: no scaling)")
    parser.add_argument("--size", type=int, default=4096, help="width of the layers (the recipe's 4096)")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10, help="untimed first steps")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-norm", type=float, default=1.0)
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must be larger than --warmup ({args.warmup})")
    if args.smoke:
        args.size, args.layers, args.batch_size, args.steps, args.warmup = 64, 3, 16, 8, 2
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")

    torch.manual_seed(0)
    model = make_model(args.size, args.size, args.layers).to(device)
    data = torch.randn(args.steps, args.batch_size, args.size, device=device)
    targets = torch.randn(args.steps, args.batch_size, args.size, device=device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"amp_loop on {name}: {args.dtype}, {args.layers} Linear layers of {args.size}, batch {args.batch_size}, "
        f"{args.steps - args.warmup} timed steps after {args.warmup}"
    )
    recipes = ("stock", "ampkernels") if args.recipe == "both" else (args.recipe,)
    results = {}
    for recipe in recipes:
        results[recipe] = train(recipe, copy.deepcopy(model), data, targets, args, device)  # same initial weights
        print(f"  {recipe:>10}: {results[recipe][0]:8.2f} ms/step, final loss {results[recipe][1][-1]:.5f}")
    if len(results) == 2:
        (stock_ms, stock_losses), (ours_ms, ours_losses) = results["stock"], results["ampkernels"]
        gap = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(stock_losses, ours_losses))
        note = " (CPU smoke run: these sizes say nothing about speed)" if device.type == "cpu" else ""
        print(f"  speedup over stock: {stock_ms / ours_ms:.2f}x{note}; largest relative loss gap {gap:.1e}")


if __name__ == "__main__":
    main()
