"""The Triton optimizer backend's launch table (StepTable) follows parameters and gradients that move.

Runs on a CUDA device, or on the CPU under ``TRITON_INTERPRET=1`` (``tests/conftest.py``). Each case steps the
Triton backend and the plain-torch backend side by side on the same data and the same changes.
"""

from __future__ import annotations

import pytest
import torch

from ampkernels import FusedAdamW, FusedSGD, dispatch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# On a GPU machine every test here runs on the GPU: marked so, for `pytest -m gpu`.
pytestmark = [pytest.mark.gpu] if DEV == "cuda" else []
if dispatch.why_not("adam", "triton", DEV) is not None:
    pytest.skip(dispatch.why_not("adam", "triton", DEV), allow_module_level=True)


def _pair(kind, shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    values = [torch.randn(s, generator=gen) for s in shapes]
    optimizers, params = [], []
    for backend in ("triton", "torch"):
        ps = [torch.nn.Parameter(v.clone().to(DEV)) for v in values]
        if kind == "adamw":
            opt = FusedAdamW(ps, lr=0.1, weight_decay=0.01, backend=backend)
        else:
            opt = FusedSGD(ps, lr=0.1, momentum=0.9, backend=backend)
        optimizers.append(opt)
        params.append(ps)
    return optimizers, params


def _set_grads(params, seed):
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(p.shape, generator=gen) for p in params[0]]
    for ps in params:
        for p, g in zip(ps, grads, strict=True):
            p.grad = g.clone().to(DEV)


def _assert_same(params):
    for a, b in zip(*params, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_parameter_given_new_storage_is_stepped_there(kind):
    """``p.data = new``: the next step writes the new storage (a table keeping the old address would update the
    abandoned tensor and leave the parameter as it was)."""
    optimizers, params = _pair(kind, [(5, 7), (40_000,), (3,)])
    _set_grads(params, 1)
    for opt in optimizers:
        opt.step()
    abandoned = []
    for ps in params:
        old = ps[1].data
        abandoned.append(old.clone())
        ps[1].data = old.clone() * 2  # same shape, new storage
        abandoned[-1] = (old, abandoned[-1])
    _set_grads(params, 2)
    for opt in optimizers:
        opt.step()
    _assert_same(params)
    old, before = abandoned[0]
    assert torch.equal(old, before), "the Triton step wrote into the parameter's old storage"
    assert not torch.equal(params[0][1].detach(), before * 2), "the parameter's new storage was not stepped"


def test_gradient_at_the_same_address_with_a_new_layout():
    """A gradient that reuses its storage with other strides is read in its new layout, not the old one."""
    optimizers, params = _pair("adamw", [(6, 10)])
    _set_grads(params, 3)
    for opt in optimizers:
        opt.step()
    gen = torch.Generator().manual_seed(4)
    values = torch.randn(10, 6, generator=gen)
    for ps in params:
        storage = ps[0].grad  # [6, 10] row-major; refill its memory as a column-major [6, 10]
        flipped = storage.view(10, 6)
        flipped.copy_(values.to(DEV))
        ps[0].grad = flipped.t()
        assert ps[0].grad.data_ptr() == storage.data_ptr() and ps[0].grad.stride() == (1, 6)
    for opt in optimizers:
        opt.step()
    _assert_same(params)


def test_parameter_resized_with_its_state_rebuilds_or_refuses():
    """A parameter whose size changed under the same tensor object no longer matches its optimizer state: the table
    refuses with a clear error instead of walking past the end of either."""
    (opt, _), (ps, _) = _pair("adamw", [(4, 4)])
    ps[0].grad = torch.ones_like(ps[0])
    opt.step()
    ps[0].data = torch.zeros(2, 4, device=DEV)
    ps[0].grad = torch.ones(2, 4, device=DEV)
    with pytest.raises((ValueError, RuntimeError), match="elements|size|shape"):
        opt.step()


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_steps_launch_on_the_parameters_device(kind, monkeypatch):
    """Triton launches on the current CUDA device: the step makes the parameters' device current first, as the
    native tables do with a CUDA guard (parameters on cuda:1 while cuda:0 is current were stepped from cuda:0)."""
    import ampkernels._runtime

    guarded = []
    real = ampkernels._runtime.device_guard
    monkeypatch.setattr(ampkernels._runtime, "device_guard", lambda device: guarded.append(device) or real(device))
    optimizers, params = _pair(kind, [(5, 7)])
    _set_grads(params, 1)
    optimizers[0].step()
    assert guarded == [params[0][0].device]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_parameters_on_a_device_that_is_not_current(kind):
    gen = torch.Generator().manual_seed(0)
    values, grads = torch.randn(3000, generator=gen), torch.randn(3000, generator=gen)
    stepped = []
    for backend, device in (("triton", "cuda:1"), ("torch", "cuda:1")):
        p = torch.nn.Parameter(values.clone().to(device))
        p.grad = grads.clone().to(device)
        if kind == "adamw":
            opt = FusedAdamW([p], lr=0.1, weight_decay=0.01, backend=backend)
        else:
            opt = FusedSGD([p], lr=0.1, momentum=0.9, backend=backend)
        with torch.cuda.device(0):
            opt.step()
        stepped.append(p.detach())
    torch.testing.assert_close(stepped[0], stepped[1], rtol=1e-6, atol=1e-7)
