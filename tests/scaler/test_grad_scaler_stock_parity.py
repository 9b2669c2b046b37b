"""FusedGradScaler against the stock ``torch.amp.GradScaler`` over whole training runs, bit for bit: the same scale
and growth tracker after every ``update()``, the same unscaled gradients, parameters and skip decisions, on every
backend, through parameter-group changes, setters and manual updates.

Every device-parametrised test runs on ``cpu`` and, when present, ``cuda`` (see ``conftest.py``).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from grad_scaler_common import (
    INF,
    LOW_PRECISION,
    Scenario,
    Stock,
    assert_bitwise_equal,
    assert_same_trajectory,
    assert_scenario_exercised,
    opt_params,
    ours_factory,
    set_flat,
    stock_factory,
    train,
)

import ampkernels
from ampkernels import FusedGradScaler

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
