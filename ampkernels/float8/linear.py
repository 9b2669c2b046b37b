"""FP8 training of ``nn.Linear`` layers: :class:`Float8Linear` and its three recipes.

For ``y = x @ w.T (+ bias)`` every recipe runs the three products of a training step in FP8 on the Tensor Cores,
with the fp32 accumulation, the dequantization scales and the bias in the GEMM's epilogue
(:func:`ampkernels.scaled_matmul`)::

    forward   y      = x8 @ w8.T        x, w in the forward dtype (e4m3)
    backward  grad_x = g8 @ w8          g in the backward dtype (e5m2 for the tensorwise recipes)
              grad_w = g8.T @ x8

The weight and the optimizer stay in their own precision; only the operands of the three products are cast, each
by one fused kernel (:mod:`ampkernels.float8.casts`) that writes the layouts the products read (a row-major, b
column-major), so that nothing is transposed or copied on the way. What is saved for the backward is the FP8 copy of
x in the layout the weight gradient reads: half the bytes of a bf16 ``nn.Linear``'s saved input.

Recipes (:class:`Float8Recipe`):

* ``"tensorwise"``: one scale per tensor from the tensor's own amax (current scaling: an amax pass, then the cast).
* ``"rowwise"``: one scale per row of each operand along the contraction (per token for x and g, per output
  feature for w); every operand is e4m3 (like torchao's rowwise recipe): a row's own scale leaves e5m2's range unused.
* ``"delayed"``: one scale per tensor from the amax history of earlier steps (TransformerEngine's delayed scaling:
  :class:`Float8DelayedScaling`); each cast is a single pass that also records this step's amax.
"""

from __future__ import annotations

import dataclasses
import math
import weakref

import torch
from torch import nn
from torch.nn import functional as F

from ampkernels._autograd import first_order
from ampkernels._constants import FLOAT8_DTYPES
from ampkernels._modules import buffers_keep_dtype
from ampkernels.float8.casts import cast_with_produced_amax, to_float8, to_float8_pair
from ampkernels.float8.fsdp import Float8AllGatherWeight, Float8GatheredWeight, wrap_float8_all_gather
from ampkernels.float8.fused import produced_amax
from ampkernels.float8.reference import float8_max
from ampkernels.float8.weight_casts import CaptureTracker, WeightCasts
from ampkernels.matmul.api import scaled_matmul

E4M3, E5M2 = FLOAT8_DTYPES
RECIPES = ("tensorwise", "rowwise", "delayed")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
#: The fields of a Float8Recipe that only the delayed recipe reads.
DELAYED_OPTIONS = ("amax_history_len", "amax_compute_algo", "margin")
#: The cast sites of a layer, in the order of its delayed-scaling buffers.
INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2
#: Inner and outer dimensions of every FP8 product must be multiples of 16 (cuBLAS's and TMA's 16-byte rule).
FLOAT8_ALIGNMENT = 16


