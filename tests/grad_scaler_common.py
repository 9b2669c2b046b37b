"""Helpers shared by the FusedGradScaler tests: bitwise comparisons, the synthetic and MLP problems, optimizers by
name, and the differential training loop that runs a scaler through a scenario and records every step."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F
from tolerances import NORM_RTOL_FLOOR  # noqa: F401  (re-exported to the scaler tests)

from ampkernels import FusedGradScaler

Stock = torch.amp.GradScaler
STOCK_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
INF = math.inf
FLOAT32_TINY = 2.0**-126
CHUNK = 65536  # the multi-tensor chunk size of dev/design.md: sizes around it are the interesting ones

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


def misuse_setup(scaler_cls, device, optimizer="sgd", scaled=True):
    g = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in ((3, 4), (5,))]
    opt = make_optimizer(optimizer, params)
    scaler = scaler_cls(device, init_scale=2.0**8)
    loss = sum((p * p).sum() for p in params)
    (scaler.scale(loss) if scaled else loss).backward()
    return scaler, opt


def ours_with_scale(device, scale: float, **kw) -> FusedGradScaler:
    scaler = FusedGradScaler(device, init_scale=2.0**12, **kw)
    scaler.scale(torch.ones((), device=device))
    if scale != 2.0**12:
        scaler.update(scale)
    assert scaler.get_scale() == scale
    return scaler


def params_with_scaled_grads(device, scaler, specs, seed=0):
    """specs: [(shape, dtype)]; grads are raw random values * scale, stored in the parameter's dtype."""
    g = torch.Generator().manual_seed(seed)
    params = []
    for shape, dtype in specs:
        p = torch.nn.Parameter(torch.randn(shape, generator=g).to(device=device, dtype=dtype))
        raw = (torch.randn(shape, generator=g) * 0.01).to(device)
        p.grad = scaler.scale(raw).to(dtype)
        params.append(p)
    return params


LOW_PRECISION = [torch.float32, torch.float16, torch.bfloat16]


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
