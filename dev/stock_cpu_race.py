"""Stock torch.amp.GradScaler's unscale_ of CPU gradients with a scale on the GPU: it copies the inverse scale to
the CPU with non_blocking=True and the CPU kernel reads the pinned buffer at once. With GPU work queued ahead of the
copy, the gradients come out wrong. python3 dev/stock_cpu_race.py   (GPU machine; prints the wrong element count
for stock and for FusedGradScaler)
"""

import torch

from ampkernels import FusedGradScaler


def wrong_elements(scaler_cls, trials: int = 5, size: int = 1 << 20) -> int:
    g = torch.Generator().manual_seed(0)
    wrong = 0
    for _ in range(trials):
        p = torch.nn.Parameter(torch.randn(size, generator=g))
        scaler = scaler_cls("cuda", init_scale=1024.0)
        scaler.scale(torch.ones((), device="cuda"))  # the scale lives on the GPU
        grad = torch.randn(size, generator=g) * 1024.0
        p.grad = grad.clone()
        busy = torch.randn(4096, 4096, device="cuda")
        for _ in range(8):
            busy = busy @ busy  # milliseconds of GPU work queued ahead of the scale's copy
        scaler.unscale_(torch.optim.SGD([p], lr=0.1))
        wrong += int((p.grad != grad / 1024.0).sum())
    return wrong


if __name__ == "__main__":
    for cls in (torch.amp.GradScaler, FusedGradScaler):
        print(f"{cls.__name__}: unscale_ of 5 CPU gradients of 1M elements, wrong elements: {wrong_elements(cls)}")
