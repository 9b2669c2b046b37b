"""Low-precision Adam state: the block floating point codes, the stochastic-rounding stream, and FusedAdam's
exp_avg_dtype / exp_avg_sq_dtype / stochastic_rounding on every backend against ``reference.adam_step_blockwise``.

The codes are integer arithmetic on float32 bit patterns, so a backend that computes the same float32 moments
writes the same codes: the CPU kernels match the reference bit for bit. CUDA contracts the moment updates into
FMAs (as the default fused step does), which moves a float32 moment by an ulp and, rarely, a code across a rounding
boundary: there parameters are compared at float32 tolerance and codes may differ by one step in a few elements.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from ampkernels import FusedAdam, FusedAdamW, FusedGradScaler, reference
from ampkernels._constants import QUANT_BLOCK, STATE_Q4, STATE_Q8
from tests.optim.test_optimizers import backends_for

FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "8bit": torch.uint8, "4bit": torch.uint4}
# Rows x cols around the block size: a whole block, a partial last block, odd rows (4-bit pads a nibble), 1-D.
SHAPES = [(20, 256), (17, 300), (33, 129), (4096,), (3, 5)]


def blockwise_backends(device: str) -> list[str]:
    out = backends_for(device)
    if "triton" in out:
        try:
            import ampkernels.optim.triton.blockwise  # noqa: F401
        except ImportError:
            out.remove("triton")
    return out


def backend_params():
    from tests.conftest import DEVICES

    return [
        pytest.param(d, b, marks=[pytest.mark.gpu] if d == "cuda" else [], id=f"{d}-{b}")
        for d in DEVICES
        for b in blockwise_backends(d)
    ]


def moments(shape, second: bool, seed: int = 0) -> torch.Tensor:
    """Random moments spanning 6 decades inside each row (never zero), as trained Adam state does."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.logspace(-4, 2, shape[-1])
    return x.square() if second else x


# ---- the codes ----


@pytest.mark.parametrize("fmt", [STATE_Q8, STATE_Q4])
@pytest.mark.parametrize("second", [False, True], ids=["exp_avg", "exp_avg_sq"])
@pytest.mark.parametrize("shape", [(7, 300), (3, 129), (2, 1), (1, 4096)])
def test_round_trip_bound_per_code(fmt, second, shape):
    x = moments(shape, second)
    codes, scales = reference.quantize_blockwise(x, fmt, second)
    assert codes.dtype == scales.dtype == torch.uint8
    assert (tuple(codes.shape), tuple(scales.shape)) == reference.quant_layout(shape, fmt)
    y = reference.dequantize_blockwise(codes, scales, fmt, second, shape)
    # Encoding a decoded tensor gives the same codes (the block's largest element keeps its exponent).
    again = reference.quantize_blockwise(y, fmt, second)
    assert torch.equal(again[0], codes) and torch.equal(again[1], scales)
    exp_bits, man_bits, _ = reference.quant_code(fmt, second)
    # Within the code's normal range (down to 2^(1 - top) of the block's scale), the relative error is at most
    # half a step: 2^-(man_bits + 1).
    blocks = torch.nn.functional.pad(x.reshape(-1, shape[-1]).abs(), (0, -shape[-1] % QUANT_BLOCK))
    blocks = blocks.reshape(blocks.shape[0], -1, QUANT_BLOCK)
    scale = torch.exp2(scales.reshape(blocks.shape[0], -1, 1).double() - 127)
    floor = (scale * 2.0 ** (1 - (2**exp_bits - 1))).expand_as(blocks).reshape(blocks.shape[0], -1)
    floor = floor[:, : shape[-1]].reshape(shape)
    normal = x.abs() >= floor
    assert normal.any()
    rel = ((y.double() - x.double()).abs() / x.double().abs())[normal]
    assert rel.max() <= 2.0 ** -(man_bits + 1) * (1 + 1e-6)
    # Below it, the codes are a uniform grid: an absolute error of at most half its step, except that the second
    # moment is never rounded to zero (the smallest code stands for anything below it).
    step = floor.double() * 2.0**-man_bits
    error = (y.double() - x.double()).abs()
    rounded = error <= step / 2 * (1 + 1e-6)
    if second:
        assert (y > 0).all(), "the second moment is never rounded to zero"
        assert (rounded | ((x.double() < step) & (y.double() == step)))[~normal].all()
    else:
        assert rounded[~normal].all()
        assert torch.equal(torch.sign(y[y != 0]), torch.sign(x[y != 0]))


@pytest.mark.parametrize("fmt", [STATE_Q8, STATE_Q4])
def test_zero_blocks_and_fresh_state_decode_to_zero(fmt):
    codes, scales = reference.quantize_blockwise(torch.zeros(3, 200), fmt, False)
    assert torch.equal(reference.dequantize_blockwise(codes, scales, fmt, False, (3, 200)), torch.zeros(3, 200))
    codes_shape, scales_shape = reference.quant_layout((3, 200), fmt)
    fresh = torch.zeros(codes_shape, dtype=torch.uint8), torch.zeros(scales_shape, dtype=torch.uint8)
    assert torch.equal(reference.dequantize_blockwise(*fresh, fmt, True, (3, 200)), torch.zeros(3, 200))


