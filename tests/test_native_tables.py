"""The native launch tables (ampkernels._C.OptimizerTable, GradTable) and kernels against the cases where a cached
table could go stale or two entries could alias: parameters whose ``.data`` shrinks or changes layout at the same
address, gradients at the same address with other strides, one tensor reached twice; and float64 norms."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from ampkernels import FusedAdamW, FusedGradScaler, FusedSGD, dispatch

CHUNK = 16384


@pytest.fixture(autouse=True)
def _needs_native(device):
    if dispatch.why_not("adam", "native", device) is not None:
        pytest.skip("native extension not available")


def _randn(shape, device, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64 if dtype == torch.float64 else torch.float32).to(
        device, dtype
    )


# ---- state layouts ----


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sgd_without_momentum_keeps_only_a_master_copy(device, dtype):
    """Plain SGD with master weights has no momentum buffer: the float32 master copy is its only state. The table
    once took its state dtype from the momentum buffers alone and refused this case."""
    p = torch.nn.Parameter(_randn((3, CHUNK + 5), device, 0, dtype))
    q = torch.nn.Parameter(p.detach().clone())
    ours = FusedSGD([p], lr=0.1, master_weights=True, backend="native")
    ref = FusedSGD([q], lr=0.1, master_weights=True, backend="torch")
    for step in range(2):
        p.grad = _randn(p.shape, device, 1 + step, dtype)
        q.grad = p.grad.clone()
        ours.step()
        ref.step()
    master, expected = ours.state[p]["master_param"], ref.state[q]["master_param"]
    assert master.dtype == torch.float32 and "momentum_buffer" not in ours.state[p]
    if device == "cpu":
        assert torch.equal(master, expected) and torch.equal(p, q)
    else:  # CUDA contracts p - lr * g into an FMA: an ulp of the larger operand apart per step (atol: where
        # p and lr * g nearly cancel, operands below 1 at these values), two steps
        torch.testing.assert_close(master, expected, rtol=2 * 2**-23, atol=2 * 2**-23)
        assert torch.equal(p, master.to(dtype))


# ---- parameters that change under a cached table ----


def test_sgd_param_shrunk_at_same_address_steps_only_its_elements(device):
    """``p.data = p.data[:n]`` keeps the address: the step must cover the n elements, not the old extent."""
    full_size, n = 3 * CHUNK + 5, CHUNK + 7
    p = torch.nn.Parameter(_randn(full_size, device, 0))
    opt = FusedSGD([p], lr=0.1, backend="native")
    p.grad = _randn(full_size, device, 1)
    opt.step()
    storage = p.data  # the whole original allocation
    p.data = p.data[:n]
    assert p.data_ptr() == storage.data_ptr()
    tail = storage[n:].clone()
    before = p.detach().clone()
    p.grad = _randn(n, device, 2)
    opt.step()
    # The same step on a fresh parameter of n elements (the kernel's own rounding: CUDA contracts p - lr * g to an
    # FMA, so a plain torch expression differs in the last bit).
    fresh = torch.nn.Parameter(before.clone())
    fresh.grad = p.grad.clone()
    FusedSGD([fresh], lr=0.1, backend="native").step()
    assert torch.equal(p.detach(), fresh.detach())
    assert torch.equal(storage[n:], tail), "the step wrote past the parameter's new end"


def test_adamw_param_shrunk_at_same_address_raises_not_overflows(device):
    """With state of the old size the step cannot run: a clear error, and nothing written past the new end."""
    full_size, n = 2 * CHUNK + 3, 100
    p = torch.nn.Parameter(_randn(full_size, device, 0))
    opt = FusedAdamW([p], lr=0.1, backend="native")
    p.grad = _randn(full_size, device, 1)
    opt.step()
    storage = p.data
    p.data = p.data[:n]
    tail = storage[n:].clone()
    p.grad = _randn(n, device, 2)
    with pytest.raises(RuntimeError, match="shape"):
        opt.step()
    assert torch.equal(storage[n:], tail)


def test_param_reshaped_at_same_address_is_rebuilt(device):
    """Same address and numel, other shape: the table is rebuilt for the new shape (SGD has no state to mismatch)."""
    p = torch.nn.Parameter(_randn((6, 40), device, 0))
    opt = FusedSGD([p], lr=0.5, backend="native")
    p.grad = _randn((6, 40), device, 1)
    opt.step()
    p.data = p.data.view(40, 6)
    before = p.detach().clone()
    p.grad = _randn((40, 6), device, 2)
    opt.step()
    torch.testing.assert_close(p.detach(), before - 0.5 * p.grad, rtol=0, atol=0)


@pytest.mark.parametrize("cls", [FusedSGD, FusedAdamW])
def test_grad_with_new_strides_at_same_address_is_read_with_them(device, cls):
    """A gradient at the address of the last one, with other strides, is read through its own strides."""
    shape = (48, 40)
    p = torch.nn.Parameter(_randn(shape, device, 0))
    ref = torch.nn.Parameter(p.detach().clone())
    ours = cls([p], lr=0.01, backend="native")
    theirs = (torch.optim.SGD if cls is FusedSGD else torch.optim.AdamW)([ref], lr=0.01)
    buf = _randn(shape[0] * shape[1], device, 1)
    for view in (buf.view(shape), buf.view(shape[1], shape[0]).t()):  # same address, strides (40, 1) then (1, 48)
        p.grad, ref.grad = view, view.clone()
        ours.step()
        theirs.step()
        torch.testing.assert_close(p.detach(), ref.detach(), rtol=1e-5, atol=1e-6)


def test_grad_of_another_shape_is_a_clear_error(device):
    p = torch.nn.Parameter(_randn((8, 8), device, 0))
    opt = FusedSGD([p], lr=0.1, backend="native")
    p.grad = _randn((8, 8), device, 1)
    opt.step()
    p.grad.data = _randn((4, 16), device, 2)  # bypasses the shape check of the .grad setter
    with pytest.raises(RuntimeError, match=r"gradient has shape \[4, 16\]"):
        opt.step()


# ---- one tensor reached twice ----


@pytest.mark.parametrize("cls", [FusedSGD, FusedAdamW])
def test_same_param_twice_in_one_optimizer_raises(device, cls):
    p = torch.nn.Parameter(_randn(CHUNK + 1, device, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch.optim warns about the duplicate
        opt = cls([p, p], lr=0.1, backend="native")
    p.grad = _randn(CHUNK + 1, device, 1)
    before = p.detach().clone()
    # The optimizer refuses it when it plans the step; the native table refuses it too, for direct callers.
    with pytest.raises(ValueError, match="are the same tensor"):
        opt.step()
    assert torch.equal(p.detach(), before)


@pytest.mark.parametrize("cls", [FusedSGD, FusedAdamW])
def test_params_sharing_one_grad_step_like_torch(device, cls):
    """Gradients are read-only in the optimizer kernels: two parameters may share one."""
    ps = [torch.nn.Parameter(_randn(CHUNK + 3, device, s)) for s in (0, 1)]
    refs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    ours = cls(ps, lr=0.01, backend="native")
    theirs = (torch.optim.SGD if cls is FusedSGD else torch.optim.AdamW)(refs, lr=0.01)
    g = _randn(CHUNK + 3, device, 2)
    for p in ps:
        p.grad = g
    for r in refs:
        r.grad = g.clone()
    ours.step()
    theirs.step()
    for a, b in zip(ps, refs, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


def test_scaler_refuses_a_grad_shared_by_two_params(device):
    """Unscaling in place would divide a shared gradient twice (concurrently, on CUDA)."""
    ps = [torch.nn.Parameter(_randn(CHUNK + 3, device, s)) for s in (0, 1)]
    opt = FusedSGD(ps, lr=0.01, backend="native")
    scaler = FusedGradScaler(device, init_scale=4.0, backend="native")
    scaler.scale(torch.ones((), device=device))
    g = _randn(CHUNK + 3, device, 2)
    for p in ps:
        p.grad = g
    before = g.clone()
    with pytest.raises(RuntimeError, match="same gradient tensor"):
        scaler.unscale_(opt)
    assert torch.equal(g, before)


# ---- float64 norms ----


@pytest.mark.parametrize("magnitude", [1e20, 1e-30, 1.0])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_float64_norms_accumulate_in_float64(device, magnitude, norm_type):
    """Sums of squares of float64 gradients overflow (1e20) or flush to zero (1e-30) in float32."""
    tensors = [_randn(n, device, s, torch.float64) * magnitude for s, n in enumerate((5, CHUNK + 1, 2 * CHUNK))]
    tensors.append(_randn(CHUNK - 1, device, 9) * 3.0)  # a float32 tensor in the same table
    scale = torch.ones(1, device=device)
    found = torch.zeros(1, device=device)
    norm, each, _ = torch.ops.ampkernels.unscale_reduce_(tensors, scale, found, None, False, norm_type, True, -1.0)
    want_each = torch.stack([torch.linalg.vector_norm(t.double(), norm_type) for t in tensors])
    want = torch.linalg.vector_norm(want_each, norm_type)
    assert float(found) == 0.0
    assert torch.isfinite(norm) and float(norm) > 0
    torch.testing.assert_close(norm.double(), want.float().double(), rtol=2e-6, atol=0)
    torch.testing.assert_close(each.double(), want_each.float().double(), rtol=2e-6, atol=0)


def test_shared_constants_exported(device):
    """The norm codes and chunk size of csrc/common/constants.h, as the Python side reads them."""
    native = dispatch.native()
    assert (native.norm_none, native.norm_l2, native.norm_inf) == (0, 1, 2)
    assert native.chunk_size == CHUNK
