"""The fused optimizers used carelessly: each misuse gets one behaviour on every backend (native, Triton, torch) —
torch.optim's where it has one, else a clear error that names the parameter or the argument, raised before the
step writes anything it would have to undo.

The ``device`` argument is parametrized by conftest.py (cpu, and cuda when present).
"""

from __future__ import annotations

import copy
import io
import math
import pickle
import re

import pytest
import torch
from tolerances import OPTIMIZER_FP32

from ampkernels import FusedAdam, FusedAdamW, FusedSGD, dispatch

BACKENDS = ["native", "triton", "torch"]
FP32_TOL = OPTIMIZER_FP32


def _skip_unless_runs(backend: str, device: str, op: str = "adam") -> None:
    reason = dispatch.why_not(op, backend, device)
    if reason is not None:
        pytest.skip(reason)


def _randn(shape, device, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def _param(shape, device, seed: int, dtype=torch.float32) -> torch.nn.Parameter:
    return torch.nn.Parameter(_randn(shape, device, seed, dtype))


# ---- master weights after p.data = t ----


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("also", ["nothing else", "an option changed", "a second bucket"])
def test_master_weights_follow_a_parameter_rebound_through_data(device, backend, dtype, also):
    """``p.data = t`` gives the parameter new storage without bumping its version counter: the next step wrote the
    stale float32 master back into it. The step starts from the new values, as a fresh twin with the same state
    (its master the new values in float32) does, bit for bit."""
    _skip_unless_runs(backend, device)
    other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    shapes = [(40,), (3, 5)]
    dtypes = [dtype, other if also == "a second bucket" else dtype]
    params = [_param(s, device, i, d) for i, (s, d) in enumerate(zip(shapes, dtypes))]
    opt = FusedAdamW(params, lr=1e-2, master_weights=True, backend=backend)
    for i, p in enumerate(params):
        p.grad = _randn(p.shape, device, 10 + i, p.dtype)
    opt.step()
    new = [_randn(p.shape, device, 20 + i, p.dtype) for i, p in enumerate(params)]
    for p, t in zip(params, new):
        p.data = t.clone()
    if also == "an option changed":
        opt.param_groups[0]["amsgrad"] = True
    twins = [torch.nn.Parameter(t.clone()) for t in new]
    twin = FusedAdamW(twins, lr=1e-2, master_weights=True, amsgrad=also == "an option changed", backend=backend)
    sd = copy.deepcopy(opt.state_dict())  # (torch's state_dict shares its entries with opt.state)
    for i, t in enumerate(new):
        sd["state"][i]["master_param"] = t.float()
    twin.load_state_dict(sd)
    for i, (p, q) in enumerate(zip(params, twins)):
        p.grad = _randn(p.shape, device, 30 + i, p.dtype)
        q.grad = p.grad.clone()
    opt.step()
    twin.step()
    for i, (p, q) in enumerate(zip(params, twins)):
        assert torch.equal(p.detach(), q.detach()), f"parameter {i} was stepped from its stale master"
        assert torch.equal(opt.state[p]["master_param"], twin.state[q]["master_param"])


# ---- a tensor lr of another floating dtype ----


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", [FusedAdamW, FusedSGD])
@pytest.mark.parametrize("lr_dtype", [torch.float64, torch.bfloat16])
def test_a_tensor_lr_of_another_float_dtype_steps_as_torch(device, backend, cls, lr_dtype):
    """A float64 0-d lr was accepted by the constructor and refused at step(); torch's optimizers step with it.
    (torch computes a bfloat16 lr's step size in bfloat16, 2**-9 off: it is compared with the same lr as a float.)"""
    _skip_unless_runs(backend, device, cls._KIND)
    stock_cls = torch.optim.AdamW if cls is FusedAdamW else torch.optim.SGD
    extra = {} if cls is FusedAdamW else {"momentum": 0.9}
    lr = torch.tensor(3e-2, dtype=lr_dtype, device=device)
    ours, theirs = _param((7, 5), device, 1), _param((7, 5), device, 1)
    opt = cls([ours], lr=lr, backend=backend, **extra)
    stock_lr = lr.clone() if lr_dtype == torch.float64 else float(lr)
    stock = stock_cls([theirs], lr=stock_lr, foreach=False, **extra)  # (the for-loop step takes any tensor lr)
    for step in range(3):
        ours.grad = _randn((7, 5), device, 100 + step)
        theirs.grad = ours.grad.clone()
        opt.step()
        stock.step()
    torch.testing.assert_close(ours.detach(), theirs.detach(), **FP32_TOL)
    assert lr.dtype == lr_dtype and float(lr) == float(torch.tensor(3e-2, dtype=lr_dtype))  # not written


# ---- copies keep the backend ----


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
@pytest.mark.parametrize("cls", [FusedAdamW, FusedSGD])
def test_a_copied_optimizer_keeps_its_backend(device, backend, how, cls):
    """deepcopy, pickle and torch.save dropped backend= (torch.optim.Optimizer.__getstate__ keeps three keys): the
    copy stepped on the default backend."""
    _skip_unless_runs(backend, device, cls._KIND)
    p = _param((6,), device, 2)
    opt = cls([p], lr=1e-2, backend=backend)
    if how == "deepcopy":
        twin = copy.deepcopy(opt)
    elif how == "pickle":
        twin = pickle.loads(pickle.dumps(opt))
    else:
        buf = io.BytesIO()
        torch.save(opt, buf)
        buf.seek(0)
        twin = torch.load(buf, weights_only=False)
    assert twin._requested_backend == backend
    q = twin.param_groups[0]["params"][0]
    q.grad = _randn((6,), device, 3)
    twin.step()
    assert [b.backend for b in twin._plans[0].buckets] == [backend]


# ---- a step refused for one group steps none ----


def _bad_lr(kind: str, device):
    if kind == "nan":
        return math.nan
    if kind == "negative":
        return -1e-3
    return torch.tensor(math.nan, device="cpu")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", ["nan", "negative", "nan cpu tensor"])
@pytest.mark.parametrize("cls", [FusedAdamW, FusedSGD])
def test_a_step_refused_for_one_group_steps_no_group(device, backend, bad, cls):
    """The NaN lr of param group 1 was found after param group 0 had stepped: half a step, then the error."""
    _skip_unless_runs(backend, device, cls._KIND)
    ps = [_param((5, 3), device, 4), _param((9,), device, 5), _param((4,), device, 6)]
    opt = cls([{"params": ps[:1]}, {"params": ps[1:2]}, {"params": ps[2:]}], lr=1e-2, backend=backend)
    for i, p in enumerate(ps):
        p.grad = _randn(p.shape, device, 40 + i)
    opt.step()  # state for every parameter
    before = [p.detach().clone() for p in ps]
    state_before = copy.deepcopy(opt.state_dict()["state"])
    opt.param_groups[1]["lr"] = _bad_lr(bad, device)
    with pytest.raises(ValueError, match="learning rate"):
        opt.step()
    for i, (p, b) in enumerate(zip(ps, before)):
        assert torch.equal(p.detach(), b), f"parameter {i} stepped"
    for i, entry in state_before.items():
        for key, value in entry.items():
            assert torch.equal(opt.state_dict()["state"][i][key], value), f"state {key} of parameter {i} changed"


def _state_copy(opt) -> dict:
    return {
        id(p): {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
        for p, entry in opt.state.items()
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("moments", [None, "8bit"])
@pytest.mark.parametrize("change", ["parameter shape", "gradient shape"])
def test_a_step_refused_for_a_later_bucket_steps_no_bucket(device, backend, moments, change):
    """A parameter of the last bucket given another shape (its state no longer fits), or a gradient of another
    shape, was found when that bucket's turn came: the buckets before it (the group before, and the bfloat16
    bucket of its own group) had stepped. The refused step now leaves every parameter and all state as they were,
    and the error names the parameter."""
    _skip_unless_runs(backend, device, "adam" if moments is None else "adam_blockwise")
    a = _param((64, 96), device, 11)  # param group 0
    b = _param((64, 96), device, 12, torch.bfloat16)  # param group 1, its first (bfloat16) bucket
    c, p = _param((5, 3), device, 13), _param((64, 128), device, 14)  # param group 1, its float32 bucket
    ps = [a, b, c, p]
    opt = FusedAdamW(
        [{"params": [a]}, {"params": [b, c, p]}],
        lr=1e-2,
        exp_avg_dtype=moments,
        exp_avg_sq_dtype=moments,
        backend=backend,
    )
    for step in range(2):
        for i, x in enumerate(ps):
            x.grad = _randn(x.shape, device, 70 + 10 * step + i, x.dtype)
        opt.step()
    assert [len(plan.buckets) for plan in opt._plans.values()] == [1, 2]
    if change == "parameter shape":
        p.data = _randn((128, 64), device, 90)
        p.grad = _randn((128, 64), device, 91)
        message = r"parameter 2 of param group 1 has shape \(128, 64\), but its state 'exp_avg' has shape \(64, 128\)"
    else:
        p.grad.data = _randn((128, 64), device, 91)  # bypasses the shape check of the .grad setter
        message = r"parameter 2 of param group 1 has shape \(64, 128\) but its gradient has shape \[128, 64\]"
    params_before = [x.detach().clone() for x in ps]
    state_before = _state_copy(opt)
    with pytest.raises(RuntimeError, match=message):
        opt.step()
    for name, x, before in zip("abcp", ps, params_before):
        assert torch.equal(x.detach(), before), f"parameter {name} stepped"
    state_after = _state_copy(opt)
    for name, x in zip("abcp", ps):
        entry, before = state_after[id(x)], state_before[id(x)]
        assert entry.keys() == before.keys(), f"the state keys of parameter {name} changed"
        for key, value in before.items():
            same = torch.equal(entry[key], value) if isinstance(value, torch.Tensor) else entry[key] == value
            assert same, f"state {key!r} of parameter {name} changed"


# ---- state of a parameter that changed shape ----


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("moments", ["8bit", "4bit", "bf16", None])
@pytest.mark.parametrize("new_shape", [(128, 64), (32, 128), (8192,)])
def test_state_of_a_parameter_that_changed_shape_names_the_parameter(device, backend, moments, new_shape):
    """An 8-bit state whose parameter was given another shape (``p.data = t``) failed with a raw reshape error (or a
    size mismatch in the kernels' checks) that named neither the parameter nor the state."""
    _skip_unless_runs(backend, device, "adam" if moments is None else "adam_blockwise")
    a, b, p = _param((6,), device, 7), _param((5, 3), device, 8), _param((64, 128), device, 9)
    opt = FusedAdam(
        [{"params": [a]}, {"params": [b, p]}],
        lr=1e-2,
        exp_avg_dtype=moments,
        exp_avg_sq_dtype=moments,
        backend=backend,
    )
    for i, x in enumerate((a, b, p)):
        x.grad = _randn(x.shape, device, 50 + i)
    opt.step()
    p.data = _randn(new_shape, device, 60)
    p.grad = _randn(new_shape, device, 61)
    state_before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[p].items()}
    message = (
        rf"FusedAdam: parameter 1 of param group 1 has shape {re.escape(str(new_shape))}, but its state "
        r"'exp_avg' has shape \(64, (128|64)\)"
    )
    with pytest.raises(RuntimeError, match=message):
        opt.step()
    assert torch.equal(p.detach(), _randn(new_shape, device, 60)), "the parameter stepped"
    for key, value in state_before.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(opt.state[p][key], value), f"its state {key} changed"
