"""GPU-only tests of ``ampkernels.FusedGradScaler``: no host syncs, CUDA graph capture, many tensors, mixed dtypes
and a tensor of more than 2**31 elements. Skipped (with the reason) without a CUDA device."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F
from tolerances import NORM_RTOL_FLOOR

from ampkernels import FusedGradScaler

pytestmark = pytest.mark.gpu

INF = math.inf
CHUNK = 65536  # the multi-tensor chunk size of dev/design.md
_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Same shape/dtype, NaN at the same places, every other element the same bit pattern (compared on device)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    a_nan, e_nan = actual.isnan(), expected.isnan()
    assert torch.equal(a_nan, e_nan), f"{what}: NaN at different positions"
    differ = (actual.view(_BITS[actual.dtype]) != expected.view(_BITS[expected.dtype])) & ~e_nan
    if differ.any():
        idx = differ.nonzero()[:5].flatten().tolist() if actual.dim() == 1 else differ.nonzero()[:5].tolist()
        raise AssertionError(f"{what}: {int(differ.sum())} of {actual.numel()} elements differ, first at {idx}")


def inv_scale(scale: float, device="cuda") -> torch.Tensor:
    """``1 / scale`` as the stock scaler computes it (float64 reciprocal rounded to float32)."""
    return torch.tensor(scale, dtype=torch.float64, device=device).reciprocal().float()


def unscaled_reference(g: torch.Tensor, scale: float) -> torch.Tensor:
    return (g.float() * inv_scale(scale, g.device)).to(g.dtype)


def mlp(seed: int) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    return model.cuda()


def batch(i: int, overflow: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
    if overflow:
        x.fill_(INF)
    return x.cuda(), y.cuda()


def train_step(model, opt, scaler, x, y, max_norm=1.0) -> None:
    loss = F.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.clip_grad_norm_(opt, max_norm)
    scaler.step(opt)
    scaler.update()


# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extras",
    [{}, {"hysteresis": 2, "min_scale": 1.0, "max_scale": 2.0**20, "telemetry": True}],
    ids=["defaults", "all_extras"],
)
def test_fused_adamw_iteration_makes_no_host_sync(extras):
    model = mlp(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = FusedGradScaler("cuda", init_scale=2.0**12, growth_interval=2, **extras)
    batches = [batch(0), batch(1, overflow=True), batch(2), batch(3)]

    def iteration(x, y):
        opt.zero_grad(set_to_none=True)
        train_step(model, opt, scaler, x, y)

    iteration(*batches[0])  # warm-up: lazy initialisation, caches, compilation
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):  # the detector is live
            torch.ones(1, device="cuda").item()
        for x, y in batches:  # includes an overflowing (skipped) step
            iteration(x, y)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    assert scaler.get_scale() > 0


def test_cuda_graph_replay_matches_eager_and_skips_overflow():
    steps, overflow_at, warmup = 9, {4}, 3

    def setup():
        model = mlp(1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True, capturable=True)
        return model, opt, FusedGradScaler("cuda", init_scale=2.0**10, growth_interval=2)

    # eager reference
    model_e, opt_e, scaler_e = setup()
    for i in range(warmup):
        opt_e.zero_grad(set_to_none=True)
        train_step(model_e, opt_e, scaler_e, *batch(-1 - i))
    eager = []
    for i in range(steps):
        opt_e.zero_grad(set_to_none=True)
        train_step(model_e, opt_e, scaler_e, *batch(i, overflow=i in overflow_at))
        eager.append(([p.detach().clone() for p in model_e.parameters()], scaler_e.get_scale()))
    eager_scales = [s for _, s in eager]
    assert any(b > a for a, b in pairwise(eager_scales)), f"no growth in {eager_scales}"

    # captured: warm up on a side stream, capture one whole step, replay it
    model_g, opt_g, scaler_g = setup()
    static_x, static_y = batch(-1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(warmup):
            opt_g.zero_grad(set_to_none=True)
            x, y = batch(-1 - i)
            static_x.copy_(x)
            static_y.copy_(y)
            train_step(model_g, opt_g, scaler_g, static_x, static_y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt_g.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        train_step(model_g, opt_g, scaler_g, static_x, static_y)

    for i in range(steps):
        x, y = batch(i, overflow=i in overflow_at)
        static_x.copy_(x)
        static_y.copy_(y)
        before = [p.detach().clone() for p in model_g.parameters()]
        scale_before = scaler_g.get_scale()
        graph.replay()
        params, scale = [p.detach().clone() for p in model_g.parameters()], scaler_g.get_scale()
        assert scale == eager[i][1], f"replay {i}: scale {scale}, eager {eager[i][1]}"
        for j, (p, e) in enumerate(zip(params, eager[i][0], strict=True)):
            torch.testing.assert_close(
                p, e, rtol=1e-6, atol=1e-7, msg=lambda m, i=i, j=j: f"replay {i}, param {j}: {m}"
            )
        if i in overflow_at:
            assert scale == scale_before / 2, f"replay {i}: overflow did not back off ({scale_before} -> {scale})"
            for j, (p, b) in enumerate(zip(params, before, strict=True)):
                assert_bitwise_equal(p, b, f"replay {i}, param {j} changed in a skipped step")
        else:
            assert any(not torch.equal(p, b) for p, b in zip(params, before, strict=True)), f"replay {i} did not step"


def _scaled_grads(specs, scaler, seed, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    params = []
    for n, dtype in specs:
        p = torch.nn.Parameter(torch.randn(n, generator=g, device=device).to(dtype))
        p.grad = scaler.scale(torch.randn(n, generator=g, device=device) * 0.01).to(dtype)
        params.append(p)
    return params


def test_ten_thousand_small_tensors_unscaled_and_last_inf_found():
    sizes = torch.randint(1, 300, (10_000,), generator=torch.Generator().manual_seed(0)).tolist()
    scale = 2.0**10
    scaler = FusedGradScaler("cuda", init_scale=scale)
    params = _scaled_grads([(n, torch.float32) for n in sizes], scaler, seed=1)
    expected = torch.cat([unscaled_reference(p.grad, scale) for p in params])
    opt = torch.optim.SGD(params, lr=0.1)
    scaler.unscale_(opt)
    assert_bitwise_equal(torch.cat([p.grad for p in params]), expected, "10k unscaled grads")
    before = torch.cat([p.detach() for p in params])
    scaler.step(opt)
    scaler.update()
    assert not torch.equal(torch.cat([p.detach() for p in params]), before), "finite step was skipped"
    assert scaler.get_scale() == scale

    fresh = _scaled_grads([(n, torch.float32) for n in sizes], scaler, seed=2)
    for p, f in zip(params, fresh, strict=True):
        p.grad = f.grad
    params[-1].grad[-1] = INF
    before = torch.cat([p.detach() for p in params])
    scaler.step(opt)
    scaler.update()
    assert_bitwise_equal(torch.cat([p.detach() for p in params]), before, "params after the skipped step")
    assert scaler.get_scale() == scale / 2


def test_scale_of_a_cpu_tensor_by_a_cuda_scale_waits_for_the_copy():
    """Stock copies the scale to the CPU with non_blocking=True and multiplies at once: the multiply can read the
    pinned buffer before the copy lands (a third of a CPU tensor came out wrong on the H200). Ours must not."""
    scaler = FusedGradScaler("cuda", init_scale=2.0**10)
    scaler.scale(torch.ones((), device="cuda"))  # the scale now lives on the GPU
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        busy = torch.randn(4096, 4096, device="cuda")
        for _ in range(8):
            busy = busy @ busy  # milliseconds of GPU work queued ahead of the scale's copy
        x = torch.randn(1 << 20, generator=g)
        single, (listed,) = scaler.scale(x), scaler.scale([x])
        assert_bitwise_equal(single, x * 2.0**10, "scale(cpu tensor)")
        assert_bitwise_equal(listed, x * 2.0**10, "scale([cpu tensor])")


def test_unscale_of_cpu_gradients_by_a_cuda_scale_waits_for_the_copy():
    """Stock's unscale_ copies the inverse scale to the CPU with non_blocking=True too (_MultiDeviceReplicator) and
    the CPU kernel can read it before it lands. Ours must unscale exactly, with GPU work queued ahead."""
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        p = torch.nn.Parameter(torch.randn(1 << 20, generator=g))
        scaler = FusedGradScaler("cuda", init_scale=2.0**10)
        scaler.scale(torch.ones((), device="cuda"))
        grad = torch.randn(1 << 20, generator=g) * 2.0**10
        p.grad = grad.clone()
        busy = torch.randn(4096, 4096, device="cuda")
        for _ in range(8):
            busy = busy @ busy
        scaler.unscale_(torch.optim.SGD([p], lr=0.1))
        assert_bitwise_equal(p.grad, grad / 2.0**10, "unscale_ of a CPU gradient")


def _blocking_replicator_get(self, device):
    """torch.amp.grad_scaler._MultiDeviceReplicator.get with a blocking copy: stock's semantics without its race."""
    copy = self._per_device_tensors.get(device)
    if copy is None:
        copy = self._per_device_tensors[device] = self.master.to(device=device, copy=True)
    return copy


