"""Tests of ``ampkernels.FusedGradScaler`` against the stock ``torch.amp.GradScaler``.

By default the two must agree bit for bit: the same scale and growth tracker after every ``update()``, the same
unscaled gradients, the same parameters and optimizer state, the same skip decisions. The extras (``clip_grad_norm_``,
hysteresis, scale bounds, telemetry) are checked against the stock recipe or against the contract's own arithmetic.

Every device-parametrised test runs on ``cpu`` and, when present, ``cuda`` (see ``conftest.py``).
"""

from __future__ import annotations

import functools
import inspect
import io
import math
import pickle
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F

import ampkernels
from ampkernels import FusedGradScaler

Stock = torch.amp.GradScaler
STOCK_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
INF = math.inf
FLOAT32_TINY = 2.0**-126
CHUNK = 65536  # the multi-tensor chunk size of dev/DESIGN.md: sizes around it are the interesting ones
# A float32 norm's relative error may be 2x that of torch's float32 norm, or up to this (~log2(n) ulps, n ~ 1e7).
NORM_RTOL_FLOOR = 1e-6

# ----------------------------------------------------------------------------------------------------------------
# comparison helpers
# ----------------------------------------------------------------------------------------------------------------

_BITS = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Exact equality: same shape/dtype, NaN at the same places, every other element the same bit pattern."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    a = actual.detach().cpu().contiguous()
    e = expected.detach().cpu().contiguous()
    if a.dtype not in _BITS:
        assert torch.equal(a, e), f"{what}: {a} != {e}"
        return
    a_nan, e_nan = a.isnan(), e.isnan()
    if not torch.equal(a_nan, e_nan):
        where = (a_nan != e_nan).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: NaN at different positions, first ones {where}")
    differ = (a.view(_BITS[a.dtype]) != e.view(_BITS[e.dtype])) & ~e_nan
    if differ.any():
        idx = differ.nonzero()[:5]
        pairs = [(tuple(i), a[tuple(i)].item(), e[tuple(i)].item()) for i in idx.tolist()]
        raise AssertionError(
            f"{what}: {int(differ.sum())} of {a.numel()} elements differ; first (index, actual, expected): {pairs}"
        )


def set_flat(t: torch.Tensor, k: int, value: float) -> None:
    """``t.view(-1)[k] = value`` that also works on non-contiguous tensors (row-major element order)."""
    idx = []
    for size in reversed(t.shape):
        idx.append(k % size)
        k //= size
    t[tuple(reversed(idx))] = value


def inv_scale(scale: float) -> torch.Tensor:
    """``1 / scale`` as the stock scaler computes it: reciprocal in float64, rounded to float32."""
    return torch.tensor(scale, dtype=torch.float64).reciprocal().float()


def unscaled_reference(g: torch.Tensor, scale: float) -> torch.Tensor:
    """The contract's manual reference: ``g.float() * (1 / scale)`` cast back to ``g.dtype``."""
    return (g.detach().float().cpu() * inv_scale(scale)).to(g.dtype)


def error_of(fn: Callable[[], object]) -> BaseException:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the exception is the result under test
        return exc
    raise AssertionError("expected an exception, none was raised")


def assert_same_error(ours: BaseException, stock: BaseException) -> None:
    assert isinstance(ours, type(stock)), f"ours raised {type(ours).__name__}: {ours}; stock {type(stock).__name__}"
    assert str(ours) == str(stock)


def key_pattern(key: str) -> str:
    """A regex that finds ``key`` as a whole identifier (``scale`` must not match ``init_scale`` or ``Scaler``)."""
    return rf"(?<![A-Za-z0-9_]){re.escape(key)}(?![A-Za-z0-9_])"


# ----------------------------------------------------------------------------------------------------------------
# problems, optimizers and the differential training loop
# ----------------------------------------------------------------------------------------------------------------


@functools.cache
def fused_adamw_supported(device: str) -> bool:
    try:
        p = torch.nn.Parameter(torch.randn(3, device=device))
        p.grad = torch.randn(3, device=device)
        torch.optim.AdamW([p], lr=1e-3, fused=True).step()
    except (RuntimeError, ValueError, TypeError):
        return False
    return True


def make_optimizer(kind: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=False)
    if kind == "adam_foreach":
        return torch.optim.Adam(params, lr=1e-2, foreach=True)
    if kind == "adamw_fused":
        device = params[0].device.type
        if not fused_adamw_supported(device):
            pytest.skip(f"torch {torch.__version__} has no fused AdamW on {device}")
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, fused=True)
        assert getattr(opt, "_step_supports_amp_scaling", False)
        return opt
    raise ValueError(kind)


def is_fused(opt: torch.optim.Optimizer) -> bool:
    return bool(getattr(opt, "_step_supports_amp_scaling", False))


def opt_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


# Synthetic problem: parameter shapes around the chunk size, zero-size ones, and gradients with awkward layouts.
SYNTH_SHAPES = [(7, 5), (33,), (0,), (CHUNK + 3,), (3, 0), (4, 4, 4), (1,), (129, 2)]
TRANSPOSED_GRAD = 0  # its .grad is a transposed (non-contiguous) tensor
OFFSET_GRAD = 5  # its .grad is a view into a larger buffer at a 3-element (misaligned) offset
SOMETIMES_NO_GRAD = 6  # gets no gradient on steps where step % 4 == 1


@dataclass
class Problem:
    params: list[torch.nn.Parameter]
    backward: Callable[[torch.amp.GradScaler, int, int], None]  # (scaler, step, micro_batch)


def _generator(seed: int, step: int, micro: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 100_003 + step * 101 + micro)


