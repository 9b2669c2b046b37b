"""Fused linear + cross-entropy: the loss of a language-model head without its [tokens, vocab] logits in memory.

Stock ``F.cross_entropy(F.linear(hidden, weight), target)`` under autocast materializes the logits in bf16/fp16,
their float32 copy for the loss, and a float32 gradient of the same size: 2 x 2.1 GB at 16k tokens and a 32k vocab,
2 x 8.4 GB at a 128k vocab. Here the tokens go through the head in chunks: each chunk's logits are formed (a GEMM on
the Tensor Cores, as stock's), reduced to the loss, turned into their gradient and consumed by the two gradient
GEMMs before the next chunk starts, so only one chunk of logits ever exists. With ``reduction="mean"`` or ``"sum"``
the gradients are formed in the forward pass (the loss is the last op of the graph; backward scales them by the
incoming scalar); with ``"none"`` the backward runs the chunks again with the per-token incoming gradients.

Backends (:mod:`ampkernels.dispatch`, op ``"linear_cross_entropy"``): ``triton`` (the default on CUDA tensors) runs
one kernel per chunk that reads the GEMM's 16-bit logits twice (an online log-sum-exp, then the softmax) and writes
their gradient over them; ``torch`` (the default on CPU tensors) runs ``reference.cross_entropy_chunk`` on a float32
copy. Both keep stock's numerics: logits in the GEMM's output dtype (bf16/fp16 under autocast), softmax and
log-sum-exp in float32, the logits' gradient rounded to the GEMM dtype for the gradient GEMMs (as autocast's
``F.linear`` backward rounds it), the weight gradient accumulated over the chunks in float32 and rounded once.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from ampkernels import dispatch
from ampkernels._autograd import first_order
from ampkernels._runtime import capturing
from ampkernels.loss import backends as _backends  # (registers the ops' backends)

__all__ = ["LinearCrossEntropy", "head_float8", "linear_cross_entropy"]

_OP = "linear_cross_entropy"

REDUCTIONS = ("mean", "sum", "none")
# Float32 bytes of logits (and of their gradient, formed in place) per chunk, at least. NOTE: 256 MiB keeps a
# chunk's GEMM large (2048 tokens x a 32k vocab) while the chunk stays a small share of an 80 GB GPU.
CHUNK_BYTES = 256 * 2**20
# At most this share of the logits per chunk (a smaller head than CHUNK_BYTES' size): a chunk's float32 logits and
# their 16-bit copy for the gradient GEMMs stay well under one whole copy of the logits in any dtype.
MIN_CHUNKS = 8
# The 2 x hidden lower bound stops here. NOTE: at hidden 4096 and a 128k vocab, 4096-token chunks measured as fast as
# 8192-token ones with less peak memory, 2048-token ones 10% slower (dev/loss/NOTES.md, chunk probe).
MAX_GRADIENT_BOUND = 4096


def chunk_tokens(tokens: int, vocab: int, hidden: int, logit_bytes: int = 4) -> int:
    """Tokens per chunk, a multiple of 64: as many as fit ``CHUNK_BYTES`` of logits at ``logit_bytes`` each (the
    torch backend's float32 copy: 4; the Triton backend works on the GEMM's 16-bit output: 2), an eighth of them at
    most, and at least 2 x hidden (up to :data:`MAX_GRADIENT_BOUND`).

    Each chunk adds its product into the float32 weight gradient, reading and writing all V x H of it; with chunks
    of at least 2H tokens that traffic stays below the chunk's own logits traffic (a 128k vocab at hidden 4096 has
    512-token chunks by the byte budget alone, 32 passes over a 2 GB gradient for 16k tokens).
    """
    budget = min(CHUNK_BYTES, logit_bytes * tokens * vocab // MIN_CHUNKS)
    by_bytes = budget // (logit_bytes * max(vocab, 1)) // 64 * 64
    fit = max(by_bytes, min(-(-2 * hidden // 64) * 64, MAX_GRADIENT_BOUND), 64)
    return min(tokens, fit) if tokens else 0


_ADDMM_OUT_DTYPE = hasattr(torch.ops.aten.addmm, "dtype")  # addmm with a float32 output for 16-bit operands


def _accumulate_weight_grad(grad_weight: torch.Tensor, grad_logits: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """grad_weight (float32) + grad_logits.T @ hidden, the product accumulated in float32."""
    if grad_logits.dtype == torch.float32 or hidden.device.type != "cuda" or not _ADDMM_OUT_DTYPE:
        return grad_weight.addmm_(grad_logits.t().float(), hidden.float())
    return torch.addmm(grad_weight, grad_logits.t(), hidden, out_dtype=torch.float32)  # 16-bit operands


class _Bf16Head:
    """The head's three products in hidden's dtype (cuBLAS; the autocast dtype under autocast), as F.linear's."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.hidden, self.weight, self.bias = hidden, weight, bias

    def logits(self, rows: slice) -> torch.Tensor:
        return torch.nn.functional.linear(self.hidden[rows], self.weight, self.bias)

    def gradients(self, rows: slice, grad_logits, grad_hidden, grad_weight) -> torch.Tensor | None:
        if grad_hidden is not None:
            torch.mm(grad_logits, self.weight, out=grad_hidden[rows])
        if grad_weight is not None:
            grad_weight = _accumulate_weight_grad(grad_weight, grad_logits, self.hidden[rows])
        return grad_weight