def test_one_optimizer_with_parameters_on_cpu_and_cuda_matches_stock(monkeypatch):
    """found_inf per device, the scale copied to each device, as stock's _MultiDeviceReplicator does. Stock copies
    to the CPU with non_blocking=True and reads the copy at once (in scale() and unscale_(): a third to two thirds
    of a CPU gradient came out wrong on the H200, tests above), so the stock run here copies blocking."""

    def run(cls):
        g = torch.Generator().manual_seed(5)
        params = [
            torch.nn.Parameter(torch.randn(n, generator=g).to(dev))
            for n, dev in ((33, "cuda"), (CHUNK + 9, "cpu"), (7, "cuda"), (129, "cpu"))
        ]
        opt = torch.optim.SGD(params, lr=0.1)
        scaler = cls("cuda", init_scale=2.0**10, growth_interval=2)
        scaler.scale(torch.ones((), device="cuda"))  # the scale lives on the GPU
        out = []
        for step in range(6):
            scale = scaler.get_scale()
            for p in params:
                p.grad = (torch.randn(p.shape, generator=g) * 0.1 * scale).to(p.device)
            if step == 2:
                params[1].grad[-1] = INF  # on the CPU only
            if step == 4:
                params[2].grad[0] = math.nan  # on the GPU only
            scaler.step(opt)
            scaler.update()
            out.append(
                (
                    scaler.get_scale(),
                    [p.detach().cpu().clone() for p in params],
                    [p.grad.detach().cpu().clone() for p in params],
                )
            )
        return out

    ours = run(FusedGradScaler)
    monkeypatch.setattr(torch.amp.grad_scaler._MultiDeviceReplicator, "get", _blocking_replicator_get)
    stock = run(torch.amp.GradScaler)
    for step, ((o_scale, o_params, o_grads), (s_scale, s_params, s_grads)) in enumerate(zip(ours, stock, strict=True)):
        assert o_scale == s_scale, f"step {step}: scale {o_scale}, stock {s_scale}"
        for j, (o, s_) in enumerate(zip(o_params + o_grads, s_params + s_grads, strict=True)):
            assert_bitwise_equal(o, s_, f"step {step}, tensor {j}")


