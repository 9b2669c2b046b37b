"""FusedAdam / FusedAdamW / FusedSGD against torch.optim, step by step, on every backend.

Tolerance: torch's own fused AdamW and its for-loop AdamW differ by up to 1.2e-7 (1 ulp at |p| ~ 1) after 10 steps of
random float32 data on CPU (torch 2.14); ours differs from torch by the same order (reordered
float32 products, FMA contraction), so float32 comparisons use rtol 1e-5 / atol 1e-6.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from tolerances import OPTIMIZER_FP32

from ampkernels import FusedAdam, FusedAdamW, FusedGradScaler, FusedSGD, dispatch, reference
from ampkernels.optim import AdamHyperparameters

FP32_TOL = OPTIMIZER_FP32
CHUNK = 16384

# (our class, torch's class, options) — every option of each optimizer at least once.
CONFIGS = [
    (FusedAdamW, torch.optim.AdamW, dict(lr=1e-2)),
    (FusedAdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    (FusedAdamW, torch.optim.AdamW, dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, maximize=True)),
    (FusedAdam, torch.optim.Adam, dict(lr=1e-2)),
    (FusedAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.05, amsgrad=True, maximize=True)),
    (FusedAdam, torch.optim.Adam, dict(lr=1e-2, betas=(0.3, 0.9))),  # 1 - beta1 >= 0.5: lerp's other formula
    (FusedSGD, torch.optim.SGD, dict(lr=1e-2)),
    (FusedSGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9)),
    (FusedSGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9, dampening=0.3, weight_decay=0.01, maximize=True)),
    (FusedSGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01)),
]
CONFIG_IDS = [f"{c.__name__}-{'-'.join(f'{k}={v}' for k, v in kw.items())}" for c, _, kw in CONFIGS]

SHAPES = [(3, 5), (CHUNK + 3,), (7,), (2, CHUNK - 1), (1,)]  # around the chunk size, odd tails
SMALL_SHAPES = [(3, 5), (70,), (1,)]  # for the Triton interpreter (slow)


def backends_for(device: str) -> list[str]:
    out = ["torch"]
    if dispatch.why_not("adam", "native", device) is None:
        out.append("native")
    if dispatch.why_not("adam", "triton", device) is None:
        out.append("triton")
    return out


def shapes_for(backend: str, device: str):
    return SMALL_SHAPES if backend == "triton" and device == "cpu" else SHAPES


def make_params(shapes, device, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(device, dtype)) for s in shapes]


def clone_params(params, dtype=None):
    return [torch.nn.Parameter(p.detach().clone().to(dtype or p.dtype)) for p in params]


def set_grads(param_lists, seed, scale=1.0, dtype=None, round_to=None):
    """The same random gradient (times ``scale``, rounded to ``round_to`` first) on the matching parameter of every
    list, in ``dtype`` (default: the parameter's)."""
    gen = torch.Generator().manual_seed(1000 + seed)
    for group in zip(*param_lists, strict=True):
        g = torch.randn(group[0].shape, generator=gen) * scale
        if round_to is not None:
            g = g.to(round_to).float()
        for p in group:
            p.grad = g.to(p.device, dtype or p.dtype)


def assert_state_close(ours, theirs, params_ours, params_theirs, **tol):
    for po, pt in zip(params_ours, params_theirs, strict=True):
        so, st = ours.state[po], theirs.state[pt]
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(so[key].float().cpu(), value.float().cpu(), **tol, msg=key)


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_matches_torch_step_by_step(device, config):
    ours_cls, torch_cls, options = config
    for backend in backends_for(device):
        shapes = shapes_for(backend, device)
        ps = make_params(shapes, device)
        pt = clone_params(ps)
        ours = ours_cls(ps, backend=backend, **options)
        theirs = torch_cls(pt, **options)
        for step in range(4):
            set_grads([ps, pt], step)
            ours.step()
            theirs.step()
            for a, b in zip(ps, pt, strict=True):
                torch.testing.assert_close(a, b, **FP32_TOL, msg=f"{backend} step {step}")
        assert_state_close(ours, theirs, ps, pt, **FP32_TOL)
        if "step" in theirs.state[pt[0]]:
            assert float(ours.state[ps[0]]["step"]) == 4.0


def test_backends_agree_with_reference(device):
    """The kernels compute reference.adam_step's float32 math. The native CPU kernel rounds every operation as the
    reference does (built with -ffp-contract=off): equal bit for bit, moments included. The CUDA and Triton kernels
    may contract multiply-adds into FMAs: a few float32 ulps after 3 steps."""
    for backend in backends_for(device):
        ps = make_params(shapes_for(backend, device), device)
        pr = clone_params(ps)
        ours = FusedAdamW(ps, lr=1e-2, weight_decay=0.1, amsgrad=True, backend=backend)
        ref = FusedAdamW(pr, lr=1e-2, weight_decay=0.1, amsgrad=True, backend="torch")
        for step in range(3):
            set_grads([ps, pr], step)
            ours.step()
            ref.step()
        exact = backend in ("native", "torch") and device == "cpu"
        for a, b in zip(ps, pr, strict=True):
            if exact:
                assert torch.equal(a, b), backend
                for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                    assert torch.equal(ours.state[a][key], ref.state[b][key]), key
            else:
                torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-7)


