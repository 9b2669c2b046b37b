"""The hyperparameter dataclasses (``ampkernels.optim.hyperparameters``): built from a param group field for field,
mirrored by the C++ structs of ``csrc/optim/optimizer.h``, and taken by the native tables (after the refresh each
step needs) as the Triton launchers and the references take them."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from ampkernels import FusedAdam, FusedSGD, dispatch, reference
from ampkernels.optim import AdamHyperparameters, SgdHyperparameters


def _randn(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _native_or_skip():
    if dispatch.why_not("adam", "native", "cpu") is not None:
        pytest.skip("native extension not available")
    return dispatch.native()


@pytest.mark.parametrize(
    ("cls", "exported"),
    [(AdamHyperparameters, "adam_hyperparameter_fields"), (SgdHyperparameters, "sgd_hyperparameter_fields")],
)
def test_the_cpp_structs_mirror_the_dataclasses(cls, exported):
    """bindings.cpp reads each struct field from the dataclass by name: the two lists are the same, in order, with
    the same kinds (double <-> float, bool <-> bool, uint64_t <-> int)."""
    native = _native_or_skip()
    assert tuple(getattr(native, exported)) == tuple((f.name, f.type) for f in dataclasses.fields(cls))


def test_adam_hyperparameters_of_a_group_take_every_option():
    """Every field comes from its own option (distinct values, so a crossed pair would show)."""
    p = torch.nn.Parameter(_randn((4, 3), 0).bfloat16())
    opt = FusedAdam(
        [p],
        betas=(0.8, 0.95),
        eps=1e-6,
        weight_decay=0.25,
        amsgrad=True,
        maximize=True,
        decoupled_weight_decay=True,
        stochastic_rounding=True,
        seed=2**40 + 3,
    )
    hyper = AdamHyperparameters.of_group(opt.param_groups[0])
    assert hyper == AdamHyperparameters(0.8, 0.95, 1e-6, 0.25, True, True, True, True, 2**40 + 3)
    assert list(vars(hyper)) == [f.name for f in dataclasses.fields(hyper)]  # (of_group writes them at once)
    assert [type(getattr(hyper, f.name)).__name__ for f in dataclasses.fields(hyper)] == [
        f.type for f in dataclasses.fields(hyper)
    ]
    with pytest.raises(dataclasses.FrozenInstanceError):
        hyper.beta1 = 0.5  # type: ignore[misc]


def test_sgd_hyperparameters_of_a_group_take_every_option():
    p = torch.nn.Parameter(_randn((4, 3), 0))
    opt = FusedSGD([p], momentum=0.7, dampening=0.2, weight_decay=0.05, maximize=True)
    hyper = SgdHyperparameters.of_group(opt.param_groups[0])
    assert hyper == SgdHyperparameters(0.7, 0.2, 0.05, False, True)
    assert list(vars(hyper)) == [f.name for f in dataclasses.fields(hyper)]
    opt.param_groups[0].update(dampening=0.0, nesterov=True)
    assert SgdHyperparameters.of_group(opt.param_groups[0]) == SgdHyperparameters(0.7, 0.0, 0.05, True, True)


def _adam_table(native, n=300):
    p = _randn(n, 1)
    grad = _randn(n, 2)
    param = torch.nn.Parameter(p.clone())
    param.grad = grad
    state = [torch.zeros(n), torch.zeros(n)]
    lists = [[state[0]], [state[1]], [], [], [torch.zeros(())]]
    return param, state, lists, native.OptimizerTable("adam", [param], lists, [], torch.float32)


def test_a_native_step_needs_a_refresh_since_the_last_step():
    """The optimizer checks every table before it launches any; a table stepped without that check (or twice after
    one) refuses, and writes nothing."""
    native = _native_or_skip()
    param, _, lists, table = _adam_table(native)
    hyper = AdamHyperparameters(weight_decay=0.1, decoupled_weight_decay=True)
    before = param.detach().clone()
    with pytest.raises(RuntimeError, match="argument 'refresh': a step needs refresh"):
        table.step_adam(1e-2, None, hyper, None, None)
    assert torch.equal(param.detach(), before) and float(lists[4][0]) == 0.0
    assert table.refresh()
    table.step_adam(1e-2, None, hyper, None, None)
    assert not torch.equal(param.detach(), before) and float(lists[4][0]) == 1.0
    with pytest.raises(RuntimeError, match="argument 'refresh'"):
        table.step_adam(1e-2, None, hyper, None, None)
    assert float(lists[4][0]) == 1.0


def test_a_native_step_is_the_reference_with_the_same_dataclass():
    """The struct the table reads is the dataclass the reference reads: every field set away from its default."""
    native = _native_or_skip()
    param, state, lists, table = _adam_table(native)
    hyper = AdamHyperparameters(0.8, 0.95, 1e-3, 0.3, False, True, False)
    p, g = param.detach().clone(), param.grad.clone()
    m, v, step = torch.zeros(300), torch.zeros(300), torch.zeros(())
    assert table.refresh()
    table.step_adam(1e-2, None, hyper, None, None)
    reference.adam_step([p], [g], [m], [v], [], [step], lr=1e-2, hyper=hyper)
    assert torch.equal(param.detach(), p) and torch.equal(state[0], m) and torch.equal(state[1], v)


@pytest.mark.parametrize(
    ("hyper", "message"),
    [
        ({"beta1": 0.9}, "the float field 'beta1', got {'beta1': 0.9}"),
        (dataclasses.replace(AdamHyperparameters(), amsgrad="yes"), "the bool field 'amsgrad', got 'yes'"),
        (dataclasses.replace(AdamHyperparameters(), seed=-1), "the int field 'seed', got -1"),
        (SgdHyperparameters(), "the float field 'beta1', got SgdHyperparameters"),
    ],
)
def test_a_native_step_names_a_field_it_cannot_read(hyper, message):
    native = _native_or_skip()
    param, _, _, table = _adam_table(native)
    before = param.detach().clone()
    assert table.refresh()
    expected = "argument 'hyper': expected a dataclass of ampkernels.optim.hyperparameters with " + message
    with pytest.raises(TypeError, match=re.escape(expected)):
        table.step_adam(1e-2, None, hyper, None, None)
    assert torch.equal(param.detach(), before)
