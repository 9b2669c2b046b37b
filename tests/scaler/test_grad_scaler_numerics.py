"""FusedGradScaler's unscale and non-finite check on awkward gradients: fp32/fp16/bf16 mixed in one optimizer, sizes
around the multi-tensor chunk, non-finite values at the first, middle and last element, zero-size, sparse and
complex gradients.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from grad_scaler_common import (
    CHUNK,
    INF,
    LOW_PRECISION,
    STOCK_KEYS,
    Scenario,
    Stock,
    assert_bitwise_equal,
    assert_same_trajectory,
    ours_factory,
    ours_with_scale,
    params_with_scaled_grads,
    set_flat,
    stock_factory,
    train,
    unscaled_reference,
)

from ampkernels import FusedGradScaler


@pytest.mark.parametrize("scale", [2.0**12, 3000.0], ids=["pow2", "not_pow2"])
def test_unscale_mixed_fp32_fp16_bf16_grads_matches_manual_reference(device, scale):
    scaler = ours_with_scale(device, scale)
    shapes = [(5,), (3, 7), (CHUNK + 1,), (0,), (2, 2, 2)]
    specs = [(s, LOW_PRECISION[i % 3]) for i, s in enumerate(shapes * 3)]  # dtypes interleaved in one optimizer
    params = params_with_scaled_grads(device, scaler, specs)
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
    scaler = ours_with_scale(device, 2.0**12)
    params = params_with_scaled_grads(device, scaler, [((9,), torch.float32), ((6, 5), dtype), ((4,), torch.float32)])
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
    scaler = ours_with_scale(device, 2.0**6)
    params = params_with_scaled_grads(device, scaler, [((n,), dtype) for n in sizes], seed=5)
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
    scaler = ours_with_scale(device, 2.0**12)
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
    scaler = ours_with_scale(device, 2.0**12)
    call = {
        "unscale_": lambda: scaler.unscale_(opt),
        "step": lambda: scaler.step(opt),
        "clip_grad_norm_": lambda: scaler.clip_grad_norm_(opt, 1.0),
    }[entry]
    with pytest.raises((TypeError, ValueError, RuntimeError, NotImplementedError), match=r"(?i)complex"):
        call()