def test_adam_reference_is_the_ieee_float32_formula():
    """reference.adam_step is its docstring's formula with every operation rounded to float32 (numpy float32 scalars
    evaluate it so), whatever torch's own lerp/addcmul/sqrt do on this CPU (torch 2.14 with AVX-512 fuses the first
    two into FMAs and rounds sqrt only to within an ulp: a reference built on them would depend on the machine)."""
    np = pytest.importorskip("numpy")
    gen = torch.Generator().manual_seed(5)
    n, beta1, beta2, eps, lr, wd = 4099, 0.9, 0.999, 1e-8, 1e-2, 0.1
    p, m, v = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen)
    g = torch.randn(n, generator=gen)
    step = torch.tensor(4.0)
    f32 = np.float32
    P, M, V, G = (t.numpy().astype(f32) for t in (p, m, v, g))
    w = f32(1 - beta1)
    P = P * f32(1 - lr * wd)
    M = M + w * (G - M)
    V = V * f32(beta2) + (f32(1 - beta2) * G) * G
    step_size = f32(lr / (1 - beta1**5))
    bc2_sqrt = f32(math.sqrt(1 - beta2**5))
    P = P - step_size * (M / (np.sqrt(V) / bc2_sqrt + f32(eps)))
    params, moments, squares = [p.clone()], [m.clone()], [v.clone()]
    hyper = AdamHyperparameters(beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd, decoupled_weight_decay=True)
    reference.adam_step(params, [g], moments, squares, [], [step], lr=lr, hyper=hyper)
    assert np.array_equal(moments[0].numpy(), M) and np.array_equal(squares[0].numpy(), V)
    assert np.array_equal(params[0].numpy(), P)


def test_grads_are_only_read(device):
    for backend in backends_for(device):
        ps = make_params(shapes_for(backend, device), device)
        set_grads([ps], 0, scale=1024.0)
        before = [p.grad.clone() for p in ps]
        opt = FusedAdamW(ps, backend=backend)
        opt.step(grad_scale=torch.tensor(1024.0, device=device))
        assert all(torch.equal(p.grad, g) for p, g in zip(ps, before, strict=True))


def test_grad_scale_divides_the_gradients(device):
    """grad_scale = 2^k: the step equals the step on the unscaled gradients bit for bit."""
    for backend in backends_for(device):
        shapes = shapes_for(backend, device)
        ps, pu = make_params(shapes, device), make_params(shapes, device)
        scaled, plain = FusedAdamW(ps, backend=backend), FusedAdamW(pu, backend=backend)
        for step in range(3):
            set_grads([ps], step, scale=65536.0)
            set_grads([pu], step)
            scaled.step(grad_scale=torch.tensor(65536.0, device=device))
            plain.step()
        assert all(torch.equal(a, b) for a, b in zip(ps, pu, strict=True))