@dataclasses.dataclass(frozen=True)
class Float8Recipe:
    """How a :class:`Float8Linear` casts. ``name``: one of :data:`RECIPES`; ``forward_dtype`` (x and w),
    ``backward_dtype`` (the output gradient); for ``"delayed"``: ``amax_history_len`` steps of amax kept per tensor,
    ``amax_compute_algo`` (``"max"`` of the history or its ``"most_recent"`` entry) and ``margin`` (the scale is
    divided by ``2**margin``), as TransformerEngine's ``DelayedScaling`` defines them (:meth:`named` refuses these
    three for the other recipes, which do not read them)."""

    name: str = "tensorwise"
    forward_dtype: torch.dtype = E4M3
    backward_dtype: torch.dtype = E5M2
    amax_history_len: int = 16
    amax_compute_algo: str = "max"
    margin: int = 0

    @classmethod
    def named(cls, recipe: str | Float8Recipe, **options) -> Float8Recipe:
        """The recipe called ``recipe`` with ``options`` overriding its defaults (rowwise: e4m3 gradients)."""
        if isinstance(recipe, Float8Recipe):
            result = dataclasses.replace(recipe, **options) if options else recipe
        elif recipe not in RECIPES:
            raise ValueError(f"ampkernels.float8: argument 'recipe': expected one of {RECIPES}, got {recipe!r}")
        else:
            defaults = {"backward_dtype": E4M3} if recipe == "rowwise" else {}
            result = cls(name=recipe, **{**defaults, **options})
        for field in DELAYED_OPTIONS:
            if field in options and result.name != "delayed":
                raise ValueError(
                    f"ampkernels.float8: argument '{field}': only recipe 'delayed' takes it, got recipe {result.name!r}"
                )
        return result

    def __post_init__(self) -> None:
        if self.name not in RECIPES:
            raise ValueError(f"ampkernels.float8: argument 'name': expected one of {RECIPES}, got {self.name!r}")
        for field in ("forward_dtype", "backward_dtype"):
            if getattr(self, field) not in FLOAT8_DTYPES:
                raise ValueError(
                    f"ampkernels.float8: argument '{field}': expected torch.float8_e4m3fn or torch.float8_e5m2, "
                    f"got {getattr(self, field)}"
                )
        if self.forward_dtype == E5M2 and self.backward_dtype == E5M2:
            raise ValueError("ampkernels.float8: e5m2 x e5m2 products are not supported: make one dtype e4m3fn")
        if type(self.amax_history_len) is not int or self.amax_history_len < 1:  # (not a bool)
            raise ValueError(
                f"ampkernels.float8: argument 'amax_history_len': expected an int >= 1, got {self.amax_history_len!r}"
            )
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(
                f"ampkernels.float8: argument 'amax_compute_algo': expected one of {AMAX_COMPUTE_ALGOS}, "
                f"got {self.amax_compute_algo!r}"
            )
        if type(self.margin) is not int or self.margin < 0:
            raise ValueError(f"ampkernels.float8: argument 'margin': expected an int >= 0, got {self.margin!r}")

    @property
    def granularity(self) -> str:
        return "row" if self.name == "rowwise" else "tensor"


def _mm(a, b, scale_a, scale_b, bias, out_dtype):
    return scaled_matmul(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype)


def _bias_grad(grad: torch.Tensor, bias_dtype: torch.dtype) -> torch.Tensor:
    return grad.sum(0, dtype=torch.float32).to(bias_dtype)


class _InputCasts:
    """The FP8 casts of the input the last Float8Linear cast with current scaling, so that the layers reading one
    tensor (q, k and v of an attention block; gate and up of a SwiGLU MLP) reuse them instead of casting it again.
    Matched by the tensor itself (a weak reference: the entry keeps nothing alive and goes with the tensor), its
    version counter (a tensor changed in place is cast anew), the cast settings and the CUDA graph capture: an
    entry is used only in the capture it was made in (or outside any, if made outside), since a graph that read an
    eager call's casts would replay reads of memory it does not own (and a later graph's casts that of an earlier
    graph's pool). A capture is told apart from the next by the calls between them that ran outside a capture.
    Not used while torch.compile traces (its graph removes the repeated casts itself), nor for inference tensors
    (torch.inference_mode), which have no version counter to tell an in-place change by."""

    def __init__(self) -> None:
        self.ref = self.casts = self.key = None
        self.version = -1
        self.capture = 0  # the capture an entry was made in (0: none)
        self.captures = CaptureTracker()

    def _capture(self, x: torch.Tensor) -> int:
        return self.captures.current(x)

    def get(self, x: torch.Tensor, key: tuple):
        if torch.compiler.is_compiling() or x.is_inference():
            return None
        capture = self._capture(x)
        if self.ref is None or self.ref() is not x:
            return None
        return self.casts if (self.key, self.version, self.capture) == (key, x._version, capture) else None

    def put(self, x: torch.Tensor, key: tuple, casts: tuple) -> tuple:
        if not (torch.compiler.is_compiling() or x.is_inference()):
            self.ref, self.key, self.version, self.casts = weakref.ref(x, self._forget), key, x._version, casts
            self.capture = self._capture(x)
        return casts

    def _forget(self, ref) -> None:
        if self.ref is ref:  # (an older entry's tensor dying leaves the current entry alone)
            self.ref = self.casts = self.key = None


_INPUT_CASTS = _InputCasts()


