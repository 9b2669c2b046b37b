"""Where the host time of FusedGradScaler.unscale_ goes for many small tensors (dev experiment, not a test).

python3 dev/profile_host.py [num_tensors]   (CUDA machine, extension built in place)
Prints microseconds per call for each layer, from the innermost out.
"""

import sys
import time

import torch
from torch.amp.grad_scaler import OptState

import ampkernels
from ampkernels import _backend


def per_call_us(fn, n=200):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def main(num_tensors: int) -> None:
    params = [torch.nn.Parameter(torch.empty(1024, device="cuda")) for _ in range(num_tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.SGD(params, lr=0.0)
    scaler = ampkernels.FusedGradScaler(init_scale=1.0)
    scaler.scale(torch.ones((), device="cuda"))
    native = _backend.native()
    table = native.GradTable(params, "cuda:0")
    table.refresh()
    groups = [g["params"] for g in opt.param_groups]
    flat = tuple(params)
    scale = torch.ones((), device="cuda")
    found = torch.zeros((), device="cuda")

    def unscale():
        scaler.unscale_(opt)
        scaler._per_optimizer_states[id(opt)]["stage"] = OptState.READY

    rows = [
        ("same_params (param identity check)", lambda: native.same_params(groups, flat)),
        ("GradTable.refresh (grad re-validation)", table.refresh),
        (
            "GradTable.unscale_reduce (refresh + 2 launches)",
            lambda: table.unscale_reduce(scale, found, None, True, 0.0, False, -1.0),
        ),
        ("torch.zeros(()) on cuda", lambda: torch.zeros((), device="cuda")),
        ("FusedGradScaler.unscale_ (everything)", unscale),
    ]
    for name, fn in rows:
        print(f"{num_tensors} tensors  {name:50s} {per_call_us(fn):8.1f} us")
    # New gradient tensors every step (zero_grad(set_to_none=True) + backward): the slow validation path.
    for p in params:
        p.grad = None
    for p in params:
        p.grad = torch.randn(1024, device="cuda")
    t = time.perf_counter()
    rebuilt = table.refresh()
    print(
        f"{num_tensors} tensors  {'refresh after new grad tensors (rebuilt=' + str(rebuilt) + ')':50s} "
        f"{(time.perf_counter() - t) * 1e6:8.1f} us"
    )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10000)
