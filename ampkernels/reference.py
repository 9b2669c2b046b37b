"""Plain-PyTorch references for every ampkernels op, in one namespace.

Each family keeps its references beside its kernels (``ampkernels/<family>/reference.py``); this module gathers their
public names for the tests (as the expected result) and for users who check a kernel against its math. The fallback
backends import their family's module directly.
"""

from ampkernels.float8.reference import (
    FLOAT8_AMAX_FLOOR,
    FLOAT8_GRANULARITIES,
    float8_amax,
    float8_max,
    float8_scale,
    rms_norm,
    rotary_embedding,
    rotary_tables,
    silu_mul,
    to_float8,
    to_float8_pair,
)
from ampkernels.loss.reference import cross_entropy_chunk, linear_cross_entropy
from ampkernels.matmul.reference import scaled_matmul, scaled_matmul_float8
from ampkernels.optim.hyperparameters import AdamHyperparameters, SgdHyperparameters
from ampkernels.optim.reference import (
    adam_step,
    adam_step_blockwise,
    dequantize_blockwise,
    quant_code,
    quant_layout,
    quantize_blockwise,
    rounding_bits,
    rounding_key,
    sgd_step,
    stochastic_round_to_bf16,
)
from ampkernels.scaler.reference import (
    FLOAT32_TINY,
    clip_coef,
    inv_scale_of,
    unscale_reduce_,
    update_scale_,
)

__all__ = [
    "AdamHyperparameters",
    "FLOAT32_TINY",
    "FLOAT8_AMAX_FLOOR",
    "FLOAT8_GRANULARITIES",
    "adam_step",
    "adam_step_blockwise",
    "clip_coef",
    "cross_entropy_chunk",
    "dequantize_blockwise",
    "float8_amax",
    "float8_max",
    "float8_scale",
    "inv_scale_of",
    "linear_cross_entropy",
    "quant_code",
    "quant_layout",
    "quantize_blockwise",
    "rms_norm",
    "rotary_embedding",
    "rotary_tables",
    "rounding_bits",
    "rounding_key",
    "scaled_matmul",
    "scaled_matmul_float8",
    "SgdHyperparameters",
    "sgd_step",
    "silu_mul",
    "stochastic_round_to_bf16",
    "to_float8",
    "to_float8_pair",
    "unscale_reduce_",
    "update_scale_",
]