@pytest.mark.parametrize("cls, options", [(FusedAdamW, dict(amsgrad=True)), (FusedSGD, dict(momentum=0.9))])
def test_found_inf_skips_everything_bitwise(device, cls, options):
    for backend in backends_for(device):
        for master in (False, True):
            dtype = torch.bfloat16 if master else torch.float32
            ps = make_params(shapes_for(backend, device), device, dtype)
            opt = cls(ps, lr=1e-2, backend=backend, master_weights=master, **options)
            for first_skipped in (True, False):
                set_grads([ps], 0)
                params_before = [p.detach().clone() for p in ps]
                state_before = copy.deepcopy(opt.state_dict()["state"])
                opt.step(found_inf=torch.ones((), device=device))
                assert all(torch.equal(a, b) for a, b in zip(ps, params_before, strict=True))
                state_after = opt.state_dict()["state"]
                for pid, st in state_before.items():
                    for key, value in st.items():
                        assert torch.equal(state_after[pid][key], value), (backend, master, key)
                if first_skipped:  # the state created by the skipped first step is still "never stepped"
                    assert all(float(opt.state[p]["step"]) == 0.0 for p in ps)
                opt.step(found_inf=torch.zeros((), device=device))
                assert not all(torch.equal(a, b) for a, b in zip(ps, params_before, strict=True))


def test_sgd_first_step_after_a_skipped_one_matches_torch(device):
    """A skipped first step must leave the momentum buffer 'uninitialised': the next step sets it to the gradient."""
    for backend in backends_for(device):
        ps = make_params(shapes_for(backend, device), device)
        pt = clone_params(ps)
        ours = FusedSGD(ps, lr=0.1, momentum=0.9, dampening=0.5, backend=backend)
        theirs = torch.optim.SGD(pt, lr=0.1, momentum=0.9, dampening=0.5)
        set_grads([ps], 99)
        ours.step(found_inf=torch.ones((), device=device))
        for step in range(3):
            set_grads([ps, pt], step)
            ours.step(found_inf=torch.zeros((), device=device))
            theirs.step()
        for a, b in zip(ps, pt, strict=True):
            torch.testing.assert_close(a, b, **FP32_TOL)


def test_param_groups_scheduler_and_tensor_lr(device):
    for backend in backends_for(device):
        shapes = shapes_for(backend, device)
        ps, pt = make_params(shapes, device), None
        pt = clone_params(ps)

        def groups(params, lr_tensor):
            lr = torch.tensor(0.02, device=device) if lr_tensor else 0.02
            return [
                {"params": params[:1], "lr": lr},
                {"params": params[1:], "weight_decay": 0.3, "betas": (0.5, 0.9)},
            ]

        for lr_tensor in (False, True):
            ours = FusedAdamW(groups(ps, lr_tensor), lr=1e-2, backend=backend)
            theirs = torch.optim.AdamW(groups(pt, lr_tensor), lr=1e-2)
            s_ours = torch.optim.lr_scheduler.StepLR(ours, step_size=1, gamma=0.5)
            s_theirs = torch.optim.lr_scheduler.StepLR(theirs, step_size=1, gamma=0.5)
            for step in range(3):
                set_grads([ps, pt], step)
                ours.step()
                theirs.step()
                s_ours.step()
                s_theirs.step()
            for a, b in zip(ps, pt, strict=True):
                torch.testing.assert_close(a, b, **FP32_TOL)
            if lr_tensor:
                assert isinstance(ours.param_groups[0]["lr"], torch.Tensor)


