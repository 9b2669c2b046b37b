"""The fused kernels of ``ampkernels.float8.fused``: the producers of FP8 inputs (``rms_norm`` / ``RMSNorm``,
``silu_mul``) and ``rotary_embedding``. Forward and gradients against float64 (no worse than twice plain torch's
error), the amax the producers record for the next Float8Linear (bit-exact, and the layer's result bit for bit the
same with or without it), non-finite inputs, argument errors, the custom ops (opcheck, torch.compile) and the fused
LlamaStack.

The Triton kernels run on a CUDA device, or on the CPU under ``TRITON_INTERPRET=1`` (``tests/conftest.py``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

from ampkernels import dispatch, reference
from ampkernels.float8 import Float8Linear, RMSNorm, rms_norm, rotary_embedding, silu_mul
from ampkernels.float8 import fused as fused_module

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# On a GPU machine every test here runs on the GPU: marked so, for `pytest -m gpu`.
pytestmark = [pytest.mark.gpu] if DEV == "cuda" else []
TRITON_REASON = dispatch.why_not("float8_fused", "triton", DEV)
needs_triton = pytest.mark.skipif(TRITON_REASON is not None, reason=str(TRITON_REASON))
BACKENDS = [pytest.param("triton", marks=needs_triton), "torch"]

# (x dtype, weight dtype): the stack's float32 residual stream, bf16 activations with float32 or bf16 weights, fp16.
NORM_DTYPES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
]
NORM_SHAPES = [(4, 33, 96), (37, 333), (16, 2048)]


def _err(value: torch.Tensor, exact: torch.Tensor) -> float:
    """Relative error in the max norm against a float64 result."""
    return float((value.detach().double() - exact).abs().max() / exact.abs().max().clamp_min(1e-30))


def _bound(*dtypes: torch.dtype, float32_ulps: float = 8.0) -> float:
    """The largest error (:func:`_err`) a correct computation in float32 rounded to ``dtypes`` reaches: the stock paths
    round to the lowest-precision dtype involved two or three times (half an ulp each: ``2 * eps``), and their
    float32 arithmetic (sums over a row, the rotary angles) adds ``float32_ulps`` float32 ulps. Measured on these
    inputs: at most 0.84 eps for 16-bit dtypes, 2.4 float32 ulps (5.3 for the rotary angles at T = 40)."""
    return 2 * max(torch.finfo(d).eps for d in dtypes) + float32_ulps * torch.finfo(torch.float32).eps


def _check_error(ours: torch.Tensor, stock: torch.Tensor, exact: torch.Tensor, what: str, bound: float) -> None:
    """The accuracy rule: stock's own error against float64 within ``bound`` (so that a wrong stock, the reference
    included, fails here and does not loosen the rule), and ours within 2x stock's error (and never beyond one ulp of
    the dtype where stock's own error is below that)."""
    assert _err(stock, exact) <= bound, ("stock", what, _err(stock, exact), bound)
    floor = torch.finfo(ours.dtype).eps
    assert _err(ours, exact) <= max(2 * _err(stock, exact), floor), (what, _err(ours, exact), _err(stock, exact))


def _norm_inputs(shape, x_dtype, w_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * 3.0
    x[..., 0] += 4.0  # a row mean far from zero, as a residual stream has
    w = 1.0 + 0.2 * torch.randn(shape[-1], generator=gen)
    g = torch.randn(shape, generator=gen)
    return x.to(x_dtype).to(DEV), w.to(w_dtype).to(DEV), g.to(DEV)


def _norm_exact(x, w, g, eps=1e-5):
    """float64 output and gradients of Llama's RMSNorm (no rounding anywhere)."""
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_()
    y = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + eps) * w64
    y.backward(g.double())
    return y.detach(), x64.grad, w64.grad


