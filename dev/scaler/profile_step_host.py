"""Host time of the post-backward phase (clip_grad_norm_, step, update) with FusedAdamW on many small tensors.

python3 dev/scaler/profile_step_host.py [num_tensors]   (CUDA machine, extension built in place)
Each segment's host time is timed without a sync (the GPU work, ~0.1 ms for 10k x 1024, runs behind); 'fresh'
re-creates every .grad as a new tensor on the same memory each step, as zero_grad(set_to_none=True) + backward do
(Python's gc is off during the loops: the 10k tensors made per step would otherwise trigger collections in the timed
parts, which a real backward, making its gradients in C++, does not).
"""

import gc
import sys
import time

import torch

import ampkernels


def main(num_tensors: int, steps: int = 100) -> None:
    params = [torch.nn.Parameter(torch.randn(1024, device="cuda")) for _ in range(num_tensors)]
    grads = [torch.randn(1024, device="cuda") for _ in params]
    opt = ampkernels.FusedAdamW(params, lr=1e-4)
    scaler = ampkernels.FusedGradScaler()
    scaler.scale(torch.ones((), device="cuda"))
    gc.disable()
    for fresh in (False, True):
        for p, g in zip(params, grads):
            p.grad = g
        seg = {"clip": 0.0, "step": 0.0, "update": 0.0}
        torch.cuda.synchronize()
        wall = time.perf_counter()
        for i in range(steps + 5):
            if i == 5:
                seg = dict.fromkeys(seg, 0.0)
                torch.cuda.synchronize()
                wall = time.perf_counter()
            if fresh:
                t = time.perf_counter()
                for p, g in zip(params, grads):
                    p.grad = g.view(g.shape)  # a new TensorImpl on the same memory
                wall += time.perf_counter() - t  # not part of the phase
            t0 = time.perf_counter()
            scaler.clip_grad_norm_(opt, 1.0)
            t1 = time.perf_counter()
            scaler.step(opt)
            t2 = time.perf_counter()
            scaler.update()
            t3 = time.perf_counter()
            seg["clip"] += t1 - t0
            seg["step"] += t2 - t1
            seg["update"] += t3 - t2
        torch.cuda.synchronize()
        total = (time.perf_counter() - wall) / steps * 1e3
        parts = ", ".join(f"{k} {v / steps * 1e3:.3f}" for k, v in seg.items())
        kind = "fresh" if fresh else "same"
        print(f"{num_tensors} tensors, {kind} grads: {total:.3f} ms/step wall ({parts} ms host)")
    gc.enable()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10_000)
