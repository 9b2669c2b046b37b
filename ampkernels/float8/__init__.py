"""FP8 training on the Tensor Cores, fast in eager mode: fused casts (:func:`to_float8`, :func:`to_float8_pair`),
FP8 operands in :func:`ampkernels.scaled_matmul`, :class:`Float8Linear` with :func:`convert_to_float8`, and the
fused producers of its inputs (:func:`rms_norm` / :class:`RMSNorm`, :func:`silu_mul`) and :func:`rotary_embedding`
(:func:`fuse_modules` puts a stock model's norms and MLPs on them),
and FP8 all-gather of the weights under FSDP2 (:func:`precompute_float8_scales`, :mod:`ampkernels.float8.fsdp`).
See docs/float8.md."""

from ampkernels.float8.casts import to_float8, to_float8_pair
from ampkernels.float8.convert import convert_to_float8
from ampkernels.float8.fsdp import precompute_float8_scales
from ampkernels.float8.fuse import FuseReport, fuse_modules
from ampkernels.float8.fused import RMSNorm, rms_norm, rotary_embedding, silu_mul
from ampkernels.float8.linear import Float8DelayedScaling, Float8Linear, Float8Recipe
from ampkernels.float8.weight_casts import forget_weight_casts

__all__ = [
    "Float8DelayedScaling",
    "Float8Linear",
    "Float8Recipe",
    "FuseReport",
    "RMSNorm",
    "convert_to_float8",
    "forget_weight_casts",
    "fuse_modules",
    "precompute_float8_scales",
    "rms_norm",
    "rotary_embedding",
    "silu_mul",
    "to_float8",
    "to_float8_pair",
]