def test_code_values_are_the_documented_formats():
    # 4-bit first moment: FP4 E2M1 magnitudes relative to the block's top binade.
    x = torch.tensor([[1.5, 1.0, 0.75, 0.5, 0.375, 0.25, 0.125, 0.0, -1.5, -0.125]])
    codes, scales = reference.quantize_blockwise(x, STATE_Q4, False)
    assert torch.equal(reference.dequantize_blockwise(codes, scales, STATE_Q4, False, x.shape), x)
    # 8-bit second moment: E5M3 reaches 2^-33 of the block's scale.
    v = torch.tensor([[1.0, 2.0**-20, 2.0**-33]])
    codes, scales = reference.quantize_blockwise(v, STATE_Q8, True)
    assert torch.equal(reference.dequantize_blockwise(codes, scales, STATE_Q8, True, v.shape), v)


# ---- stochastic rounding ----


def test_stochastic_rounding_is_unbiased_and_exact_on_representable_values():
    key = reference.rounding_key(1234, 7, torch.tensor(3.0))
    n = 1 << 18
    index = torch.arange(n)
    bits = reference.rounding_bits(key, index)
    assert 0 <= int(bits.min()) and int(bits.max()) < 2**16
    for value in (1.0 + 2.0**-9, -3.0 - 3 * 2.0**-9, 1e-3 * (1 + 2.0**-10)):
        x = torch.full((n,), value)
        rounded = reference.stochastic_round_to_bf16(x, bits).double()
        lo, hi = rounded.min().item(), rounded.max().item()
        assert lo < value < hi and len(torch.unique(rounded)) == 2
        # The mean of n draws: a Bernoulli mean's standard error is (hi - lo) / (2 sqrt(n)); allow 5 of them.
        assert abs(rounded.mean().item() - value) <= 5 * (hi - lo) / (2 * math.sqrt(n))
    exact = torch.randn(4096).bfloat16().float()
    assert torch.equal(reference.stochastic_round_to_bf16(exact, bits[:4096]).float(), exact)
    nan = reference.stochastic_round_to_bf16(torch.tensor([math.nan, math.inf, -math.inf]), bits[:3]).float()
    assert nan[0].isnan() and nan[1] == math.inf and nan[2] == -math.inf


def test_rounding_stream_depends_on_seed_salt_step_and_global_index_only():
    a = reference.rounding_bits(reference.rounding_key(5, 2, torch.tensor(10.0)), torch.arange(1000, 2000))
    whole = reference.rounding_bits(reference.rounding_key(5, 2, torch.tensor(10.0)), torch.arange(3000))
    assert torch.equal(a, whole[1000:2000])  # a shard starting at 1000 draws what the full tensor draws there
    for seed, salt, step in ((6, 2, 10.0), (5, 3, 10.0), (5, 2, 11.0)):
        other = reference.rounding_bits(
            reference.rounding_key(seed, salt, torch.tensor(step)), torch.arange(1000, 2000)
        )
        assert (other != a).float().mean() > 0.99


# ---- the optimizer on every backend ----


def make_model_params(shapes, device, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.1).to(device, dtype)) for s in shapes]
    grads = [[(torch.randn(s, generator=gen)).to(device, dtype) for s in shapes] for _ in range(3)]
    return params, grads


def reference_run(params, grads_per_step, opts):
    """The same steps on the torch backend (reference.adam_step_blockwise through the optimizer)."""
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = FusedAdamW(ref, backend="torch", **opts)
    for grads in grads_per_step:
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        opt.step()
    return ref, opt


def close(dtype: torch.dtype) -> dict:
    """Where CUDA's FMA moves a float32 value by an ulp, a value rounded to bfloat16 may land one ulp away."""
    return dict(rtol=2**-7, atol=1e-6) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-7)


def assert_state_matches(opt, ref_opt, params, ref_params, exact: bool):
    for p, q in zip(params, ref_params):
        if exact:
            assert torch.equal(p, q)
        else:
            torch.testing.assert_close(p.float(), q.float(), **close(p.dtype))
        mine, theirs = opt.state[p], ref_opt.state[q]
        assert mine.keys() == theirs.keys()
        for key, value in mine.items():
            if not isinstance(value, torch.Tensor):
                assert value == theirs[key]
            elif exact or key in ("step", "exp_avg_scale", "exp_avg_sq_scale"):
                # Block exponents move only if a block's largest element crosses a power of two: not at 1 ulp here.
                assert torch.equal(value.cpu(), theirs[key].cpu()), key
            elif value.dtype == torch.uint8:
                differ = (value.cpu() != theirs[key].cpu()).float().mean().item()
                assert differ <= 0.01, f"{key}: {differ:.2%} of the codes differ"
            else:
                torch.testing.assert_close(value.float(), theirs[key].float(), **close(value.dtype))


