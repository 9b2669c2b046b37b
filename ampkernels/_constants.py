"""Constants the Python, Triton and C++ sides of ampkernels must agree on (C++: csrc's shared headers)."""

import enum
import math

import torch

# The FP8 formats ampkernels casts to and multiplies: e4m3 (forward operands) and e5m2 (gradients).
FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Floor of the amax an FP8 scale is computed from (torchao's): an all-zero tensor gets a large finite scale, not inf
# (the CUDA casts: kAmaxFloor in csrc/float8/casts.cu).
FLOAT8_AMAX_FLOOR = 1e-12


class NormKind(enum.IntEnum):
    """Which norm the multi-tensor unscale/norm kernels compute: C++ ``NormKind`` (csrc/common/constants.h), the
    native ops' ``norm_kind`` and the Triton kernels' ``NORM`` constexpr. Users pass torch's float ``norm_type``
    instead: :func:`norm_kind` converts it."""

    NONE = 0
    L2 = 1
    INF = 2

    @property
    def norm_type(self) -> float | None:
        """torch's ``norm_type`` of this kind (``None`` for ``NONE``): the inverse of :func:`norm_kind`."""
        return None if self is NormKind.NONE else 2.0 if self is NormKind.L2 else math.inf


def norm_kind(norm_type: float | None, arg: str = "norm_type") -> NormKind:
    """The :class:`NormKind` of a user's ``norm_type`` (``torch.nn.utils.clip_grad_norm_``'s spelling): ``None``
    (no norm), ``2.0`` or ``inf``; any other value raises ``ValueError`` naming ``arg`` (the fused kernels compute
    only those two norms; torch's ``0`` counts non-zeros, it does not mean "no norm")."""
    if norm_type is None:
        return NormKind.NONE
    try:
        p = float(norm_type)
    except (TypeError, ValueError):
        raise TypeError(
            f"ampkernels: argument '{arg}': expected None, 2.0 or inf, got {type(norm_type).__name__}"
        ) from None
    if p == 2.0:
        return NormKind.L2
    if p == math.inf:
        return NormKind.INF
    raise ValueError(f"ampkernels: argument '{arg}': the fused kernels compute 2 and inf norms, got {norm_type}")


# The max_norm that asks the native ops for no clip coefficient (C++ kNoClip). Python APIs say "no clip" with None;
# this value stands for it only where max_norm crosses into C++ (a float argument).
NO_CLIP = -1.0

# Scale modes of the scaled_matmul kernels (a runtime argument: one compiled kernel serves all four).
SCALE_NONE = 0  # no scale tensor (alpha only)
SCALE_TENSOR = 1  # one element
SCALE_ROW = 2  # [M], one per output row
SCALE_COL = 3  # [N], one per output column

# Elements per chunk of the multi-tensor tables (dev/design.md). The C++ kernels and the Triton optimizers use 16384
# (one CUDA block per chunk, a thread's whole share of the chunk in flight: dev/scaler/NOTES.md "Unscale bandwidth").
CHUNK = 16384
# The Triton unscale/norm kernel uses 65536: measured with it at 99-100% (read-only) and 90% (in place) of copy
# bandwidth, one program per chunk (dev/scaler/NOTES.md, "Unscale bandwidth"); 16384 has not been measured there.
TRITON_UNSCALE_CHUNK = 65536

# Storage formats of the Adam moments (FusedAdam's exp_avg_dtype / exp_avg_sq_dtype; csrc/optim/blockwise.h).
STATE_F32 = 0
STATE_BF16 = 1
STATE_Q8 = 2  # 8-bit codes + one power-of-two scale per block
STATE_Q4 = 3  # 4-bit codes, two per byte along the last dimension, + one scale per block
# Elements per quantization block, consecutive along the last dimension (so dim-0 sharding never splits a block).
QUANT_BLOCK = 128
# Tensors with fewer elements, or fewer than 2 dimensions, keep float32 moments (a negligible share of the state).
QUANT_MIN_NUMEL = 4096
# (exponent bits, mantissa bits) of each code's magnitude: the first moment is signed (one more bit), the second
# unsigned and never rounded to zero (its smallest code stands for anything below it: see reference.py).
QUANT_CODES = {
    (STATE_Q8, False): (4, 3),
    (STATE_Q8, True): (5, 3),
    (STATE_Q4, False): (2, 1),
    (STATE_Q4, True): (4, 0),
}