def make_synthetic(device: str, dtype: torch.dtype, seed: int, grad_layout: str) -> Problem:
    """``grad_layout``: "odd" (one transposed grad, one misaligned view), "dense" (fresh contiguous grads; torch's
    fused optimizers want these) or "flat_buffer" (every grad a view into one persistent flat buffer, at unaligned
    offsets, as DDP's gradient_as_bucket_view or FSDP's flat parameters do)."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(device=device, dtype=dtype)) for s in SYNTH_SHAPES]
    offsets = [0]
    for p in params:
        offsets.append(offsets[-1] + p.numel())
    flat = torch.empty(offsets[-1], device=device, dtype=dtype) if grad_layout == "flat_buffer" else None

    def new_grad(i: int, p: torch.Tensor) -> torch.Tensor:
        if flat is not None:
            return flat[offsets[i] : offsets[i + 1]].view(p.shape)
        if grad_layout == "odd" and i == TRANSPOSED_GRAD:
            return torch.empty(p.shape[::-1], device=device, dtype=dtype).t()
        if grad_layout == "odd" and i == OFFSET_GRAD:
            return torch.empty(p.numel() + 3, device=device, dtype=dtype)[3:].view(p.shape)
        return torch.empty_like(p)

    def backward(scaler, step, micro):
        gen = _generator(seed, step, micro)
        raws = [(torch.randn(p.shape, generator=gen) * 0.1).to(device=device, dtype=dtype) for p in params]
        scaled = scaler.scale(raws)  # the list form of scale()
        for i, (p, s) in enumerate(zip(params, scaled, strict=True)):
            if i == SOMETIMES_NO_GRAD and step % 4 == 1:
                continue
            if p.grad is None:
                p.grad = new_grad(i, p)
                p.grad.copy_(s)
            else:
                p.grad.add_(s)

    return Problem(params, backward)


def make_mlp(device: str, dtype: torch.dtype, seed: int) -> Problem:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(
            torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3)
        )
    model.to(device=device, dtype=dtype)

    def backward(scaler, step, micro):
        gen = _generator(seed, step, micro)
        x = torch.randn(16, 6, generator=gen).to(device=device, dtype=dtype)
        y = torch.randn(16, 3, generator=gen).to(device=device, dtype=dtype)
        loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()

    return Problem(list(model.parameters()), backward)


DEFAULT_INJECT = {3: "first", 4: "last", 9: "middle", 14: "first+last+middle"}
BASE_SCALER_KWARGS = {"init_scale": 2.0**10, "growth_interval": 3}


@dataclass
class Scenario:
    optimizers: tuple[str, ...] = ("sgd",)
    problem: str = "synthetic"  # or "mlp"
    dtype: torch.dtype = torch.float32
    clip: float | None = None  # max_norm; None: no clipping
    norm_type: float = 2.0
    micro_batches: int = 1
    set_to_none: bool = True  # zero_grad(set_to_none=...): False keeps the same grad tensors from step to step
    grad_layout: str | None = None  # synthetic only, see make_synthetic; default "odd", "dense" with a fused optimizer
    steps: int = 20
    inject: dict[int, str] = field(default_factory=lambda: dict(DEFAULT_INJECT))
    scaler_kwargs: dict = field(default_factory=lambda: dict(BASE_SCALER_KWARGS))
    # step -> (method, value) called on the scaler before that step's update(); ("update", v) replaces the update.
    actions: dict[int, tuple[str, object]] = field(default_factory=dict)

    def make_problem(self, device: str, seed: int = 0) -> Problem:
        if self.problem == "mlp":
            return make_mlp(device, self.dtype, seed)
        fused = any(k == "adamw_fused" for k in self.optimizers)  # torch's fused kernels need dense grads
        return make_synthetic(device, self.dtype, seed, self.grad_layout or ("dense" if fused else "odd"))


def poison(params: list[torch.Tensor], where: str) -> None:
    """Put inf at the first element of the first grad, -inf at the last of the last, NaN in the middle one."""
    live = [p.grad for p in params if p.grad is not None and p.grad.numel() > 0]
    for w in where.split("+"):
        if w == "first":
            set_flat(live[0], 0, INF)
        elif w == "last":
            set_flat(live[-1], live[-1].numel() - 1, -INF)
        elif w == "middle":
            g = live[len(live) // 2]
            set_flat(g, g.numel() // 2, math.nan)
        else:
            raise ValueError(w)


def train(scaler, device: str, sc: Scenario, *, clip_api: bool = False, seed: int = 0) -> list[dict[str, object]]:
    """Run ``sc`` with ``scaler``; return one record per step of everything the two scalers must agree on.

    ``clip_api``: clip with ``scaler.clip_grad_norm_`` (the extra) instead of the stock recipe
    ``scaler.unscale_(opt); torch.nn.utils.clip_grad_norm_(...)``.
    """
    problem = sc.make_problem(device, seed)
    n = len(sc.optimizers)
    groups = [problem.params[i::n] for i in range(n)]
    opts = [make_optimizer(kind, ps) for kind, ps in zip(sc.optimizers, groups, strict=True)]
    index = {id(p): j for j, p in enumerate(problem.params)}
    records = []
    for step in range(sc.steps):
        for opt in opts:
            opt.zero_grad(set_to_none=sc.set_to_none)
        for micro in range(sc.micro_batches):
            problem.backward(scaler, step, micro)
        if step in sc.inject:
            poison(problem.params, sc.inject[step])
        rec: dict[str, object] = {}
        for i, opt in enumerate(opts):
            ps = opt_params(opt)
            if sc.clip is not None:
                if clip_api:
                    norm = scaler.clip_grad_norm_(opt, sc.clip, norm_type=sc.norm_type)
                    assert isinstance(norm, torch.Tensor), type(norm)
                    assert norm.shape == () and norm.dtype == torch.float32, (norm.shape, norm.dtype)
                    assert norm.device.type == device, norm.device
                else:
                    scaler.unscale_(opt)
                    norm = torch.nn.utils.clip_grad_norm_(ps, sc.clip, norm_type=sc.norm_type)
                rec[f"norm{i}"] = norm.detach().clone()
                if not is_fused(opt):  # with a fused optimizer the clip may be folded into its step
                    for p in ps:
                        if p.grad is not None:
                            rec[f"grad_after_clip{index[id(p)]}"] = p.grad.detach().clone()
            before = [p.detach().clone() for p in ps]
            scaler.step(opt)
            rec[f"stepped{i}"] = any(not torch.equal(b, p) for b, p in zip(before, ps, strict=True))
            for p in ps:
                j = index[id(p)]
                if p.grad is not None and not is_fused(opt):
                    rec[f"grad{j}"] = p.grad.detach().clone()
                for k, v in opt.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor):
                        rec[f"opt{i}.p{j}.{k}"] = v.detach().clone()
        method, value = sc.actions.get(step, (None, None))
        if method == "update":
            if value == "tensor":
                value = torch.full((), 3.0 * 2**9, device=device)
            scaler.update(value)
        else:
            if method is not None:
                getattr(scaler, method)(value)
            scaler.update()
        for j, p in enumerate(problem.params):
            rec[f"param{j}"] = p.detach().clone()
        sd = scaler.state_dict()
        rec.update({f"state.{k}": sd[k] for k in STOCK_KEYS if k in sd})
        rec["get_scale"] = scaler.get_scale()
        records.append(rec)
    return records


def assert_same_trajectory(actual, expected, *, rtol: float = 0.0, atol: float = 0.0) -> None:
    """Bitwise by default; with a tolerance, tensors are compared with it, everything else still exactly.

    With a tolerance (the clip extra against the stock recipe), gradients of overflowing steps are not compared (the
    step is skipped; only the decision matters) and a non-finite norm only has to be non-finite on both sides.
    """
    assert len(actual) == len(expected)
    for step, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert a.keys() == e.keys(), f"step {step}: recorded {sorted(set(a) ^ set(e))} on one side only"
        overflow = any(k.startswith("norm") and not bool(torch.isfinite(v)) for k, v in e.items())
        for key, ev in e.items():
            av, what = a[key], f"step {step}, {key}"
            if not isinstance(ev, torch.Tensor):
                assert av == ev, f"{what}: ours {av!r}, stock {ev!r}"
            elif rtol == 0.0 and atol == 0.0:
                assert_bitwise_equal(av, ev, what)
            elif key.startswith("norm") and not bool(torch.isfinite(ev)):
                assert not bool(torch.isfinite(av)), f"{what}: ours {av.item()}, stock {ev.item()}"
            elif key.startswith("norm"):
                torch.testing.assert_close(av, ev, rtol=1e-5, atol=0.0, msg=lambda m, w=what: f"{w}: {m}")
            elif key.startswith("grad") and overflow:
                continue
            else:
                torch.testing.assert_close(
                    av, ev, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m, w=what: f"{w}: {m}"
                )


def assert_scenario_exercised(records, sc: Scenario) -> None:
    """Sanity of the scenario itself (run on the stock trajectory): growth happens, injected steps are skipped."""
    scales = [sc.scaler_kwargs.get("init_scale", 2.0**16)] + [r["get_scale"] for r in records]
    assert any(b > a for a, b in pairwise(scales)), f"no growth in {scales}"
    if sc.inject and not sc.actions:
        assert any(b < a for a, b in pairwise(scales)), f"no backoff in {scales}"
    n = len(sc.optimizers)
    for step, r in enumerate(records):
        stepped = [r[f"stepped{i}"] for i in range(n)]
        if step in sc.inject:
            assert not all(stepped), f"step {step} was injected but every optimizer stepped"
        else:
            assert all(stepped), f"step {step} skipped without an injected overflow"


def ours_factory(device, **kw):
    return FusedGradScaler(device, **kw)


def stock_factory(device, **kw):
    return Stock(device, **kw)


# ----------------------------------------------------------------------------------------------------------------
# the default path equals the stock scaler, bit for bit
# ----------------------------------------------------------------------------------------------------------------

TRAINING_SCENARIOS = {
    "sgd-mlp": Scenario(("sgd",), "mlp"),
    "sgd-synthetic-clip": Scenario(("sgd",), clip=1.0),
    "sgd-synthetic-accumulate2": Scenario(("sgd",), micro_batches=2),
    "adam_foreach-synthetic": Scenario(("adam_foreach",)),
    "adam_foreach-mlp-accumulate2": Scenario(("adam_foreach",), "mlp", micro_batches=2),
    "adam_foreach-mlp-clip": Scenario(("adam_foreach",), "mlp", clip=0.05),
    "adamw_fused-synthetic": Scenario(("adamw_fused",)),
    "adamw_fused-mlp-clip": Scenario(("adamw_fused",), "mlp", clip=0.05),
    "adamw_fused-synthetic-accumulate2": Scenario(("adamw_fused",), micro_batches=2),
    "sgd-mlp-zero_grad_in_place": Scenario(("sgd",), "mlp", set_to_none=False),
    "adamw_fused-mlp-zero_grad_in_place-clip": Scenario(("adamw_fused",), "mlp", clip=0.05, set_to_none=False),
    "two_optimizers-sgd+adam_foreach-mlp": Scenario(("sgd", "adam_foreach"), "mlp"),
    "two_optimizers-sgd+adamw_fused-synthetic-clip": Scenario(("sgd", "adamw_fused"), clip=1.0),
    "bf16_params-sgd-synthetic": Scenario(("sgd",), dtype=torch.bfloat16),
    "fp64_params-adam_foreach-synthetic": Scenario(("adam_foreach",), dtype=torch.float64),
    "sgd-flat_grad_buffer-zero_grad_in_place": Scenario(("sgd",), grad_layout="flat_buffer", set_to_none=False),
    "adamw_fused-flat_grad_buffer-clip": Scenario(("adamw_fused",), grad_layout="flat_buffer", clip=1.0),
    "growth4-backoff0.25": Scenario(
        ("adam_foreach",),
        "mlp",
        scaler_kwargs={"init_scale": 2.0**8, "growth_factor": 4.0, "backoff_factor": 0.25, "growth_interval": 2},
    ),
    "scale_near_float32_max": Scenario(
        ("sgd",), inject={5: "first", 11: "last"}, scaler_kwargs={"init_scale": 2.0**125, "growth_interval": 1}
    ),
}


@pytest.mark.parametrize("name", list(TRAINING_SCENARIOS))
def test_training_matches_stock_bitwise(device, name):
    sc = TRAINING_SCENARIOS[name]
    if device == "cuda" and sc.dtype in (torch.float16, torch.bfloat16):
        # Stock raises "not implemented for 'BFloat16'" on CUDA, so there is nothing to compare with; ours is
        # checked against the manual reference for fp16/bf16 CUDA gradients in test_grad_scaler_gpu.py.
        pytest.skip("torch.amp.GradScaler refuses fp16/bf16 gradients on CUDA")
    expected = train(stock_factory(device, **sc.scaler_kwargs), device, sc)
    assert_scenario_exercised(expected, sc)
    actual = train(ours_factory(device, **sc.scaler_kwargs), device, sc)
    assert_same_trajectory(actual, expected)


def _param_group_run(scaler, device: str, change: str) -> list[dict[str, object]]:
    """Four steps of SGD on two parameters; before step 2 the optimizer's parameters change as ``change`` says."""
    g = torch.Generator().manual_seed(11)
    a, b, c = (torch.nn.Parameter(torch.randn(n, generator=g).to(device)) for n in (10, 20, 20))
    opt = torch.optim.SGD([a, b], lr=0.1)
    records = []
    for step in range(4):
        if step == 2:
            if change == "add_param_group":
                opt.add_param_group({"params": [c]})
            elif change == "replace_param_in_place":  # same list object, same length
                opt.param_groups[0]["params"][1] = c
            elif change == "replace_params_list":
                opt.param_groups[0]["params"] = [a, c]
            elif change == "param_data_to_bfloat16":
                b.data = b.data.to(torch.bfloat16)
            elif change == "param_data_resized":
                b.data = torch.randn(40, generator=g).to(device)
        opt.zero_grad(set_to_none=True)
        for p in (a, b, c):
            p.grad = scaler.scale((torch.randn(p.shape, generator=g) * 0.1).to(device=device, dtype=p.dtype))
        if step == 3:
            set_flat(opt_params(opt)[-1].grad, opt_params(opt)[-1].numel() - 1, INF)
        scaler.step(opt)
        scaler.update()
        rec = {f"param{i}": p.detach().clone() for i, p in enumerate((a, b, c))}
        rec.update({f"grad{i}": p.grad.detach().clone() for i, p in enumerate((a, b, c))})
        rec["get_scale"] = scaler.get_scale()
        records.append(rec)
    return records