@pytest.mark.parametrize(("dev", "backend"), backend_params())
@pytest.mark.parametrize(
    ("exp_avg", "exp_avg_sq"),
    [("8bit", "8bit"), ("4bit", "4bit"), ("bf16", "8bit"), ("8bit", "fp32"), ("bf16", "bf16")],
)
def test_formats_match_the_reference(dev, backend, exp_avg, exp_avg_sq):
    device = dev
    params, grads = make_model_params(SHAPES, device)
    opts = dict(lr=1e-2, weight_decay=0.1, exp_avg_dtype=FORMATS[exp_avg], exp_avg_sq_dtype=FORMATS[exp_avg_sq])
    opt = FusedAdamW(params, backend=backend, **opts)
    found = torch.zeros(1, device=device)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step(grad_scale=torch.full((1,), 2.0, device=device), found_inf=found)
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in make_model_params(SHAPES, device)[0]]
    ref = FusedAdamW(ref_params, backend="torch", **opts)
    for step_grads in grads:
        for p, g in zip(ref_params, step_grads):
            p.grad = g.clone()
        ref.step(grad_scale=torch.full((1,), 2.0, device=device), found_inf=found)
    assert_state_matches(opt, ref, params, ref_params, exact=device == "cpu")
    for key, name in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if name not in ("8bit", "4bit"):
            continue  # the 2-D tensors of >= 4096 elements hold codes; the small and 1-D ones float32
        assert opt.state[params[0]][key].dtype == torch.uint8
        assert opt.state[params[4]][key].dtype == torch.float32
        assert opt.state[params[3]][key].dtype == torch.float32


# (class, parameter dtype, options): every boolean option, the other lerp formula and master weights, each with
# quantized moments.
NATIVE_CPU_CASES = {
    "adam-l2-amsgrad-maximize": (
        FusedAdam,
        torch.float32,
        dict(weight_decay=0.05, amsgrad=True, maximize=True, exp_avg_dtype="8bit", exp_avg_sq_dtype="bf16"),
    ),
    "adamw-maximize-4bit-8bit": (FusedAdamW, torch.float32, dict(maximize=True, exp_avg_dtype="4bit")),
    "adamw-amsgrad-betas": (
        FusedAdamW,
        torch.float32,
        dict(amsgrad=True, betas=(0.3, 0.9), exp_avg_dtype="4bit", exp_avg_sq_dtype="fp32"),
    ),
    "adamw-no-decay-8bit": (FusedAdamW, torch.float32, dict(weight_decay=0.0, exp_avg_dtype="8bit")),
    "bf16-master-4bit": (
        FusedAdamW,
        torch.bfloat16,
        dict(master_weights=True, exp_avg_dtype="4bit", exp_avg_sq_dtype="4bit"),
    ),
    "fp16-8bit": (FusedAdamW, torch.float16, dict(exp_avg_dtype="8bit", exp_avg_sq_dtype="8bit")),
    "bf16-sr-4bit": (
        FusedAdam,
        torch.bfloat16,
        dict(weight_decay=0.01, stochastic_rounding=True, exp_avg_dtype="4bit", exp_avg_sq_dtype="4bit"),
    ),
}


