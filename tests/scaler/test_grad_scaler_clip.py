"""``FusedGradScaler.clip_grad_norm_``: equal to the stock recipe (``unscale_`` then
``torch.nn.utils.clip_grad_norm_``) for ordinary and fused optimizers, and its norm accurate on mixed-precision
gradients.
"""

from __future__ import annotations

import pytest
import torch
from grad_scaler_common import (
    CHUNK,
    INF,
    NORM_RTOL_FLOOR,
    Scenario,
    Stock,
    assert_same_error,
    assert_same_trajectory,
    assert_scenario_exercised,
    error_of,
    misuse_setup,
    ours_factory,
    ours_with_scale,
    params_with_scaled_grads,
    stock_factory,
    train,
    unscaled_reference,
)

from ampkernels import FusedGradScaler

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
    expected = error_of(lambda: (lambda s, o: (s.unscale_(o), s.unscale_(o)))(*misuse_setup(Stock, device)))
    scaler, opt = misuse_setup(FusedGradScaler, device, optimizer)
    scaler.clip_grad_norm_(opt, 1.0)
    assert_same_error(error_of(lambda: scaler.unscale_(opt)), expected)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return abs(x.double().item() - ref.double().item()) / abs(ref.double().item())


def test_clip_grad_norm_of_mixed_precision_grads_matches_reference(device):
    """The norm of unscaled fp16/fp32/bf16 grads: its error against float64 at most 2x that of torch's float32 norm
    (or NORM_RTOL_FLOOR); the grads unscaled and multiplied by the coefficient of the returned norm in place."""
    specs = [((300,), torch.float16), ((17, 3), torch.float32), ((CHUNK + 7,), torch.bfloat16)]
    scaler = ours_with_scale(device, 2.0**10)
    params = params_with_scaled_grads(device, scaler, specs, seed=9)
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
    scaler2 = ours_with_scale(device, 2.0**10)
    params2 = params_with_scaled_grads(device, scaler2, specs, seed=9)
    norm_inf = scaler2.clip_grad_norm_(torch.optim.SGD(params2, lr=0.1), 1e9, norm_type=INF)
    assert norm_inf.item() == want_inf.item()  # a max is exact
