"""Tests written for bugs that ``scripts/mutation_test.py`` put into the kernels and no other test caught.

Each test names the entries of ``scripts/mutations.py`` it kills; it checks behaviour the other tests leave
unconstrained, against torch.optim (or the float64 math) as the independent reference.
"""

from __future__ import annotations

import pytest
import torch

from ampkernels import FusedAdam, FusedAdamW, dispatch

BACKENDS = ["torch", "native", "triton"]


def _need(backend: str, device: str = "cpu") -> None:
    reason = dispatch.why_not("adam", backend, device)
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls, torch_cls", [(FusedAdamW, torch.optim.AdamW), (FusedAdam, torch.optim.Adam)])
def test_adam_eps_is_added_after_the_bias_correction(backend, cls, torch_cls):
    """``p -= step_size * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)``: with gradients of the size of eps the
    denominator's two terms weigh alike, so eps added before the division by the bias correction (a step up to
    ~30x smaller at t = 1) shows; with gradients of order 1 it changes the step by ~1e-7 relative and passes the
    other tests (mutations triton-adam-eps-inside, native-adam-eps-inside)."""
    _need(backend)
    gen = torch.Generator().manual_seed(11)
    shapes = [(5, 7), (33,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    stock_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    options = dict(lr=1e-2, eps=1e-8)
    ours, stock = cls(params, backend=backend, **options), torch_cls(stock_params, **options)
    for _ in range(3):
        for p, q in zip(params, stock_params, strict=True):
            g = torch.randn(p.shape, generator=gen) * 1e-8
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        stock.step()
        for p, q in zip(params, stock_params, strict=True):
            moved = (q.detach() - p.detach()).abs().max()
            # A step is lr * m / (|g| + eps) ~ 0.5 lr here; rounding moves it by float32 ulps of p only.
            assert moved <= 1e-6, (backend, float(moved))