@pytest.mark.parametrize("case", list(NATIVE_CPU_CASES))
def test_native_cpu_options_match_the_reference_bit_for_bit(case):
    """The CPU kernel's loops are specialized per moment format and per boolean option: each case is its own code,
    and each gives the reference's parameters, codes, block exponents and moments bit for bit."""
    if "native" not in blockwise_backends("cpu"):
        pytest.skip("native extension not available")
    cls, dtype, options = NATIVE_CPU_CASES[case]
    opts = {"lr": 1e-2, "exp_avg_sq_dtype": "8bit", **options}
    params, grads = make_model_params(SHAPES, "cpu", dtype)
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, ref = cls(params, backend="native", **opts), cls(ref_params, backend="torch", **opts)
    for step_grads in grads:
        for p, q, g in zip(params, ref_params, step_grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step(grad_scale=torch.full((1,), 4.0))
        ref.step(grad_scale=torch.full((1,), 4.0))
    assert any(v.dtype == torch.uint8 for v in opt.state[params[0]].values() if isinstance(v, torch.Tensor))
    assert_state_matches(opt, ref, params, ref_params, exact=True)


@pytest.mark.parametrize(("dev", "backend"), backend_params())
@pytest.mark.parametrize("moment", ["bf16", "8bit"])
def test_bf16_stochastic_rounding_matches_the_reference(dev, backend, moment):
    device = dev
    params, grads = make_model_params(SHAPES, device, torch.bfloat16)
    opts = dict(lr=1e-3, stochastic_rounding=True, seed=99, exp_avg_dtype=FORMATS[moment])
    opt = FusedAdamW(params, backend=backend, **opts)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    ref_params, ref = reference_run(make_model_params(SHAPES, device, torch.bfloat16)[0], grads, opts)
    assert "master_param" not in opt.state[params[0]]
    # Rounding draws are exact integer math: identical parameters wherever the float32 update is identical.
    assert_state_matches(opt, ref, params, ref_params, exact=device == "cpu")


@pytest.mark.parametrize(("dev", "backend"), backend_params())
def test_skipped_step_leaves_everything_bitwise_unchanged(dev, backend):
    device = dev
    params, grads = make_model_params(SHAPES, device, torch.bfloat16)
    opt = FusedAdamW(
        params, backend=backend, lr=1e-2, stochastic_rounding=True, exp_avg_dtype="8bit", exp_avg_sq_dtype="4bit"
    )
    for p, g in zip(params, grads[0]):
        p.grad = g.clone()
    opt.step()
    before = copy.deepcopy((params, opt.state_dict()))
    for p, g in zip(params, grads[1]):
        p.grad = g.clone()
    opt.step(found_inf=torch.ones(1, device=device))
    for p, q in zip(params, before[0]):
        assert torch.equal(p, q)
    for key, entry in opt.state_dict()["state"].items():
        for name, value in entry.items():
            old = before[1]["state"][key][name]
            assert torch.equal(value, old) if isinstance(value, torch.Tensor) else value == old, name


@pytest.mark.parametrize(("dev", "backend"), backend_params())
def test_first_step_from_zero_state_is_exact_and_later_ones_within_the_code(dev, backend):
    device = dev
    """A quantized moment only rounds what is stored: the first step from zeros equals the float32 step exactly;
    the next ones differ from it by what the stored moments' rounding makes of the update."""
    params, grads = make_model_params([(64, 256)], device)
    low = FusedAdamW(params, backend=backend, lr=1e-2, exp_avg_dtype="8bit", exp_avg_sq_dtype="8bit")
    full_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    full = FusedAdamW(full_params, backend=backend, lr=1e-2)
    for k, step_grads in enumerate(grads):
        for p, q, g in zip(params, full_params, step_grads):
            p.grad, q.grad = g.clone(), g.clone()
        before = params[0].detach().clone()
        low.step()
        full.step()
        if k == 0:
            # Bit for bit where both steps round alike (CPU); on CUDA the default step contracts into FMAs and
            # Triton's blockwise step does not, an ulp apart.
            if device == "cpu":
                assert torch.equal(params[0], full_params[0])
            else:
                torch.testing.assert_close(params[0], full_params[0], rtol=1e-6, atol=1e-7)
        else:
            # Adam's update is at most ~lr per element; the stored moments carry 3 mantissa bits (2^-4 relative
            # rounding error each), so the update moves by at most ~2^-4 + 2^-5 of lr: bound it by 2^-3 lr.
            # (Measured on CPU: max 0.078 lr, median 0.009 lr, for updates of median 0.5 lr.)
            error = ((params[0] - before) - (full_params[0] - before)).abs().detach()
            assert error.max() <= 2.0**-3 * 1e-2 and error.median() <= 2.0**-6 * 1e-2
            assert error.max() > 0  # the codes did round something
            with torch.no_grad():
                params[0].copy_(full_params[0])  # the next step starts from the same parameters again


@pytest.mark.parametrize(("dev", "backend"), backend_params())
def test_with_the_scaler_lr_tensor_and_param_groups(dev, backend):
    device = dev
    params, grads = make_model_params([(16, 300), (300,)], device)
    lr = torch.tensor(1e-2, device=device)
    opt = FusedAdam(
        [{"params": params[:1], "exp_avg_dtype": "4bit"}, {"params": params[1:], "lr": 1e-3}],
        lr=lr,
        exp_avg_sq_dtype="8bit",
        backend=backend,
    )
    scaler = FusedGradScaler(device, init_scale=2.0**10)
    for step_grads in grads:
        opt.zero_grad()
        scale = scaler.scale(torch.ones((), device=device))  # as scaler.scale(loss) would
        for p, g in zip(params, step_grads):
            p.grad = g * scale
        scaler.step(opt)
        scaler.update()
    state = opt.state[params[0]]
    assert state["exp_avg_bits"] == 4 and state["exp_avg_sq_bits"] == 8
    assert float(state["step"]) == 3
    # Against the reference with the same options, unscaling by hand (2^10 is exact).
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in make_model_params([(16, 300), (300,)], device)[0]]
    ref = FusedAdam(
        [{"params": ref_params[:1], "exp_avg_dtype": "4bit"}, {"params": ref_params[1:], "lr": 1e-3}],
        lr=torch.tensor(1e-2, device=device),
        exp_avg_sq_dtype="8bit",
        backend="torch",
    )
    for step_grads in grads:
        for p, g in zip(ref_params, step_grads):
            p.grad = g.clone()
        ref.step()
    assert_state_matches(opt, ref, params, ref_params, exact=device == "cpu")


