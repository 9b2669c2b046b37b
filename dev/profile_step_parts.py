"""Host time of each piece of the 10k-tensor post-backward phase (clip_grad_norm_, FusedAdamW step, update), to
place the ~1.3 ms per step of the benchmark's many-small set (dev/NOTES.md).

python3 dev/profile_step_parts.py [num_tensors]   (CUDA machine, extension built in place; median of 200 calls
each, microseconds; the GPU work runs behind, nothing synchronizes inside the timed calls)
"""

import statistics
import sys
import time

import torch

import ampkernels
from ampkernels import _backend

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def median_us(fn, reps: int = 200) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        if len(times) % 50 == 0:
            torch.cuda.synchronize() if DEV == "cuda" else None  # keep the launch queue short
    return statistics.median(times) * 1e6


def main(n: int) -> None:
    params = [torch.nn.Parameter(torch.randn(1024, device=DEV)) for _ in range(n)]
    for p in params:
        p.grad = torch.randn(1024, device=DEV)
    opt = ampkernels.FusedAdamW(params, lr=1e-4)
    scaler = ampkernels.FusedGradScaler(DEV, init_scale=1.0)
    scaler.scale(torch.ones((), device=DEV))

    def phase():
        scaler.clip_grad_norm_(opt, 1e9)
        scaler.step(opt)
        scaler.update()

    phase()
    ((_, table, _),) = scaler._grad_tables[opt][1]
    bucket = opt._plans[0].buckets[0]
    hyper = opt._hyper(opt.param_groups[0])
    one = torch.ones((), device=DEV)
    zero = torch.zeros((), device=DEV)
    groups = [g["params"] for g in opt.param_groups]
    flat = scaler._grad_tables[opt][0]
    rows = {
        "phase (clip + step + update)": phase,
        "clip_grad_norm_": lambda: (scaler.clip_grad_norm_(opt, 1e9), scaler.update()),
        "GradTable.refresh": table.refresh,
        "GradTable.unscale_reduce, no re-check": lambda: table.unscale_reduce(
            one, zero, None, False, 2.0, False, 1e9, False
        ),
        "GradTable.unscale_reduce, re-check": lambda: table.unscale_reduce(one, zero, None, False, 2.0, False, 1e9),
        "OptimizerTable.step_adam (re-check + launch)": lambda: bucket.table.step_adam(
            1e-4, None, grad_scale=one, found_inf=zero, **hyper
        ),
        "FusedAdamW.step(grad_scale, found_inf)": lambda: opt.step(grad_scale=one, found_inf=zero),
        "same_params (10k)": lambda: _backend.same_params(groups, flat),
        "update": lambda: (scaler.unscale_(opt), scaler.update()),
        "torch.zeros(())": lambda: torch.zeros((), device=DEV),
    }
    for threads in (torch.get_num_threads(), 1):
        torch.set_num_threads(threads)
        print(f"-- {n} tensors, {threads} intra-op threads")
        for name, fn in rows.items():
            print(f"{name:48s} {median_us(fn):8.1f} us")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10_000)