@pytest.mark.parametrize("fused_torch", [False, True])
@pytest.mark.parametrize("ours_cls, torch_cls, options", [CONFIGS[1], CONFIGS[4], CONFIGS[9]])
def test_state_dict_round_trips_with_torch(device, fused_torch, ours_cls, torch_cls, options):
    shapes = [(3, 5), (70,), (1,)]
    ps = make_params(shapes, device)
    pt = clone_params(ps)
    ours = ours_cls(ps, **options)
    theirs = torch_cls(pt, fused=fused_torch, **options)
    for step in range(2):
        set_grads([ps, pt], step)
        ours.step()
        theirs.step()
    # torch -> ours and ours -> torch, then both continue in lockstep with the originals.
    ps2, pt2 = clone_params(pt), clone_params(ps)
    ours2 = ours_cls(ps2, **options)
    ours2.load_state_dict(copy.deepcopy(theirs.state_dict()))  # as a save and load would: no shared tensors
    theirs2 = torch_cls(pt2, fused=fused_torch, **options)
    theirs2.load_state_dict(copy.deepcopy(ours.state_dict()))
    for step in range(2, 4):
        set_grads([ps, pt, ps2, pt2], step)
        for opt in (ours, theirs, ours2, theirs2):
            opt.step()
    for a, b, c, d in zip(ps, pt, ps2, pt2, strict=True):
        torch.testing.assert_close(a, b, **FP32_TOL)
        torch.testing.assert_close(c, b, **FP32_TOL)
        torch.testing.assert_close(d, b, **FP32_TOL)


def test_torch_state_dict_with_missing_state_loads(device):
    """torch's state_dict lacks state for a parameter that never had a gradient: ours creates it lazily."""
    ps = make_params([(4, 4), (9,)], device)
    pt = clone_params(ps)
    theirs = torch.optim.AdamW(pt, lr=1e-2)
    set_grads([pt[:1]], 0)
    theirs.step()
    assert len(theirs.state_dict()["state"]) == 1
    ours = FusedAdamW(ps, lr=1e-2)
    ours.load_state_dict(copy.deepcopy(theirs.state_dict()))
    with torch.no_grad():
        ps[0].copy_(pt[0])
    for step in range(1, 3):
        set_grads([ps, pt], step)
        ours.step()
        theirs.step()
    for a, b in zip(ps, pt, strict=True):
        torch.testing.assert_close(a, b, **FP32_TOL)


@pytest.mark.parametrize(
    "dtypes",
    [(torch.float32, False), (torch.bfloat16, True), (torch.float16, False)],
    ids=["fp32", "bf16-master", "fp16"],
)
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_native_cpu_step_is_the_reference_bit_for_bit(config, dtypes):
    """Each option selects its own vectorized loop in the CPU kernel (the options are template arguments there):
    every one gives the reference's parameters and state bit for bit, with a grad scale and across chunk tails."""
    if dispatch.why_not("adam", "native", "cpu") is not None:
        pytest.skip(dispatch.why_not("adam", "native", "cpu"))
    cls, _, options = config
    param_dtype, master = dtypes
    ps = make_params(SHAPES, "cpu", param_dtype)
    pr = clone_params(ps)
    ours = cls(ps, backend="native", master_weights=master, **options)
    ref = cls(pr, backend="torch", master_weights=master, **options)
    for step in range(3):
        set_grads([ps, pr], step, scale=64.0)
        for opt in (ours, ref):
            opt.step(grad_scale=torch.tensor([64.0]))
    for a, b in zip(ps, pr, strict=True):
        assert torch.equal(a, b)
        for key, value in ref.state[b].items():
            assert torch.equal(ours.state[a][key], value), key


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cls, options", [(FusedAdamW, dict(weight_decay=0.1)), (FusedSGD, dict(momentum=0.9))])
def test_low_precision_params(device, dtype, cls, options):
    """Without master weights: float32 math on low-precision storage (== the reference's). With master weights: the
    float32 master follows torch's float32 optimizer on float32 copies, and the parameter is its rounding."""
    torch_cls = torch.optim.AdamW if cls is FusedAdamW else torch.optim.SGD
    for backend in backends_for(device):
        shapes = shapes_for(backend, device)
        ps_plain, ps_master = make_params(shapes, device, dtype), make_params(shapes, device, dtype)
        ps_ref, p32 = clone_params(ps_plain), clone_params(ps_plain, torch.float32)
        plain = cls(ps_plain, lr=1e-2, backend=backend, **options)
        ref = cls(ps_ref, lr=1e-2, backend="torch", **options)
        master = cls(ps_master, lr=1e-2, backend=backend, master_weights=True, **options)
        fp32 = torch_cls(p32, lr=1e-2, **options)
        for step in range(3):
            set_grads([ps_plain, ps_ref, ps_master, p32], step, round_to=dtype)
            for opt in (plain, ref, master, fp32):
                opt.step()
        for a, r, m, f in zip(ps_plain, ps_ref, ps_master, p32, strict=True):
            assert a.dtype == dtype and m.dtype == dtype
            ulp = 2**-10 if dtype == torch.float16 else 2**-7
            # fp16 subnormals (below 6.1e-5) are spaced 2^-24 apart: one rounding there is a large relative step.
            subnormal = 2 * 2**-24 if dtype == torch.float16 else 0.0
            if device == "cpu":
                # Same float32 math, same rounding (no FMA contraction on the CPU; the Triton kernels round bf16 by
                # integer arithmetic under the interpreter, whose own casts truncate).
                assert torch.equal(a, r)
            else:  # FMA contraction in the CUDA kernel: up to 2 ulps after 3 steps (seen on the H200)
                torch.testing.assert_close(a.float(), r.float(), rtol=2 * ulp, atol=subnormal)
            master_copy = master.state[m]["master_param"]
            assert master_copy.dtype == torch.float32
            torch.testing.assert_close(master_copy, f.detach(), rtol=1e-4, atol=1e-4)
            assert torch.equal(m, master_copy.to(dtype))
        state = master.state[ps_master[0]]
        key = "exp_avg" if cls is FusedAdamW else "momentum_buffer"
        assert state[key].dtype == torch.float32 and plain.state[ps_plain[0]][key].dtype == dtype


