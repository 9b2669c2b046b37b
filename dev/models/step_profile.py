"""Where an AMP training step of a real model spends its time, stock against ampkernels, phase by phase and kernel
by kernel: answers why one recipe's step is slower than the other's.

For each recipe (``fp16-stock``: ``torch.amp.GradScaler`` + ``unscale_`` + ``clip_grad_norm_`` + torch fused AdamW;
``fp16-ampkernels``: ``FusedGradScaler.clip_grad_norm_`` + ``FusedAdamW``), after warm-up:

- wall time per step, alternating the recipes for several rounds (so that clock and host drift hit both alike);
- per phase (zero_grad + forward, backward, post-backward = unscale/clip/step/update): device time between CUDA
  events, and the host time the phase took to enqueue (how far the host runs ahead of the device);
- the kernels of two profiled steps by device time, each recipe's top kernels and the largest differences.

Run: ``python3 dev/models/step_profile.py [MODEL ...]`` (CUDA needed; models: resnet-50, resnet-50-cl (channels_last),
bert-base; default resnet-50).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict

import torch

import ampkernels

MAX_NORM, LR, ROUNDS, STEPS_PER_ROUND = 1.0, 1e-4, 5, 20


def build(name: str):
    if name.startswith("resnet-50"):
        import torchvision

        model = torchvision.models.resnet50().cuda()
        images = torch.randn(64, 3, 224, 224, device="cuda")
        labels = torch.randint(0, 1000, (64,), device="cuda")
        if name == "resnet-50-cl":
            model = model.to(memory_format=torch.channels_last)
            images = images.contiguous(memory_format=torch.channels_last)
        return model, lambda m: torch.nn.functional.cross_entropy(m(images).float(), labels)
    if name == "bert-base":
        import transformers

        model = transformers.BertForMaskedLM(transformers.BertConfig()).cuda()
        ids = torch.randint(0, 30522, (32, 512), device="cuda")
        labels = torch.where(torch.rand(32, 512, device="cuda") < 0.15, ids, -100)
        return model, lambda m: m(input_ids=ids, labels=labels).loss
    raise SystemExit(f"unknown model {name!r}")


def make_step(recipe: str, model: torch.nn.Module, loss_of):
    params = [p for p in model.parameters() if p.requires_grad]
    if recipe == "fp16-ampkernels":
        optimizer, scaler = ampkernels.FusedAdamW(params, lr=LR), ampkernels.FusedGradScaler("cuda")
    else:
        optimizer, scaler = torch.optim.AdamW(params, lr=LR, fused=True), torch.amp.GradScaler("cuda")
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    host = [0.0, 0.0, 0.0]

    def step():
        t0 = time.perf_counter()
        marks[0].record()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = loss_of(model)
        t1 = time.perf_counter()
        marks[1].record()
        scaler.scale(loss).backward()
        t2 = time.perf_counter()
        marks[2].record()
        if isinstance(scaler, ampkernels.FusedGradScaler):
            scaler.clip_grad_norm_(optimizer, MAX_NORM)
        else:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        scaler.step(optimizer)
        scaler.update()
        marks[3].record()
        t3 = time.perf_counter()
        host[0], host[1], host[2] = t1 - t0, t2 - t1, t3 - t2

    def phases():
        torch.cuda.synchronize()
        device = [marks[i].elapsed_time(marks[i + 1]) for i in range(3)]
        return device, [h * 1e3 for h in host]

    return step, phases


def main(names: list[str]) -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for name in names:
        steps = {}
        for recipe in ("fp16-stock", "fp16-ampkernels"):
            torch.manual_seed(0)
            model, loss_of = build(name)
            steps[recipe] = make_step(recipe, model, loss_of)
            for _ in range(5):
                steps[recipe][0]()
        torch.cuda.synchronize()
        wall = defaultdict(list)
        for _ in range(ROUNDS):
            for recipe, (step, _) in steps.items():
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(STEPS_PER_ROUND):
                    step()
                torch.cuda.synchronize()
                wall[recipe].append((time.perf_counter() - start) * 1e3 / STEPS_PER_ROUND)
        print(f"\n== {name}: wall ms/step per round (alternating)")
        for recipe, values in wall.items():
            print(f"  {recipe:16s} median {statistics.median(values):7.3f}  {' '.join(f'{v:.2f}' for v in values)}")
        print("  phase ms, device (host enqueue): fwd | bwd | post-backward")
        for recipe, (step, phases) in steps.items():
            step()
            device, host = phases()
            cells = " | ".join(f"{d:6.3f} ({h:6.3f})" for d, h in zip(device, host))
            print(f"  {recipe:16s} {cells}")
        kernels = {}
        for recipe, (step, _) in steps.items():
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(2):
                    step()
                torch.cuda.synchronize()
            per = defaultdict(float)
            counts = defaultdict(int)
            for event in prof.events():
                if event.device_type == torch.autograd.DeviceType.CUDA:
                    per[event.name] += event.device_time / 2 / 1e3  # ms per step
                    counts[event.name] += 1
            kernels[recipe] = (per, counts)
            total = sum(per.values())
            print(f"\n  {recipe}: {total:.3f} ms of kernels per step, top 12:")
            for kname, ms in sorted(per.items(), key=lambda kv: -kv[1])[:12]:
                print(f"    {ms:7.3f} ms  x{counts[kname] // 2:<4d} {kname[:110]}")
        stock, ours = kernels["fp16-stock"][0], kernels["fp16-ampkernels"][0]
        diff = {k: ours.get(k, 0.0) - stock.get(k, 0.0) for k in set(stock) | set(ours)}
        print("\n  largest differences, ampkernels - stock (ms per step):")
        for kname, ms in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:15]:
            print(f"    {ms:+7.3f}  stock {stock.get(kname, 0):6.3f}  ours {ours.get(kname, 0):6.3f}  {kname[:100]}")
        del steps
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:] or ["resnet-50"])