PARAM_GROUP_CHANGES = [
    "add_param_group",
    "replace_param_in_place",
    "replace_params_list",
    "param_data_to_bfloat16",
    "param_data_resized",
]


@pytest.mark.parametrize("change", PARAM_GROUP_CHANGES)
def test_optimizer_parameter_changes_mid_run_match_stock(device, change):
    """Any cached view of the optimizer's gradients must follow changes to its parameters, as stock (which looks at
    ``param_groups`` afresh every step) does."""
    if device == "cuda" and change == "param_data_to_bfloat16":
        pytest.skip("torch.amp.GradScaler refuses bf16 gradients on CUDA: nothing to compare with")
    expected = _param_group_run(Stock(device, init_scale=2.0**10), device, change)
    actual = _param_group_run(FusedGradScaler(device, init_scale=2.0**10), device, change)
    assert_same_trajectory(actual, expected)


# Every backend (``backend=`` is an implementation extra, not part of the stock signature) against stock: short runs
# that still cross the chunk size, skip, grow, clip, and take both the ordinary and the fused-optimizer path.
BACKEND_SCENARIOS = {
    "sgd-synthetic-clip": Scenario(("sgd",), clip=1.0, steps=8, inject={2: "first", 5: "last+middle"}),
    "adamw_fused-synthetic": Scenario(("adamw_fused",), steps=8, inject={2: "middle", 5: "first"}),
}
CLIP_BACKEND_SCENARIO = Scenario(("sgd", "adamw_fused"), clip=1.0, steps=8, inject={2: "first", 5: "last"})


