"""The targeted mutations of ``scripts/mutation_test.py``: small deliberate bugs in the reference and kernel math,
each with the tests that must catch it.

An entry is one bug a real change could introduce (an off-by-one, ``<`` for ``<=``, a dropped or swapped term, a
constant scaled), in math the tests are meant to check:

* ``file``: path from the repository root; ``original``: a snippet that occurs exactly once in it (else the entry is
  stale and the run fails); ``mutated``: what replaces it.
* ``tests``: the pytest arguments (node ids, files, ``-k`` expressions) of the one or two narrowest selections that
  should fail; run with ``-x -q``, so put the test most likely to fail first.
* ``native``: a C++ source of the CPU kernels (the extension is rebuilt; runs only with ``--native``).
* ``equivalent``: for a mutant that no test can kill because it does not change the behaviour, the reason; such an
  entry is checked for staleness but not run.

Adding a kernel adds entries here (docs/development.md, "Mutation testing").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    original: str
    mutated: str
    description: str
    tests: tuple[str, ...]
    native: bool = False
    timeout: float = 300.0
    equivalent: str = ""


REF_SCALER = "ampkernels/scaler/reference.py"
REF_OPTIM = "ampkernels/optim/reference.py"
REF_MATMUL = "ampkernels/matmul/reference.py"
REF_FLOAT8 = "ampkernels/float8/reference.py"
REF_LOSS = "ampkernels/loss/reference.py"
MT = "ampkernels/scaler/triton/multi_tensor_kernels.py"
OPT = "ampkernels/optim/triton/optimizers_kernels.py"
CAST = "ampkernels/float8/triton/casts_kernels.py"
FUSED = "ampkernels/float8/triton/fused_kernels.py"
BLOCK = "ampkernels/optim/triton/blockwise_kernels.py"
SCALER = "ampkernels/scaler/grad_scaler.py"

T_MT = "tests/scaler/test_triton_multi_tensor.py"
T_OPS = "tests/scaler/test_ops.py"
T_OPT = "tests/optim/test_optimizers.py"
T_FUSED = "tests/float8/test_float8_fused.py"
T_CAST = "tests/float8/test_float8_casts.py"
T_KILLS = "tests/test_mutation_kills.py"
T_REF64 = "tests/test_reference_float64.py"
LCE = "ampkernels/loss/cross_entropy.py"
T_LCE = "tests/loss/test_linear_cross_entropy.py"

MUTATIONS: list[Mutation] = [
    # ---- fused linear + cross-entropy: reference and the chunked kernel ----
    Mutation(
        "ref-lce-smoothing-term",
        REF_LOSS,
        "label_smoothing * (lse - logits.mean(-1))",
        "label_smoothing * (lse + logits.mean(-1))",
        "reference label smoothing adds the mean logit instead of subtracting it",
        (f"{T_LCE}::test_reference_is_torch_cross_entropy_in_float64",),
    ),
    Mutation(
        "lce-z-loss-gradient",
        REF_LOSS,
        "grad.mul_((1 + 2 * z_loss * lse)[:, None])",
        "grad.mul_((1 + z_loss * lse)[:, None])",
        "the z-loss gradient drops the 2 of d(lse^2)",
        (f"{T_LCE}::test_error_at_most_twice_stock_against_float64",),
    ),
    Mutation(
        "lce-smoothing-uniform-gradient",
        REF_LOSS,
        "grad.sub_(label_smoothing / vocab)",
        "grad.sub_(label_smoothing / (vocab - 1))",
        "the label-smoothing gradient spreads over V - 1 classes",
        (f"{T_LCE}::test_error_at_most_twice_stock_against_float64",),
    ),
    Mutation(
        "lce-all-ignored-mean",
        LCE,
        "grad.float() / counted.clamp(min=1)",
        "grad.float() / counted",
        "the mean's factor divides by zero on an all-ignored batch (NaN gradients)",
        (f"{T_LCE}::test_all_ignored_batch_matches_stock",),
    ),
    # ---- reference: the scaler's unscale, non-finite check, norms, clip coefficient, scale update ----
    Mutation(
        "ref-unscale-by-scale",
        REF_SCALER,
        "v = g.to(math_dtype) * inv.to(g.device, math_dtype)",
        "v = g.to(math_dtype) * scale.to(g.device, math_dtype)",
        "reference unscale multiplies by the scale instead of its inverse",
        (f"{T_OPS}::test_unscale_matches_reference_bitwise",),
    ),
    Mutation(
        "ref-nonfinite-misses-inf",
        REF_SCALER,
        "flags.append(torch.isfinite(g).all().logical_not().to(dev))",
        "flags.append(torch.isnan(g).any().to(dev))",
        "reference non-finite check sees NaN but not inf",
        (f"{T_OPS}::test_non_finite_found_anywhere",),
    ),
    Mutation(
        "ref-l2-norm-no-sqrt",
        REF_SCALER,
        "total, each = stacked.sum().sqrt(), stacked.sqrt()",
        "total, each = stacked.sum(), stacked.sqrt()",
        "reference total L2 norm is the sum of squares (square root dropped)",
        (f"{T_OPS}::test_unscale_matches_reference_bitwise",),
    ),
    Mutation(
        "ref-inf-norm-no-abs",
        REF_SCALER,
        "norms.append((vd.abs().max() if vd.numel()",
        "norms.append((vd.max() if vd.numel()",
        "reference inf norm takes max(v) instead of max(|v|)",
        (f"{T_OPS}::test_inf_norm_factor_and_clip_coefficient",),
    ),
    Mutation(
        "ref-clip-coef-no-eps",
        REF_SCALER,
        "torch.clamp(max_norm / (norm.float() + 1e-6), max=1.0)",
        "torch.clamp(max_norm / norm.float(), max=1.0)",
        "reference clip coefficient drops clip_grad_norm_'s 1e-6",
        (f"{T_MT}::test_clip_coef", "tests/scaler/test_grad_scaler_clip.py"),
    ),
    Mutation(
        "ref-growth-off-by-one",
        REF_SCALER,
        "grow = successful == growth_interval",
        "grow = successful > growth_interval",
        "reference scale grows one step after growth_interval clean steps",
        (
            f"{T_OPS}::test_update_scale_follows_reference",
            f"{T_OPS}::test_update_scale_defaults_equal_torch_amp_update_scale",
        ),
    ),
    Mutation(
        "ref-hysteresis-off-by-one",
        REF_SCALER,
        "scale_if_found = torch.where(ht_after_overflow <= 0, backed_off, s)",
        "scale_if_found = torch.where(ht_after_overflow < 0, backed_off, s)",
        "reference backs off one overflow later than the hysteresis says",
        (f"{T_OPS}::test_update_scale_follows_reference", "tests/scaler/test_grad_scaler_extras.py"),
    ),
    Mutation(
        "ref-tracker-kept-on-overflow",
        REF_SCALER,
        "growth_tracker.copy_(torch.where(found | grow, zero, successful)",
        "growth_tracker.copy_(torch.where(grow, zero, successful)",
        "reference growth tracker is not reset by an overflow",
        (
            f"{T_OPS}::test_update_scale_follows_reference",
            f"{T_OPS}::test_update_scale_defaults_equal_torch_amp_update_scale",
        ),
    ),
    Mutation(
        "ref-backoff-floor-dropped",
        REF_SCALER,
        "backed_off = torch.maximum((s.double() * backoff_factor).float(), torch.tensor(min_scale, **f32))",
        "backed_off = (s.double() * backoff_factor).float()",
        "reference backoff ignores min_scale",
        (f"{T_OPS}::test_update_scale_follows_reference", "tests/scaler/test_grad_scaler_extras.py"),
    ),
    # ---- reference: Adam / AdamW / SGD ----
    Mutation(
        "ref-adam-bias-correction-old-step",
        REF_OPTIM,
        "step_size = (lr64 / (1 - beta1 ** new_step.double())).float()",
        "step_size = (lr64 / (1 - beta1 ** (new_step.double() + 1))).float()",
        "reference Adam's first bias correction uses the next step count (off by one)",
        (f"{T_OPT}::test_matches_torch_step_by_step",),
    ),
    Mutation(
        "ref-adam-bc2-no-sqrt",
        REF_OPTIM,
        "bc2_sqrt = (1 - beta2 ** new_step.double()).sqrt().float()",
        "bc2_sqrt = (1 - beta2 ** new_step.double()).float()",
        "reference Adam divides by 1 - beta2^t instead of its square root",
        (f"{T_OPT}::test_matches_torch_step_by_step",),
    ),
    Mutation(
        "ref-adam-eps-inside",
        REF_OPTIM,
        "p = p - step_size * (m / (root / bc2_sqrt + eps))",
        "p = p - step_size * (m / ((root + eps) / bc2_sqrt))",
        "reference Adam adds eps before the bias correction instead of after",
        (f"{T_OPT}::test_adam_reference_is_the_ieee_float32_formula", f"{T_OPT}::test_matches_torch_step_by_step"),
    ),
    Mutation(
        "ref-amsgrad-max-unused",
        REF_OPTIM,
        "second = vmax = torch.maximum(vmax0, v)",
        "vmax = torch.maximum(vmax0, v)",
        "reference AMSGrad keeps the running max but divides by the current second moment",
        (f"{T_OPT}::test_matches_torch_step_by_step",),
    ),
    Mutation(
        "ref-adam-l2-sign",
        REF_OPTIM,
        "        else:\n            g = g + weight_decay * p\n    m = m0",
        "        else:\n            g = g - weight_decay * p\n    m = m0",
        "reference Adam (L2) subtracts the weight decay term from the gradient",
        (f"{T_OPT}::test_matches_torch_step_by_step",),
    ),
    Mutation(
        "ref-adamw-decay-without-lr",
        REF_OPTIM,
        "p = p * torch.as_tensor(1 - lr64 * weight_decay, device=dev).float()",
        "p = p * torch.as_tensor(1 - weight_decay, device=dev).float()",
        "reference AdamW decays by weight_decay instead of lr * weight_decay",
        (f"{T_OPT}::test_matches_torch_step_by_step",),
    ),
    Mutation(
        "ref-sgd-dampening",
        REF_OPTIM,
        "momentum_buffers[i].float() * momentum + (1 - dampening) * g",
        "momentum_buffers[i].float() * momentum + dampening * g",
        "reference SGD scales the new gradient by dampening instead of 1 - dampening",
        (f"{T_OPT}::test_matches_torch_step_by_step",),
    ),
    Mutation(
        "ref-sgd-nesterov",
        REF_OPTIM,
        "g = g + momentum * buf if nesterov else buf",
        "g = g + buf if nesterov else buf",
        "reference Nesterov SGD drops the momentum factor of the look-ahead",
        (f"{T_OPT}::test_matches_torch_step_by_step",),
    ),
    # ---- reference: fused producers, RoPE, FP8 casts, scaled_matmul ----
    Mutation(
        "ref-rms-norm-eps",
        REF_FLOAT8,
        "torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)",
        "torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps * 1000)",
        "reference RMSNorm's eps scaled by 1000",
        (f"{T_REF64}::test_rms_norm_and_its_gradients",),
    ),
    Mutation(
        "ref-silu-is-sigmoid",
        REF_FLOAT8,
        "(torch.nn.functional.silu(gate.float()) * up.float())",
        "(torch.sigmoid(gate.float()) * up.float())",
        "reference SiLU·up uses sigmoid(gate) instead of gate * sigmoid(gate)",
        (f"{T_REF64}::test_silu_mul_and_its_gradients",),
    ),
    Mutation(
        "ref-rotary-sign",
        REF_FLOAT8,
        "torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)",
        "torch.cat((x1 * cos + x2 * sin, x1 * sin + x2 * cos), dim=-1)",
        "reference RoPE with the sign of x2 * sin flipped in the first half",
        (f"{T_REF64}::test_rotary_turns_a_pair_counterclockwise_by_t_radians",),
    ),
    Mutation(
        "ref-rotary-frequency",
        REF_FLOAT8,
        "inv_freq = base ** (-torch.arange(half, device=device, dtype=torch.float32) / half)",
        "inv_freq = base ** (-torch.arange(half, device=device, dtype=torch.float32) / (2 * half))",
        "reference RoPE frequencies base^(-i/D) instead of base^(-i/(D/2))",
        (f"{T_REF64}::test_rotary_tables",),
    ),
    Mutation(
        "ref-float8-no-saturation",
        REF_FLOAT8,
        "y = (xf * s).clamp(-limit, limit)",
        "y = xf * s",
        "reference FP8 cast does not saturate at ±max",
        (f"{T_REF64}::test_to_float8_given_scale_saturates_and_flags",),
    ),
    Mutation(
        "ref-float8-inf-saturates",
        REF_FLOAT8,
        "y = torch.where(torch.isfinite(xf), y, torch.full_like(y, math.nan))",
        "y = torch.where(torch.isnan(xf), y, y)",
        "reference FP8 cast saturates inf to ±max instead of making it NaN",
        (f"{T_REF64}::test_to_float8_given_scale_saturates_and_flags", f"{T_REF64}::test_to_float8_current_scaling"),
    ),
    Mutation(
        "ref-float8-double-rounding",
        REF_FLOAT8,
        "data = y.to(dtype).contiguous()",
        "data = y.to(torch.bfloat16).to(dtype).contiguous()",
        "reference FP8 cast rounds through bfloat16 first (double rounding)",
        (f"{T_REF64}::test_to_float8_current_scaling", f"{T_REF64}::test_to_float8_given_scale_saturates_and_flags"),
    ),
    Mutation(
        "ref-float8-scale-floor",
        REF_FLOAT8,
        "scale = torch.reciprocal(torch.clamp(amax, min=FLOAT8_AMAX_FLOOR)) * float8_max(dtype)",
        "scale = torch.reciprocal(amax) * float8_max(dtype)",
        "reference FP8 scale without the amax floor (an all-zero tensor gets an inf scale)",
        (f"{T_REF64}::test_float8_scale",),
    ),
    Mutation(
        "ref-scaled-matmul-divides",
        REF_MATMUL,
        "v = v * (scale.to(compute) * alpha)",
        "v = v / (scale.to(compute) * alpha)",
        "reference scaled_matmul divides by a tensor scale instead of multiplying",
        (f"{T_REF64}::test_scaled_matmul",),
    ),
    Mutation(
        "ref-float8-matmul-bias-rounded",
        REF_MATMUL,
        "        v = v + bias.float()\n",
        "        v = v + bias.to(out_dtype).float()\n",
        "reference FP8 scaled_matmul rounds the bias to the output dtype before adding it",
        (
            f"{T_REF64}::test_scaled_matmul_float8",
            "tests/matmul/test_scaled_matmul_float8.py::test_backend_matches_the_reference",
        ),
        equivalent="not equivalent, but below every tolerance: it moves an element of a 16-bit output by at most one "
        "ulp (the bias rounded, then the sum), and the accuracy tests allow half an ulp plus the float32 sum's error "
        "in the norm; killing it needs a bit-exact float64 reference of the rounded output",
    ),
    # ---- Triton: multi-tensor unscale / norms / scale update ----
    Mutation(
        "triton-flt-max-boundary",
        MT,
        "bad = bad | ((tl.abs(xf) <= _FLT_MAX) == 0).to(tl.int32)",
        "bad = bad | ((tl.abs(xf) < _FLT_MAX) == 0).to(tl.int32)",
        "Triton non-finite check flags |x| == FLT_MAX",
        ("tests/scaler/test_non_finite_boundary.py", "-k", "triton"),
    ),
    Mutation(
        "triton-l2-overwrites",
        MT,
        "        acc += vn * vn\n",
        "        acc = vn * vn\n",
        "Triton L2 partial overwrites its accumulator instead of adding",
        (f"{T_MT}::test_unscale_values_and_l2_norms",),
    ),
    Mutation(
        "triton-inf-norm-drops-nan",
        MT,
        "    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)",
        "    return tl.maximum(a, b)",
        "Triton inf norm drops NaN (plain maximum)",
        (f"{T_MT}::test_found_inf",),
    ),
    Mutation(
        "triton-clip-coef-no-eps",
        MT,
        "recip = (1.0 / (norm + 1e-6).to(tl.float64)).to(tl.float32)",
        "recip = (1.0 / norm.to(tl.float64)).to(tl.float32)",
        "Triton clip coefficient drops the 1e-6",
        (f"{T_MT}::test_clip_coef",),
    ),
    Mutation(
        "triton-unscale-drops-factor",
        MT,
        "            v = v * fac\n",
        "            v = xf * fac\n",
        "Triton unscale of a 16/32-bit tensor with a clip factor drops the inverse scale",
        (f"{T_MT}::test_factor",),
    ),
    Mutation(
        "triton-hysteresis-off-by-one",
        MT,
        "new_s = tl.where(found, tl.where(ht - 1 <= 0, backed, s)",
        "new_s = tl.where(found, tl.where(ht - 1 < 0, backed, s)",
        "Triton scale update backs off one overflow late",
        (f"{T_MT}::test_update_scale_sequence",),
    ),
    Mutation(
        "triton-growth-to-inf",
        MT,
        "grown_ok = tl.abs(grown) <= _FLT_MAX",
        "grown_ok = grown == grown",
        "Triton scale update lets the scale grow to inf",
        (f"{T_MT}::test_update_scale_edges",),
    ),
    # ---- Triton: optimizers ----
    Mutation(
        "triton-adam-v-not-squared",
        OPT,
        "* beta2 + omb2 * g * g",
        "* beta2 + omb2 * g",
        "Triton Adam's second moment adds (1 - beta2) * g instead of (1 - beta2) * g * g",
        (f"{T_OPT}::test_backends_agree_with_reference",),
    ),
    Mutation(
        "triton-adam-eps-inside",
        OPT,
        "denom = tl.div_rn(tl.sqrt_rn(second), bc2_sqrt) + eps",
        "denom = tl.div_rn(tl.sqrt_rn(second) + eps, bc2_sqrt)",
        "Triton Adam adds eps before the bias correction",
        (f"{T_KILLS}::test_adam_eps_is_added_after_the_bias_correction",),
    ),
    Mutation(
        "triton-adam-bc1-uses-beta2",
        OPT,
        "bc1 = 1.0 - tl.exp2(s * _f64(log2_beta1_bits))",
        "bc1 = 1.0 - tl.exp2(s * _f64(log2_beta2_bits))",
        "Triton Adam's first bias correction uses beta2",
        (f"{T_OPT}::test_backends_agree_with_reference",),
    ),
    Mutation(
        "triton-adamw-decay-without-lr",
        OPT,
        "decay = (1.0 - lr * _f64(wd_bits)).to(tl.float32)",
        "decay = (1.0 - _f64(wd_bits)).to(tl.float32)",
        "Triton AdamW decays by weight_decay instead of lr * weight_decay",
        (f"{T_OPT}::test_backends_agree_with_reference",),
    ),
    Mutation(
        "triton-amsgrad-drops-nan",
        OPT,
        "tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32), v, propagate_nan=tl.PropagateNan.ALL",
        "tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32), v",
        "Triton AMSGrad's running max drops a NaN second moment",
        ("tests/optim/test_amsgrad_nan.py", "-k", "triton"),
    ),
    Mutation(
        "triton-sgd-nesterov",
        OPT,
        "g = g + momentum * buf",
        "g = g + buf",
        "Triton Nesterov SGD drops the momentum factor of the look-ahead",
        (f"{T_OPT}::test_matches_torch_step_by_step",),
    ),
    Mutation(
        "triton-sgd-dampening",
        OPT,
        "buf = tl.where(first, g, buf * momentum + omd * g)",
        "buf = tl.where(first, g, buf * momentum + g)",
        "Triton SGD ignores dampening",
        (f"{T_OPT}::test_matches_torch_step_by_step",),
    ),
    # ---- Triton: FP8 casts, fused producers, blockwise state ----
    Mutation(
        "triton-float8-no-upper-saturation",
        CAST,
        "    p = tl.where(p > FP8_MAX, FP8_MAX, p)\n",
        "",
        "Triton FP8 cast saturates only the negative side",
        (T_CAST, "-k", "test_rounding_ties_subnormals_and_saturation"),
    ),
    Mutation(
        "triton-float8-scale-floor",
        CAST,
        "tl.maximum(amax, _AMAX_FLOOR)) * FP8_MAX",
        "amax) * FP8_MAX",
        "Triton FP8 scale without the amax floor",
        (T_CAST, "-k", "test_all_zero_tensor"),
    ),
    Mutation(
        "triton-rms-norm-mean-off-by-one",
        FUSED,
        "rstd = 1.0 / tl.sqrt_rn(tl.sum(xf * xf, axis=1) / D + eps)",
        "rstd = 1.0 / tl.sqrt_rn(tl.sum(xf * xf, axis=1) / (D - 1) + eps)",
        "Triton RMSNorm divides the sum of squares by D - 1",
        (T_FUSED, "-k", "rms_norm and within_torchs_error and triton"),
    ),
    Mutation(
        "triton-silu-sign",
        FUSED,
        "out = _rounded(g / (1.0 + tl.exp(-g)) * u",
        "out = _rounded(g / (1.0 + tl.exp(g)) * u",
        "Triton SiLU with exp(g) for exp(-g)",
        (T_FUSED, "-k", "silu_mul and within_torchs_error and triton"),
    ),
    Mutation(
        "triton-rotary-sign",
        FUSED,
        "_rounded(x1 * cos - x2 * sin, dtype, INT_BF16)",
        "_rounded(x1 * cos + x2 * sin, dtype, INT_BF16)",
        "Triton RoPE with the sign of x2 * sin flipped in the first half",
        (T_FUSED, "-k", "rotary and within_torchs_error and triton"),
    ),
    Mutation(
        "triton-blockwise-second-moment-zero",
        BLOCK,
        "codes = tl.maximum(codes, 1)  # the second moment is never zero",
        "codes = tl.maximum(codes, 0)  # the second moment is never zero",
        "Triton blockwise state lets a quantized second moment round to zero",
        ("tests/optim/test_triton_blockwise.py::test_second_moment_never_zero_and_signs",),
    ),
    # ---- the scaler's Python logic ----
    Mutation(
        "scaler-deferred-clip-multiplies",
        SCALER,
        "state[_PENDING] = base / coef",
        "state[_PENDING] = base * coef",
        "FusedGradScaler's deferred clip hands scale * coef to the optimizer instead of scale / coef",
        ("tests/scaler/test_grad_scaler_clip.py",),
    ),
    Mutation(
        "scaler-hysteresis-not-passed",
        SCALER,
        "            hysteresis=self._hysteresis,\n            hysteresis_tracker=self._hysteresis_tracker,",
        "            hysteresis=1,\n            hysteresis_tracker=self._hysteresis_tracker,",
        "FusedGradScaler.update resets the hysteresis tracker to 1, not to the configured hysteresis",
        ("tests/scaler/test_grad_scaler_extras.py", "-k", "hysteresis"),
    ),
    Mutation(
        "scaler-state-dict-hysteresis-tracker",
        SCALER,
        "else int(self._hysteresis_tracker.item())",
        "else self._init_hysteresis_tracker",
        "FusedGradScaler.state_dict saves the initial hysteresis tracker, not the current one",
        ("tests/scaler/test_grad_scaler_state_dict.py",),
    ),
    # ---- native CPU kernels (C++; --native) ----
    Mutation(
        "native-amsgrad-drops-nan",
        "csrc/optim/optimizer.h",
        "vmax = (v > vmax || v != v) ? v : vmax;",
        "vmax = v > vmax ? v : vmax;",
        "native AMSGrad's running max drops a NaN second moment",
        ("tests/optim/test_amsgrad_nan.py", "-k", "native"),
        native=True,
    ),
    Mutation(
        "native-adam-v-uses-beta1",
        "csrc/optim/optimizer.h",
        "v = v * h.beta2_f + h.one_minus_beta2 * g * g;",
        "v = v * h.beta2_f + h.one_minus_beta1 * g * g;",
        "native Adam's second moment weighs g * g by 1 - beta1",
        (f"{T_OPT}::test_backends_agree_with_reference",),
        native=True,
    ),
    Mutation(
        "native-adam-eps-inside",
        "csrc/optim/optimizer.h",
        "const float denom = ::sqrtf(second) / bc2_sqrt + h.eps;",
        "const float denom = (::sqrtf(second) + h.eps) / bc2_sqrt;",
        "native Adam adds eps before the bias correction",
        (f"{T_KILLS}::test_adam_eps_is_added_after_the_bias_correction",),
        native=True,
    ),
    Mutation(
        "native-adam-bc1-uses-beta2",
        "csrc/optim/optimizer.h",
        "const double bc1 = 1.0 - ::pow(beta1, static_cast<double>(step));",
        "const double bc1 = 1.0 - ::pow(beta2, static_cast<double>(step));",
        "native Adam's first bias correction uses beta2",
        (f"{T_OPT}::test_backends_agree_with_reference",),
        native=True,
    ),
    Mutation(
        "native-sgd-nesterov",
        "csrc/optim/optimizer.h",
        "g = h.nesterov ? g + h.momentum * buf : buf;",
        "g = h.nesterov ? g + buf : buf;",
        "native Nesterov SGD drops the momentum factor of the look-ahead",
        (f"{T_OPT}::test_native_cpu_step_is_the_reference_bit_for_bit",),
        native=True,
    ),
    Mutation(
        "native-adamw-decay-without-lr",
        "csrc/optim/optimizer_cpu.cpp",
        "const float decay = static_cast<float>(1.0 - lr * l.adam.weight_decay);",
        "const float decay = static_cast<float>(1.0 - l.adam.weight_decay);",
        "native AdamW decays by weight_decay instead of lr * weight_decay",
        (f"{T_OPT}::test_backends_agree_with_reference",),
        native=True,
    ),
    Mutation(
        "native-blockwise-no-unscale",
        "csrc/optim/blockwise_cpu.cpp",
        "for (int k = 0; k < n; ++k) g[k] = static_cast<float>(grad[k]) * inv_scale;",
        "for (int k = 0; k < n; ++k) g[k] = static_cast<float>(grad[k]);",
        "native blockwise Adam does not unscale the gradients",
        ("tests/optim/test_blockwise_adam.py", "-k", "native and (scaler or formats_match)"),
        native=True,
    ),
    Mutation(
        "native-nonfinite-misses-inf",
        "csrc/scaler/scaler_cpu.cpp",
        "bad[lane] |= !(g - g == M(0));",
        "bad[lane] |= g != g;",
        "native non-finite check sees NaN but not inf",
        (f"{T_OPS}::test_non_finite_found_anywhere",),
        native=True,
    ),
    Mutation(
        "native-l2-overwrites",
        "csrc/scaler/scaler_cpu.cpp",
        "if (kNorm == NormKind::kL2) acc[lane] += vf * vf;",
        "if (kNorm == NormKind::kL2) acc[lane] = vf * vf;",
        "native L2 lane accumulators overwrite instead of adding",
        (f"{T_OPS}::test_unscale_matches_reference_bitwise",),
        native=True,
    ),
    Mutation(
        "native-clip-coef-no-eps",
        "csrc/scaler/scaler_cpu.cpp",
        "const float coef = (1.f / (norm + 1e-6f)) * static_cast<float>(a.max_norm);",
        "const float coef = (1.f / norm) * static_cast<float>(a.max_norm);",
        "native clip coefficient drops the 1e-6",
        (f"{T_OPS}::test_inf_norm_factor_and_clip_coefficient", "tests/scaler/test_grad_scaler_clip.py"),
        native=True,
    ),
    Mutation(
        "native-hysteresis-off-by-one",
        "csrc/scaler/scaler.h",
        "if (*hysteresis_tracker <= 0) {",
        "if (*hysteresis_tracker < 0) {",
        "native scale update backs off one overflow late",
        (f"{T_OPS}::test_update_scale_follows_reference",),
        native=True,
    ),
    Mutation(
        "native-growth-off-by-one",
        "csrc/scaler/scaler.h",
        "const I successful = *growth_tracker + 1;",
        "const I successful = *growth_tracker + 2;",
        "native scale update grows one clean step early",
        (f"{T_OPS}::test_update_scale_defaults_equal_torch_amp_update_scale",),
        native=True,
    ),
]
