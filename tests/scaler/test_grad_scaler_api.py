"""FusedGradScaler's API against the stock scaler's: class hierarchy, constructor, getters and setters, the errors
of every misuse (the same type and message as stock), the disabled scaler, the deprecated protocol of optimizers
that take ``grad_scaler``, and the checks of the extras' arguments.
"""

from __future__ import annotations

import inspect
import math
import pickle
import warnings

import pytest
import torch
from grad_scaler_common import (
    INF,
    Scenario,
    Stock,
    assert_bitwise_equal,
    assert_same_error,
    assert_same_trajectory,
    error_of,
    fused_adamw_supported,
    make_optimizer,
    misuse_setup,
    train,
)

from ampkernels import FusedGradScaler


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
    expected = error_of(lambda: MISUSES[misuse](*misuse_setup(Stock, device, optimizer), device))
    actual = error_of(lambda: MISUSES[misuse](*misuse_setup(FusedGradScaler, device, optimizer), device))
    assert_same_error(actual, expected)


def test_step_before_scale_raises_same_error_as_stock(device):
    expected = error_of(lambda: (lambda s, o: s.step(o))(*misuse_setup(Stock, device, scaled=False)))
    actual = error_of(lambda: (lambda s, o: s.step(o))(*misuse_setup(FusedGradScaler, device, scaled=False)))
    assert_same_error(actual, expected)


@pytest.mark.parametrize("kwargs", [{"growth_factor": 1.0}, {"backoff_factor": 1.0}], ids=["growth1", "backoff1"])
def test_bad_factors_raise_same_error_as_stock(device, kwargs):
    assert_same_error(error_of(lambda: FusedGradScaler(device, **kwargs)), error_of(lambda: Stock(device, **kwargs)))


@pytest.mark.parametrize("init_scale", [0.0, -0.0, -1.0, INF, -INF, math.nan])
def test_invalid_init_scale_raises_value_error(device, init_scale):
    with pytest.raises(ValueError, match="init_scale"):
        FusedGradScaler(device, init_scale=init_scale)


@pytest.mark.parametrize(
    ("bounds", "message"),
    [
        ({"min_scale": 2.0**17}, r"init_scale \(65536.0\) is below min_scale"),
        ({"max_scale": 2.0**15}, r"init_scale \(65536.0\) is above max_scale"),
        ({"min_scale": 1.0, "max_scale": 2.0**10}, r"init_scale \(65536.0\) is above max_scale"),
    ],
)
def test_init_scale_outside_the_bounds_raises_value_error(device, bounds, message):
    with pytest.raises(ValueError, match=message):
        FusedGradScaler(device, **bounds)


def test_init_scale_on_or_inside_the_bounds_is_accepted(device):
    assert FusedGradScaler(device, min_scale=2.0**16).get_scale() == 2.0**16
    assert FusedGradScaler(device, max_scale=2.0**16).get_scale() == 2.0**16
    assert FusedGradScaler(device, init_scale=8.0, min_scale=1.0, max_scale=2.0**10).get_scale() == 8.0


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


def _without_gradients(scaler_cls, device, optimizer):
    """A scaled backward that reaches none of the optimizer's parameters (a forgotten or misdirected backward)."""
    params = [torch.nn.Parameter(torch.randn(4, device=device)) for _ in range(2)]
    opt = make_optimizer(optimizer, params)
    scaler = scaler_cls(device, init_scale=2.0**8)
    other = torch.nn.Parameter(torch.randn(3, device=device))
    scaler.scale((other * other).sum()).backward()
    return scaler, opt


@pytest.mark.parametrize("optimizer", ["sgd", "adam_foreach", "adamw_fused"])
@pytest.mark.parametrize("unscale_first", [False, True], ids=["step", "unscale_then_step"])
def test_step_and_update_without_gradients_raise_like_stock(device, optimizer, unscale_first):
    """Stock: step() on an ordinary optimizer none of whose parameters has a gradient raises "No inf checks were
    recorded for this optimizer."; with a fused optimizer step() passes and update() raises "... prior to update."."""
    if optimizer == "adamw_fused" and not fused_adamw_supported(device):
        pytest.skip(f"torch's fused AdamW does not run on {device}")

    def run(scaler_cls):
        scaler, opt = _without_gradients(scaler_cls, device, optimizer)
        if unscale_first:
            scaler.unscale_(opt)
        return error_of(lambda: (scaler.step(opt), scaler.update()))

    assert_same_error(run(FusedGradScaler), run(Stock))


def test_clip_then_step_without_gradients_raises_like_stock_unscale_then_step(device):
    scaler, opt = _without_gradients(FusedGradScaler, device, "sgd")
    assert float(scaler.clip_grad_norm_(opt, 1.0)) == 0.0
    with pytest.raises(AssertionError, match="No inf checks were recorded for this optimizer"):
        scaler.step(opt)


def test_step_with_gradients_on_some_parameters_still_steps(device):
    scaler, opt = _without_gradients(FusedGradScaler, device, "sgd")
    p = opt.param_groups[0]["params"][0]
    p.grad = torch.full_like(p, 2.0**8)
    before = p.detach().clone()
    scaler.step(opt)
    scaler.update()
    torch.testing.assert_close(p.detach(), before - 0.05)  # make_optimizer's SGD: lr 0.05, unscaled gradient 1


def _stepped(device):
    scaler, opt = misuse_setup(FusedGradScaler, device)
    scaler.step(opt)
    return scaler