def _ours_on_backend(device: str, backend: str, **kw) -> FusedGradScaler:
    if "backend" not in inspect.signature(FusedGradScaler.__init__).parameters:
        pytest.skip("FusedGradScaler has no backend= argument")
    reason = ampkernels.dispatch.why_not("unscale_reduce_", backend, device)
    if reason is not None:
        pytest.skip(f"backend {backend!r} unavailable on {device}: {reason}")
    return FusedGradScaler(device, backend=backend, **kw)


@pytest.mark.parametrize("backend", ["native", "triton", "torch"])
@pytest.mark.parametrize("name", list(BACKEND_SCENARIOS))
def test_every_backend_matches_stock_bitwise(device, backend, name):
    sc = BACKEND_SCENARIOS[name]
    expected = train(stock_factory(device, **sc.scaler_kwargs), device, sc)
    actual = train(_ours_on_backend(device, backend, **sc.scaler_kwargs), device, sc)
    assert_same_trajectory(actual, expected)


@pytest.mark.parametrize("backend", ["native", "triton", "torch"])
def test_every_backend_clip_grad_norm_matches_stock_recipe(device, backend):
    sc = CLIP_BACKEND_SCENARIO
    expected = train(stock_factory(device, **sc.scaler_kwargs), device, sc)
    actual = train(_ours_on_backend(device, backend, **sc.scaler_kwargs), device, sc, clip_api=True)
    assert_same_trajectory(actual, expected, rtol=1e-6, atol=1e-7)


SETTER_SCENARIO = Scenario(
    ("sgd",),
    "mlp",
    actions={
        6: ("set_growth_interval", 1),
        8: ("set_growth_factor", 4.0),
        10: ("set_backoff_factor", 0.25),
        12: ("update", 3000.0),  # update(new_scale=float): not a power of two
        16: ("update", "tensor"),  # update(new_scale=0-d tensor on the device)
    },
)


def test_setters_and_manual_update_mid_run_match_stock(device):
    expected = train(stock_factory(device, **SETTER_SCENARIO.scaler_kwargs), device, SETTER_SCENARIO)
    actual = train(ours_factory(device, **SETTER_SCENARIO.scaler_kwargs), device, SETTER_SCENARIO)
    assert_same_trajectory(actual, expected)
    assert expected[12]["get_scale"] == 3000.0


def test_non_power_of_two_scale_and_factors_match_stock(device):
    # The contract promises bitwise grads only for power-of-two scales; scale/tracker/skips must still be exact.
    kw = {"init_scale": 1000.0, "growth_factor": 1.5, "backoff_factor": 0.7, "growth_interval": 2}
    sc = Scenario(("sgd",), "mlp", scaler_kwargs=kw)
    expected = train(stock_factory(device, **kw), device, sc)
    actual = train(ours_factory(device, **kw), device, sc)
    for step, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert {k: v for k, v in a.items() if not isinstance(v, torch.Tensor)} == {
            k: v for k, v in e.items() if not isinstance(v, torch.Tensor)
        }, f"step {step}"
    assert_same_trajectory(actual, expected, rtol=1e-6, atol=1e-8)


def test_scale_of_tensors_and_nested_sequences_matches_stock(device):
    g = torch.Generator().manual_seed(1)
    a, b, c = (torch.randn(3, generator=g).to(device=device, dtype=d) for d in LOW_PRECISION)
    ours, stock = FusedGradScaler(device, init_scale=3.0 * 2**10), Stock(device, init_scale=3.0 * 2**10)

    assert_bitwise_equal(ours.scale(a), stock.scale(a), "scale(tensor)")
    assert ours.scale(b).dtype == stock.scale(b).dtype == torch.float16
    o_out, s_out = ours.scale([a, (b, [c])]), stock.scale([a, (b, [c])])
    assert type(o_out) is list and type(o_out[1]) is tuple and type(o_out[1][1]) is list
    for o, s, what in (
        (o_out[0], s_out[0], "a"),
        (o_out[1][0], s_out[1][0], "b"),
        (o_out[1][1][0], s_out[1][1][0], "c"),
    ):
        assert_bitwise_equal(o, s, f"scale(nested) {what}")
    o_gen, s_gen = list(ours.scale(t for t in (a, c))), list(stock.scale(t for t in (a, c)))
    assert len(o_gen) == len(s_gen) == 2
    for o, s in zip(o_gen, s_gen, strict=True):
        assert_bitwise_equal(o, s, "scale(generator)")


class _SGDReturningTag(torch.optim.SGD):
    def step(self, closure=None, *, tag=None):
        super().step(closure)
        return ("stepped", tag)


def test_step_forwards_arguments_and_returns_optimizer_result_like_stock(device):
    def run(cls, poisoned):
        p = torch.nn.Parameter(torch.randn(4, device=device))
        scaler = cls(device, init_scale=2.0**8)
        p.grad = scaler.scale(torch.randn(4, device=device))
        if poisoned:
            p.grad[1] = INF
        return scaler.step(_SGDReturningTag([p], lr=0.1), tag="x")

    assert run(FusedGradScaler, False) == run(Stock, False) == ("stepped", "x")
    assert run(FusedGradScaler, True) is run(Stock, True) is None


# ----------------------------------------------------------------------------------------------------------------
# API surface: same class hierarchy, constructor, errors as stock
# ----------------------------------------------------------------------------------------------------------------


def test_is_a_subclass_of_stock_grad_scaler():
    assert issubclass(FusedGradScaler, torch.amp.GradScaler)
    assert isinstance(FusedGradScaler("cpu"), torch.amp.GradScaler)