def test_state_bytes_per_param():
    """The memory the options promise, on Llama-shaped 2-D weights."""
    params = [torch.nn.Parameter(torch.randn(256, 2048)), torch.nn.Parameter(torch.randn(2048))]
    for p in params:
        p.grad = torch.randn_like(p)
    for dtype, limit in ((torch.uint8, 2.1), (torch.uint4, 1.1), (torch.bfloat16, 4.0)):
        opt = FusedAdamW(params, exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype, backend="torch")
        opt.step()
        state_bytes = sum(
            v.numel() * v.element_size()
            for s in opt.state.values()
            for k, v in s.items()
            if isinstance(v, torch.Tensor) and k != "step"
        )
        assert state_bytes / sum(p.numel() for p in params) <= limit


# ---- state_dict ----


def test_state_dict_round_trip_and_conversions():
    params, grads = make_model_params([(32, 256), (256,)], "cpu")
    opt = FusedAdamW(params, lr=1e-2, exp_avg_dtype="8bit", exp_avg_sq_dtype="8bit", backend="torch")
    for p, g in zip(params, grads[0]):
        p.grad = g
    opt.step()
    sd = opt.state_dict()
    # The compact state is what is saved, and loads back exactly.
    assert sd["state"][0]["exp_avg_codes"].dtype == torch.uint8 and sd["state"][0]["exp_avg_bits"] == 8
    assert "exp_avg" not in sd["state"][0] and opt.state[params[0]]["exp_avg"].dtype == torch.uint8
    again = FusedAdamW(params, lr=1e-2, exp_avg_dtype="8bit", exp_avg_sq_dtype="8bit", backend="torch")
    again.load_state_dict(copy.deepcopy(sd))
    for p in params:
        for key, value in opt.state[p].items():
            other = again.state[p][key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
    # Into float32: decoded.
    fp32 = FusedAdamW(params, lr=1e-2, backend="torch")
    fp32.load_state_dict(copy.deepcopy(sd))
    decoded = reference.dequantize_blockwise(
        sd["state"][0]["exp_avg_codes"], sd["state"][0]["exp_avg_scale"], STATE_Q8, False, (32, 256)
    )
    assert torch.equal(fp32.state[params[0]]["exp_avg"], decoded)
    assert "exp_avg_scale" not in fp32.state[params[0]]
    # Into 4-bit: decoded, then quantized at the next step.
    q4 = FusedAdamW(params, lr=1e-2, exp_avg_dtype="4bit", exp_avg_sq_dtype="4bit", backend="torch")
    q4.load_state_dict(copy.deepcopy(sd))
    assert q4.param_groups[0]["exp_avg_dtype"] == torch.uint4  # the optimizer's options, not the checkpoint's
    for p, g in zip(params, grads[1]):
        p.grad = g
    q4.step()
    assert q4.state[params[0]]["exp_avg_bits"] == 4
    # Checkpoints from before the codes had names of their own (uint8 under 'exp_avg') still load.
    legacy = copy.deepcopy(sd)
    for entry in legacy["state"].values():
        for key in ("exp_avg", "exp_avg_sq"):
            if f"{key}_codes" in entry:
                entry[key] = entry.pop(f"{key}_codes")
    old_form = FusedAdamW(params, lr=1e-2, exp_avg_dtype="8bit", exp_avg_sq_dtype="8bit", backend="torch")
    old_form.load_state_dict(legacy)
    assert torch.equal(old_form.state[params[0]]["exp_avg"], opt.state[params[0]]["exp_avg"])
    # torch.optim.AdamW refuses to step from the compact form (its load would cast uint8 codes to float moments
    # without a word, and 32 x 256 codes have the parameter's shape), and loads the dequantized form.
    torch_opt = torch.optim.AdamW(params, lr=1e-2)
    torch_opt.load_state_dict(copy.deepcopy(sd))
    with pytest.raises(KeyError, match="exp_avg"):
        torch_opt.step()
    torch_opt = torch.optim.AdamW(params, lr=1e-2)
    torch_opt.load_state_dict(opt.state_dict(dequantize=True))
    assert torch.equal(torch_opt.state[params[0]]["exp_avg"], decoded)
    from_torch = FusedAdamW(params, lr=1e-2, exp_avg_dtype="8bit", backend="torch")
    from_torch.load_state_dict(torch_opt.state_dict())
    for p, g in zip(params, grads[2]):
        p.grad = g
    from_torch.step()
    assert from_torch.state[params[0]]["exp_avg"].dtype == torch.uint8


def test_bad_state_dicts_and_options_raise_clear_errors():
    params, grads = make_model_params([(32, 256)], "cpu")
    opt = FusedAdamW(params, exp_avg_dtype="8bit", backend="torch")
    params[0].grad = grads[0][0]
    opt.step()
    sd = opt.state_dict()
    bad = copy.deepcopy(sd)
    del bad["state"][0]["exp_avg_bits"]
    with pytest.raises(ValueError, match="exp_avg_bits"):
        FusedAdamW(params, exp_avg_dtype="8bit").load_state_dict(bad)
    bad = copy.deepcopy(sd)
    bad["state"][0]["exp_avg_scale"] = bad["state"][0]["exp_avg_scale"][:1]
    with pytest.raises(ValueError, match="exp_avg_scale"):
        FusedAdamW(params, exp_avg_dtype="8bit").load_state_dict(bad)
    bad = copy.deepcopy(sd)
    bad["state"][0]["exp_avg_codes"] = bad["state"][0]["exp_avg_codes"][:, :64]
    with pytest.raises(ValueError, match=r"\['exp_avg_codes'\] \(parameter 0 of param group 0\) has shape \(32, 64\)"):
        FusedAdamW(params, exp_avg_dtype="8bit").load_state_dict(bad)
    bad = copy.deepcopy(sd)
    bad["state"][0]["exp_avg_codes"] = bad["state"][0]["exp_avg_codes"].float()
    with pytest.raises(TypeError, match="'exp_avg_codes'.* uint8"):
        FusedAdamW(params, exp_avg_dtype="8bit").load_state_dict(bad)
    bad = copy.deepcopy(sd)
    bad["state"][0]["exp_avg"] = torch.zeros(32, 256)
    with pytest.raises(ValueError, match="also holds 'exp_avg'"):
        FusedAdamW(params, exp_avg_dtype="8bit").load_state_dict(bad)
    bad = copy.deepcopy(sd)
    del bad["state"][0]["exp_avg_codes"]
    with pytest.raises(ValueError, match="without their 'exp_avg_codes'"):
        FusedAdamW(params, exp_avg_dtype="8bit").load_state_dict(bad)
    # An entry without one of the moments (codes and all) or without its step: the step would start that moment
    # from zeros (a zero second moment makes the update m / eps) or the bias corrections from step 0.
    for name, missing in (
        (r"'exp_avg' \(or 'exp_avg_codes'\)", ("exp_avg_codes", "exp_avg_scale", "exp_avg_bits")),
        (r"'exp_avg_sq' \(or 'exp_avg_sq_codes'\)", ("exp_avg_sq",)),
        ("'step'", ("step",)),
    ):
        bad = copy.deepcopy(sd)
        for key in missing:
            del bad["state"][0][key]
        with pytest.raises(KeyError, match=rf"state\[0\] \(parameter 0 of param group 0\) holds .* but no {name};"):
            FusedAdamW(params, exp_avg_dtype="8bit").load_state_dict(bad)
    # A code width on a float moment (the step would decode it as codes without block exponents).
    bad = copy.deepcopy(sd)
    bad["state"][0]["exp_avg_sq_bits"] = 8
    with pytest.raises(ValueError, match=r"\['exp_avg_sq_bits'\].*on a float 'exp_avg_sq', without 'exp_avg_sq_codes'"):
        FusedAdamW(params, exp_avg_dtype="8bit").load_state_dict(bad)
    with pytest.raises(ValueError, match="exp_avg_dtype"):
        FusedAdamW(params, exp_avg_dtype="int3")
    with pytest.raises(ValueError, match="exp_avg_sq_dtype must be None, .* got \\['8bit'\\]"):
        FusedAdamW(params, exp_avg_sq_dtype=["8bit"])  # was TypeError: unhashable type: 'list'
    with pytest.raises(ValueError, match="amsgrad"):
        FusedAdamW(params, amsgrad=True, exp_avg_sq_dtype="8bit")
    with pytest.raises(ValueError, match="master_weights"):
        FusedAdamW(params, stochastic_rounding=True, master_weights=True)
    with pytest.raises(TypeError, match="float16"):
        FusedAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))], stochastic_rounding=True)
    with pytest.raises(ValueError, match="seed"):
        FusedAdamW(params, seed=-1)
    transposed = torch.nn.Parameter(torch.randn(256, 64).t())
    transposed.grad = torch.randn_like(transposed)
    with pytest.raises(ValueError, match="contiguous"):
        FusedAdamW([transposed], exp_avg_dtype="8bit", backend="torch").step()


