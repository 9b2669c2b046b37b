"""The native launch tables (ampkernels._C.OptimizerTable, GradTable) and kernels against the cases where a cached
table could go stale or two entries could alias: parameters whose ``.data`` shrinks or changes layout at the same
address, gradients at the same address with other strides, one tensor reached twice; and float64 norms."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from ampkernels import FusedAdamW, FusedGradScaler, FusedSGD, _constants, dispatch
from ampkernels._constants import NO_CLIP, NormKind, norm_kind

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
    kind = norm_kind(norm_type)
    norm, each, _ = torch.ops.ampkernels.unscale_reduce_(tensors, scale, found, None, False, kind, True, NO_CLIP)
    want_each = torch.stack([torch.linalg.vector_norm(t.double(), norm_type) for t in tensors])
    want = torch.linalg.vector_norm(want_each, norm_type)
    assert float(found) == 0.0
    assert torch.isfinite(norm) and float(norm) > 0
    torch.testing.assert_close(norm.double(), want.float().double(), rtol=2e-6, atol=0)
    torch.testing.assert_close(each.double(), want_each.float().double(), rtol=2e-6, atol=0)


def test_shared_constants_exported(device):
    """csrc/common/constants.h as ampkernels._C exports it equals its mirror in ampkernels._constants (which the
    Python and Triton sides use): every NormKind and no other, the no-clip max_norm, the chunk size."""
    native = dispatch.native()
    exported = {name: getattr(native, name) for name in dir(native) if name.startswith("norm_")}
    assert exported == {f"norm_{kind.name.lower()}": kind.value for kind in NormKind}
    assert len(set(exported.values())) == len(NormKind) == 3
    assert native.no_clip == NO_CLIP < 0  # any max_norm >= 0 is a real clip
    assert native.chunk_size == _constants.CHUNK == CHUNK


# ---- memory the kernels would reach twice, and arguments they would trust ----


def _unscale_op(tensors, scale=2.0, write=True, norm_type=None, per_tensor=False):
    device = tensors[0].device
    found = torch.zeros(1, device=device)
    out = torch.ops.ampkernels.unscale_reduce_(
        tensors, torch.tensor([scale], device=device), found, None, write, norm_kind(norm_type), per_tensor, NO_CLIP
    )
    return found, out


@pytest.mark.parametrize("views", ["same tensor", "overlapping views"])
def test_unscale_op_refuses_tensors_sharing_memory_when_writing(device, views):
    """One element reached through two list entries was unscaled twice (by concurrent blocks on CUDA)."""
    buf = torch.full((2 * CHUNK + 10,), 8.0, device=device)
    if views == "same tensor":
        tensors = [buf, buf]
    else:
        tensors = [buf[: CHUNK + 10], buf[CHUNK:]]
    with pytest.raises(RuntimeError, match=r"argument 'tensors': elements 0 and 1 share memory"):
        _unscale_op(tensors)
    assert torch.equal(buf, torch.full_like(buf, 8.0)), "the refused call wrote"
    # Read-only, the same list is fine: each entry's norm as torch.linalg.vector_norm gives it.
    found, (_, each, _) = _unscale_op(tensors, write=False, norm_type=2.0, per_tensor=True)
    want = torch.stack([torch.linalg.vector_norm(t / 2.0) for t in tensors])
    torch.testing.assert_close(each, want)
    assert float(found) == 0.0 and torch.equal(buf, torch.full_like(buf, 8.0))


def test_unscale_op_refuses_an_expanded_tensor_before_writing_any(device):
    """The write-back into an expanded tensor failed after the other tensors had been unscaled in place."""
    dense = torch.full((CHUNK + 3,), 8.0, device=device)
    expanded = torch.full((1,), 8.0, device=device).expand(40)
    with pytest.raises(RuntimeError, match=r"argument 'tensors': element 1 has elements that share memory"):
        _unscale_op([dense, expanded])
    assert torch.equal(dense, torch.full_like(dense, 8.0)), "the refused call unscaled element 0"
    found, (norm, _, _) = _unscale_op([dense, expanded], write=False, norm_type=math.inf)
    assert float(norm) == 4.0 and float(found) == 0.0


def test_scaler_refuses_overlapping_grads_of_two_params(device):
    """Gradients that are overlapping views of one buffer (different start addresses) were unscaled twice where
    they overlap."""
    n = CHUNK + 3
    ps = [torch.nn.Parameter(_randn(n, device, s)) for s in (0, 1)]
    opt = FusedSGD(ps, lr=0.01, backend="native")
    scaler = FusedGradScaler(device, init_scale=4.0, backend="native")
    scaler.scale(torch.ones((), device=device))
    buf = _randn(n + 100, device, 2)
    ps[0].grad, ps[1].grad = buf[:n], buf[100:]
    before = buf.clone()
    with pytest.raises(RuntimeError, match="parameters 0 and 1 have gradients that share memory"):
        scaler.unscale_(opt)
    assert torch.equal(buf, before)


def test_scaler_refuses_an_expanded_grad_before_writing_any(device):
    n = CHUNK + 3
    ps = [torch.nn.Parameter(_randn(n, device, s)) for s in (0, 1)]
    opt = FusedSGD(ps, lr=0.01, backend="native")
    scaler = FusedGradScaler(device, init_scale=4.0, backend="native")
    scaler.scale(torch.ones((), device=device))
    ps[0].grad = _randn(n, device, 2)
    ps[1].grad = torch.full((1,), 3.0, device=device).expand(n)
    before = ps[0].grad.clone()
    with pytest.raises(RuntimeError, match="parameter 1 has a gradient whose elements share memory"):
        scaler.unscale_(opt)
    assert torch.equal(ps[0].grad, before), "the refused call unscaled parameter 0's gradient"


def _update_scale_args(device, **over):
    args = dict(
        scale=torch.tensor([4.0], device=device),
        growth_tracker=torch.zeros(1, dtype=torch.int32, device=device),
        hysteresis_tracker=torch.ones(1, dtype=torch.int32, device=device),
        found_inf=torch.zeros(1, device=device),
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=1,
        hysteresis=1,
        min_scale=0.0,
        max_scale=1e30,
        counters=None,
        history=None,
    )
    args.update(over)
    return args


@pytest.mark.parametrize("count", [-1, -6, -(2**40) - 1])
def test_update_scale_negative_counter_writes_inside_history(device, count):
    """history[counters[0] % N] with C++'s `%` wrote before the history for a negative count; the slot is the
    reference's (torch's remainder, in [0, N))."""
    storage = torch.full((12,), -7.0, device=device)
    history = storage[4:8]
    counters = torch.tensor([count, 0], device=device)
    torch.ops.ampkernels.update_scale_(**_update_scale_args(device, counters=counters, history=history))
    assert torch.equal(storage[:4], torch.full((4,), -7.0, device=device)), "wrote before the history"
    assert torch.equal(storage[8:], torch.full((4,), -7.0, device=device)), "wrote after the history"
    want = torch.full((4,), -7.0, device=device)
    want[count % 4] = 8.0  # grown from 4 (growth_interval 1)
    assert torch.equal(history, want)
    assert counters.tolist() == [count + 1, 0]


@pytest.mark.parametrize("arg", ["growth_interval", "hysteresis"])
@pytest.mark.parametrize("value", [2**31, 2**32 + 1])
def test_update_scale_refuses_counts_beyond_int32(device, arg, value):
    """The trackers are int32: hysteresis 2**32 + 1 was stored as 1 (backing off at every overflow)."""
    args = _update_scale_args(device, **{arg: value})
    with pytest.raises(RuntimeError, match=rf"argument '{arg}': must be in \[1, 2\*\*31\)"):
        torch.ops.ampkernels.update_scale_(**args)
    assert float(args["scale"]) == 4.0


@pytest.mark.parametrize(
    "kind,state,msg",
    [
        ("adam", "no step", "Adam needs exp_avg, exp_avg_sq and step"),
        ("adam", "no exp_avg_sq", "Adam needs exp_avg, exp_avg_sq and step"),
        ("sgd", "buffer without step", "SGD takes momentum_buffer and step tensors together"),
    ],
)
def test_optimizer_table_refuses_missing_state_lists(device, kind, state, msg):
    """The kernels read these lists unchecked: a missing moment was dereferenced (a crash), a missing step count
    left the step size unset (the parameters stepped by garbage)."""
    p = torch.nn.Parameter(_randn(100, device, 0))
    p.grad = _randn(100, device, 1)
    like = lambda: torch.zeros_like(p)  # noqa: E731
    step = [torch.zeros(1, device=device)]
    lists = {
        "no step": [[like()], [like()], [], [], []],
        "no exp_avg_sq": [[like()], [], [], [], step],
        "buffer without step": [[like()], [], [], [], []],
    }[state]
    with pytest.raises(RuntimeError, match=rf"argument 'state': {msg}"):
        dispatch.native().OptimizerTable(kind, [p.detach()], lists, [], torch.float32)


def _matmul_cpu_args(**over):
    args = dict(
        a=torch.randn(6, 4).half(),
        b=torch.randn(4, 5).half(),
        scale=None,
        scale_mode=0,
        alpha=1.0,
        bias=None,
        out=torch.empty(6, 5),
        accumulate=False,
        found_inf=None,
    )
    args.update(over)
    return args


def _padded_a_under_out():
    """a: rows of 4 halfs 16 apart (a view with gaps: torch's overlap test says "too hard"); out over its rows."""
    wide = torch.zeros(6, 16, dtype=torch.float16)
    return dict(a=wide[:, :4], out=wide.view(torch.float32).reshape(-1)[:30].view(6, 5))


@pytest.mark.parametrize("op", ["scaled_matmul_wmma_", "scaled_matmul_wgmma_"])
@pytest.mark.parametrize(
    "arg,over",
    [
        ("bias", lambda out: dict(bias=out[1])),
        ("scale", lambda out: dict(scale_mode=3, scale=out[2])),
        ("scale", lambda out: dict(scale_mode=1, scale=out[3, 4:])),
        ("found_inf", lambda out: dict(found_inf=out[0, :1])),
        ("a", lambda out: _padded_a_under_out()),
    ],
)
def test_scaled_matmul_out_must_not_overlap_what_the_kernel_reads(device, op, arg, over):
    """The kernels write `out` while they read the scale and bias and write found_inf: the op checked only a and b
    (and those only where torch's overlap test could tell)."""
    if device != "cpu":
        pytest.skip("argument checks, run on CPU tensors")
    out = torch.empty(6, 5)
    args = _matmul_cpu_args(out=out)
    args.update(over(out))
    with pytest.raises(RuntimeError, match=rf"argument 'out': must not overlap '{arg}'"):
        getattr(torch.ops.ampkernels, op)(**args)


def test_scaled_matmul_fp8_out_must_not_overlap_its_factors(device):
    if device != "cpu":
        pytest.skip("argument checks, run on CPU tensors")
    a = torch.zeros(6, 32).to(torch.float8_e4m3fn)
    b = torch.zeros(5, 32).to(torch.float8_e4m3fn).t()
    for name in ("scale_a", "scale_b", "amax_out"):
        out = torch.empty(6, 5)
        factors = dict(scale_a=None, scale_b=None, amax_out=None)
        factors[name] = out[1, :1]
        with pytest.raises(RuntimeError, match=rf"argument 'out': must not overlap '{name}'"):
            torch.ops.ampkernels.scaled_matmul_fp8_wgmma_(
                a,
                b,
                factors["scale_a"],
                factors["scale_b"],
                None,
                0,
                1.0,
                None,
                out,
                False,
                None,
                factors["amax_out"],
            )
