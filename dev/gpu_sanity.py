"""Quick GPU check of the native kernels before the full suite: correctness on random data + rough timings.

python3 dev/gpu_sanity.py   (on the device, after `python3 setup.py build_ext --inplace`)
"""

import time

import torch
from torch.amp.grad_scaler import OptState

import ampkernels
from ampkernels import ops, reference

dev = "cuda"
torch.manual_seed(0)


def check_unscale(shapes, dtypes, backend):
    ts = [(torch.randn(s, device=dev) * 65536).to(dt) for s, dt in zip(shapes, dtypes)]
    ref = [t.clone() for t in ts]
    scale = torch.full((1,), 65536.0, device=dev)
    f1, f2 = torch.zeros(1, device=dev), torch.zeros(1, device=dev)
    r = ops.unscale_reduce_(ts, scale, f1, norm_type=2.0, per_tensor=True, max_norm=1.0, backend=backend)
    n_ref, e_ref = reference.unscale_reduce_(ref, scale, f2, norm_type=2.0, per_tensor=True)
    exact = all(torch.equal(a, b) for a, b in zip(ts, ref))
    rel = ((r.norm - n_ref).abs() / n_ref).item()
    rel_each = ((r.per_tensor_norms - e_ref).abs() / e_ref.clamp_min(1e-30)).max().item()
    print(f"[{backend}] unscale exact={exact} norm rel err={rel:.2e} per-tensor max rel={rel_each:.2e} "
          f"found={f1.item()} coef={r.clip_coef.item():.3e}")
    ts[-1].view(-1)[-1] = float("nan")
    f1.zero_()
    ops.unscale_reduce_(ts, scale, f1, write=False, backend=backend)
    print(f"[{backend}] nan at last element found: {f1.item() == 1.0}")


def wall(fn, n=50):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


shapes = [(65535,), (16384,), (16385,), (1,), (0,), (3, 7), (1000, 1000)]
dts = [torch.float32, torch.float16, torch.bfloat16, torch.float32, torch.float32, torch.float16, torch.float32]
for b in ("native", "triton", "torch"):
    try:
        check_unscale(shapes, dts, b)
    except Exception as e:  # report and go on
        print(f"[{b}] FAILED: {type(e).__name__}: {e}")

# Timings: unscale_ alone, stock vs fused (scale 1.0 so repeated calls keep the data).
for name, shapes in [("bert-like 109M/202", [(30522, 768)] + [(768, 768)] * 72 + [(3072, 768)] * 24
                      + [(768,)] * 105), ("many-small 10k", [(1024,)] * 10000)]:
    params = [torch.nn.Parameter(torch.empty(s, device=dev)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 65.536
    nelem = sum(p.numel() for p in params)
    for cls in (torch.amp.GradScaler, ampkernels.FusedGradScaler):
        opt = torch.optim.SGD(params, lr=0)
        sc = cls("cuda", init_scale=1.0)
        sc.scale(torch.ones((), device=dev))

        def step():
            sc.unscale_(opt)
            sc._per_optimizer_states[id(opt)]["stage"] = OptState.READY

        ms = wall(step)
        print(f"{name}: {cls.__name__:16s} unscale_ {ms:.3f} ms  {8 * nelem / ms / 1e6:.0f} GB/s")