@pytest.mark.parametrize(("dev", "backend"), backend_params())
@pytest.mark.parametrize("back_to", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["8bit", "4bit"])
def test_a_group_switched_off_quantized_moments_decodes_them(dev, backend, fmt, back_to):
    """exp_avg_dtype / exp_avg_sq_dtype changed in the param group after steps with codes: the next step decodes the
    codes (as loading the compact state into such an optimizer does) instead of casting the uint8 codes to float
    moments or failing on their shape."""
    params, grads = make_model_params([(32, 256)], dev)
    opt = FusedAdamW(params, lr=1e-2, exp_avg_dtype=fmt, exp_avg_sq_dtype=fmt, backend=backend)
    params[0].grad = grads[0][0].clone()
    opt.step()
    decoded = copy.deepcopy(opt.state_dict(dequantize=True))
    twin = [torch.nn.Parameter(params[0].detach().clone())]
    expected = FusedAdamW(twin, lr=1e-2, exp_avg_dtype=back_to, exp_avg_sq_dtype=back_to, backend=backend)
    expected.load_state_dict(decoded)
    for group in opt.param_groups:
        group["exp_avg_dtype"] = group["exp_avg_sq_dtype"] = back_to
    for step_grads in grads[1:]:
        params[0].grad, twin[0].grad = step_grads[0].clone(), step_grads[0].clone()
        opt.step()
        expected.step()
    assert torch.equal(params[0], twin[0])
    state, reference_state = opt.state[params[0]], expected.state[twin[0]]
    assert state.keys() == reference_state.keys() and "exp_avg_bits" not in state
    for key, value in state.items():
        assert torch.equal(value, reference_state[key]), key
    # and the state saves and loads again
    FusedAdamW(twin, exp_avg_dtype=back_to, exp_avg_sq_dtype=back_to).load_state_dict(opt.state_dict())