def _forward_backward(fn, x, w, g):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    y = fn(x, w)
    y.backward(g.to(y.dtype))
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
@pytest.mark.parametrize("dtypes", NORM_DTYPES, ids=lambda d: f"{d[0]}-{d[1]}".replace("torch.", ""))
def test_rms_norm_matches_the_reference_within_torchs_error(dtypes, shape, backend):
    x, w, g = _norm_inputs(shape, *dtypes)
    ours = _forward_backward(lambda a, b: rms_norm(a, b, backend=backend), x, w, g)
    stock = _forward_backward(reference.rms_norm, x, w, g)
    exact = _norm_exact(x, w, g)
    assert ours[0].dtype == stock[0].dtype == torch.promote_types(*dtypes)
    assert ours[1].dtype == x.dtype and ours[2].dtype == w.dtype
    for what, a, b, e in zip(("out", "grad_x", "grad_weight"), ours, stock, exact):
        _check_error(a, b, e, what, _bound(*dtypes))


@needs_triton
def test_rms_norm_rows_too_long_for_a_program_take_the_reference_math(monkeypatch):
    """Rows longer than the Triton backend's max_row run on the torch math, and still record the amax for the next
    layer."""
    monkeypatch.setattr(dispatch.backend("float8_fused", "triton"), "max_row", 64)
    x, w, g = _norm_inputs((8, 96), torch.float32, torch.float32)
    ours = _forward_backward(lambda a, b: rms_norm(a, b, backend="triton"), x, w, g)
    for a, b in zip(ours, _forward_backward(lambda a, b: rms_norm(a, b, backend="torch"), x, w, g)):
        assert torch.equal(a, b)
    out = rms_norm(x, w, backend="triton")
    assert _recorded(out) == (float(out.abs().amax()), 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rms_norm_of_strided_input_and_module(backend):
    """A transposed (non-contiguous) input, and RMSNorm the module: the values of the contiguous call."""
    x, w, _ = _norm_inputs((64, 48), torch.float32, torch.float32)
    xt, wt = x.t(), torch.linspace(0.5, 1.5, 64, device=DEV)  # [48, 64], rows not contiguous
    assert torch.equal(rms_norm(xt, wt, backend=backend), rms_norm(xt.contiguous(), wt, backend=backend))
    module = RMSNorm(48, eps=1e-6, device=DEV)
    with torch.no_grad():
        module.weight.copy_(w)
    assert list(module.state_dict()) == ["weight"]
    torch.testing.assert_close(module(x), reference.rms_norm(x, w, 1e-6), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["strided", "expanded"])
def test_rms_norm_of_a_non_contiguous_weight(layout, backend):
    """A weight that is a strided (stride 2) or expanded (stride 0) view gives the output and gradients of its
    contiguous copy, bit for bit (the Triton kernels read the weight as a dense vector: they once read the wrong
    elements, or past its storage)."""
    x, w, g = _norm_inputs((4, 33, 96), torch.bfloat16, torch.float32)
    results = []
    for contiguous in (False, True):
        base = (torch.stack((w, -w), dim=-1) if layout == "strided" else w[:1]).clone().requires_grad_()
        weight = base[:, 0] if layout == "strided" else base.expand(96)
        assert not weight.is_contiguous()
        xg = x.clone().requires_grad_()
        out = rms_norm(xg, weight.contiguous() if contiguous else weight, backend=backend)
        out.backward(g.to(out.dtype))
        results.append((out, xg.grad, base.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    values = w if layout == "strided" else w[:1].expand(96)
    torch.testing.assert_close(results[0][0], reference.rms_norm(x, values), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(4, 7, 333), (2048,)], ids=str)
def test_silu_mul_matches_the_reference_within_torchs_error(shape, dtype, backend):
    gen = torch.Generator().manual_seed(1)
    gate = (torch.randn(shape, generator=gen) * 4).to(dtype).to(DEV)
    up = torch.randn(shape, generator=gen).to(dtype).to(DEV)
    grad = torch.randn(shape, generator=gen).to(dtype).to(DEV)

    def run(fn):
        a, b = gate.clone().requires_grad_(), up.clone().requires_grad_()
        out = fn(a, b)
        out.backward(grad)
        return out.detach(), a.grad, b.grad

    ours = run(lambda a, b: silu_mul(a, b, backend=backend))
    stock = run(lambda a, b: F.silu(a) * b)  # what a model writes: two kernels, silu rounded first
    g64, u64 = gate.double().requires_grad_(), up.double().requires_grad_()
    out64 = F.silu(g64) * u64
    out64.backward(grad.double())
    for what, a, b, e in zip(("out", "grad_gate", "grad_up"), ours, stock, (out64.detach(), g64.grad, u64.grad)):
        assert a.dtype == dtype
        _check_error(a, b, e, what, _bound(dtype))


def _rope_exact(x, grad, base=10000.0):
    """float64 rotary embedding of x (half-split) and its input gradient."""
    half, T = x.shape[-1] // 2, x.shape[-2]
    inv_freq = base ** (-torch.arange(half, dtype=torch.float64) / half)
    angles = (torch.arange(T, dtype=torch.float64)[:, None] * inv_freq).to(x.device)
    cos, sin = angles.cos(), angles.sin()
    x64 = x.detach().double().requires_grad_()
    x1, x2 = x64[..., :half], x64[..., half:]
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    out.backward(grad.double())
    return out.detach(), x64.grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "layout", ["attention", "contiguous", "3d", "odd_half"], ids=["transposed-BHTD", "BHTD", "HTD", "half-9"]
)
def test_rotary_embedding_matches_the_reference_within_torchs_error(layout, dtype, backend):
    """As the attention block calls it (q [B, heads, T, D] a transposed view of [B, T, heads, D]) and other layouts:
    the output keeps x's layout; values and input gradient within 2x the error of the model's torch code."""
    from benchmarks.models import rotary

    gen = torch.Generator().manual_seed(4)
    if layout == "attention":
        x = torch.randn(2, 40, 3, 32, generator=gen).transpose(1, 2)
    elif layout == "contiguous":
        x = torch.randn(2, 3, 40, 32, generator=gen)
    elif layout == "3d":
        x = torch.randn(3, 40, 32, generator=gen)
    else:
        x = torch.randn(2, 2, 17, 18, generator=gen)
    x = (x * 2).to(dtype).to(DEV)
    grad = torch.randn(x.shape, generator=gen).to(dtype).to(DEV)

    def run(fn):
        leaf = x.detach().clone().requires_grad_() if layout != "attention" else x.detach().requires_grad_()
        out = fn(leaf)
        out.backward(grad)
        return out.detach(), leaf.grad

    ours = run(lambda t: rotary_embedding(t, backend=backend))
    stock = run(rotary)
    exact = _rope_exact(x, grad)
    assert ours[0].shape == x.shape and ours[0].dtype == dtype
    if layout == "attention" and backend == "triton":
        assert ours[0].stride() == x.stride()  # the layout attention reads, no copy
    # The float32 angles t * theta are off by up to t float32 ulps: the float32 error grows with the positions.
    bound = _bound(dtype, float32_ulps=8 + x.shape[-2])
    for what, a, b, e in zip(("out", "grad_x"), ours, stock, exact):
        _check_error(a, b, e, what, bound)


@needs_triton
def test_triton_launches_on_the_device_of_the_inputs(monkeypatch):
    """Triton launches on the current CUDA device: each fused op (forward and backward) makes its inputs' device
    current first (inputs on cuda:1 while cuda:0 is current were worked on from cuda:0)."""
    import ampkernels._runtime

    guarded = []
    real = ampkernels._runtime.device_guard
    monkeypatch.setattr(ampkernels._runtime, "device_guard", lambda device: guarded.append(device) or real(device))
    x = torch.randn(4, 6, 8, device=DEV, requires_grad=True)
    w = torch.ones(8, device=DEV, requires_grad=True)
    (rms_norm(x, w, backend="triton").sum() + silu_mul(x, x, backend="triton").sum()).backward()
    rotary_embedding(x, backend="triton").sum().backward()
    assert guarded == [x.device] * 6


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_inputs_on_a_device_that_is_not_current():
    x = torch.randn(4, 33, 96, device="cuda:1", requires_grad=True)
    w = torch.randn(96, device="cuda:1", requires_grad=True)
    results = []
    for backend in ("triton", "torch"):
        with torch.cuda.device(0):
            outs = (
                rms_norm(x, w, backend=backend),
                silu_mul(x, x * 2, backend=backend),
                rotary_embedding(x, backend=backend),
            )
            grads = torch.autograd.grad(sum(o.sum() for o in outs), (x, w))
        results.append((*outs, *grads))
    for ours, ref in zip(*results, strict=True):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


_ROTARY_FAR_STRIDE = """
import torch
from ampkernels.float8 import rotary_embedding
s = 2**30
# 3 * 2**30 + 2 fp16 elements of address space, only 4 of them touched (written here, read by the kernel).
x = torch.empty(3 * s + 2, dtype=torch.float16).as_strided((1, 2, 1, 4), (1, 1, 1, s))
x.copy_(torch.tensor([[1.0, -2.0, 3.0, 0.5], [0.25, 5.0, -6.0, 7.0]]).view(1, 2, 1, 4))
ours = rotary_embedding(x, backend="triton")
print(torch.equal(ours, rotary_embedding(x, backend="torch")))
"""


@pytest.mark.skipif(DEV != "cpu", reason="6 GiB of address space: lazily mapped on the CPU, not on a GPU")
@needs_triton
def test_rotary_embedding_element_offsets_past_int32():
    """x's last dimension with stride 2**30 (D not innermost): the element offset (i + D/2) * stride is 2**31,
    which an int32 product wraps to a negative offset (a crash under the interpreter, wrong reads on a GPU). Run in
    a subprocess so that a crash fails this test only."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _ROTARY_FAR_STRIDE], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "True", (done.returncode, done.stdout, done.stderr[-2000:])


def test_rotary_embedding_arguments_are_checked_by_name():
    x = torch.randn(2, 4, 6, device=DEV)
    with pytest.raises(ValueError, match="argument 'x'.*D even"):
        rotary_embedding(x[..., :5])
    with pytest.raises(ValueError, match="argument 'base'"):
        rotary_embedding(x, 0.0)
    with pytest.raises(ValueError, match="argument 'x'"):
        rotary_embedding(x.long())
    cos, sin = torch.ones(4, 3, device=DEV), torch.zeros(4, 3, device=DEV)
    for bad in ((cos,), (cos, sin[:3]), (cos.double(), sin), (cos, sin.bfloat16()), [cos, sin]):
        with pytest.raises(ValueError, match="argument 'tables'"):
            rotary_embedding(x, tables=bad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rotary_embedding_with_tables_given(backend):
    """``tables=(cos, sin)`` (a model's own RoPE scaling): the pairs turn by those angles, within 2x torch's error."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 24, 3, 16, generator=gen).transpose(1, 2).bfloat16().to(DEV)
    grad = torch.randn(x.shape, generator=gen).bfloat16().to(DEV)
    angles64 = torch.rand(24, 8, generator=gen, dtype=torch.float64) * 7  # not any base's angles
    cos64, sin64 = angles64.cos().to(DEV), angles64.sin().to(DEV)
    tables = (cos64.float(), sin64.float())

    def run(fn, dtype=None):
        leaf = x.detach().to(dtype or x.dtype).requires_grad_()
        out = fn(leaf)
        out.backward(grad.to(out.dtype))
        return out.detach(), leaf.grad

    def written_out(t, cos, sin):  # Hugging Face's apply_rotary_pos_emb for one tensor, tables of t's dtype
        half = t.shape[-1] // 2
        cos, sin = torch.cat((cos, cos), -1).to(t.dtype), torch.cat((sin, sin), -1).to(t.dtype)
        return t * cos + torch.cat((-t[..., half:], t[..., :half]), -1) * sin

    ours = run(lambda t: rotary_embedding(t, tables=tables, backend=backend))
    stock = run(lambda t: written_out(t, *tables))
    exact = run(lambda t: written_out(t, cos64, sin64), torch.float64)
    for what, a, b, e in zip(("out", "grad_x"), ours, stock, exact):
        _check_error(a, b, e, what, _bound(torch.bfloat16))


# --------------------------------------------------------------------------------------------------------------------
# The amax for the next layer
# --------------------------------------------------------------------------------------------------------------------


def _recorded(t: torch.Tensor) -> tuple[float, int]:
    scratch = fused_module.produced_amax(t)
    assert scratch is not None
    return float(scratch[0:1].view(torch.float32)), int(scratch[1])


@needs_triton
@pytest.mark.parametrize("producer", ["rms_norm", "silu_mul"])
def test_recorded_amax_is_the_outputs_finite_amax_and_flags_non_finite(producer):
    gen = torch.Generator().manual_seed(2)
    a = (torch.randn(40, 96, generator=gen) * 5).to(DEV)
    b = torch.randn(40, 96, generator=gen).to(DEV)

    def produce(a):
        return rms_norm(a, b[0], backend="triton") if producer == "rms_norm" else silu_mul(a, b, backend="triton")

    out = produce(a)
    amax, bad = _recorded(out)
    assert amax == float(out.abs().amax()) and bad == 0  # bit-exact: the amax of what was stored
    a[3, 5] = float("nan")
    a[7, 1] = float("inf")
    out = produce(a)
    amax, bad = _recorded(out)
    finite = out[torch.isfinite(out)]
    assert bad == 1 and amax == float(finite.abs().amax())
    assert fused_module.produced_amax(out.clone()) is None  # another tensor
    with torch.no_grad():
        out.mul_(2)
    assert fused_module.produced_amax(out) is None  # changed in place


@needs_triton
@pytest.mark.parametrize(
    "casts_backend",
    [
        pytest.param(name, marks=pytest.mark.skipif(reason is not None, reason=str(reason)))
        for name, reason in ((name, dispatch.why_not("to_float8", name, DEV)) for name in ("native", "triton"))
    ],
)
@pytest.mark.parametrize("producer", ["rms_norm", "silu_mul"])
def test_float8_linear_after_a_producer_skips_its_amax_pass_bit_for_bit(producer, casts_backend, monkeypatch):
    """A Float8Linear reading a producer's output takes the recorded amax (no amax pass) and computes exactly what it
    computes on a copy of that output (which has no record), forward and backward, with either kernel backend of the
    casts (the fused kernels stay on Triton: they have no native version)."""
    from ampkernels.float8 import casts, linear

    monkeypatch.setenv("AMPKERNELS_FLOAT8_BACKEND", casts_backend)  # (on the CPU: the casts in the interpreter too)
    taken = []
    original = casts.cast_with_produced_amax
    monkeypatch.setattr(linear, "cast_with_produced_amax", lambda *a, **k: taken.append(1) or original(*a, **k))
    torch.manual_seed(0)
    layer = Float8Linear(96, 48, device=DEV)
    twin = copy.deepcopy(layer)
    gen = torch.Generator().manual_seed(3)
    a = (torch.randn(2, 32, 96, generator=gen) * 3).to(DEV).requires_grad_()
    b = torch.randn(2, 32, 96, generator=gen).to(DEV)
    h = rms_norm(a, b[0, 0]) if producer == "rms_norm" else silu_mul(a, b)
    out = layer(h)
    assert taken == [1]
    copy_in = h.detach().clone().requires_grad_()
    expected = twin(copy_in)
    assert len(taken) == 1
    assert torch.equal(out, expected)
    grad = torch.randn(out.shape, generator=gen).to(DEV)
    out.backward(grad)
    expected.backward(grad)
    assert torch.equal(layer.weight.grad, twin.weight.grad)
    assert a.grad is not None and torch.isfinite(a.grad).all()


@needs_triton
@pytest.mark.parametrize("producer", ["rms_norm", "silu_mul"])
def test_producer_to_float8_linear_under_inference_mode(producer):
    """Under torch.inference_mode the producer's output is an inference tensor, which has no version counter: it is
    not matched to a recorded amax (an in-place change would go unseen), and the layer computes what it computes on
    the same values under no_grad."""
    torch.manual_seed(0)
    layer = Float8Linear(96, 48, device=DEV)
    gen = torch.Generator().manual_seed(3)
    a = (torch.randn(2, 32, 96, generator=gen) * 3).to(DEV)
    b = torch.randn(2, 32, 96, generator=gen).to(DEV)

    def forward():
        h = rms_norm(a, b[0, 0]) if producer == "rms_norm" else silu_mul(a, b)
        return h, layer(h)

    with torch.inference_mode():
        h, out = forward()
        assert h.is_inference() and fused_module.produced_amax(h) is None
    with torch.no_grad():
        _, expected = forward()
    assert torch.equal(out, expected)


# --------------------------------------------------------------------------------------------------------------------
# Errors, ops, torch.compile, the model
# --------------------------------------------------------------------------------------------------------------------


def test_arguments_are_checked_by_name():
    x = torch.randn(4, 8, device=DEV)
    w = torch.ones(8, device=DEV)
    with pytest.raises(ValueError, match="argument 'weight'.*shape \\[8\\]"):
        rms_norm(x, torch.ones(7, device=DEV))
    with pytest.raises(ValueError, match="argument 'x'"):
        rms_norm(x.long(), w)
    with pytest.raises(ValueError, match="argument 'eps'"):
        rms_norm(x, w, -1.0)
    with pytest.raises(ValueError, match="argument 'backend'"):
        rms_norm(x, w, backend="cuda")
    with pytest.raises(ValueError, match="argument 'up'.*no broadcasting"):
        silu_mul(x, x[:, :1])
    with pytest.raises(TypeError, match="argument 'gate'"):
        silu_mul([1.0], x)
    with pytest.raises(ValueError, match="argument 'gate'"):
        silu_mul(x.double(), x.double())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["rms_norm", "silu_mul", "rotary_embedding"])
def test_double_backward_raises_instead_of_dropping_second_order_terms(op, backend):
    """The fused backwards are not differentiable (kernels, and rms_norm's saved rstd): differentiating a gradient
    taken with ``create_graph`` raises, instead of giving no second-order terms or a graph-less gradient."""
    gen = torch.Generator().manual_seed(5)
    a = (torch.randn(2, 3, 8, 32, generator=gen) * 2).to(DEV).requires_grad_()
    b = (1.0 + 0.2 * torch.randn(32, generator=gen)).to(DEV).requires_grad_()
    c = torch.randn(2, 3, 8, 32, generator=gen).to(DEV).requires_grad_()
    if op == "rms_norm":
        inputs, out = (a, b), rms_norm(a, b, backend=backend)
    elif op == "silu_mul":
        inputs, out = (a, c), silu_mul(a, c, backend=backend)
    else:
        inputs, out = (a,), rotary_embedding(a, backend=backend)
    grads = torch.autograd.grad(out.square().sum(), inputs, create_graph=True)
    assert all(g.abs().sum() > 0 for g in grads)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        (out.sum() + sum(g.square().sum() for g in grads)).backward()
    # A loss linear in the output: constant incoming gradients, but the inputs' gradients still depend on them.
    grads = torch.autograd.grad(out.sum(), inputs, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        sum(g.square().sum() for g in grads).backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_custom_ops_pass_opcheck(backend):
    x, w, g = _norm_inputs((8, 32), torch.bfloat16, torch.float32)
    out, rstd = torch.ops.ampkernels.rms_norm(x, w, 1e-5, backend)
    torch.library.opcheck(torch.ops.ampkernels.rms_norm, (x, w, 1e-5, backend))
    torch.library.opcheck(torch.ops.ampkernels.rms_norm_backward, (g.to(out.dtype), x, w, rstd, backend))
    gate, up = x.clone(), (x * 0.5).contiguous()
    torch.library.opcheck(torch.ops.ampkernels.silu_mul, (gate, up, backend))
    torch.library.opcheck(torch.ops.ampkernels.silu_mul_backward, (x, gate, up, backend))
    cos, sin = reference.rotary_tables(32, 8, 10000.0, DEV)
    q = torch.randn(2, 3, 32, 16, device=DEV).bfloat16()
    torch.library.opcheck(torch.ops.ampkernels.rotary, (q, cos, sin, False, backend))


def test_compiled_calls_match_eager():
    x, w, g = _norm_inputs((16, 64), torch.float32, torch.float32)

    def fn(a, b):
        return rotary_embedding(silu_mul(rms_norm(a, b), a).view(2, 8, 64)).view(16, 64)

    eager = _forward_backward(fn, x, w, g)
    compiled = _forward_backward(torch.compile(fn, backend="aot_eager", fullgraph=True), x, w, g)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_inductor_compiles_rope_of_a_transposed_view():
    """The rotary op's output keeps x's layout on every backend, as its fake says: a transposed q ([B, T, H, D] viewed
    as [B, H, T, D], the attention's layout) compiled by Inductor (the torch backend once returned it contiguous,
    and Inductor's stride check failed)."""
    q = torch.randn(2, 24, 3, 16, device=DEV).transpose(1, 2).requires_grad_()

    def fn(t):
        return rotary_embedding(t * 2.0).square().sum()

    eager, compiled = fn(q), torch.compile(fn)(q)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_inductor_compiles_silu_mul_forward_and_backward():
    """The fused MLP of fuse_modules under torch.compile's default backend: Inductor lowers the silu_mul op (once an
    optional mutated amax scratch, given None, made it reject the op's one output)."""
    x, w, g = _norm_inputs((16, 64), torch.float32, torch.float32)

    def fn(a, b):
        return silu_mul(a * 2.0, a * b)

    eager = _forward_backward(fn, x, w, g)
    compiled = _forward_backward(torch.compile(fn), x, w, g)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_rms_norm_module_deferred_initialization():
    """Made on the meta device, materialized by to_empty (uninitialized: NaN here), reset_parameters gives the ones a
    directly built module starts with, as torch.nn.RMSNorm's does."""
    with torch.device("meta"):
        norm = RMSNorm(96, eps=1e-6)
    norm.to_empty(device=DEV)
    norm.weight.data.fill_(float("nan"))
    norm.reset_parameters()
    assert torch.equal(norm.weight, RMSNorm(96, device=DEV).weight)
    x = torch.randn(4, 96, device=DEV)
    assert torch.equal(norm(x), RMSNorm(96, eps=1e-6, device=DEV)(x))


def test_fused_llama_stack_has_the_plain_state_dict_and_values():
    from benchmarks.models import tiny_llama

    torch.manual_seed(0)
    plain = tiny_llama().to(DEV)
    fused = tiny_llama(fused=True).to(DEV)
    fused.load_state_dict(plain.state_dict())
    assert list(fused.state_dict()) == list(plain.state_dict())
    tokens = torch.randint(128, (2, 32), device=DEV)
    with torch.autocast(DEV, dtype=torch.bfloat16):
        a, b = plain(tokens), fused(tokens)
    (a.float().square().mean()).backward()
    (b.float().square().mean()).backward()
    torch.testing.assert_close(b.float(), a.float(), rtol=2e-2, atol=2e-2)
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=5e-2, atol=5e-4, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rotary_tables_made_inside_a_capture_are_not_kept():
    """Kernels captured in a CUDA graph run only at replay: tables made there must not serve a later eager call."""
    rotary_embedding(torch.randn(1, 2, 36, 16, device="cuda"))  # compiles the kernel outside the capture
    fused_module._TABLES.clear()
    x = torch.randn(1, 2, 37, 16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = rotary_embedding(x)
    assert not fused_module._TABLES
    torch.testing.assert_close(rotary_embedding(x), reference.rotary_embedding(x), rtol=1e-6, atol=1e-6)
    graph.replay()
    torch.testing.assert_close(captured, reference.rotary_embedding(x), rtol=1e-6, atol=1e-6)