MIXED_SIZES = [1, 7, 1023, CHUNK - 1, CHUNK, CHUNK + 1, 4 * CHUNK + 3, 1_000_003]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("scale", [2.0**14, 3000.0], ids=["pow2", "not_pow2"])
def test_mixed_fp32_fp16_bf16_grads_on_cuda_match_reference(scale):
    scaler = FusedGradScaler("cuda", init_scale=2.0**14)
    scaler.scale(torch.ones((), device="cuda"))
    scaler.update(scale)
    specs = [(n, DTYPES[i % 3]) for i, n in enumerate(MIXED_SIZES * 3)]
    params = _scaled_grads(specs, scaler, seed=3)
    expected = [unscaled_reference(p.grad, scale) for p in params]
    want = torch.stack([e.double().pow(2).sum() for e in expected]).sum().sqrt()  # float64 reference norm
    opt = torch.optim.SGD(params, lr=0.1)
    norm = scaler.clip_grad_norm_(opt, 1e9)  # never clips: the grads are just unscaled in place
    assert norm.device.type == "cuda" and norm.dtype == torch.float32 and norm.shape == ()
    torch_fp32 = torch.nn.utils.get_total_norm([e.float() for e in expected])
    err, torch_err = ((x.double() - want).abs() / want for x in (norm, torch_fp32))
    assert err <= max(2 * torch_err, NORM_RTOL_FLOOR), (
        f"norm error {err.item()}, torch's float32 norm {torch_err.item()}"
    )
    for i, (p, e) in enumerate(zip(params, expected, strict=True)):
        assert_bitwise_equal(p.grad, e, f"grad {i} ({p.dtype}, {p.numel()} elements)")