def test_mixed_grad_dtypes_and_param_dtypes_in_one_group(device):
    ps = make_params([(5,), (6,), (7,)], device)
    ps[1] = torch.nn.Parameter(ps[1].detach().to(torch.bfloat16))
    pr = clone_params(ps)
    ours = FusedAdamW(ps, lr=1e-2)
    ref = FusedAdamW(pr, lr=1e-2, backend="torch")
    for step in range(2):
        set_grads([ps, pr], step)
        ours.step()
        ref.step()
    for a, b in zip(ps, pr, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-6)


def test_many_tensors_and_gradients_that_come_and_go(device):
    shapes = [(i % 37 + 1,) for i in range(300)]
    ps = make_params(shapes, device)
    pt = clone_params(ps)
    ours = FusedAdamW(ps, lr=1e-2)
    theirs = torch.optim.AdamW(pt, lr=1e-2)
    for step in range(4):
        set_grads([ps, pt], step)
        if step == 1:  # some parameters without gradient this step (skipped, as torch does)
            for a, b in zip(ps[::3], pt[::3], strict=True):
                a.grad = b.grad = None
        if step == 2:  # gradients moved to new memory
            for a in ps:
                a.grad = a.grad.clone()
        ours.step()
        theirs.step()
    for a, b in zip(ps, pt, strict=True):
        torch.testing.assert_close(a, b, **FP32_TOL)
    assert float(ours.state[ps[0]]["step"]) == 3.0 and float(ours.state[ps[1]]["step"]) == 4.0


def test_closure_is_called_with_grad_enabled(device):
    ps = make_params([(4,)], device)
    opt = FusedSGD(ps, lr=0.1)

    def closure():
        assert torch.is_grad_enabled()
        opt.zero_grad()
        loss = (ps[0] ** 2).sum()
        loss.backward()
        return loss

    with torch.no_grad():
        loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and ps[0].grad is not None


def test_bad_inputs_raise_clear_errors(device):
    with pytest.raises(TypeError, match="parameter 1 .* torch.int64"):
        FusedAdamW([torch.nn.Parameter(torch.randn(3)), torch.zeros(3, dtype=torch.int64)])
    with pytest.raises(TypeError, match="float64"):
        FusedSGD([torch.nn.Parameter(torch.randn(3, dtype=torch.float64))])
    with pytest.raises(ValueError, match="Invalid beta"):
        FusedAdam([torch.nn.Parameter(torch.randn(3))], betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="Nesterov"):
        FusedSGD([torch.nn.Parameter(torch.randn(3))], nesterov=True)
    emb = torch.nn.Embedding(10, 4, sparse=True).to(device)
    emb(torch.tensor([1, 2], device=device)).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        FusedAdamW(emb.parameters()).step()


