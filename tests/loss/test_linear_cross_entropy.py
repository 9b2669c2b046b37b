"""ampkernels.linear_cross_entropy against a float64 reference, its error against stock's (F.linear +
F.cross_entropy on float32 logits), the chunking, the edge cases of the loss, autograd, torch.compile and errors."""

import pytest
import torch
import torch.nn.functional as F

import ampkernels
from ampkernels import dispatch, reference
from ampkernels.float8 import Float8Linear
from ampkernels.loss import cross_entropy as lce_module

# The float64 error of a float32 loss of O(1) per token: the absolute floor of the 2x-stock bound (both errors can be
# at rounding level, where a ratio means nothing).
FLOOR = {torch.float32: 1e-5, torch.bfloat16: 1e-3, torch.float16: 1e-4}


def _inputs(device, tokens=300, hidden=32, vocab=203, seed=0, ignored_every=7, bias=True):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen).to(device)
    w = (torch.randn(vocab, hidden, generator=gen) / hidden**0.5).to(device)
    b = torch.randn(vocab, generator=gen).to(device) if bias else None
    t = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
    if ignored_every:
        t[::ignored_every] = -100
    return h, w, b, t


def _stock(h, w, t, b, *, label_smoothing=0.0, reduction="mean", z_loss=0.0):
    return _loss_of(F.linear(h, w, b), t, label_smoothing, reduction, z_loss)


def _stock_float8(h, w, t, b, *, label_smoothing=0.0, reduction="mean", z_loss=0.0):
    """The unfused FP8 head: a tensorwise Float8Linear (the same parameters), then F.cross_entropy on float32."""
    layer = Float8Linear(w.shape[1], w.shape[0], bias=b is not None, device=w.device)
    params = {"weight": w} if b is None else {"weight": w, "bias": b}
    logits = torch.func.functional_call(layer, params, (h,))
    return _loss_of(logits, t, label_smoothing, reduction, z_loss)


def _loss_of(logits, t, label_smoothing, reduction, z_loss):
    loss = F.cross_entropy(logits.float(), t, label_smoothing=label_smoothing, reduction=reduction)
    if z_loss:
        z = z_loss * torch.logsumexp(logits.float(), -1) ** 2 * (t != -100)
        loss = loss + (z if reduction == "none" else z.sum() / ((t != -100).sum() if reduction == "mean" else 1))
    return loss


def _loss_and_grads(fn, h, w, b, t, dtype, device, **options):
    leaves = [x.detach().clone().requires_grad_() if x is not None else None for x in (h, w, b)]
    autocast = dtype != torch.float32
    with torch.autocast(device, dtype=dtype, enabled=autocast):
        loss = fn(leaves[0], leaves[1], t, leaves[2], **options)
    grad_out = torch.linspace(0.5, 1.5, loss.numel(), device=device).reshape(loss.shape)
    (loss * grad_out).sum().backward()
    return [loss.detach().double()] + [x.grad.double() for x in leaves if x is not None]


def _ours(h, w, t, b, **options):
    return ampkernels.linear_cross_entropy(h, w, t, bias=b, **options)


def _runs_here(backend, device):
    reason = dispatch.why_not("linear_cross_entropy", backend, device)
    if reason is not None:
        pytest.skip(reason)


