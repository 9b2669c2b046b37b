"""The tolerances the tests share, defined once. Where a test's tolerance comes from PyTorch's own error (ours within
2x of stock's against a float64 reference), the test computes it; these are the fixed ones, each with its reason."""

#: Ours against torch.optim in float32: the same math, rounded in a different order (FusedAdamW fuses the update).
OPTIMIZER_FP32 = dict(rtol=1e-5, atol=1e-6)
#: A float32 norm's relative error may be 2x that of torch's float32 norm, or up to this (~log2(n) ulps, n ~ 1e7).
NORM_RTOL_FLOOR = 1e-6
#: A short training run's final loss against its higher-precision baseline (FP8 against bf16, 8-bit or bf16 optimizer
#: state against float32), relative.
TRAINING_LOSS_RTOL = 0.01