def test_zero_grad_and_params_without_grads(device):
    ps = make_params([(3,), (4,)], device)
    opt = FusedAdamW(ps)
    opt.step()  # no gradients at all: nothing happens, no state
    assert len(opt.state) == 0
    set_grads([ps], 0)
    opt.step()
    opt.zero_grad()
    assert all(p.grad is None for p in ps)
    before = [p.detach().clone() for p in ps]
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(ps, before, strict=True))


def _inject(params, step):
    """Gradients with an inf (step 1) or a NaN (step 3) in them; the others finite."""
    if step == 1:
        params[0].grad.view(-1)[0] = math.inf
    if step == 3:
        params[-1].grad.view(-1)[-1] = math.nan


@pytest.mark.parametrize("scaler_kind", ["torch", "ampkernels"])
def test_under_grad_scaler_matches_stock(device, scaler_kind):
    """scaler.step(ours) with overflowing steps == stock GradScaler + torch AdamW, step by step."""
    ps = make_params([(3, 5), (70,), (1,)], device)
    pt = clone_params(ps)
    ours = FusedAdamW(ps, lr=1e-2, weight_decay=0.1)
    theirs = torch.optim.AdamW(pt, lr=1e-2, weight_decay=0.1)
    make = FusedGradScaler if scaler_kind == "ampkernels" else torch.amp.GradScaler
    s_ours = make(device, init_scale=2.0**8, growth_interval=2)
    s_theirs = torch.amp.GradScaler(device, init_scale=2.0**8, growth_interval=2)
    for step in range(6):
        for scaler in (s_ours, s_theirs):
            scaler.scale(torch.ones((), device=device))  # initialises the scale, as scaler.scale(loss) would
        set_grads([ps, pt], step, scale=s_ours.get_scale())
        _inject(ps, step)
        _inject(pt, step)
        s_ours.step(ours)
        s_theirs.step(theirs)
        s_ours.update()
        s_theirs.update()
        assert s_ours.get_scale() == s_theirs.get_scale()
        for a, b in zip(ps, pt, strict=True):
            torch.testing.assert_close(a, b, **FP32_TOL)
    assert float(ours.state[ps[0]]["step"]) == 4.0  # two of six steps skipped


def test_lr_scheduler_stepping_after_a_skipped_step_matches_stock(device):
    """The skip is decided on the device, so our step() always runs and torch's 'scheduler.step() before
    optimizer.step()' warning cannot fire; the schedule, the parameters and the scale still follow stock's."""
    ps = make_params([(4, 3), (17,)], device)
    pt = clone_params(ps)
    ours, theirs = FusedAdamW(ps, lr=1e-2), torch.optim.AdamW(pt, lr=1e-2)
    sched_ours = torch.optim.lr_scheduler.StepLR(ours, step_size=2, gamma=0.5)
    sched_theirs = torch.optim.lr_scheduler.StepLR(theirs, step_size=2, gamma=0.5)
    s_ours = FusedGradScaler(device, init_scale=2.0**8)
    s_theirs = torch.amp.GradScaler(device, init_scale=2.0**8)
    for step in range(5):
        for scaler in (s_ours, s_theirs):
            scaler.scale(torch.ones((), device=device))
        set_grads([ps, pt], step, scale=s_ours.get_scale())
        if step in (0, 3):  # the very first step overflows, and one later
            ps[0].grad.view(-1)[1] = math.inf
            pt[0].grad.view(-1)[1] = math.inf
        before = [p.detach().clone() for p in ps]
        s_ours.step(ours)
        s_theirs.step(theirs)
        s_ours.update()
        s_theirs.update()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # stock warns after its skipped first step
            sched_ours.step()
            sched_theirs.step()
        if step in (0, 3):
            assert all(torch.equal(b, p) for b, p in zip(before, ps, strict=True))
        assert ours.param_groups[0]["lr"] == theirs.param_groups[0]["lr"]
        assert s_ours.get_scale() == s_theirs.get_scale()
        for a, b in zip(ps, pt, strict=True):
            torch.testing.assert_close(a, b, **FP32_TOL)