@pytest.mark.parametrize(("dev", "backend"), backend_params())
def test_options_set_on_a_group_between_steps_are_normalised_and_checked(dev, backend):
    """A group's exp_avg_dtype set to an alias ("4bit") between steps steps as torch.uint4 does; a mix the
    constructor refuses (amsgrad with a quantized second moment) is refused at the next step, naming the group."""
    params, grads = make_model_params([(32, 256)], dev)
    twin = [torch.nn.Parameter(params[0].detach().clone())]
    opts = [
        FusedAdamW(ps, lr=1e-2, exp_avg_dtype="8bit", exp_avg_sq_dtype="8bit", backend=backend) for ps in (params, twin)
    ]
    params[0].grad, twin[0].grad = grads[0][0].clone(), grads[0][0].clone()
    for opt in opts:
        opt.step()
    opts[0].param_groups[0]["exp_avg_dtype"] = "4bit"
    opts[1].param_groups[0]["exp_avg_dtype"] = torch.uint4
    params[0].grad, twin[0].grad = grads[1][0].clone(), grads[1][0].clone()
    for opt in opts:
        opt.step()
    assert opts[0].param_groups[0]["exp_avg_dtype"] == torch.uint4
    assert torch.equal(params[0], twin[0])
    for key, value in opts[0].state[params[0]].items():
        assert torch.equal(torch.as_tensor(value), torch.as_tensor(opts[1].state[twin[0]][key])), key
    opts[0].param_groups[0]["amsgrad"] = True
    before = params[0].detach().clone()
    with pytest.raises(ValueError, match="param group 0: amsgrad needs a float32 or bfloat16 exp_avg_sq_dtype"):
        opts[0].step()
    assert torch.equal(params[0], before)


@pytest.mark.parametrize(
    ("source", "target", "match"),
    [
        (
            lambda ps: torch.optim.AdamW(ps, amsgrad=True),
            dict(exp_avg_dtype="8bit", exp_avg_sq_dtype="8bit"),
            r"param_groups\[0\]: amsgrad needs a float32 or bfloat16 exp_avg_sq_dtype",
        ),
        (
            lambda ps: FusedAdamW(ps, master_weights=True, backend="torch"),
            dict(stochastic_rounding=True),
            r"param_groups\[0\]: stochastic_rounding and master_weights exclude each other",
        ),
    ],
    ids=["torch-amsgrad-into-8bit-second-moment", "master-weights-into-stochastic-rounding"],
)
def test_load_state_dict_refuses_options_that_cannot_step_together(source, target, match):
    """amsgrad and master_weights come from the checkpoint, the storage options from the optimizer: a mix that the
    constructor refuses is refused at the load, naming the group, and nothing is loaded (it used to load and fail at
    the step with KeyError: 2, or step with both master weights and stochastic rounding)."""
    params, grads = make_model_params([(32, 256), (256,)], "cpu", torch.bfloat16)
    src = source(params)
    for p, g in zip(params, grads[0]):
        p.grad = g.clone()
    src.step()
    sd = copy.deepcopy(src.state_dict())
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = FusedAdamW(twin, backend="torch", **target)
    before = copy.deepcopy(opt.param_groups[0])
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    assert not opt.state and {k: v for k, v in opt.param_groups[0].items() if k != "params"} == {
        k: v for k, v in before.items() if k != "params"
    }
    for p, g in zip(twin, grads[1]):
        p.grad = g.clone()
    opt.step()  # the optimizer as it was


