"""Constants the Python, Triton and C++ sides of ampkernels must agree on (C++: csrc's shared headers)."""

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
# (one CUDA block per chunk, a thread's whole share of the chunk in flight: dev/scaler/NOTES.md "Unscale write path").
CHUNK = 16384
# The Triton unscale/norm kernel uses 65536: measured with it at 99-100% (read-only) and 90% (in place) of copy
# bandwidth, one program per chunk (dev/matmul/NOTES.md, "Triton on the 768-wide shapes"); 16384 has not been
# measured there.
TRITON_UNSCALE_CHUNK = 65536