def test_native_step_from_mid_training_state_matches_reference(device):
    """One native FusedAdamW step (amsgrad, weight decay) from a mid-training state (step 3, random moments) equals
    reference.adam_step from the same state."""
    if dispatch.why_not("adam", "native", device) is not None:
        pytest.skip("native extension not available")
    ps = make_params([(5,), (CHUNK + 1,)], device)
    hyper = AdamHyperparameters(
        beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, amsgrad=True, decoupled_weight_decay=True
    )
    opt = FusedAdamW(ps, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, amsgrad=True, backend="native")
    set_grads([ps], 0)
    opt.step()  # creates the state; overwritten below, in place
    keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    gen = torch.Generator().manual_seed(1)
    for p in ps:
        for key in keys:
            opt.state[p][key].copy_(torch.rand(p.shape, generator=gen))
        opt.state[p]["step"].fill_(3.0)
    set_grads([ps], 1)
    grads = [p.grad.clone() for p in ps]
    ref_p = [p.detach().clone() for p in ps]
    ref_s = [[opt.state[p][key].clone() for p in ps] for key in keys]
    ref_steps = [opt.state[p]["step"].clone() for p in ps]
    opt.step()
    reference.adam_step(ref_p, grads, *ref_s, ref_steps, lr=1e-2, hyper=hyper)
    for a, b in zip(ps, ref_p, strict=True):
        torch.testing.assert_close(a.detach(), b, rtol=2e-6, atol=2e-7)
    assert all(float(opt.state[p]["step"]) == 4.0 for p in ps)


# ---- GPU only ----


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["native", "triton"])
@pytest.mark.parametrize("cls", [FusedAdamW, FusedSGD])
def test_cuda_graph_capture_and_replay(backend, cls):
    """The whole step (with a tensor lr and a scaler's grad_scale/found_inf) captured once, replayed with new
    gradients, lr values and overflow flags, equals eager steps."""
    device = "cuda"
    shapes = [(3, 5), (CHUNK + 3,), (1000,)]
    options = dict(momentum=0.9) if cls is FusedSGD else dict(weight_decay=0.1)
    ps, pe = make_params(shapes, device), make_params(shapes, device)
    lr = torch.tensor(0.01, device=device)
    graphed = cls(ps, lr=lr, backend=backend, **options)
    eager = cls(pe, lr=0.01, backend=backend, **options)
    scale = torch.tensor(4.0, device=device)
    found = torch.zeros((), device=device)
    set_grads([ps, pe], 0, scale=4.0)
    # Warm up on a side stream (builds the launch tables and the state), then capture.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graphed.step(grad_scale=scale, found_inf=found)
    torch.cuda.current_stream().wait_stream(side)
    eager.step(grad_scale=scale, found_inf=found)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed.step(grad_scale=scale, found_inf=found)
    for step in range(1, 5):
        gen = torch.Generator().manual_seed(step)
        for a, b in zip(ps, pe, strict=True):
            g = (torch.randn(a.shape, generator=gen) * 4.0).to(device)
            a.grad.copy_(g)
            b.grad = g.clone()
        found.fill_(1.0 if step == 2 else 0.0)
        lr.fill_(0.01 / step)
        for group in eager.param_groups:
            group["lr"] = 0.01 / step
        graph.replay()
        eager.step(grad_scale=scale, found_inf=found)
        torch.cuda.synchronize()
        for a, b in zip(ps, pe, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
def test_params_on_two_devices_are_grouped():
    if torch.cuda.device_count() < 1:
        pytest.skip("needs CUDA")
    ps = [torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(6, device="cuda"))]
    pt = clone_params(ps)
    ours, theirs = FusedAdamW(ps, lr=1e-2), torch.optim.AdamW(pt, lr=1e-2)
    for step in range(2):
        set_grads([ps, pt], step)
        ours.step()
        theirs.step()
    for a, b in zip(ps, pt, strict=True):
        torch.testing.assert_close(a, b, **FP32_TOL)
