"""The fused optimizers' clip_grad_norm_: torch's clip then step, with the clip folded into the step (one read-only
pass over the gradients for the norm; the step divides them by 1 / coef)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import ampkernels


def _models(device: str, seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.Tanh(), torch.nn.Linear(48, 8)).to(device)
    return model, copy.deepcopy(model)


def _backward(model: torch.nn.Module, step: int, device: str, scale: float = 10.0) -> None:
    x = torch.randn(16, 24, generator=torch.Generator().manual_seed(step)).to(device)
    (model(x).square().sum() * scale).backward()


OPTIMIZERS = {
    "adamw": (lambda p: ampkernels.FusedAdamW(p, lr=1e-2, weight_decay=0.1), lambda p: torch.optim.AdamW(p, lr=1e-2)),
    "sgd": (lambda p: ampkernels.FusedSGD(p, lr=1e-2, momentum=0.9), lambda p: torch.optim.SGD(p, 1e-2, 0.9)),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0])
def test_same_update_as_torchs_clip_then_step(device, name, norm_type):
    model, stock = _models(device)
    make_ours, make_stock = OPTIMIZERS[name]
    opt, stock_opt = make_ours(model.parameters()), make_stock(stock.parameters())
    if name == "adamw":  # (the same decoupled decay as ours)
        stock_opt.param_groups[0]["weight_decay"] = 0.1
    for step in range(4):
        for m, o in ((model, opt), (stock, stock_opt)):
            o.zero_grad()
            _backward(m, step, device)
        norm = opt.clip_grad_norm_(0.5, norm_type)
        expected = torch.nn.utils.clip_grad_norm_(stock.parameters(), 0.5, norm_type)
        torch.testing.assert_close(norm, expected, rtol=1e-5, atol=0)
        assert norm.item() > 0.5  # (the clip does clip)
        opt.step()
        stock_opt.step()
    for p, q in zip(model.parameters(), stock.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_the_gradients_are_only_read(device):
    model, _ = _models(device)
    opt = ampkernels.FusedAdamW(model.parameters(), lr=1e-2)
    _backward(model, 0, device)
    before = [p.grad.clone() for p in model.parameters()]
    opt.clip_grad_norm_(0.1)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), before))


def test_zero_grad_drops_a_clip_no_step_consumed(device):
    model, reference = _models(device)
    opt = ampkernels.FusedAdamW(model.parameters(), lr=1e-2)
    reference_opt = ampkernels.FusedAdamW(reference.parameters(), lr=1e-2)
    _backward(model, 0, device)
    opt.clip_grad_norm_(1e-3)  # (a tiny coefficient that must not reach the next step)
    for m, o in ((model, opt), (reference, reference_opt)):
        o.zero_grad()
        _backward(m, 1, device)
        o.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


def test_a_second_clip_measures_what_the_first_left(device):
    model, stock = _models(device)
    opt, stock_opt = ampkernels.FusedSGD(model.parameters(), lr=0.1), torch.optim.SGD(stock.parameters(), lr=0.1)
    _backward(model, 0, device)
    _backward(stock, 0, device)
    opt.clip_grad_norm_(2.0)
    second = opt.clip_grad_norm_(0.5)
    torch.nn.utils.clip_grad_norm_(stock.parameters(), 2.0)
    expected = torch.nn.utils.clip_grad_norm_(stock.parameters(), 0.5)
    torch.testing.assert_close(second, expected, rtol=1e-5, atol=0)
    opt.step()
    stock_opt.step()
    for p, q in zip(model.parameters(), stock.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_non_finite_gradients_give_what_torchs_clip_gives(device):
    model, stock = _models(device)
    opt, stock_opt = ampkernels.FusedSGD(model.parameters(), lr=0.1), torch.optim.SGD(stock.parameters(), lr=0.1)
    for m in (model, stock):
        _backward(m, 0, device)
        m[0].weight.grad[0, 0] = float("inf")
    norm = opt.clip_grad_norm_(1.0)
    expected = torch.nn.utils.clip_grad_norm_(stock.parameters(), 1.0)
    assert math.isinf(norm.item()) and math.isinf(expected.item())
    opt.step()
    stock_opt.step()
    for p, q in zip(model.parameters(), stock.parameters()):
        torch.testing.assert_close(p, q, equal_nan=True)