def _exact(h, w, b, t, **options):
    leaves = [x.detach().double().requires_grad_() if x is not None else None for x in (h, w, b)]
    loss = reference.linear_cross_entropy(leaves[0], leaves[1], t, leaves[2], **options)
    grad_out = torch.linspace(0.5, 1.5, loss.numel(), device=loss.device, dtype=torch.float64).reshape(loss.shape)
    (loss * grad_out).sum().backward()
    return [loss.detach()] + [x.grad for x in leaves if x is not None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing, z_loss", [(0.0, 0.0), (0.1, 1e-3)])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_error_at_most_twice_stock_against_float64(device, dtype, reduction, smoothing, z_loss, backend, monkeypatch):
    if device == "cpu" and dtype == torch.float16:
        pytest.skip("CPU autocast runs float16 linear layers slowly and without a reference of its own")
    _runs_here(backend, device)
    # 64-token chunks (hidden 32: 2 x hidden = 64), for float32 logits and for Triton's 16-bit ones (an eighth of
    # the logits at most): five chunks for 300 tokens, the last one ragged
    monkeypatch.setattr(lce_module, "CHUNK_BYTES", 64 * 4 * 203)
    assert lce_module.chunk_tokens(300, 203, 32) == 64 == lce_module.chunk_tokens(300, 203, 32, 2)
    h, w, b, t = _inputs(device)
    options = dict(label_smoothing=smoothing, reduction=reduction, z_loss=z_loss)
    exact = _exact(h, w, b, t, **options)
    ours = _loss_and_grads(_ours, h, w, b, t, dtype, device, backend=backend, **options)
    stock = _loss_and_grads(_stock, h, w, b, t, dtype, device, **options)
    for name, o, s, e in zip(("loss", "hidden", "weight", "bias"), ours, stock, exact):
        ours_error, stock_error = (o - e).abs().max().item(), (s - e).abs().max().item()
        assert ours_error <= 2 * stock_error + FLOOR[dtype] * max(1.0, e.abs().max().item()), (
            name,
            ours_error,
            stock_error,
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing, z_loss", [(0.0, 0.0), (0.1, 1e-3)])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_float8_head_error_at_most_twice_the_unfused_float8_heads(
    device, dtype, reduction, smoothing, z_loss, backend, monkeypatch
):
    """float8="tensorwise": loss and gradients against float64 within twice the error of the unfused FP8 head (a
    tensorwise Float8Linear, then F.cross_entropy on float32 logits); the chunks cast their own hidden states and
    logit gradients (64-token chunks here, the last one ragged)."""
    if device == "cpu" and dtype == torch.float16:
        pytest.skip("CPU autocast runs float16 linear layers slowly and without a reference of its own")
    _runs_here(backend, device)
    monkeypatch.setattr(lce_module, "CHUNK_BYTES", 64 * 4 * 208)
    assert lce_module.chunk_tokens(304, 208, 32) == 64
    h, w, b, t = _inputs(device, tokens=304, vocab=208)
    options = dict(label_smoothing=smoothing, reduction=reduction, z_loss=z_loss)
    exact = _exact(h, w, b, t, **options)
    ours = _loss_and_grads(_ours, h, w, b, t, dtype, device, backend=backend, float8="tensorwise", **options)
    stock = _loss_and_grads(_stock_float8, h, w, b, t, dtype, device, **options)
    for name, o, s, e in zip(("loss", "hidden", "weight", "bias"), ours, stock, exact):
        ours_error, stock_error = (o - e).abs().max().item(), (s - e).abs().max().item()
        assert ours_error <= 2 * stock_error + FLOOR[dtype] * max(1.0, e.abs().max().item()), (
            name,
            ours_error,
            stock_error,
        )
    # (and FP8's error is FP8's: well above the 16-bit head's, so the FP8 products did run)
    bf16 = _loss_and_grads(_ours, h, w, b, t, dtype, device, backend=backend, **options)
    assert (ours[1] - exact[1]).abs().max() > 2 * (bf16[1] - exact[1]).abs().max()


def test_float8_head_casts_the_weight_once_per_optimizer_step(monkeypatch):
    """Micro-batches reuse the weight's FP8 casts until an optimizer step (or an in-place change) makes them stale."""
    from ampkernels.float8 import casts

    cast_shapes = []
    pair = casts.to_float8_pair

    def counting(x, *args, **kwargs):
        cast_shapes.append(tuple(x.shape))
        return pair(x, *args, **kwargs)

    monkeypatch.setattr(casts, "to_float8_pair", counting)
    h, w, _, t = _inputs("cpu", tokens=64, vocab=208, bias=False)
    w.requires_grad_()
    opt = torch.optim.SGD([w], lr=0.1)

    def micro_batch():
        ampkernels.linear_cross_entropy(h, w, t, float8="tensorwise").backward()
        return cast_shapes.count((208, 32))

    assert [micro_batch(), micro_batch()] == [1, 1]
    opt.step()
    assert micro_batch() == 2
    with torch.no_grad():
        w.mul_(0.5)
    assert micro_batch() == 3


def test_float8_head_needs_multiples_of_16_else_runs_the_16_bit_head():
    h, w, b, t = _inputs("cpu", tokens=300, vocab=208)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fallback = ampkernels.linear_cross_entropy(h, w, t, bias=b, float8="tensorwise")
        plain = ampkernels.linear_cross_entropy(h, w, t, bias=b)
    assert torch.equal(fallback, plain)


@pytest.mark.parametrize("float8", ["rowwise", "delayed", 8, Float8Linear])
def test_float8_argument_is_checked(float8):
    h, w, b, t = _inputs("cpu", tokens=64, vocab=208)
    with pytest.raises(ValueError, match="argument 'float8'"):
        ampkernels.linear_cross_entropy(h, w, t, float8=float8)
    with pytest.raises(ValueError, match="argument 'float8'"):
        ampkernels.LinearCrossEntropy(32, 208, float8=float8)


def test_chunk_size_rule():
    assert lce_module.chunk_tokens(0, 10, 64) == 0
    assert lce_module.chunk_tokens(100, 32000, 2048) == 100  # fewer tokens than a chunk: one chunk
    by_bytes = lce_module.chunk_tokens(16384, 32000, 512)
    assert by_bytes % 64 == 0 and by_bytes * 32000 * 4 <= lce_module.CHUNK_BYTES < (by_bytes + 64) * 32000 * 4
    assert lce_module.chunk_tokens(16384, 128256, 2048) == 4096  # at least 2 x hidden (weight-gradient traffic)
    assert lce_module.chunk_tokens(16384, 128256, 4096) == 4096  # up to MAX_GRADIENT_BOUND
    assert lce_module.chunk_tokens(8192, 32000, 512) == 1024  # an eighth of a head smaller than CHUNK_BYTES x 8
    assert lce_module.chunk_tokens(16384, 10**9, 8) == 64  # at least 64 tokens, whatever the vocabulary


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_batch_matches_stock(reduction):
    h, w, b, t = _inputs("cpu", tokens=8, ignored_every=1)
    ours = _loss_and_grads(_ours, h, w, b, t, torch.float32, "cpu", reduction=reduction)
    stock = _loss_and_grads(_stock, h, w, b, t, torch.float32, "cpu", reduction=reduction)
    for o, s in zip(ours, stock):
        torch.testing.assert_close(o, s, equal_nan=True)  # mean: NaN loss, zero gradients, as torch
    if reduction == "mean":
        assert ours[0].isnan()


def test_gradients_only_for_what_requires_them():
    h, w, b, t = _inputs("cpu", bias=True)
    w.requires_grad_()
    loss = ampkernels.linear_cross_entropy(h, w, t, bias=b)
    loss.backward()
    assert h.grad is None and b.grad is None and w.grad is not None
    with torch.no_grad():
        torch.testing.assert_close(ampkernels.linear_cross_entropy(h, w, t, bias=b), loss.detach())


def test_second_derivative_refused():
    h, w, b, t = _inputs("cpu", bias=False)
    h.requires_grad_()
    (grad,) = torch.autograd.grad(ampkernels.linear_cross_entropy(h, w, t), h, create_graph=True)
    with pytest.raises(RuntimeError):
        grad.sum().backward()


def test_module_is_an_nn_linear_head():
    torch.manual_seed(0)
    head = ampkernels.LinearCrossEntropy(32, 203, bias=True, label_smoothing=0.1)
    linear = torch.nn.Linear(32, 203)
    linear.load_state_dict(head.state_dict())
    h, _, _, t = _inputs("cpu")
    expected = F.cross_entropy(linear(h), t, label_smoothing=0.1)
    torch.testing.assert_close(head(h, t), expected, rtol=1e-5, atol=1e-5)
    assert "vocab=203" in repr(head)


def test_leading_dimensions_and_none_reduction_shape():
    h, w, b, t = _inputs("cpu", tokens=24)
    out = ampkernels.linear_cross_entropy(h.view(2, 3, 4, -1), w, t.view(2, 3, 4), bias=b, reduction="none")
    assert out.shape == (2, 3, 4)
    torch.testing.assert_close(out.reshape(-1), _stock(h, w, t, b, reduction="none"), rtol=1e-5, atol=1e-5)


def test_traced_by_torch_compile_and_opcheck():
    h, w, b, t = _inputs("cpu", tokens=64, bias=False)
    h.requires_grad_()

    def step(h, w, t):
        return ampkernels.linear_cross_entropy(h, w, t, label_smoothing=0.1)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    loss = compiled(h, w, t)
    loss.backward()
    expected = h.grad.clone()
    h.grad = None
    step(h, w, t).backward()
    torch.testing.assert_close(h.grad, expected)
    for backend in ("torch", "triton"):
        if dispatch.why_not("linear_cross_entropy", backend, "cpu") is None:
            for float8 in ((None, None), (torch.float8_e4m3fn, torch.float8_e5m2)):
                options = (-100, 0.1, 0.0, "mean", [True, True, False], *float8, h.dtype, backend)
                args = (h.detach(), w, t, None, *options)
                torch.library.opcheck(torch.ops.ampkernels.linear_cross_entropy.default, args)


@pytest.mark.parametrize(
    "change, argument",
    [
        (dict(weight=torch.randn(10, 31)), "weight"),
        (dict(target=torch.zeros(300, dtype=torch.float32)), "target"),
        (dict(target=torch.full((300,), 203)), "target"),
        (dict(bias=torch.randn(7)), "bias"),
        (dict(reduction="avg"), "reduction"),
        (dict(label_smoothing=1.5), "label_smoothing"),
        (dict(z_loss=-1.0), "z_loss"),
        (dict(weight=torch.randn(203, 32, dtype=torch.float64)), "weight"),
    ],
)
def test_bad_arguments_are_named(change, argument):
    h, w, b, t = _inputs("cpu")
    kwargs = dict(hidden=h, weight=w, target=t, bias=b)
    kwargs.update(change)
    with pytest.raises(ValueError, match=f"argument '{argument}'"):
        ampkernels.linear_cross_entropy(kwargs.pop("hidden"), kwargs.pop("weight"), kwargs.pop("target"), **kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_peak_memory_below_the_logits_on_cuda():
    tokens, hidden, vocab = 8192, 512, 32000
    h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, vocab, (tokens,), device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ampkernels.linear_cross_entropy(h, w, t).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    logits_fp32 = tokens * vocab * 4
    assert peak < logits_fp32 / 2, (peak, logits_fp32)


def test_fp16_gradients_under_a_loss_scale_match_stock():
    """With fp16 operands, the mean's 1 / tokens and the loss scale meet in float32: neither flushes the other's
    gradient to zero nor overflows it (stock applies the scale to the float32 logits' gradient first)."""
    tokens = 4096
    h, w, b, t = _inputs("cpu", tokens=tokens, bias=False, ignored_every=0)
    h16, w16 = h.half().requires_grad_(), w.half().requires_grad_()
    (ampkernels.linear_cross_entropy(h16, w16, t) * 65536.0).backward()
    ours = [h16.grad.float(), w16.grad.float()]
    h16.grad = w16.grad = None
    (_stock(h16, w16, t, None) * 65536.0).backward()
    stock = [h16.grad.float(), w16.grad.float()]
    for o, s in zip(ours, stock):
        assert torch.isfinite(o).all() and (o != 0).float().mean() > 0.99  # nothing flushed to zero
        torch.testing.assert_close(o, s, rtol=2e-2, atol=1e-2)


def test_scaled_loss_overflow_reaches_the_scaler_and_skips_the_step():
    h, w, b, t = _inputs("cpu", bias=False)
    head = torch.nn.Parameter(w.half())
    optimizer = ampkernels.FusedAdamW([head], lr=1e-2)
    scaler = ampkernels.FusedGradScaler("cpu", init_scale=2.0**40)  # the fp16 gradients overflow
    before = head.detach().clone()
    scaler.scale(ampkernels.linear_cross_entropy(h.half(), head, t)).backward()
    assert not torch.isfinite(head.grad).all()
    scaler.step(optimizer)
    scaler.update()
    assert torch.equal(head.detach(), before) and scaler.get_scale() == 2.0**39


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_reference_is_torch_cross_entropy_in_float64(reduction):
    """The reference against torch's own float64 formula (and the z-loss term against an explicit log-sum-exp)."""
    h, w, b, t = (x.double() if x.is_floating_point() else x for x in _inputs("cpu", tokens=64))
    logits = F.linear(h, w, b)
    expected = F.cross_entropy(logits, t, label_smoothing=0.2, reduction=reduction)
    got = reference.linear_cross_entropy(h, w, t, b, label_smoothing=0.2, reduction=reduction)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    z = 0.01 * torch.log(torch.exp(logits).sum(-1)) ** 2 * (t != -100)
    with_z = reference.linear_cross_entropy(h, w, t, b, reduction="none", z_loss=0.01)
    torch.testing.assert_close(with_z, F.cross_entropy(logits, t, reduction="none") + z, rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("float8", [None, "tensorwise"])
def test_captured_step_replays_the_eager_run(float8):
    """A head trained with fp16 autocast, FusedGradScaler and FusedAdamW, captured by capture_step: the replays give
    the eager run's losses and parameters (the target check's host sync is skipped inside the capture), with the
    head in fp16 and in FP8 (whose weight casts are cached between steps)."""

    def build():
        torch.manual_seed(0)
        trunk = torch.nn.Linear(64, 128).cuda()
        head = ampkernels.LinearCrossEntropy(128, 1008, label_smoothing=0.1, float8=float8).cuda()
        model = torch.nn.ModuleDict({"trunk": trunk, "head": head})
        return model, ampkernels.FusedAdamW(model.parameters(), lr=1e-3), ampkernels.FusedGradScaler("cuda")

    def step_fn(model, opt, scaler):
        def step(x, t):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model["head"](torch.tanh(model["trunk"](x)), t)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            return loss.detach()

        return step

    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(512, 64, generator=gen).cuda(), torch.randint(0, 1008, (512,), generator=gen).cuda())
               for _ in range(5)]  # fmt: skip
    eager_model, eager_opt, eager_scaler = build()
    eager = step_fn(eager_model, eager_opt, eager_scaler)
    expected = [float(eager(x, t)) for x, t in batches]
    model, opt, scaler = build()
    graphed = ampkernels.capture_step(step_fn(model, opt, scaler), *batches[0], models=model, optimizers=opt,
                                      scalers=scaler)  # fmt: skip
    assert [float(graphed(x, t)) for x, t in batches] == pytest.approx(expected, rel=1e-5)
    for p, q in zip(eager_model.parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