@functools.cache
def _head_weight_casts():
    """The FP8 heads' weight casts (made on first use: ampkernels.float8 imports this module)."""
    from ampkernels.float8.weight_casts import WeightCasts

    return WeightCasts()


class _Float8Head:
    """The head's three products in FP8 with one scale per tensor and current scaling, as a tensorwise
    :class:`~ampkernels.float8.Float8Linear`'s: the hidden states cast once (both layouts) and the weight once (kept
    across micro-batches, as a layer's own casts: :mod:`ampkernels.float8.weight_casts`) in ``forward_dtype``, so
    that every chunk's logits are the unfused layer's; each chunk's logit gradient in ``backward_dtype`` with its own
    amax. The weight gradient is accumulated in float32 in the GEMM's epilogue."""

    def __init__(self, hidden, weight, bias, dtypes, logits_dtype: torch.dtype, need_weight_grad: bool) -> None:
        from ampkernels.float8.casts import to_float8, to_float8_pair  # (ampkernels.float8 imports this module)
        from ampkernels.matmul.api import scaled_matmul

        self.to_float8, self.to_float8_pair, self.mm = to_float8, to_float8_pair, scaled_matmul
        self.bias, self.out_dtype = bias, logits_dtype
        fwd, self.bwd = dtypes
        if need_weight_grad:
            self.h8, self.ht8, self.h_inv = to_float8_pair(hidden, fwd)
        else:
            (self.h8, self.h_inv), self.ht8 = to_float8(hidden, fwd), None
        settings = (fwd, weight.dtype)
        cache = _head_weight_casts()
        casts = cache.get("tensor", weight, settings)
        if casts is None:
            casts = cache.put("tensor", weight, settings, to_float8_pair(weight, fwd))
        self.w8, self.wt8, self.w_inv = casts

    def logits(self, rows: slice) -> torch.Tensor:
        scales = {"scale_a": self.h_inv, "scale_b": self.w_inv}
        return self.mm(self.h8[rows], self.w8.t(), **scales, bias=self.bias, out_dtype=self.out_dtype)

    def gradients(self, rows: slice, grad_logits, grad_hidden, grad_weight) -> torch.Tensor | None:
        if grad_weight is None:
            (g8, g_inv), gt8 = self.to_float8(grad_logits, self.bwd), None
        else:
            g8, gt8, g_inv = self.to_float8_pair(grad_logits, self.bwd)
        if grad_hidden is not None:
            self.mm(g8, self.wt8.t(), scale_a=g_inv, scale_b=self.w_inv, out=grad_hidden[rows])
        if grad_weight is not None:
            ht8 = self.ht8[:, rows]  # ([H, chunk] of the [H, N] layout: b's columns, one row apart)
            self.mm(gt8, ht8.t(), scale_a=g_inv, scale_b=self.h_inv, out=grad_weight, accumulate=True)
        return grad_weight