def test_constructor_signature_extends_stock_with_keyword_only_extras():
    stock = inspect.signature(Stock.__init__).parameters
    ours = inspect.signature(FusedGradScaler.__init__).parameters
    assert list(ours)[: len(stock)] == list(stock)
    for name, p in stock.items():
        assert (ours[name].kind, ours[name].default) == (p.kind, p.default), name
    extras = {"hysteresis": 1, "min_scale": None, "max_scale": None, "telemetry": False, "history_size": 1024}
    for name, default in extras.items():
        assert ours[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert ours[name].default == default, name


def test_getters_setters_and_defaults_match_stock(device):
    ours, stock = FusedGradScaler(device), Stock(device)
    for getter in ("get_scale", "get_growth_factor", "get_backoff_factor", "get_growth_interval", "is_enabled"):
        assert getattr(ours, getter)() == getattr(stock, getter)(), getter
    ours.set_growth_factor(3.0)
    ours.set_backoff_factor(0.125)
    ours.set_growth_interval(17)
    assert (ours.get_growth_factor(), ours.get_backoff_factor(), ours.get_growth_interval()) == (3.0, 0.125, 17)
    sd = ours.state_dict()
    assert (sd["growth_factor"], sd["backoff_factor"], sd["growth_interval"]) == (3.0, 0.125, 17)


def test_default_cuda_device_behaves_like_stock():
    """``device="cuda"`` (the default) without CUDA: stock warns and disables itself; ours must do the same."""
    with warnings.catch_warnings(record=True) as w_stock:
        warnings.simplefilter("always")
        stock = Stock()
    with warnings.catch_warnings(record=True) as w_ours:
        warnings.simplefilter("always")
        ours = FusedGradScaler()
    assert ours.is_enabled() == stock.is_enabled()
    assert [type(w.message) for w in w_ours] == [type(w.message) for w in w_stock]


def _misuse_setup(scaler_cls, device, optimizer="sgd", scaled=True):
    g = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in ((3, 4), (5,))]
    opt = make_optimizer(optimizer, params)
    scaler = scaler_cls(device, init_scale=2.0**8)
    loss = sum((p * p).sum() for p in params)
    (scaler.scale(loss) if scaled else loss).backward()
    return scaler, opt


MISUSES = {
    "step_with_closure_kwarg": lambda s, o, d: s.step(o, closure=lambda: 0.0),
    "step_twice": lambda s, o, d: (s.step(o), s.step(o)),
    "unscale_twice": lambda s, o, d: (s.unscale_(o), s.unscale_(o)),
    "unscale_after_step": lambda s, o, d: (s.step(o), s.unscale_(o)),
    "update_without_step": lambda s, o, d: s.update(),
    "update_with_two_element_tensor": lambda s, o, d: (s.step(o), s.update(torch.ones(2, device=d))),
    "update_with_requires_grad_tensor": lambda s, o, d: (
        s.step(o),
        s.update(torch.ones((), device=d, requires_grad=True)),
    ),
    "load_empty_state_dict": lambda s, o, d: s.load_state_dict({}),
    "pickle_between_step_and_update": lambda s, o, d: (s.step(o), pickle.dumps(s)),
}


# step() takes another path for optimizers with _step_supports_amp_scaling (torch fused AdamW): check those too.
MISUSE_CASES = [(m, "sgd") for m in MISUSES] + [
    (m, "adamw_fused") for m in ("step_with_closure_kwarg", "step_twice", "unscale_after_step")
]


@pytest.mark.parametrize(("misuse", "optimizer"), MISUSE_CASES, ids=[f"{m}-{o}" for m, o in MISUSE_CASES])
def test_misuse_raises_same_error_as_stock(device, misuse, optimizer):
    expected = error_of(lambda: MISUSES[misuse](*_misuse_setup(Stock, device, optimizer), device))
    actual = error_of(lambda: MISUSES[misuse](*_misuse_setup(FusedGradScaler, device, optimizer), device))
    assert_same_error(actual, expected)


def test_step_before_scale_raises_same_error_as_stock(device):
    expected = error_of(lambda: (lambda s, o: s.step(o))(*_misuse_setup(Stock, device, scaled=False)))
    actual = error_of(lambda: (lambda s, o: s.step(o))(*_misuse_setup(FusedGradScaler, device, scaled=False)))
    assert_same_error(actual, expected)


@pytest.mark.parametrize("kwargs", [{"growth_factor": 1.0}, {"backoff_factor": 1.0}], ids=["growth1", "backoff1"])
def test_bad_factors_raise_same_error_as_stock(device, kwargs):
    assert_same_error(error_of(lambda: FusedGradScaler(device, **kwargs)), error_of(lambda: Stock(device, **kwargs)))


@pytest.mark.parametrize("init_scale", [0.0, -0.0, -1.0, INF, -INF, math.nan])
def test_invalid_init_scale_raises_value_error(device, init_scale):
    with pytest.raises(ValueError, match="init_scale"):
        FusedGradScaler(device, init_scale=init_scale)


# ----------------------------------------------------------------------------------------------------------------
# state_dict and pickling
# ----------------------------------------------------------------------------------------------------------------

CONTINUE = Scenario(("adam_foreach",), "mlp", steps=8, inject={2: "middle"})
WARMUP = Scenario(("sgd",), "mlp", steps=7, inject={1: "first", 5: "last"})


def _through_torch_save(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("destination_state", ["fresh", "already_used"])
@pytest.mark.parametrize("direction", ["stock_to_ours", "ours_to_stock"])
def test_state_dict_interoperates_with_stock(device, direction, destination_state):
    src_cls, dst_cls = (Stock, FusedGradScaler) if direction == "stock_to_ours" else (FusedGradScaler, Stock)
    source = src_cls(device, init_scale=2.0**9, growth_interval=3)
    train(source, device, WARMUP, seed=1)
    sd = _through_torch_save(source.state_dict())  # checkpoints must load with weights_only=True
    assert sd["_growth_tracker"] != 0 and sd["scale"] != 2.0**9, "warm-up should leave a non-trivial state"

    def loaded(cls):
        scaler = cls(device, init_scale=2.0**3, growth_interval=50, growth_factor=8.0)
        if destination_state == "already_used":
            train(scaler, device, Scenario(("sgd",), "mlp", steps=2, inject={}), seed=2)
        scaler.load_state_dict(sd)
        return scaler

    dst, reference = loaded(dst_cls), loaded(Stock)
    assert {k: dst.state_dict()[k] for k in STOCK_KEYS} == {k: sd[k] for k in STOCK_KEYS}
    assert_same_trajectory(train(dst, device, CONTINUE, seed=3), train(reference, device, CONTINUE, seed=3))


@pytest.mark.parametrize("key", STOCK_KEYS)
def test_load_state_dict_with_missing_key_names_the_key(device, key):
    source = FusedGradScaler(device, init_scale=2.0**9, growth_interval=3)
    train(source, device, Scenario(("sgd",), "mlp", steps=2, inject={}))
    sd = dict(source.state_dict())
    del sd[key]
    with pytest.raises((KeyError, TypeError, ValueError), match=key_pattern(key)):
        FusedGradScaler(device).load_state_dict(sd)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("scale", "big"),
        ("growth_factor", [2.0]),
        ("backoff_factor", "half"),
        ("growth_interval", "3"),
        ("_growth_tracker", None),
    ],
)
def test_load_state_dict_with_wrong_type_names_the_key(device, key, value):
    sd = dict(FusedGradScaler(device, init_scale=2.0**9).state_dict())
    sd[key] = value
    with pytest.raises((KeyError, TypeError, ValueError), match=key_pattern(key)):
        FusedGradScaler(device).load_state_dict(sd)


def test_state_dict_round_trip_keeps_hysteresis_progress(device):
    """One overflow absorbed by hysteresis=2 before the checkpoint: the first overflow after loading backs off."""
    src = FusedGradScaler(device, init_scale=2.0**10, growth_interval=100, hysteresis=2)
    drive(src, device, "o")
    assert src.get_scale() == 2.0**10
    dst = FusedGradScaler(device, init_scale=2.0**10, growth_interval=100, hysteresis=2)
    dst.load_state_dict(_through_torch_save(src.state_dict()))
    assert drive(dst, device, "o")[0] == [2.0**9]