@pytest.mark.parametrize("where", ["first_of_first", "middle", "last_of_last"])
def test_mixed_dtype_nonfinite_found_on_cuda(where):
    scaler = FusedGradScaler("cuda", init_scale=2.0**14)
    specs = [(n, DTYPES[i % 3]) for i, n in enumerate(MIXED_SIZES * 3)]
    params = _scaled_grads(specs, scaler, seed=4)
    k = {"first_of_first": 0, "middle": len(params) // 2, "last_of_last": len(params) - 1}[where]
    pos = {"first_of_first": 0, "middle": params[k].numel() // 2, "last_of_last": params[k].numel() - 1}[where]
    params[k].grad[pos] = math.nan if where == "middle" else INF
    before = [p.detach().clone() for p in params]
    scaler.step(torch.optim.SGD(params, lr=0.1))
    scaler.update()
    for i, (p, b) in enumerate(zip(params, before, strict=True)):
        assert_bitwise_equal(p.detach(), b, f"param {i} changed in a skipped step")
    assert scaler.get_scale() == 2.0**13


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tensor_with_more_than_2_31_elements(dtype):
    n = 2**31 + 17
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    if free < 20 * 2**30:
        pytest.skip(f"needs 20 GiB of free GPU memory, {free / 2**30:.1f} GiB free")
    scale = 2.0**8
    scaler = FusedGradScaler("cuda", init_scale=scale, growth_interval=1000)
    scaler.scale(torch.ones((), device="cuda"))
    p = torch.nn.Parameter(torch.full((n,), 0.5, dtype=dtype, device="cuda"))
    p.grad = torch.empty(n, dtype=dtype, device="cuda").normal_()
    original = p.grad.clone()
    opt = torch.optim.SGD([p], lr=10.0, foreach=False)
    scaler.unscale_(opt)
    step = 2**28
    for start in range(0, n, step):  # the whole tensor, a slice at a time, to bound temporary memory
        sl = slice(start, min(start + step, n))
        assert_bitwise_equal(p.grad[sl], unscaled_reference(original[sl], scale), f"grad[{sl.start}:{sl.stop}]")
    del original
    probe = torch.tensor([0, 1, 2**31 - 1, 2**31, 2**31 + 1, n - 2, n - 1], device="cuda")
    before = p.detach()[probe].clone()
    scaler.step(opt)
    scaler.update()
    assert not torch.equal(p.detach()[probe], before), "finite step was skipped"
    assert scaler.get_scale() == scale

    p.grad.normal_()
    p.grad[-1] = INF
    before = p.detach()[probe].clone()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(p.detach()[probe], before), "a non-finite last element did not skip the step"
    assert scaler.get_scale() == scale / 2
