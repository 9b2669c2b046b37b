"""A ConvNet trained in channels_last memory format with fp16 or bf16 autocast, on ampkernels.

torchvision's ResNet-50 (random weights, synthetic ImageNet-sized batches) with SGD + momentum, the usual ConvNet
recipe. Stock is `torch.amp.GradScaler` with `torch.optim.SGD(fused=True)`; ampkernels is the same loop, with the
same calls, on `FusedGradScaler` and `FusedSGD`. channels_last (NHWC) lets cuDNN run the convolutions on the Tensor
Cores without transposes; the model and every input batch are converted.

    python examples/convnet_channels_last.py                 # ResNet-50, batch 64, 224x224, fp16, on a GPU
    python examples/convnet_channels_last.py --dtype bf16    # bf16 autocast: no loss scaling needed
    python examples/convnet_channels_last.py --smoke         # a tiny ResNet on 32x32 images, on the CPU
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch

from ampkernels import FusedGradScaler, FusedSGD

try:
    import torchvision
except ImportError:
    sys.exit(
        "convnet_channels_last.py needs torchvision: pip install torchvision (pick the release built for your torch, "
        f"{torch.__version__}; `pip install --no-deps torchvision==<that release>` keeps the torch you have)"
    )


def make_model(smoke: bool) -> torch.nn.Module:
    if not smoke:
        return torchvision.models.resnet50()
    # torchvision's ResNet blocks at widths 16 and 32: the same code path, at a size a CPU trains in milliseconds
    from torchvision.models.resnet import BasicBlock

    def down(cin, cout):
        return torch.nn.Sequential(torch.nn.Conv2d(cin, cout, 1, stride=2, bias=False), torch.nn.BatchNorm2d(cout))

    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1, bias=False),
        torch.nn.BatchNorm2d(16),
        torch.nn.ReLU(inplace=True),
        BasicBlock(16, 16),
        BasicBlock(16, 32, stride=2, downsample=down(16, 32)),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(32, 10),
    )
    return model


def train(recipe: str, model, batches, args, device) -> tuple[float, list[float]]:
    """Trains ``model`` with ``recipe`` ("stock" or "ampkernels"); (ms per timed step, losses)."""
    fused = {"fused": True} if device.type == "cuda" else {}
    sgd = dict(lr=args.lr, momentum=0.9, weight_decay=5e-5)
    if recipe == "stock":
        optimizer = torch.optim.SGD(model.parameters(), **sgd, **fused)
        scaler = torch.amp.GradScaler(device.type, enabled=args.dtype == "fp16")
    else:
        optimizer = FusedSGD(model.parameters(), **sgd)
        scaler = FusedGradScaler(device.type, enabled=args.dtype == "fp16")
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    losses = []
    for step in range(args.steps):
        if step == args.warmup:
            _sync(device)
            start = time.perf_counter()
        images, labels = batches[step % len(batches)]
        with torch.autocast(device.type, dtype=dtype):
            loss = torch.nn.functional.cross_entropy(model(images), labels)
        scaler.scale(loss).backward()
        if args.max_norm > 0:
            if recipe == "stock":
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
            else:
                scaler.clip_grad_norm_(optimizer, args.max_norm)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    _sync(device)
    return (time.perf_counter() - start) * 1e3 / (args.steps - args.warmup), [float(x) for x in losses]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a tiny ResNet on the CPU, a few steps (for CI)")
    parser.add_argument("--recipe", choices=("both", "stock", "ampkernels"), default="both")
    parser.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10, help="untimed first steps (cuDNN picks its algorithms)")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--max-norm", type=float, default=0.0, help="clip the gradient norm to this (0: no clip)")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must be larger than --warmup ({args.warmup})")
    if args.smoke:
        args.batch_size, args.image_size, args.steps, args.warmup = 2, 16, 3, 1
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    torch.backends.cudnn.benchmark = True

    torch.manual_seed(0)
    model = make_model(args.smoke).to(device, memory_format=torch.channels_last)
    classes = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1].out_features
    batches = [
        (
            torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device).contiguous(
                memory_format=torch.channels_last
            ),
            torch.randint(classes, (args.batch_size,), device=device),
        )
        for _ in range(4)
    ]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    what = "tiny ResNet" if args.smoke else "ResNet-50"
    print(
        f"convnet_channels_last on {name}: {what}, channels_last, {args.dtype}, batch {args.batch_size} x "
        f"{args.image_size}x{args.image_size}, {args.steps - args.warmup} timed steps after {args.warmup}"
    )
    recipes = ("stock", "ampkernels") if args.recipe == "both" else (args.recipe,)
    results = {}
    for recipe in recipes:
        torch.manual_seed(1)
        results[recipe] = train(recipe, copy.deepcopy(model), batches, args, device)
        print(f"  {recipe:>10}: {results[recipe][0]:8.2f} ms/step, final loss {results[recipe][1][-1]:.4f}")
    if len(results) == 2:
        (stock_ms, stock_losses), (ours_ms, ours_losses) = results["stock"], results["ampkernels"]
        gap = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(stock_losses, ours_losses))
        note = " (CPU smoke run: these sizes say nothing about speed)" if device.type == "cpu" else ""
        print(f"  speedup over stock: {stock_ms / ours_ms:.2f}x{note}; largest relative loss gap {gap:.1e}")


if __name__ == "__main__":
    main()