def _batched(out: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """The [tokens, N] product in the input's batch shape, never a view of it (FSDP2 warns of a module that returns
    a view: an in-place op on it would skip FSDP2's pre-backward hook). The product is a fresh tensor that nothing
    else holds, so the reshape is an unsafe view, as nn.Linear's from torch 2.15 on (a plain view before)."""
    return out if input.dim() == 2 else torch.ops.aten._unsafe_view(out, (*input.shape[:-1], out.shape[-1]))


class _TensorwiseMatmul(torch.autograd.Function):
    """The three products with one scale per tensor: current scaling (``scale`` None) or delayed (``scale`` and
    ``amax``: the layer's float32 [3] buffers, indexed by INPUT, WEIGHT, GRAD_OUTPUT)."""

    @staticmethod
    def forward(ctx, input, weight, bias, recipe, out_dtype, scale, amax, weight_casts):
        def site(t, i):
            return None if t is None else t[i]

        fwd = recipe.forward_dtype
        need_w = weight.requires_grad
        x = input.reshape(-1, input.shape[-1])
        key = ("tensor", fwd, need_w)
        cached = None if scale is not None else _INPUT_CASTS.get(input, key)  # delayed: every layer its own scale
        casts = cached
        if casts is None and scale is None and (produced := produced_amax(input)) is not None:
            # The producer (a fused RMSNorm or SiLU·up) reduced x's amax as it wrote x: no amax pass here.
            casts = cast_with_produced_amax(x, fwd, produced, pair=need_w)
        if casts is not None:
            x8, xt8, x_inv = casts
        elif need_w:  # the weight gradient reads x^T: write both layouts in the one pass
            x8, xt8, x_inv = to_float8_pair(x, fwd, scale=site(scale, INPUT), amax_out=site(amax, INPUT))
        else:
            (x8, x_inv), xt8 = to_float8(x, fwd, scale=site(scale, INPUT), amax_out=site(amax, INPUT)), None
        if cached is None and scale is None:
            _INPUT_CASTS.put(input, key, (x8, xt8, x_inv))
        gathered = weight if isinstance(weight, Float8GatheredWeight) else None
        if gathered is not None:
            # FSDP2 all-gathered the weight as FP8 codes cast with the global amax's scale: nothing to cast. The
            # backward's layout is made from the codes FSDP2 gathers again for it (it frees them in between).
            w8, w_inv, wt8 = gathered._codes, gathered._scale_inv, None
        else:
            w8, wt8, w_inv = _tensorwise_weight_casts(weight, fwd, scale, amax, weight_casts)
        out = _mm(x8, w8.t(), x_inv, w_inv, bias, out_dtype)
        # (a gathered weight's scale_inv is refilled in place by the next all-gather: read it in the backward)
        ctx.save_for_backward(xt8, wt8, x_inv, None if gathered is not None else w_inv, gathered)
        # The delayed-scaling buffers are not saved tensors: the next forward updates them in place, which must not
        # count as modifying what this backward reads (it reads only the gradient's site).
        ctx.scale, ctx.amax = scale, amax
        ctx.recipe, ctx.x_dtype, ctx.w_dtype, ctx.x_shape = recipe, x.dtype, weight.dtype, input.shape
        ctx.bias_dtype = None if bias is None else bias.dtype
        return _batched(out, input)

    @staticmethod
    @first_order
    def backward(ctx, grad):
        xt8, wt8, x_inv, w_inv, gathered = ctx.saved_tensors
        need_x, need_w, need_bias = ctx.needs_input_grad[:3]
        if gathered is not None and need_x:
            wt8, w_inv = gathered._codes.t().contiguous(), gathered._scale_inv
        scale = None if ctx.scale is None else ctx.scale[GRAD_OUTPUT]
        amax = None if ctx.amax is None else ctx.amax[GRAD_OUTPUT]
        grad = grad.reshape(-1, grad.shape[-1]).contiguous()
        bwd = ctx.recipe.backward_dtype
        if need_w:
            g8, gt8, g_inv = to_float8_pair(grad, bwd, scale=scale, amax_out=amax)
        else:
            g8, g_inv = to_float8(grad, bwd, scale=scale, amax_out=amax)
        grad_x = _mm(g8, wt8.t(), g_inv, w_inv, None, ctx.x_dtype).view(ctx.x_shape) if need_x else None
        grad_w = _mm(gt8, xt8.t(), g_inv, x_inv, None, ctx.w_dtype) if need_w else None
        grad_bias = _bias_grad(grad, ctx.bias_dtype) if need_bias else None
        return grad_x, grad_w, grad_bias, None, None, None, None, None


def _tensorwise_weight_casts(weight, fwd, scale, amax, weight_casts: WeightCasts):
    """(w8, wt8, w_inv): the weight's casts, from the layer's cache when the weight, its scale (delayed) and the
    settings are unchanged since they were made (:mod:`ampkernels.float8.weight_casts`)."""
    w_scale, w_amax = (None, None) if scale is None else (scale[WEIGHT], amax[WEIGHT])
    if isinstance(weight, Float8AllGatherWeight):  # (FSDP2's wrapper: its storage is FSDP2's to change)
        return to_float8_pair(weight._hp, fwd, scale=w_scale, amax_out=w_amax)
    settings = (fwd, weight.dtype)
    casts = weight_casts.get("tensor", weight, settings, scale)
    if casts is None:
        casts = to_float8_pair(weight, fwd, scale=w_scale, amax_out=w_amax)
        weight_casts.put("tensor", weight, settings, casts, scale)
    return casts


class _RowwiseMatmul(torch.autograd.Function):
    """The three products with one scale per row of each operand along the contraction: the cast of x's transpose
    (per column of x, over all tokens) for the weight gradient is made in the forward, so that only FP8 is saved."""

    @staticmethod
    def forward(ctx, input, weight, bias, recipe, out_dtype, weight_casts):
        fwd = recipe.forward_dtype
        x = input.reshape(-1, input.shape[-1])
        key = ("row", fwd, weight.requires_grad)
        casts = _INPUT_CASTS.get(input, key)
        if casts is None:
            x8, x_inv = to_float8(x, fwd, "row")  # [M, 1]
            xt8 = xt_inv = None
            if weight.requires_grad:
                xt8, xt_inv = to_float8(x, fwd, "row", transpose=True)  # [K, M], [K, 1]
            casts = _INPUT_CASTS.put(input, key, (x8, x_inv, xt8, xt_inv))
        x8, x_inv, xt8, xt_inv = casts
        settings = (fwd, weight.dtype)
        w8, w_inv = weight_casts.get("row", weight, settings) or weight_casts.put(
            "row",
            weight,
            settings,
            to_float8(weight, fwd, "row"),  # [N, 1]
        )
        ctx.weight_casts = weight_casts
        out = _mm(x8, w8.t(), x_inv, w_inv.t(), bias, out_dtype)
        ctx.save_for_backward(xt8, xt_inv, weight)
        ctx.recipe, ctx.x_dtype, ctx.x_shape = recipe, x.dtype, input.shape
        ctx.bias_dtype = None if bias is None else bias.dtype
        return _batched(out, input)

    @staticmethod
    @first_order
    def backward(ctx, grad):
        xt8, xt_inv, weight = ctx.saved_tensors
        need_x, need_w, need_bias = ctx.needs_input_grad[:3]
        grad = grad.reshape(-1, grad.shape[-1]).contiguous()
        fwd, bwd = ctx.recipe.forward_dtype, ctx.recipe.backward_dtype
        grad_x = grad_w = grad_bias = None
        if need_x:
            g8, g_inv = to_float8(grad, bwd, "row")  # [M, 1]
            settings = (fwd, weight.dtype)
            wt8, wt_inv = ctx.weight_casts.get("row_t", weight, settings) or ctx.weight_casts.put(
                "row_t",
                weight,
                settings,
                to_float8(weight, fwd, "row", transpose=True),  # [K, N], [K, 1]
            )
            grad_x = _mm(g8, wt8.t(), g_inv, wt_inv.t(), None, ctx.x_dtype).view(ctx.x_shape)
        if need_w:
            gt8, gt_inv = to_float8(grad, bwd, "row", transpose=True)  # [N, M], [N, 1]
            grad_w = _mm(gt8, xt8.t(), gt_inv, xt_inv.t(), None, weight.dtype)
        if need_bias:
            grad_bias = _bias_grad(grad, ctx.bias_dtype)
        return grad_x, grad_w, grad_bias, None, None, None


#: The size rule. Per token, a layer's GEMMs do 2KN FLOPs (each of the three products) while its casts touch K + N
#: elements (the input and the output-gradient rows): FP8 pays when 2KN / (K + N), GEMM FLOPs per cast element, is
#: large. Measured (H200, ``python -m benchmarks --only float8``, "layer sizes": forward + backward of one layer at
#: 16384 tokens under bf16 autocast, replayed as a CUDA graph, 2026-12-04): FP8 was faster than bf16 on every
#: layer at or above this ratio, per granularity, and slower on every one below. Tensorwise: 1536^2 (1536) 1.05x,
#: 1024^2 (1024) 0.86x; rowwise (more cast work per operand): 3072^2 (3072) 1.05x, 2048 x 8192 (3277) 1.20x,
#: 2048^2 (2048) 0.95x. A weight-size rule (K x N >= 1536^2) also took BERT-base's 768 x 3072 FFN layers (ratio
#: 1229), and the model zoo measured that FP8 BERT-base step at 0.86x of bf16 (H100). docs/float8.md has the table.
MIN_FLOPS_PER_CAST_ELEMENT = {"tensor": 1536, "row": 3072}


def flops_per_cast_element(in_features: int, out_features: int) -> float:
    """GEMM FLOPs per element cast to FP8, per token: 2KN / (K + N) (see :data:`MIN_FLOPS_PER_CAST_ELEMENT`)."""
    return 2 * in_features * out_features / (in_features + out_features)


def float8_fits(in_features: int, out_features: int, min_features: int | None, recipe: Float8Recipe) -> bool:
    """The layer-size rule of :func:`ampkernels.float8.convert_to_float8`: both dimensions multiples of
    :data:`FLOAT8_ALIGNMENT`, and either both at least ``min_features`` or, with ``min_features`` None,
    :func:`flops_per_cast_element` at least :data:`MIN_FLOPS_PER_CAST_ELEMENT` for the recipe's granularity."""
    aligned = in_features % FLOAT8_ALIGNMENT == 0 and out_features % FLOAT8_ALIGNMENT == 0
    if min_features is None:
        threshold = MIN_FLOPS_PER_CAST_ELEMENT[recipe.granularity]
        return aligned and flops_per_cast_element(in_features, out_features) >= threshold
    return aligned and min(in_features, out_features) >= min_features


class Float8Linear(nn.Linear):
    """Drop-in ``nn.Linear`` (same constructor, parameters, initialization and ``state_dict``) whose training
    products run in FP8 (see the module docstring).

    Args (beyond ``nn.Linear``'s): recipe: ``"tensorwise"`` (default), ``"rowwise"``, ``"delayed"`` or a
        :class:`Float8Recipe`. A ``"delayed"`` layer reads its scales from, and records its amaxes into, the
        non-persistent float32 [3] buffers ``float8_scale`` and ``float8_amax`` (input, weight, output gradient),
        which a :class:`Float8DelayedScaling` updates once per step; standing alone (not converted by
        :func:`convert_to_float8`) it keeps its initial scales of 1. fsdp_float8_all_gather (tensorwise only):
        the weight becomes an :class:`~ampkernels.float8.fsdp.Float8AllGatherWeight`, which FSDP2's
        ``fully_shard`` all-gathers as FP8 codes cast with the global amax's scale (:mod:`ampkernels.float8.fsdp`);
        the layer then computes with the gathered codes, bit for bit what it computes unsharded.

    Layers that read one tensor (q, k and v; gate and up) cast it once with current scaling: the first casts, the
    others reuse its casts while the tensor is unchanged.

    The FP8 path runs when the input has a float dtype other than float64 and every dimension of the three products
    is a multiple of 16 (tokens, ``in_features``, ``out_features``); otherwise the layer computes exactly what
    ``nn.Linear`` would (with an FP8-gathered weight: its dequantized codes). The output has the autocast dtype under
    ``torch.autocast``, else the input's dtype; the input gradient has the input's dtype and the weight gradient the
    weight's, both straight from the GEMM epilogue.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        recipe: str | Float8Recipe = "tensorwise",
        fsdp_float8_all_gather: bool = False,
    ) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        self.recipe = Float8Recipe.named(recipe)
        self.float8_weight_casts = WeightCasts()  # reused across micro-batches: ampkernels.float8.weight_casts
        self.fsdp_float8_all_gather = _check_all_gather(fsdp_float8_all_gather, self.recipe)
        if self.fsdp_float8_all_gather:
            self.weight = wrap_float8_all_gather(self.weight, self.recipe.forward_dtype)
        if self.recipe.name == "delayed":
            device = self.weight.device
            self.register_buffer("float8_scale", torch.ones(3, device=device), persistent=False)
            self.register_buffer("float8_amax", torch.zeros(3, device=device), persistent=False)
            self._float8_state_ready = device.type != "meta"

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialization, and for ``"delayed"`` the initial scales (1) and recorded amaxes (0)."""
        super().reset_parameters()
        if getattr(self, "float8_scale", None) is not None:  # (nn.Linear.__init__ calls this before they exist)
            self._float8_state_ready = False
            self._ensure_float8_state()

    def _ensure_float8_state(self) -> None:
        """Writes the delayed scaling buffers' initial values once they are on a real device. A layer made on the
        meta device and materialized with ``to_empty`` (FSDP2's deferred initialization) has uninitialized memory
        there, which no weight-initialization routine touches: without this its first scales would be garbage."""
        if self._float8_state_ready or self.float8_scale.is_meta:
            return
        with torch.no_grad():
            self.float8_scale.fill_(1.0)
            self.float8_amax.zero_()
        self._float8_state_ready = True

    def _apply(self, fn, recurse=True):
        # The delayed scaling state stays float32 (the casts take float32 scales) through model.to(torch.bfloat16).
        with buffers_keep_dtype(self, ("float8_scale", "float8_amax")):
            return super()._apply(fn, recurse)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, recipe: str | Float8Recipe = "tensorwise", *, fsdp_float8_all_gather: bool = False
    ) -> Float8Linear:
        """A Float8Linear sharing ``linear``'s parameters (the same ``nn.Parameter`` objects: an optimizer built on
        the old module keeps working) and its training mode. With ``fsdp_float8_all_gather`` the weight becomes a
        new Parameter around the same storage (build the optimizer after the conversion, as after ``fully_shard``)."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, linear.bias is not None, recipe=recipe)
        new.fsdp_float8_all_gather = _check_all_gather(fsdp_float8_all_gather, new.recipe)
        new.weight = linear.weight
        if new.fsdp_float8_all_gather:
            new.weight = wrap_float8_all_gather(linear.weight, new.recipe.forward_dtype)
        new.bias = linear.bias
        if new.recipe.name == "delayed":
            new.float8_scale = torch.ones(3, device=linear.weight.device)
            new.float8_amax = torch.zeros(3, device=linear.weight.device)
            new._float8_state_ready = linear.weight.device.type != "meta"
        new.train(linear.training)
        return new

    def _runs_float8(self, x: torch.Tensor) -> bool:
        # Anything else (float64) goes to F.linear, which computes it, or refuses mixed dtypes as nn.Linear does.
        casts = (torch.float32, torch.bfloat16, torch.float16)
        if x.dtype not in casts or self.weight.dtype not in casts or x.ndim == 0:
            return False
        rows = math.prod(x.shape[:-1])
        aligned = self.in_features % FLOAT8_ALIGNMENT == 0 and self.out_features % FLOAT8_ALIGNMENT == 0
        return aligned and rows > 0 and rows % FLOAT8_ALIGNMENT == 0 and x.shape[-1] == self.in_features

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self._runs_float8(input):
            return F.linear(input, self.weight, self.bias)
        device_type = input.device.type
        out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else input.dtype
        casts = self.__dict__.get("float8_weight_casts")
        if casts is None:  # (a layer pickled before layers kept their weight casts)
            casts = self.float8_weight_casts = WeightCasts()
        if self.recipe.name == "rowwise":
            return _RowwiseMatmul.apply(input, self.weight, self.bias, self.recipe, out_dtype, casts)
        if self.recipe.name == "delayed":
            self._ensure_float8_state()
            scale, amax = self.float8_scale, self.float8_amax
            return _TensorwiseMatmul.apply(input, self.weight, self.bias, self.recipe, out_dtype, scale, amax, casts)
        return _TensorwiseMatmul.apply(input, self.weight, self.bias, self.recipe, out_dtype, None, None, casts)

    def extra_repr(self) -> str:
        gather = ", fsdp_float8_all_gather=True" if self.fsdp_float8_all_gather else ""
        return f"{super().extra_repr()}, recipe={self.recipe.name}{gather}"


def _check_all_gather(fsdp_float8_all_gather: bool, recipe: Float8Recipe) -> bool:
    if not isinstance(fsdp_float8_all_gather, bool):
        raise ValueError(
            f"ampkernels.float8: argument 'fsdp_float8_all_gather': expected a bool, got {fsdp_float8_all_gather!r}"
        )
    if fsdp_float8_all_gather and recipe.name != "tensorwise":
        raise ValueError(
            "ampkernels.float8: argument 'fsdp_float8_all_gather': needs recipe 'tensorwise' (one scale per "
            f"weight, from the global amax), got {recipe.name!r}"
        )
    return fsdp_float8_all_gather


class Float8DelayedScaling:
    """The amax history of every ``"delayed"`` :class:`Float8Linear` of a model, and the once-per-step update of
    their scales (TransformerEngine's ``DelayedScaling``). :func:`convert_to_float8` makes one, keeps it as
    ``model.float8_scaling`` and calls :meth:`update` before each forward in training mode with grad enabled.

    The history is a buffer of the model it is made for, ``float8_amax_history`` (float32 [layers, 3,
    amax_history_len], entry 0 the most recent step; with ``float8_limits``, the largest value per site; both
    non-persistent, so a converted model's ``state_dict`` is the
    plain model's, while ``.to()`` moves it and :func:`ampkernels.capture_step` saves and restores it with the
    layers' scales). :meth:`update`, all on the device (no host sync, capturable): the amaxes the layers recorded
    since the last update enter the history at entry 0 (the oldest leaves), ``amax = history.max()`` or
    ``history[0]`` (``amax_compute_algo``), and each layer's scale becomes ``float8_max(dtype) / amax / 2**margin``,
    except where that amax is 0 or not finite: there the scale is kept. The recorded amaxes are then zeroed. Scales
    start at 1 (as TransformerEngine's).
    """

    HISTORY, LIMITS = "float8_amax_history", "float8_limits"

    def __init__(self, owner: nn.Module, layers: list[Float8Linear], recipe: Float8Recipe) -> None:
        if not layers:
            raise ValueError("Float8DelayedScaling: no layers")
        self.owner, self.layers, self.recipe = owner, list(layers), recipe
        device = layers[0].weight.device
        history = torch.zeros(len(layers), 3, recipe.amax_history_len, device=device)
        owner.register_buffer(self.HISTORY, history, persistent=False)
        self._limits = [float8_max(recipe.forward_dtype)] * 2 + [float8_max(recipe.backward_dtype)]  # per site
        owner.register_buffer(self.LIMITS, torch.tensor(self._limits, device=device), persistent=False)
        self._ready = device.type != "meta"

    @torch.no_grad()
    def _ensure_state(self) -> None:
        """As Float8Linear._ensure_float8_state, for the history and the limits: a model made on the meta device
        gets their initial values (fills: capturable) at its first update on a real device. They are buffers of the
        model, which ``model.to(torch.bfloat16)`` converts: they are made float32 again here (the limits exactly;
        a history recorded before the conversion keeps its rounded values)."""
        history, limits = getattr(self.owner, self.HISTORY), getattr(self.owner, self.LIMITS)
        if history.is_meta:
            return
        if history.dtype != torch.float32 or limits.dtype != torch.float32:
            self.owner.register_buffer(self.HISTORY, history.float(), persistent=False)
            self.owner.register_buffer(self.LIMITS, torch.empty(3, device=history.device), persistent=False)
            self._fill_limits()
        if self._ready:
            return
        getattr(self.owner, self.HISTORY).zero_()
        self._fill_limits()
        for layer in self.layers:
            layer._ensure_float8_state()
        self._ready = True

    def _fill_limits(self) -> None:
        limits = getattr(self.owner, self.LIMITS)
        for site, limit in enumerate(self._limits):
            limits[site].fill_(limit)

    @torch.no_grad()
    def update(self) -> None:
        """Moves the recorded amaxes into the history and sets every layer's next scales (see the class)."""
        self._ensure_state()
        scales = [layer.float8_scale for layer in self.layers]
        amaxes = [layer.float8_amax for layer in self.layers]
        history = getattr(self.owner, self.HISTORY)
        recorded = torch.stack(amaxes)  # [layers, 3]
        history.copy_(torch.cat((recorded[..., None], history[..., :-1]), dim=-1))
        amax = history.amax(-1) if self.recipe.amax_compute_algo == "max" else history[..., 0]
        fresh = torch.reciprocal(amax) * getattr(self.owner, self.LIMITS)  # reference.float8_scale's rounding
        if self.recipe.margin:
            fresh = fresh * (2.0**-self.recipe.margin)
        keep = (amax == 0) | ~torch.isfinite(amax)
        new = torch.where(keep, torch.stack(scales), fresh)
        torch._foreach_copy_(scales, list(new.unbind(0)))
        torch._foreach_zero_(amaxes)

    def __repr__(self) -> str:
        r = self.recipe
        return (
            f"Float8DelayedScaling(layers={len(self.layers)}, amax_history_len={r.amax_history_len}, "
            f"amax_compute_algo={r.amax_compute_algo!r}, margin={r.margin})"
        )