def test_pickle_fresh_scaler_round_trips(device):
    kw = {"init_scale": 2.0**7, "growth_factor": 4.0, "backoff_factor": 0.25, "growth_interval": 5}
    ours = FusedGradScaler(device, **kw, hysteresis=2, min_scale=1.0, max_scale=2.0**20)
    copy = pickle.loads(pickle.dumps(ours))
    assert type(copy) is FusedGradScaler
    assert copy.get_scale() == 2.0**7 and copy.is_enabled()
    assert (copy.get_growth_factor(), copy.get_backoff_factor(), copy.get_growth_interval()) == (4.0, 0.25, 5)
    assert drive(copy, device, "oo") == drive(ours, device, "oo")


def test_pickled_scaler_continues_like_the_original(device):
    ours = FusedGradScaler(device, init_scale=2.0**9, growth_interval=3)
    train(ours, device, WARMUP, seed=1)
    copy = pickle.loads(pickle.dumps(ours))
    assert_same_trajectory(train(copy, device, CONTINUE, seed=3), train(ours, device, CONTINUE, seed=3))


# ----------------------------------------------------------------------------------------------------------------
# disabled scaler
# ----------------------------------------------------------------------------------------------------------------


def test_disabled_scaler_behaves_like_stock_disabled(device):
    ours, stock = FusedGradScaler(device, enabled=False), Stock(device, enabled=False)
    assert not ours.is_enabled()
    assert ours.get_scale() == stock.get_scale() == 1.0
    assert ours.state_dict() == stock.state_dict() == {}
    ours.load_state_dict({"scale": 5.0})  # a no-op, as stock
    x = torch.randn(3, device=device)
    assert ours.scale(x) is x
    outs = [x, (x,)]
    assert ours.scale(outs) is outs
    p = torch.nn.Parameter(torch.randn(4, device=device))
    p.grad = torch.randn(4, device=device)
    opt = torch.optim.SGD([p], lr=0.1)
    assert ours.unscale_(opt) is None
    assert ours.step(opt, closure=lambda: 7.0) == stock.step(opt, closure=lambda: 7.0) == 7.0
    ours.update()
    sc = Scenario(("adam_foreach",), "mlp", steps=6, inject={})
    assert_same_trajectory(train(ours, device, sc), train(stock, device, sc))


# ----------------------------------------------------------------------------------------------------------------
# fp16 / bf16 / fp32 gradients, chunk boundaries, zero-size, sparse, complex
# ----------------------------------------------------------------------------------------------------------------

LOW_PRECISION = [torch.float32, torch.float16, torch.bfloat16]


def _params_with_scaled_grads(device, scaler, specs, seed=0):
    """specs: [(shape, dtype)]; grads are raw random values * scale, stored in the parameter's dtype."""
    g = torch.Generator().manual_seed(seed)
    params = []
    for shape, dtype in specs:
        p = torch.nn.Parameter(torch.randn(shape, generator=g).to(device=device, dtype=dtype))
        raw = (torch.randn(shape, generator=g) * 0.01).to(device)
        p.grad = scaler.scale(raw).to(dtype)
        params.append(p)
    return params


def _ours_with_scale(device, scale: float, **kw) -> FusedGradScaler:
    scaler = FusedGradScaler(device, init_scale=2.0**12, **kw)
    scaler.scale(torch.ones((), device=device))
    if scale != 2.0**12:
        scaler.update(scale)
    assert scaler.get_scale() == scale
    return scaler


@pytest.mark.parametrize("scale", [2.0**12, 3000.0], ids=["pow2", "not_pow2"])
def test_unscale_mixed_fp32_fp16_bf16_grads_matches_manual_reference(device, scale):
    scaler = _ours_with_scale(device, scale)
    shapes = [(5,), (3, 7), (CHUNK + 1,), (0,), (2, 2, 2)]
    specs = [(s, LOW_PRECISION[i % 3]) for i, s in enumerate(shapes * 3)]  # dtypes interleaved in one optimizer
    params = _params_with_scaled_grads(device, scaler, specs)
    before = [p.detach().clone() for p in params]
    expected = [unscaled_reference(p.grad, scale) for p in params]
    opt = torch.optim.SGD(params, lr=10.0)  # large enough to move every bf16/fp16 parameter
    scaler.unscale_(opt)
    for i, (p, e) in enumerate(zip(params, expected, strict=True)):
        assert_bitwise_equal(p.grad, e, f"grad {i} ({p.dtype}, {tuple(p.shape)})")
    scaler.step(opt)
    scaler.update()
    assert all(not torch.equal(b, p) for b, p in zip(before, params, strict=True) if p.numel()), (
        "a finite step was skipped"
    )
    assert scaler.get_scale() == scale


@pytest.mark.parametrize("value", [INF, -INF, math.nan])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_nonfinite_low_precision_grad_skips_step_and_backs_off(device, dtype, value):
    scaler = _ours_with_scale(device, 2.0**12)
    params = _params_with_scaled_grads(device, scaler, [((9,), torch.float32), ((6, 5), dtype), ((4,), torch.float32)])
    set_flat(params[1].grad, 29, value)
    before = [p.detach().clone() for p in params]
    opt = torch.optim.SGD(params, lr=0.1)
    scaler.step(opt)
    scaler.update()
    for b, p in zip(before, params, strict=True):
        assert_bitwise_equal(p, b, "parameter after a skipped step")
    assert scaler.get_scale() == 2.0**11


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_unscale_across_chunk_boundaries_with_nonfinite_at_first_middle_last(device, dtype):
    """apex-style fuzz: sizes below/at/above the chunk size; inf at the first element of the first tensor, NaN in
    the middle one, -inf at the last element of the last tensor; every other element unscaled exactly."""
    sizes = [1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 5, 17]
    scaler = _ours_with_scale(device, 2.0**6)
    params = _params_with_scaled_grads(device, scaler, [((n,), dtype) for n in sizes], seed=5)
    set_flat(params[0].grad, 0, INF)
    set_flat(params[len(params) // 2].grad, sizes[len(params) // 2] // 2, math.nan)
    set_flat(params[-1].grad, sizes[-1] - 1, -INF)
    expected = [unscaled_reference(p.grad, 2.0**6) for p in params]
    before = [p.detach().clone() for p in params]
    opt = torch.optim.SGD(params, lr=0.1)
    scaler.unscale_(opt)
    for i, (p, e) in enumerate(zip(params, expected, strict=True)):
        assert_bitwise_equal(p.grad, e, f"grad {i} of {p.numel()} elements")
    scaler.step(opt)
    scaler.update()
    for b, p in zip(before, params, strict=True):
        assert_bitwise_equal(p, b, "parameter after a skipped step")
    assert scaler.get_scale() == 2.0**5


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_single_nonfinite_value_is_found_wherever_it_is(device, where):
    sc = Scenario(("sgd",), steps=3, inject={1: where})
    assert_same_trajectory(
        train(ours_factory(device, **sc.scaler_kwargs), device, sc),
        train(stock_factory(device, **sc.scaler_kwargs), device, sc),
    )


def test_zero_size_parameters_only(device):
    def run(scaler):
        params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in ((0,), (3, 0), (0, 2, 2))]
        for p in params:
            p.grad = torch.randn(p.shape, device=device)
        opt = torch.optim.AdamW(params, lr=1e-2)
        scaler.scale(torch.ones((), device=device))
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        return scaler.state_dict()

    ours = run(FusedGradScaler(device, growth_interval=1))
    stock = run(Stock(device, growth_interval=1))
    assert {k: ours[k] for k in STOCK_KEYS} == stock


def test_clip_grad_norm_of_zero_size_parameters_is_zero(device):
    params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in ((0,), (3, 0))]
    for p in params:
        p.grad = torch.randn(p.shape, device=device)
    scaler = _ours_with_scale(device, 2.0**12)
    norm = scaler.clip_grad_norm_(torch.optim.SGD(params, lr=0.1), 1.0)
    assert norm.item() == 0.0


