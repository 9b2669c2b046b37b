"""Host time of GradTable's re-validation for 10k gradients: unchanged, and new tensors on the same memory each
step (what zero_grad(set_to_none=True) + backward bring when the allocator hands back the same blocks).

python dev/grad_table_refresh.py THREADS     (CPU; extension built in place; prints min and median microseconds)
"""

import statistics
import sys
import time

import torch

from ampkernels import _backend

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
n = 10000
params = [torch.nn.Parameter(torch.randn(4)) for _ in range(n)]
grads = [torch.randn(4) for _ in params]
for p, g in zip(params, grads):
    p.grad = g
table = _backend.native().GradTable(params, "cpu")
table.refresh()


def run(fresh: bool, reps: int = 100) -> str:
    times = []
    for _ in range(reps):
        if fresh:
            for p, g in zip(params, grads):
                p.grad = g.view(g.shape)
        start = time.perf_counter()
        rebuilt = table.refresh()
        times.append(time.perf_counter() - start)
        assert not rebuilt
    return f"min {min(times) * 1e6:.0f} med {statistics.median(times) * 1e6:.0f}"


print(f"threads {torch.get_num_threads()}: same {run(False)} | fresh {run(True)}")