def test_torch_amsgrad_state_loads_into_a_low_bit_first_moment():
    """The supported counterpart: torch.optim.AdamW(amsgrad=True) state into 8-bit first and bfloat16 second
    moments keeps amsgrad and its running maximum."""
    params, grads = make_model_params([(32, 256)], "cpu")
    src = torch.optim.AdamW(params, lr=1e-2, amsgrad=True)
    params[0].grad = grads[0][0].clone()
    src.step()
    twin = [torch.nn.Parameter(params[0].detach().clone())]
    opt = FusedAdamW(twin, lr=1e-2, exp_avg_dtype="8bit", exp_avg_sq_dtype="bf16", backend="torch")
    opt.load_state_dict(copy.deepcopy(src.state_dict()))
    twin[0].grad = grads[1][0].clone()
    opt.step()
    state = opt.state[twin[0]]
    assert opt.param_groups[0]["amsgrad"] and state["max_exp_avg_sq"].dtype == torch.bfloat16
    assert state["exp_avg"].dtype == torch.uint8 and float(state["step"]) == 2


def test_stochastic_rounding_of_non_contiguous_parameters_follows_the_reference_or_is_refused():
    """The rounding stream is indexed by each element's logical flat index (reference.adam_step_blockwise). The
    torch backend steps a channels_last or transposed bfloat16 parameter as its contiguous copy; the native kernels
    would index the stream in memory order (other bits for about half the elements) and Triton's refuses it: both
    refuse it at the step, naming the parameter, with nothing written."""
    makers = {
        "channels_last": lambda: torch.randn(8, 16, 5, 5).to(memory_format=torch.channels_last),
        "transposed": lambda: torch.randn(96, 64).t(),
    }
    for name, make in makers.items():
        torch.manual_seed(0)
        strided = make().bfloat16()
        contiguous = strided.contiguous()
        results = []
        for data in (strided, contiguous):
            p = torch.nn.Parameter(data.clone(memory_format=torch.preserve_format))
            opt = FusedAdamW([p], lr=1e-3, stochastic_rounding=True, seed=7, backend="torch")
            gen = torch.Generator().manual_seed(1)
            for _ in range(2):
                p.grad = torch.randn(p.shape, generator=gen).bfloat16()
                opt.step()
            results.append(p.detach())
        assert torch.equal(results[0], results[1]), name
        for backend in blockwise_backends("cpu"):
            if backend == "torch":
                continue
            p = torch.nn.Parameter(strided.clone(memory_format=torch.preserve_format))
            assert not p.is_contiguous()
            opt = FusedAdamW([torch.nn.Parameter(torch.randn(4)), p], stochastic_rounding=True, backend=backend)
            p.grad = torch.randn_like(p)
            with pytest.raises(
                ValueError, match=rf"parameter 1 of param group 0 .* stochastic_rounding on the {backend}"
            ):
                opt.step()
            assert torch.equal(p, strided)


def test_default_options_keep_the_default_step():
    """exp_avg_dtype equal to the state dtype is today's path, bit for bit."""
    params, grads = make_model_params([(32, 256)], "cpu")
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    a = FusedAdamW(params, backend="torch")
    b = FusedAdamW(twin, exp_avg_dtype=torch.float32, exp_avg_sq_dtype="float32", backend="torch")
    for step_grads in grads:
        params[0].grad, twin[0].grad = step_grads[0].clone(), step_grads[0].clone()
        a.step()
        b.step()
    assert torch.equal(params[0], twin[0])
    assert next(iter(b._plans.values())).buckets[0].layout is None


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["native", "triton"])
def test_blockwise_step_replays_in_a_cuda_graph(backend):
    """Step counts, bias corrections and rounding keys live on the device: a captured step replays as eager."""
    if backend not in blockwise_backends("cuda"):
        pytest.skip(f"{backend} backend not available")
    shapes = [(64, 256), (256,)]
    eager, grads = make_model_params(shapes, "cuda", torch.bfloat16)
    graphed = [torch.nn.Parameter(p.detach().clone()) for p in eager]
    opts = dict(lr=torch.tensor(1e-2, device="cuda"), stochastic_rounding=True, seed=5, exp_avg_sq_dtype="8bit")
    eager_opt = FusedAdamW(eager, backend=backend, **opts)
    graph_opt = FusedAdamW(graphed, backend=backend, **{**opts, "lr": torch.tensor(1e-2, device="cuda")})
    for p in graphed:
        p.grad = torch.zeros_like(p)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph (builds the tables), then undo it
        graph_opt.step(found_inf=torch.ones(1, device="cuda"))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_opt.step()
    for step_grads in grads:
        for p, q, g in zip(eager, graphed, step_grads):
            p.grad = g.clone()
            q.grad.copy_(g)
        eager_opt.step()
        graph.replay()
        for p, q in zip(eager, graphed):
            assert torch.equal(p, q)
    for p, q in zip(eager, graphed):
        for key, value in eager_opt.state[p].items():
            other = graph_opt.state[q][key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