def test_sparse_gradient_unscaled_like_stock_or_rejected_clearly(device):
    def setup(cls):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(4)
            emb = torch.nn.Embedding(50, 6, sparse=True).to(device)
        scaler = cls(device, init_scale=2.0**10, growth_interval=1)
        idx = torch.tensor([1, 7, 7, 49, 0], device=device)
        scaler.scale(emb(idx).pow(2).sum()).backward()
        return scaler, emb, torch.optim.SGD(emb.parameters(), lr=0.1)

    stock, s_emb, s_opt = setup(Stock)
    ours, o_emb, o_opt = setup(FusedGradScaler)
    stock.unscale_(s_opt)
    try:
        ours.unscale_(o_opt)
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as exc:
        assert re.search(r"(?i)sparse", str(exc)), f"unclear error for a sparse gradient: {exc}"
        return
    assert o_emb.weight.grad.is_sparse
    assert_bitwise_equal(o_emb.weight.grad.to_dense(), s_emb.weight.grad.to_dense(), "unscaled sparse grad")
    for scaler, opt in ((stock, s_opt), (ours, o_opt)):
        scaler.step(opt)
        scaler.update()
    assert_bitwise_equal(o_emb.weight, s_emb.weight, "embedding after step")
    assert ours.get_scale() == stock.get_scale()


@pytest.mark.parametrize("entry", ["unscale_", "step", "clip_grad_norm_"])
def test_complex_gradient_raises_error_naming_the_dtype(device, entry):
    p = torch.nn.Parameter(torch.randn(4, dtype=torch.complex64, device=device))
    p.grad = torch.randn(4, dtype=torch.complex64, device=device)
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = _ours_with_scale(device, 2.0**12)
    call = {
        "unscale_": lambda: scaler.unscale_(opt),
        "step": lambda: scaler.step(opt),
        "clip_grad_norm_": lambda: scaler.clip_grad_norm_(opt, 1.0),
    }[entry]
    with pytest.raises((TypeError, ValueError, RuntimeError, NotImplementedError), match=r"(?i)complex"):
        call()


# ----------------------------------------------------------------------------------------------------------------
# extra: clip_grad_norm_
# ----------------------------------------------------------------------------------------------------------------

CLIP_SCENARIOS = {
    "sgd-synthetic-l2": Scenario(("sgd",), clip=1.0),
    "sgd-mlp-inf": Scenario(("sgd",), "mlp", clip=0.02, norm_type=INF),
    "sgd-mlp-l1-fallback": Scenario(("sgd",), "mlp", clip=0.5, norm_type=1.0, steps=10),
    "adam_foreach-synthetic-l2-accumulate2": Scenario(("adam_foreach",), clip=1.0, micro_batches=2),
    "sgd-flat_grad_buffer-l2": Scenario(("sgd",), clip=1.0, grad_layout="flat_buffer", set_to_none=False),
    "adamw_fused-synthetic-l2": Scenario(("adamw_fused",), clip=1.0),
    "adamw_fused-mlp-inf": Scenario(("adamw_fused",), "mlp", clip=0.02, norm_type=INF),
    "two_optimizers-sgd+adamw_fused-mlp-l2": Scenario(("sgd", "adamw_fused"), "mlp", clip=0.05),
}