def _chunked(
    backend: _backends.LossBackend,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    options: tuple[int, float, float],
    token_weight: torch.Tensor | None,
    needs: tuple[bool, bool, bool],
    float8: tuple[torch.dtype, torch.dtype] | None,
    logits_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The per-token losses (float32 [N]) and, with ``token_weight`` (float32 [N], the derivative of the result by
    each token's loss), the gradients of hidden, weight and bias that ``needs`` asks for. ``float8``: the head's
    (forward, backward) FP8 dtypes, or None for hidden's dtype; ``logits_dtype``: the head's output."""
    tokens, vocab = hidden.shape[0], weight.shape[0]
    losses = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
    grads = token_weight is not None
    grad_hidden = torch.empty_like(hidden) if grads and needs[0] else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if grads and needs[1] else None
    grad_bias = torch.zeros(vocab, dtype=torch.float32, device=weight.device) if grads and needs[2] else None
    if float8 is None:
        head = _Bf16Head(hidden, weight, bias)
    else:
        head = _Float8Head(hidden, weight, bias, float8, logits_dtype, grad_weight is not None)
    step = chunk_tokens(tokens, vocab, hidden.shape[1], backend.logit_bytes(logits_dtype))
    for start in range(0, tokens, step):
        rows = slice(start, start + step)
        logits = head.logits(rows)
        grad_logits = backend.losses_and_grad_logits(
            logits, target[rows], None if token_weight is None else token_weight[rows], losses[rows], options
        )
        if grad_logits is None:
            continue
        if grad_bias is not None:
            grad_bias.add_(grad_logits.sum(0, dtype=torch.float32))
        grad_logits = grad_logits.to(logits_dtype)  # (as the float32 loss's backward rounds it)
        grad_weight = head.gradients(rows, grad_logits, grad_hidden, grad_weight)
    return losses, grad_hidden, grad_weight, grad_bias


def _empty(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0)


@torch.library.custom_op("ampkernels::linear_cross_entropy", mutates_args=())
def _forward_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    reduction: str,
    needs: list[bool],
    float8_forward: torch.dtype | None,
    float8_backward: torch.dtype | None,
    logits_dtype: torch.dtype,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (per-token losses float32 [N], counted tokens float32 [], grad_hidden [N, H] or empty, grad_weight float32
    [V, H] or empty, grad_bias float32 [V] or empty). With reduction mean or sum the gradients are those of the
    *sum* of the losses: the mean's 1 / counted and the incoming gradient (a loss scale) are applied in float32 by
    the backward, so that an fp16 gradient is neither flushed to zero by 1 / counted nor overflowed by the scale
    before it meets the other. ``float8_forward``/``float8_backward``: the FP8 head's dtypes (None: the 16-bit
    head); ``logits_dtype``: the head's output (the autocast dtype, else hidden's)."""
    counted = (target != ignore_index).sum().float()
    token_weight = None
    if reduction != "none" and any(needs):
        token_weight = torch.ones((), dtype=torch.float32, device=hidden.device).expand(target.shape[0])
    options = (ignore_index, label_smoothing, z_loss)
    chosen = dispatch.backend(_OP, backend)
    float8 = None if float8_forward is None else (float8_forward, float8_backward)
    losses, gh, gw, gb = _chunked(
        chosen, hidden, weight, target, bias, options, token_weight, tuple(needs), float8, logits_dtype
    )
    return losses, counted, *(_empty(hidden) if g is None else g for g in (gh, gw, gb))


@_forward_op.register_fake
def _(hidden, weight, target, bias, ignore_index, label_smoothing, z_loss, reduction, needs, *dtypes_and_backend):
    grads = reduction != "none"
    tokens, vocab = hidden.shape[0], weight.shape[0]
    losses = hidden.new_empty(tokens, dtype=torch.float32)
    counted = hidden.new_empty((), dtype=torch.float32)
    gh = hidden.new_empty(hidden.shape) if grads and needs[0] else _empty(hidden)
    gw = weight.new_empty(weight.shape, dtype=torch.float32) if grads and needs[1] else _empty(hidden)
    gb = weight.new_empty(vocab, dtype=torch.float32) if grads and needs[2] else _empty(hidden)
    return losses, counted, gh, gw, gb


@torch.library.custom_op("ampkernels::linear_cross_entropy_backward", mutates_args=())
def _backward_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    grad_losses: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    needs: list[bool],
    float8_forward: torch.dtype | None,
    float8_backward: torch.dtype | None,
    logits_dtype: torch.dtype,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """reduction="none": the chunks again, each token's gradient weighted by ``grad_losses`` (float32 [N])."""
    options = (ignore_index, label_smoothing, z_loss)
    chosen = dispatch.backend(_OP, backend)
    float8 = None if float8_forward is None else (float8_forward, float8_backward)
    _, gh, gw, gb = _chunked(
        chosen, hidden, weight, target, bias, options, grad_losses, tuple(needs), float8, logits_dtype
    )
    return tuple(_empty(hidden) if g is None else g for g in (gh, gw, gb))


@_backward_op.register_fake
def _(hidden, weight, target, bias, grad_losses, ignore_index, label_smoothing, z_loss, needs, *dtypes_and_backend):
    gh = hidden.new_empty(hidden.shape) if needs[0] else _empty(hidden)
    gw = weight.new_empty(weight.shape, dtype=torch.float32) if needs[1] else _empty(hidden)
    gb = weight.new_empty(weight.shape[0], dtype=torch.float32) if needs[2] else _empty(hidden)
    return gh, gw, gb


class _LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, bias, ignore_index, label_smoothing, z_loss, reduction, dtypes, backend):
        needs = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[3]]
        losses, counted, gh, gw, gb = torch.ops.ampkernels.linear_cross_entropy(
            hidden, weight, target, bias, ignore_index, label_smoothing, z_loss, reduction, needs, *dtypes, backend
        )
        ctx.reduction, ctx.needs, ctx.head_dtypes, ctx.backend = reduction, needs, dtypes, backend
        ctx.options = (ignore_index, label_smoothing, z_loss)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        if reduction == "none":
            ctx.save_for_backward(hidden, weight, target, bias)
            return losses
        ctx.save_for_backward(gh, gw, gb, counted)
        total = losses.sum()
        return total / counted if reduction == "mean" else total

    @staticmethod
    @first_order
    def backward(ctx, grad):
        if ctx.reduction == "none":
            hidden, weight, target, bias = ctx.saved_tensors
            grad_losses = grad.float().contiguous()
            gh, gw, gb = torch.ops.ampkernels.linear_cross_entropy_backward(
                hidden, weight, target, bias, grad_losses, *ctx.options, ctx.needs, *ctx.head_dtypes, ctx.backend
            )
        else:
            gh, gw, gb, counted = ctx.saved_tensors
            # (no counted token: the gradients are zero, as stock's; clamp keeps 0 / 0 out of them)
            factor = grad.float() / counted.clamp(min=1) if ctx.reduction == "mean" else grad.float()
            # g * factor in float32, rounded once into the result's dtype: no float32 temporary of the [V, H]
            # weight gradient (2 GiB at 128k x 4096)
            dtypes = (gh.dtype, *ctx.dtypes)
            gh, gw, gb = (
                torch.mul(g, factor, out=torch.empty(g.shape, dtype=dtype, device=g.device)) if need else None
                for g, need, dtype in zip((gh, gw, gb), ctx.needs, dtypes)
            )
        weight_dtype, bias_dtype = ctx.dtypes
        return (
            gh if ctx.needs[0] else None,
            gw.to(weight_dtype) if ctx.needs[1] else None,
            None,
            gb.to(bias_dtype) if ctx.needs[2] else None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


def _error(argument: str, message: str) -> ValueError:
    return ValueError(f"linear_cross_entropy: argument '{argument}': {message}")


# (Over 80 lines: most of it is the docstring, the op's contract.)
def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    z_loss: float = 0.0,
    float8: str | Any | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias), target, ...)`` plus ``z_loss * lse**2`` per token, without
    the [tokens, vocab] logits in memory (see the module docstring; :func:`ampkernels.reference.linear_cross_entropy`
    is the formula).

    Args:
        hidden: [..., H] float32, bfloat16 or float16 (any leading dimensions: the tokens).
        weight: [V, H], the head's weight (``nn.Linear(H, V).weight``), on hidden's device.
        target: hidden's leading shape, int64 class indices in [0, V) or ``ignore_index``.
        bias: optional [V].
        ignore_index: targets that contribute nothing and are not counted.
        label_smoothing: in [0, 1], as torch's.
        reduction: ``"mean"`` (over the counted tokens; NaN when none is, as torch), ``"sum"`` or ``"none"``.
        z_loss: weight of ``lse**2`` (the log-sum-exp of a token's logits), >= 0.
        float8: ``"tensorwise"`` (or a tensorwise :class:`~ampkernels.float8.Float8Recipe`) runs the head's three
            products in FP8 as a tensorwise :class:`~ampkernels.float8.Float8Linear` would (e4m3 hidden states and
            weight, e5m2 logit gradients, one scale per tensor and chunk, current scaling; the weight's casts kept
            across micro-batches); where tokens, H or V is not a multiple of 16 the head runs as without it. None
            (default): the head in hidden's dtype (the autocast dtype).
        backend: ``"triton"`` (the default on CUDA tensors: one kernel per chunk forms the loss and the logits'
            gradient in place) or ``"torch"`` (the reference's math per chunk, the default on CPU tensors);
            default: :mod:`ampkernels.dispatch`'s choice (op ``"linear_cross_entropy"``).
    Under autocast the head runs in the autocast dtype, as ``F.linear`` would; the loss is float32.
    """
    for name, value in (("hidden", hidden), ("weight", weight), ("target", target)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"linear_cross_entropy: argument '{name}' must be a Tensor, got {type(value).__name__}")
    if hidden.ndim < 1 or not hidden.is_floating_point():
        raise _error("hidden", f"expected a floating tensor [..., H], got {hidden.dtype} of shape {list(hidden.shape)}")
    if weight.ndim != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:
        raise _error("weight", f"expected [V, {hidden.shape[-1]}] with V >= 1, got shape {list(weight.shape)}")
    if target.shape != hidden.shape[:-1] or target.dtype not in (torch.int64, torch.int32):
        raise _error("target", f"expected int64 of shape {list(hidden.shape[:-1])}, got {target.dtype} "
                     f"{list(target.shape)}")  # fmt: skip
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (weight.shape[0],)):
        raise _error("bias", f"expected None or a tensor of shape [{weight.shape[0]}]")
    for name, value in (("weight", weight), ("target", target), ("bias", bias)):
        if value is not None and value.device != hidden.device:
            raise _error(name, f"expected a tensor on {hidden.device} (like hidden), got one on {value.device}")
    if reduction not in REDUCTIONS:
        raise _error("reduction", f"expected one of {'/'.join(REDUCTIONS)}, got {reduction!r}")
    if not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing <= 1.0:
        raise _error("label_smoothing", f"expected a float in [0, 1], got {label_smoothing!r}")
    if not isinstance(z_loss, (int, float)) or not z_loss >= 0 or math.isinf(z_loss):
        raise _error("z_loss", f"expected a finite float >= 0, got {z_loss!r}")
    if not isinstance(ignore_index, int):
        raise _error("ignore_index", f"expected an int, got {ignore_index!r}")
    if not (torch.compiler.is_compiling() or capturing()):
        # NOTE: one host sync. Where none is allowed (a CUDA graph capture, a compiled graph) the Triton kernel
        # gives an out-of-range target a NaN loss and gradient instead, which a loss scaler's check catches.
        out_of_range = (target != ignore_index) & ((target < 0) | (target >= weight.shape[0]))
        if bool(out_of_range.any()):
            raise _error("target", f"holds class indices outside [0, {weight.shape[0]}) other than ignore_index")
    float8_dtypes = _float8_dtypes(float8)
    chosen = dispatch.select(_OP, hidden.device, dispatch.check_backend(_OP, backend))
    device = hidden.device.type
    if (
        hidden.numel() // hidden.shape[-1] % 16
        or hidden.shape[-1] % 16
        or weight.shape[0] % 16
        or torch.float64 in (hidden.dtype, weight.dtype)
    ):
        float8_dtypes = (None, None)  # (FP8 GEMMs take dimensions in multiples of 16; float64 stays float64)
    logits_dtype = hidden.dtype
    if torch.is_autocast_enabled(device):
        logits_dtype = torch.get_autocast_dtype(device)
        if float8_dtypes[0] is None:  # (an FP8 head casts hidden and weight itself, as Float8Linear)
            hidden, weight = hidden.to(logits_dtype), weight.to(logits_dtype)
        bias = None if bias is None else bias.to(logits_dtype)
    elif hidden.dtype != weight.dtype:
        raise _error("weight", f"expected {hidden.dtype} like hidden outside autocast, got {weight.dtype}")
    shape = hidden.shape[:-1]
    hidden2d = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    with torch.autocast(device, enabled=False):
        loss = _LinearCrossEntropyFunction.apply(
            hidden2d,
            weight.contiguous(),
            target.reshape(-1).long(),
            None if bias is None else bias.contiguous(),
            int(ignore_index),
            float(label_smoothing),
            float(z_loss),
            reduction,
            (*float8_dtypes, logits_dtype),
            chosen,
        )
    return loss.reshape(shape) if reduction == "none" else loss


def _float8_dtypes(float8: Any) -> tuple[torch.dtype | None, torch.dtype | None]:
    """linear_cross_entropy's ``float8`` argument as the head's (forward, backward) FP8 dtypes; (None, None)."""
    if float8 is None:
        return None, None
    from ampkernels.float8.linear import Float8Recipe

    if isinstance(float8, str):
        if float8 != "tensorwise":
            raise _error("float8", f"expected None, 'tensorwise' or a tensorwise Float8Recipe, got {float8!r}")
        float8 = Float8Recipe.named(float8)
    if not isinstance(float8, Float8Recipe) or float8.name != "tensorwise":
        raise _error("float8", f"expected None, 'tensorwise' or a tensorwise Float8Recipe, got {float8!r}")
    return float8.forward_dtype, float8.backward_dtype


def head_float8(head: torch.nn.Module) -> Any:
    """The ``float8`` argument of :func:`linear_cross_entropy` for the products of ``head``: a tensorwise
    :class:`~ampkernels.float8.Float8Linear`'s recipe (whose weight is a plain tensor, not FSDP2's FP8-gathered one),
    else None (the head in the autocast dtype)::

        loss = linear_cross_entropy(hidden, head.weight, target, bias=head.bias, float8=head_float8(head))
    """
    recipe = getattr(head, "recipe", None)
    if getattr(recipe, "name", None) != "tensorwise" or getattr(head, "fsdp_float8_all_gather", False):
        return None
    from ampkernels.float8.linear import Float8Linear  # (ampkernels.float8 imports this module)

    return recipe if isinstance(head, Float8Linear) else None


class LinearCrossEntropy(torch.nn.Module):
    """A language-model head and its loss in one module: ``nn.Linear(in_features, vocab, bias)`` whose forward takes
    ``(hidden, target)`` and returns :func:`linear_cross_entropy` (arguments as there). ``state_dict`` is the
    ``nn.Linear``'s (``weight``, ``bias``)."""

    def __init__(
        self,
        in_features: int,
        vocab: int,
        bias: bool = False,
        *,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        reduction: str = "mean",
        z_loss: float = 0.0,
        float8: str | Any | None = None,
        backend: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        head = torch.nn.Linear(in_features, vocab, bias, device=device, dtype=dtype)
        self.weight, self.bias = head.weight, head.bias
        self.ignore_index, self.label_smoothing, self.reduction, self.z_loss = (
            ignore_index,
            label_smoothing,
            reduction,
            z_loss,
        )
        _float8_dtypes(float8)  # (checked here, as the other arguments are by their first call)
        self.float8 = float8
        self.backend = dispatch.check_backend(_OP, backend)

    def forward(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(
            hidden,
            self.weight,
            target,
            bias=self.bias,
            ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing,
            reduction=self.reduction,
            z_loss=self.z_loss,
            float8=self.float8,
            backend=self.backend,
        )

    def extra_repr(self) -> str:
        float8 = "" if self.float8 is None else f", float8={getattr(self.float8, 'name', self.float8)!r}"
        return f"in_features={self.weight.shape[1]}, vocab={self.weight.shape[0]}, bias={self.bias is not None}{float8}"