@pytest.mark.parametrize("value", [0.0, -0.0, -2.0, INF, -INF, math.nan])
@pytest.mark.parametrize("kind", ["float", "int", "cpu_tensor"])
def test_update_rejects_a_non_positive_or_non_finite_host_scale(device, value, kind):
    if kind == "int" and not math.isfinite(value):
        pytest.skip("ints are finite")
    new = {"float": lambda: value, "int": lambda: int(value), "cpu_tensor": lambda: torch.tensor(value)}[kind]()
    scaler = _stepped(device)
    with pytest.raises(ValueError, match="new_scale must be finite and > 0"):
        scaler.update(new)
    assert scaler.get_scale() == 2.0**8


@pytest.mark.gpu
@pytest.mark.parametrize("value", [0.0, -2.0, INF, math.nan])
def test_update_with_an_invalid_device_scale_keeps_the_scale(value):
    """A tensor on the scale's (CUDA) device is checked on the device (a host check would synchronize): an invalid
    value leaves the scale as it was; a valid one is taken as stock takes it."""
    device = "cuda"
    scaler = _stepped(device)
    scaler.update(torch.tensor(value, device=device))
    assert scaler.get_scale() == 2.0**8
    scaler = _stepped(device)
    scaler.update(torch.tensor(3.0, device=device))
    assert scaler.get_scale() == 3.0
    assert scaler._per_optimizer_states == {}  # the iteration is over, as after stock's update(new_scale)


@pytest.mark.parametrize(
    ("bounds", "new", "message"),
    [
        ({}, 1e-50, "new_scale must be finite and > 0"),  # > 0 as a double, 0.0 once stored in the float32 scale
        ({}, 2.0**-130, r"new_scale \(7.*e-40\) is below min_scale \(1.17.*e-38\)"),  # the default floor, 2**-126
        ({"min_scale": 4.0}, 1.0, r"new_scale \(1.0\) is below min_scale \(4.0\)"),
        ({"max_scale": 2.0**10}, 3000.0, r"new_scale \(3000.0\) is above max_scale \(1024.0\)"),
    ],
    ids=["float32_underflow", "below_default_floor", "below_min_scale", "above_max_scale"],
)
@pytest.mark.parametrize("kind", ["float", "cpu_tensor"])
def test_update_rejects_a_host_scale_outside_the_bounds(device, bounds, new, message, kind):
    """A scale set outside [min_scale, max_scale] would make the next update move it the wrong way: an overflow
    would raise it to min_scale, a clean step would cut it to max_scale."""
    scaler, opt = misuse_setup(lambda d, **kw: FusedGradScaler(d, **kw, **bounds), device)
    scaler.step(opt)
    with pytest.raises(ValueError, match=message):
        scaler.update(new if kind == "float" else torch.tensor(new, dtype=torch.float64))
    assert scaler.get_scale() == 2.0**8


@pytest.mark.parametrize(
    ("init_scale", "message"),
    [
        (1e-50, "init_scale must be a finite number > 0"),  # 0.0 in float32
        (1e39, "init_scale must be a finite number > 0"),  # inf in float32
        (2.0**-130, r"init_scale \(7.*e-40\) is below min_scale \(1.17.*e-38\)"),
    ],
    ids=["float32_underflow", "float32_overflow", "below_default_floor"],
)
def test_init_scale_outside_float32_or_the_default_floor_raises_value_error(device, init_scale, message):
    with pytest.raises(ValueError, match=message):
        FusedGradScaler(device, init_scale=init_scale)


@pytest.mark.gpu
def test_update_with_a_device_scale_outside_the_bounds_keeps_the_scale():
    device = "cuda"
    for bounds, value in (({"min_scale": 4.0}, 1.0), ({"max_scale": 2.0**10}, 3000.0), ({}, 2.0**-130)):
        scaler, opt = misuse_setup(lambda d, b=bounds, **kw: FusedGradScaler(d, **kw, **b), device)
        scaler.step(opt)
        scaler.update(torch.tensor(value, device=device))
        assert scaler.get_scale() == 2.0**8, (bounds, value)


def test_update_with_a_valid_host_scale_sets_it(device):
    for new in (3.0, 5, torch.tensor(0.25)):
        scaler = _stepped(device)
        scaler.update(new)
        assert scaler.get_scale() == float(new)


@pytest.mark.parametrize("history_size", [0, -1, 2.5, True, "8"])
def test_history_size_must_be_a_positive_int(history_size):
    with pytest.raises(ValueError, match="history_size must be an int >= 1"):
        FusedGradScaler("cpu", telemetry=True, history_size=history_size)


@pytest.mark.parametrize(("poisoned", "start"), [(True, 0.0), (False, 0.0), (False, 1.0)])
def test_unscale_grads_internal_matches_stock(device, poisoned, start):
    """Code that calls stock's internal ``_unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)`` gets the
    unscaled gradients and, per device, a flag that starts from a copy of ``found_inf`` (set to 1 by a non-finite
    gradient); ``found_inf`` itself is left as it was."""
    results = []
    for cls in (FusedGradScaler, Stock):
        scaler, opt = misuse_setup(cls, device)
        params = [p for group in opt.param_groups for p in group["params"]]
        if poisoned:
            params[0].grad[1, 2] = INF
        found_inf = torch.full((1,), start, device=device)
        flags = scaler._unscale_grads_(opt, torch.full((), 2.0**-8, device=device), found_inf, True)
        results.append((found_inf, flags, [p.grad.detach().clone() for p in params]))
    (ours_found, ours_flags, ours_grads), (stock_found, stock_flags, stock_grads) = results
    assert_bitwise_equal(ours_found, stock_found, "found_inf")
    assert ours_flags.keys() == stock_flags.keys()
    for d in stock_flags:
        assert_bitwise_equal(ours_flags[d], stock_flags[d], f"flag on {d}")
    for i, (o, s) in enumerate(zip(ours_grads, stock_grads, strict=True)):
        assert_bitwise_equal(o, s, f"grad {i}")