@pytest.mark.parametrize("name", list(CLIP_SCENARIOS))
def test_clip_grad_norm_matches_stock_unscale_then_clip_recipe(device, name):
    sc = CLIP_SCENARIOS[name]
    expected = train(stock_factory(device, **sc.scaler_kwargs), device, sc)
    assert_scenario_exercised(expected, sc)
    norms = [r[k].item() for r in expected for k in r if k.startswith("norm") and torch.isfinite(r[k])]
    assert any(n > sc.clip for n in norms), "max_norm too large: clipping never happened"
    actual = train(ours_factory(device, **sc.scaler_kwargs), device, sc, clip_api=True)
    assert_same_trajectory(actual, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("optimizer", ["sgd", "adam_foreach", "adamw_fused"])
def test_unscale_after_clip_grad_norm_raises_like_second_unscale(device, optimizer):
    expected = error_of(lambda: (lambda s, o: (s.unscale_(o), s.unscale_(o)))(*_misuse_setup(Stock, device)))
    scaler, opt = _misuse_setup(FusedGradScaler, device, optimizer)
    scaler.clip_grad_norm_(opt, 1.0)
    assert_same_error(error_of(lambda: scaler.unscale_(opt)), expected)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return abs(x.double().item() - ref.double().item()) / abs(ref.double().item())


def test_clip_grad_norm_of_mixed_precision_grads_matches_reference(device):
    """The norm of unscaled fp16/fp32/bf16 grads: its error against float64 at most 2x that of torch's float32 norm
    (or NORM_RTOL_FLOOR); the grads unscaled and multiplied by the coefficient of the returned norm in place."""
    specs = [((300,), torch.float16), ((17, 3), torch.float32), ((CHUNK + 7,), torch.bfloat16)]
    scaler = _ours_with_scale(device, 2.0**10)
    params = _params_with_scaled_grads(device, scaler, specs, seed=9)
    unscaled = [unscaled_reference(p.grad, 2.0**10) for p in params]
    want_l2 = torch.stack([u.double().pow(2).sum() for u in unscaled]).sum().sqrt()
    torch_fp32 = torch.nn.utils.get_total_norm([u.float() for u in unscaled])
    norm = scaler.clip_grad_norm_(torch.optim.SGD(params, lr=0.1), 0.1)
    assert rel_err(norm, want_l2) <= max(2 * rel_err(torch_fp32, want_l2), NORM_RTOL_FLOOR), (norm, want_l2, torch_fp32)
    coef = 0.1 / (norm.double().cpu() + 1e-6)
    for p, u in zip(params, unscaled, strict=True):  # 1 ulp of the grad's dtype allowed (fp16 subnormals: absolute)
        rtol, atol = {torch.float32: (1e-6, 0.0), torch.float16: (1e-3, 2.0**-24), torch.bfloat16: (8e-3, 0.0)}[p.dtype]
        want = (u.double() * coef).to(p.dtype).double()
        torch.testing.assert_close(
            p.grad.double().cpu(), want, rtol=rtol, atol=atol, msg=lambda m, d=p.dtype: f"{d}: {m}"
        )

    want_inf = torch.stack([u.float().abs().max() for u in unscaled]).max()
    scaler2 = _ours_with_scale(device, 2.0**10)
    params2 = _params_with_scaled_grads(device, scaler2, specs, seed=9)
    norm_inf = scaler2.clip_grad_norm_(torch.optim.SGD(params2, lr=0.1), 1e9, norm_type=INF)
    assert norm_inf.item() == want_inf.item()  # a max is exact


# ----------------------------------------------------------------------------------------------------------------
# extras: hysteresis, scale bounds, telemetry
# ----------------------------------------------------------------------------------------------------------------


def drive(scaler, device: str, pattern: str) -> tuple[list[float], list[bool]]:
    """One step per character of ``pattern`` ('o': overflow, '.': finite grads); returns (scales, skipped)."""
    p = torch.nn.Parameter(torch.randn(5, device=device))
    opt = torch.optim.SGD([p], lr=0.1)
    scales, skipped = [], []
    for i, c in enumerate(pattern):
        raw = torch.randn(5, generator=torch.Generator().manual_seed(i)).to(device) * 0.01
        p.grad = scaler.scale(raw)
        if c == "o":
            p.grad[2] = INF
        before = p.detach().clone()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        skipped.append(torch.equal(before, p.detach()))
    return scales, skipped


def expected_scales(pattern, init, growth_interval, hysteresis=1, factor=2.0, backoff=0.5, lo=FLOAT32_TINY, hi=INF):
    """The contract's update rule, written out in Python (Megatron-LM hysteresis, clamped to [lo, hi])."""
    scale, tracker, hyst, out = init, 0, hysteresis, []
    for c in pattern:
        if c == "o":
            tracker, hyst = 0, hyst - 1
            if hyst <= 0:
                scale = max(scale * backoff, lo)
        else:
            tracker += 1
            if tracker == growth_interval:
                if math.isfinite(scale * factor):
                    scale = min(scale * factor, hi)
                tracker, hyst = 0, hysteresis
        out.append(scale)
    return out


def test_hysteresis_2_backs_off_on_second_overflow_since_growth(device):
    scaler = FusedGradScaler(device, init_scale=1024.0, growth_interval=3, hysteresis=2)
    scales, skipped = drive(scaler, device, "oo...o.oo")
    assert scales == [1024, 512, 512, 512, 1024, 1024, 1024, 512, 256]
    assert skipped == [c == "o" for c in "oo...o.oo"], "an overflow absorbed by hysteresis must still skip the step"


def test_hysteresis_is_not_reset_by_finite_steps_without_growth(device):
    scaler = FusedGradScaler(device, init_scale=1024.0, growth_interval=2, hysteresis=3)
    assert drive(scaler, device, "o.o.o..o")[0] == [1024, 1024, 1024, 1024, 512, 512, 1024, 1024]


def test_hysteresis_random_pattern_follows_megatron_rule(device):
    pattern = "".join("o" if b else "." for b in (torch.rand(40, generator=torch.Generator().manual_seed(0)) < 0.35))
    scaler = FusedGradScaler(device, init_scale=2.0**12, growth_interval=2, hysteresis=2)
    scales, skipped = drive(scaler, device, pattern)
    assert scales == expected_scales(pattern, 2.0**12, 2, hysteresis=2)
    assert skipped == [c == "o" for c in pattern]


def test_max_scale_clamps_growth(device):
    scaler = FusedGradScaler(device, init_scale=1024.0, growth_interval=1, max_scale=3000.0)
    assert drive(scaler, device, "...o..")[0] == [2048, 3000, 3000, 1500, 3000, 3000]


def test_min_scale_clamps_backoff(device):
    scaler = FusedGradScaler(device, init_scale=1024.0, growth_interval=2, min_scale=256.0)
    assert drive(scaler, device, "oooo..")[0] == [512, 256, 256, 256, 256, 512]


def test_scale_never_drops_below_smallest_normal_float32_by_default(device):
    pattern = "oooooo."
    ours = drive(FusedGradScaler(device, init_scale=2.0**-123, growth_interval=1), device, pattern)[0]
    stock = drive(Stock(device, init_scale=2.0**-123, growth_interval=1), device, pattern)[0]
    assert ours == [2.0**-124, 2.0**-125, 2.0**-126, 2.0**-126, 2.0**-126, 2.0**-126, 2.0**-125]
    assert stock[:3] == ours[:3] and stock[3] == 2.0**-127, "stock goes on below 2**-126"


@pytest.mark.parametrize("history_size", [4, 1024])
def test_telemetry_reports_history_and_counters(device, history_size):
    pattern = "..o..o."
    scaler = FusedGradScaler(device, init_scale=1024.0, growth_interval=2, telemetry=True, history_size=history_size)
    scales, _ = drive(scaler, device, pattern)
    t = scaler.telemetry()
    assert set(t) >= {"scale_history", "updates", "skipped_steps", "last_grad_norm"}
    assert isinstance(t["scale_history"], list) and all(isinstance(s, float) for s in t["scale_history"])
    assert t["scale_history"] == scales[-history_size:]
    assert (t["updates"], t["skipped_steps"]) == (7, 2)
    assert isinstance(t["updates"], int) and isinstance(t["skipped_steps"], int)
    assert t["last_grad_norm"] is None, "no norm was measured (clip_grad_norm_ never called)"


def test_telemetry_last_grad_norm_is_the_clip_norm(device):
    scaler, opt = _misuse_setup(lambda d, **kw: FusedGradScaler(d, telemetry=True, **kw), device)
    norm = scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    scaler.update()
    last = scaler.telemetry()["last_grad_norm"]
    assert isinstance(last, float) and last == pytest.approx(norm.item(), rel=1e-6)


def test_plot_scale_history_writes_png(device, tmp_path):
    pytest.importorskip("matplotlib")
    scaler = FusedGradScaler(device, init_scale=1024.0, growth_interval=2, telemetry=True)
    drive(scaler, device, "..o..")
    path = tmp_path / "scale.png"
    ampkernels.plot_scale_history(scaler, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_step_hands_itself_to_an_optimizer_that_takes_grad_scaler():
    """The deprecated protocol, as stock: a FutureWarning, then step(grad_scaler=scaler), on every step (the
    signature check is cached per step function)."""

    class Legacy(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure=None, grad_scaler=None):
            self.seen = grad_scaler
            grad_scaler._check_inf_per_device(self)  # what such an optimizer does itself

    for scaler in (torch.amp.GradScaler("cpu"), FusedGradScaler("cpu")):
        p = torch.nn.Parameter(torch.randn(4))
        opt = Legacy([p], lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            scaler.scale(p.sum()).backward()
            with pytest.warns(FutureWarning, match="stop passing itself"):
                scaler.step(opt)
            assert opt.seen is scaler
            scaler.update()
