"""Constants the Python, Triton and C++ sides of ampkernels must agree on (C++: csrc's shared headers)."""

import torch

# The FP8 formats ampkernels casts to and multiplies: e4m3 (forward operands) and e5m2 (gradients).
FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# Norm codes of the multi-tensor unscale/norm kernels (the Triton kernels' NORM constexpr; the C++ ops' norm code).
NORM_NONE = 0
NORM_L2 = 1
NORM_INF = 2

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
