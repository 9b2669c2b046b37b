"""The Triton Adam step with low-precision moments (``ampkernels.optim.triton.blockwise.BlockwiseStepTable``) against
``reference.adam_step_blockwise``.

Runs on a CUDA device, or on the CPU under ``TRITON_INTERPRET=1`` (``tests/conftest.py``). Every result is compared
bit for bit, on both: the kernel's float32 math is the reference's operation for operation (no FMA contraction:
``blockwise._FP_FUSION``; IEEE division and square root, on the GPU the division by the bias correction by exact
FMA corrections), its codes the reference's integer math on the same bit patterns.
The one inexact step is the prologue's float64 beta^step (exp2 of a product, as the fp32 kernels' prologue): a few
float64 ulps from torch's pow, which moves the float32 step size only when it lies that close to a rounding
boundary (not seen here).
"""

from __future__ import annotations

import pytest
import torch

from ampkernels import dispatch, reference
from ampkernels._constants import QUANT_CODES, STATE_BF16, STATE_F32, STATE_Q4, STATE_Q8
from ampkernels.optim import AdamHyperparameters
from ampkernels.optim import reference as optim_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if dispatch.why_not("adam", "triton", DEV) is not None:
    pytest.skip(dispatch.why_not("adam", "triton", DEV), allow_module_level=True)

# On a GPU machine every test here runs on the GPU: marked so, for `pytest -m gpu`.
pytestmark = [pytest.mark.gpu] if DEV == "cuda" else []

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from ampkernels.optim.triton.blockwise import BlockwiseStepTable  # noqa: E402
from ampkernels.optim.triton.blockwise_kernels import _div_rn_by  # noqa: E402
from ampkernels.optim.triton.optimizers import StepTable  # noqa: E402

FORMATS = (STATE_F32, STATE_BF16, STATE_Q8, STATE_Q4)
QUANTIZED = (STATE_Q8, STATE_Q4)
NAMES = ("param", "exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale", "max_exp_avg_sq", "master", "step")
HYPER = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False)


def _moment(shape, fmt, second, gen, fresh):
    """A moment in format ``fmt`` (state tensor, scale tensor): random values whose rows span several binades (so the
    blocks' exponents differ), or a fresh zero state (codes and exponents 0)."""
    rows = 2.0 ** torch.randint(-12, -2, (*shape[:-1], 1), generator=gen).float() if len(shape) > 1 else 1e-3
    x = torch.randn(shape, generator=gen) * rows
    if second:
        x = x * x
    if fmt in QUANTIZED:
        codes, scales = reference.quantize_blockwise(x, fmt, second)
        if fresh:
            codes, scales = torch.zeros_like(codes), torch.zeros_like(scales)
        return codes, scales
    x = torch.zeros(shape) if fresh else x
    return x.to(torch.bfloat16 if fmt == STATE_BF16 else torch.float32), torch.empty(0, dtype=torch.uint8)


def _make(specs, *, dtype=torch.float32, master=False, amsgrad=False, fresh=False, seed=0):
    """Per spec ``(shape, fmt_m, fmt_v)`` a dict of every tensor of one parameter."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for shape, fmt_m, fmt_v in specs:
        p32 = torch.randn(shape, generator=gen)
        m, ms = _moment(shape, fmt_m, False, gen, fresh)
        v, vs = _moment(shape, fmt_v, True, gen, fresh)
        t = dict(param=p32.to(dtype), exp_avg=m, exp_avg_scale=ms, exp_avg_sq=v, exp_avg_sq_scale=vs)
        t["step"] = torch.tensor(float(torch.randint(0, 5, (), generator=gen)))
        if amsgrad:  # (a quantized second moment cannot take amsgrad: a float32 maximum for the test that says so)
            v32 = reference.dequantize_blockwise(v, vs, fmt_v, True, shape) if fmt_v in QUANTIZED else v.float()
            t["max_exp_avg_sq"] = (v32 * 1.5).to(torch.float32 if fmt_v in QUANTIZED else v.dtype)
        if master:
            t["master"] = p32
        out.append(t)
    return out


def _grads(tensors, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1000 + seed)
    return [(torch.randn(t["param"].shape, generator=gen) * 0.1).to(dtype) for t in tensors]


def _to(tensors, device):
    return [{k: x.clone().to(device) for k, x in t.items()} for t in tensors]


def _reference_step(tensors, grads, formats, *, lr, salts, offsets, grad_scale=None, found_inf=None, **kw):
    has = tensors[0]
    reference.adam_step_blockwise(
        [t["param"] for t in tensors],
        grads,
        [t["exp_avg"] for t in tensors],
        [t["exp_avg_scale"] if f[0] in QUANTIZED else None for t, f in zip(tensors, formats, strict=True)],
        [t["exp_avg_sq"] for t in tensors],
        [t["exp_avg_sq_scale"] if f[1] in QUANTIZED else None for t, f in zip(tensors, formats, strict=True)],
        [t["max_exp_avg_sq"] for t in tensors] if "max_exp_avg_sq" in has else [],
        [t["step"] for t in tensors],
        formats=formats,
        lr=lr,
        hyper=AdamHyperparameters(**kw),
        grad_scale=grad_scale,
        found_inf=found_inf,
        master_params=[t["master"] for t in tensors] if "master" in has else [],
        salts=salts,
        offsets=offsets,
    )


def _table(tensors, specs, salts, offsets):
    has = tensors[0]
    lists = [
        [t["exp_avg"] for t in tensors],
        [t["exp_avg_scale"] for t in tensors],
        [t["exp_avg_sq"] for t in tensors],
        [t["exp_avg_sq_scale"] for t in tensors],
        [t["max_exp_avg_sq"] for t in tensors] if "max_exp_avg_sq" in has else [],
        [t["master"] for t in tensors] if "master" in has else [],
        [t["step"] for t in tensors],
    ]
    layout = [
        (fm, fv, shape[-1] if shape else 1, salt, off)
        for (shape, fm, fv), salt, off in zip(specs, salts, offsets, strict=True)
    ]
    return BlockwiseStepTable([t["param"] for t in tensors], lists, layout)


def _plain_step(table, ref, specs, grads, salts, offsets):
    """One default step (lr 1e-2, AdamW, no scale) of ``table`` and of the reference on ``ref``."""
    kw = dict(HYPER, decoupled_weight_decay=True)
    table.step_adam([g.to(DEV) for g in grads], 1e-2, None, None, AdamHyperparameters(**kw))
    formats = [(fm, fv) for _, fm, fv in specs]
    _reference_step(ref, grads, formats, lr=1e-2, salts=salts, offsets=offsets, **kw)


def _compare(ours, ref, what=""):
    """Every tensor of every parameter bit for bit (NaNs equal to NaNs)."""
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        for name in a:
            x, y = a[name].cpu(), b[name].cpu()
            assert x.dtype == y.dtype and x.shape == y.shape
            if x.is_floating_point():
                same = (x == y) | (torch.isnan(x) & torch.isnan(y))
            else:
                same = x == y
            if not bool(same.all()):
                bad = (~same).nonzero()[:4].tolist()
                raise AssertionError(
                    f"{what}tensor {i} {name}: {int((~same).sum())} of {x.numel()} differ, first at {bad}: "
                    f"{x.flatten()[(~same).flatten()][:4].tolist()} vs {y.flatten()[(~same).flatten()][:4].tolist()}"
                )


def _run(
    specs,
    *,
    steps=2,
    dtype=torch.float32,
    master=False,
    amsgrad=False,
    fresh=False,
    lr=1e-2,
    lr_tensor=False,
    grad_scale=None,
    found_inf=None,
    stochastic_rounding=False,
    seed=0x1234_5678_9ABC,
    salts=None,
    offsets=None,
    grad_dtype=torch.float32,
    **hyper,
):
    """Steps the table and the reference side by side for ``steps`` steps (new gradients each step, the codes each
    side wrote read back by the next) and compares everything after each. Returns (ours, reference) tensors."""
    kw = dict(HYPER, amsgrad=amsgrad, **hyper)
    kw.setdefault("decoupled_weight_decay", True)
    formats = [(fm, fv) for _, fm, fv in specs]
    salts = salts if salts is not None else list(range(7, 7 + len(specs)))
    offsets = offsets if offsets is not None else [0] * len(specs)
    initial = _make(specs, dtype=dtype, master=master, amsgrad=amsgrad, fresh=fresh)
    ours, ref = _to(initial, DEV), _to(initial, "cpu")
    table = _table(ours, specs, salts, offsets)
    lr_ours = torch.tensor(lr, device=DEV) if lr_tensor else lr
    lr_ref = torch.tensor(lr) if lr_tensor else lr
    scale = None if grad_scale is None else torch.tensor([grad_scale])
    found = None if found_inf is None else torch.tensor([found_inf])
    for step in range(steps):
        grads = _grads(initial, step, grad_dtype)
        if scale is not None:
            grads = [g * grad_scale for g in grads]
        table.step_adam(
            [g.to(DEV) for g in grads],
            lr_ours,
            None if scale is None else scale.to(DEV),
            None if found is None else found.to(DEV),
            AdamHyperparameters(**kw, stochastic_rounding=stochastic_rounding, seed=seed),
        )
        _reference_step(
            ref,
            grads,
            formats,
            lr=lr_ref,
            grad_scale=scale,
            found_inf=found,
            stochastic_rounding=stochastic_rounding,
            seed=seed,
            salts=salts,
            offsets=offsets,
            **kw,
        )
        _compare(ours, ref, f"step {step}: ")
    return ours, ref, initial


# Row lengths: whole blocks (the vector path), odd (300, 129: a partial last block; Q4 rows of odd length end in
# a zero high nibble), a single column, and a 3-D tensor (rows = the first two dimensions).
SHAPES = [(3, 300), (2, 256), (4, 129), (6, 1), (2, 2, 128)]


@pytest.mark.parametrize("fmt_m", FORMATS)
@pytest.mark.parametrize("fmt_v", FORMATS)
def test_every_format_combination_matches_the_reference(fmt_m, fmt_v):
    """Codes, block exponents, moments, parameters and steps bit for bit, over two steps (the second decodes what the
    first encoded), rows of every kind in one table."""
    _run([(shape, fmt_m, fmt_v) for shape in SHAPES], weight_decay=0.01)


def test_mixed_formats_in_one_table():
    """Every combination, unquantized tensors (one row: any length, a non-contiguous one) and an empty one in one
    table: one launch per format group, the items of each group's tensors only."""
    specs = [((2, 300), fm, fv) for fm in FORMATS for fv in FORMATS]
    specs += [((700,), STATE_F32, STATE_F32), ((512,), STATE_BF16, STATE_F32), ((0,), STATE_F32, STATE_F32)]
    _run(specs, steps=1)


def test_fresh_state_decodes_to_zero():
    """Zeroed codes with zero block exponents (a fresh state) are a zero moment: the first step equals the reference's
    from zeros, for both moments in both code widths."""
    ours, ref, initial = _run([((3, 300), fm, fv) for fm in QUANTIZED for fv in QUANTIZED], steps=1, fresh=True)
    for t in ours:
        assert int(t["exp_avg_scale"].min()) > 0 and int(t["exp_avg_sq_scale"].min()) > 0  # every block written


def test_zero_block_exponent_decodes_to_zero_whatever_the_codes():
    """Block exponent 0 stands for a zero block even under non-zero codes (the reference's rule): row 0's blocks
    zeroed, with zero gradients, the other rows as they are."""
    specs = [((3, 300), fm, fv) for fm in QUANTIZED for fv in QUANTIZED]
    initial = _make(specs)
    for t in initial:
        t["exp_avg_scale"][0] = 0
        t["exp_avg_sq_scale"][0] = 0
        assert int(t["exp_avg"][0].max()) > 0 and int(t["exp_avg_sq"][0].max()) > 0
    grads = _grads(initial, 0)
    for g in grads:
        g[0] = 0.0  # else the gradient swamps what 2^-126-scaled codes would decode to
    ours, ref = _to(initial, DEV), _to(initial, "cpu")
    _plain_step(_table(ours, specs, [0, 1, 2, 3], [0] * 4), ref, specs, grads, [0, 1, 2, 3], [0] * 4)
    _compare(ours, ref)


def test_bfloat16_ties_round_to_even():
    """Master values exactly halfway between two bfloat16 values (lr 0: the parameter is the master value rounded):
    ties go to the even neighbour, as torch's cast."""
    specs = [((2, 256), STATE_Q8, STATE_Q8), ((700,), STATE_F32, STATE_F32)]
    initial = _make(specs, dtype=torch.bfloat16, master=True)
    for t in initial:
        bits = t["master"].view(torch.int32)
        t["master"] = ((bits & ~0xFFFF) | 0x8000).view(torch.float32)  # every value a tie
    ours, ref = _to(initial, DEV), _to(initial, "cpu")
    table = _table(ours, specs, [0, 1], [0, 0])
    kw = dict(HYPER, decoupled_weight_decay=True)
    table.step_adam([g.to(DEV) for g in _grads(initial, 0)], 0.0, None, None, AdamHyperparameters(**kw))
    formats = [(fm, fv) for _, fm, fv in specs]
    _reference_step(ref, _grads(initial, 0), formats, lr=0.0, salts=[0, 1], offsets=[0, 0], **kw)
    _compare(ours, ref)
    for t in ours:
        assert torch.equal(t["param"].cpu(), t["master"].cpu().to(torch.bfloat16))


def _code_values(fmt, second):
    eb, mb = QUANT_CODES[(fmt, second)]
    return optim_reference._decode(torch.arange(2 ** (eb + mb), dtype=torch.int32), eb, mb)


def _grid_and_ties(fmt, second):
    """Magnitudes (float32, in the code's range below 2) at every code value, halfway between neighbours (a tie of
    the rounding) and one float32 ulp either side of halfway."""
    values = _code_values(fmt, second)
    half = (values[1:] + values[:-1]) / 2  # exact: neighbours are within a binade of each other
    return torch.cat((values, half, torch.nextafter(half, torch.zeros(())), torch.nextafter(half, torch.ones(()) * 2)))


def _blocks_of(magnitudes, top, rows, gen, signed):
    """[rows, 256] values: each block's first element the largest code value (fixing the block exponent at 2^-10),
    the rest drawn from ``magnitudes``, all scaled by 2^-10."""
    pick = magnitudes[torch.randint(0, magnitudes.numel(), (rows, 256), generator=gen)]
    pick[:, 0] = pick[:, 128] = top
    if signed:
        pick = pick * (torch.randint(0, 2, pick.shape, generator=gen) * 2 - 1)
    return pick * 2.0**-10


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_codes_at_rounding_ties_and_on_the_subnormal_grid(fmt):
    """beta1 = 0 makes the new first moment the gradient and beta2 = 0 the second its square, so the encoder sees
    chosen values: every code value, every tie between neighbours (ties away from zero), one ulp either side, the
    grid below the smallest normal code. Codes and exponents bit for bit the reference's."""
    gen = torch.Generator().manual_seed(5)
    specs = [((4, 256), fmt, STATE_F32), ((4, 256), STATE_F32, fmt)]
    initial = _make(specs)
    g_m = _blocks_of(_grid_and_ties(fmt, False), float(_code_values(fmt, False)[-1]), 4, gen, True)
    # Second moment targets t = g * g exactly in float32 where such a g exists (about half of them).
    t = _blocks_of(_grid_and_ties(fmt, True), float(_code_values(fmt, True)[-1]), 4, gen, False) * 2.0**-10
    g_v = t.double().sqrt().float()
    for step in (torch.zeros(()), torch.ones(()), -torch.ones(())):
        candidate = torch.nextafter(g_v, g_v + step)
        g_v = torch.where(candidate * candidate == t, candidate, g_v)
    assert float((g_v * g_v == t).float().mean()) > 0.3  # 48% here
    ours, ref = _to(initial, DEV), _to(initial, "cpu")
    table = _table(ours, specs, [0, 1], [0, 0])
    kw = dict(HYPER, beta1=0.0, beta2=0.0, decoupled_weight_decay=True)
    table.step_adam([g_m.to(DEV), g_v.to(DEV)], 1e-3, None, None, AdamHyperparameters(**kw))
    _reference_step(ref, [g_m, g_v], [(fmt, STATE_F32), (STATE_F32, fmt)], lr=1e-3, salts=[0, 1], offsets=[0, 0], **kw)
    _compare(ours, ref)
    assert torch.equal(ref[0]["exp_avg"].cpu(), reference.quantize_blockwise(g_m, fmt, False)[0])  # m was g


def test_q4_padding_nibble_is_ignored_and_written_as_zero():
    """Rows of odd length: the last byte's high nibble stands for no element. Poisoned with the largest code in a
    last block of small codes and zero gradients, it must not reach the block's absmax (the reference drops it),
    and it comes back zero."""
    specs = [((3, 301), STATE_Q4, STATE_Q4), ((2, 129), STATE_Q4, STATE_Q8)]
    initial = _make(specs)
    grads = _grads(initial, 0)
    for t, g in zip(initial, grads, strict=True):
        last_block = (t["param"].shape[-1] - 1) // 128 * 128
        g[:, last_block:] = 0.0
        for name in ("exp_avg", "exp_avg_sq"):
            if t[name].dtype == torch.uint8 and t[name].shape[-1] * 2 != t["param"].shape[-1]:
                t[name][:, last_block // 2 :] = 0x11  # code 1 everywhere: a small block
                t[name][:, -1] = 0x71  # the padding nibble: the largest magnitude code
    ours, ref = _to(initial, DEV), _to(initial, "cpu")
    _plain_step(_table(ours, specs, [0, 1], [0, 0]), ref, specs, grads, [0, 1], [0, 0])
    _compare(ours, ref)
    assert int((ours[0]["exp_avg"][:, -1] >> 4).max()) == 0


def test_second_moment_never_zero_and_signs():
    """A block of zero gradients: the second moment's codes stay >= 1, the first moment's zero code has no sign."""
    specs = [((2, 256), fm, fv) for fm, fv in ((STATE_Q8, STATE_Q8), (STATE_Q4, STATE_Q4))]
    initial = _make(specs, fresh=True)
    ours, ref = _to(initial, DEV), _to(initial, "cpu")
    grads = _grads(initial, 0)
    for g in grads:
        g[0] = 0.0  # row 0: all zero
    _plain_step(_table(ours, specs, [0, 1], [0, 0]), ref, specs, grads, [0, 1], [0, 0])
    _compare(ours, ref)
    q8, q4 = (t["exp_avg_sq"].cpu() for t in ours)
    assert int(q8.min()) >= 1 and int((q4 & 0xF).min()) >= 1 and int((q4 >> 4).min()) >= 1
    assert int(ours[0]["exp_avg"][0].max()) == 0  # zero codes, no sign bit


@pytest.mark.parametrize("master", [False, True])
def test_bfloat16_stochastic_rounding(master):
    """bfloat16 parameters rounded from the counter-based stream: exact against the reference, with a seed of more
    than 32 bits, salts past 2^31 and shard offsets whose index crosses 2^32 inside the tensor (the high word)."""
    specs = [((3, 300), STATE_Q8, STATE_Q8), ((2, 256), STATE_Q4, STATE_BF16), ((700,), STATE_F32, STATE_F32)]
    kw = dict(dtype=torch.bfloat16, master=master, seed=(1 << 62) + 12345)
    kw.update(salts=[3, 2**31 + 5, 2**32 - 1], offsets=[2**32 - 450, 0, 5 * 2**32 + 17])
    _run(specs, stochastic_rounding=True, **kw)
    # Not round-to-nearest: after one step from the same state some elements went the other way.
    rounded, nearest = (_run(specs, stochastic_rounding=sr, steps=1, **kw)[0] for sr in (True, False))
    assert any(not torch.equal(a["param"], b["param"]) for a, b in zip(rounded, nearest, strict=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_round_to_nearest(dtype):
    """Without stochastic rounding (or for float16, where it does not apply) parameters are rounded to nearest even,
    with and without a master copy."""
    specs = [((3, 300), STATE_Q8, STATE_Q4), ((2, 256), STATE_BF16, STATE_Q8)]
    _run(specs, dtype=dtype, stochastic_rounding=dtype == torch.float16)
    _run(specs, dtype=dtype, master=True, steps=1)


def test_skipped_step_changes_nothing():
    """found_inf = 1: parameters, master copies, codes, block exponents and steps bitwise unchanged (compared with the
    state before the step, not only with the reference)."""
    specs = [((3, 300), STATE_Q8, STATE_Q4), ((2, 256), STATE_Q4, STATE_Q8), ((700,), STATE_BF16, STATE_F32)]
    ours, ref, initial = _run(specs, found_inf=1.0, master=True, dtype=torch.bfloat16, stochastic_rounding=True)
    _compare(ours, initial, "skipped: ")
    ours, _, initial = _run(specs, found_inf=0.0, steps=1)
    assert all(not torch.equal(a["exp_avg"].cpu(), b["exp_avg"]) for a, b in zip(ours, initial, strict=True))


def test_grad_scale_lr_tensor_and_l2_weight_decay():
    specs = [((3, 300), STATE_Q8, STATE_Q8), ((2, 256), STATE_Q4, STATE_Q4), ((700,), STATE_F32, STATE_BF16)]
    _run(specs, grad_scale=1024.0, lr_tensor=True, weight_decay=0.1, decoupled_weight_decay=False)
    _run(specs, grad_scale=3.0, maximize=True, weight_decay=0.05, steps=1)


def test_beta1_at_least_half_uses_the_other_lerp_form():
    _run([((3, 300), STATE_Q8, STATE_Q8)], steps=1, beta1=0.3, beta2=0.9)


@pytest.mark.parametrize("fmt_v", [STATE_F32, STATE_BF16])
def test_amsgrad(fmt_v):
    """amsgrad keeps the running maximum in the second moment's (float) format; the first moment may be quantized."""
    specs = [((3, 300), STATE_Q8, fmt_v), ((2, 256), STATE_Q4, fmt_v), ((700,), STATE_BF16, fmt_v)]
    _run(specs, amsgrad=True)


def test_amsgrad_with_quantized_second_moment_raises():
    specs = [((2, 256), STATE_F32, STATE_Q8)]
    tensors = _to(_make(specs, amsgrad=True), DEV)
    table = _table(tensors, specs, [0], [0])
    kw = dict(HYPER, amsgrad=True, decoupled_weight_decay=True)
    with pytest.raises(ValueError, match="amsgrad"):
        table.step_adam([torch.ones(2, 256, device=DEV)], 1e-2, None, None, AdamHyperparameters(**kw))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf / inf in the interpreter
def test_non_finite_values_saturate_as_the_reference():
    """An inf gradient in a block (no found_inf): that block's exponent becomes 253 and its codes saturate, as the
    reference's; the parameter goes NaN there as the reference's."""
    specs = [((2, 256), STATE_Q8, STATE_Q8), ((2, 300), STATE_Q4, STATE_Q4)]
    initial = _make(specs)
    grads = _grads(initial, 0)
    grads[0][1, 5] = float("inf")
    grads[1][0, 140] = float("-inf")
    ours, ref = _to(initial, DEV), _to(initial, "cpu")
    _plain_step(_table(ours, specs, [0, 1], [0, 0]), ref, specs, grads, [0, 1], [0, 0])
    _compare(ours, ref)
    assert int(ours[0]["exp_avg_sq_scale"][1, 0]) == 253 and int(ours[1]["exp_avg_scale"][0, 1]) == 253


def test_unquantized_matches_the_fp32_adam_kernel():
    """F32/F32 moments with float32 parameters: bit for bit the existing Triton Adam step (``StepTable``) where
    neither contracts (the interpreter)."""
    specs = [((700,), STATE_F32, STATE_F32), ((3, 300), STATE_F32, STATE_F32), ((2, 256), STATE_F32, STATE_F32)]
    for amsgrad in (False, True):
        initial = _make(specs, amsgrad=amsgrad)
        ours, theirs = _to(initial, DEV), _to(initial, DEV)
        table = _table(ours, specs, [0, 1, 2], [0, 0, 0])
        fp32 = StepTable(
            "adam",
            [t["param"] for t in theirs],
            [
                [t["exp_avg"] for t in theirs],
                [t["exp_avg_sq"] for t in theirs],
                [t["max_exp_avg_sq"] for t in theirs] if amsgrad else [],
                [],
                [t["step"] for t in theirs],
            ],
        )
        kw = dict(HYPER, amsgrad=amsgrad, weight_decay=0.01, decoupled_weight_decay=not amsgrad)
        for step in range(2):
            grads = [g.to(DEV) for g in _grads(initial, step)]
            table.step_adam(grads, 1e-2, None, None, AdamHyperparameters(**kw))
            fp32.step_adam(grads, 1e-2, None, None, AdamHyperparameters(**kw))
        if DEV == "cpu":
            _compare(ours, theirs)
        else:
            # The fp32 kernels contract into FMAs on a GPU (this one does not: it matches the reference there):
            # up to 2 ulps apart after steps (test_optimizers.py, seen on the H200); atol for the moments' values
            # near zero, where a contracted lerp cancels differently.
            for a, b in zip(ours, theirs, strict=True):
                for name in a:
                    if not b[name].numel():  # the empty scale entries of unquantized moments
                        continue
                    atol = 2.0**-20 * float(b[name].abs().max())
                    torch.testing.assert_close(a[name], b[name], rtol=4 * 2.0**-23, atol=atol)


def test_gradients_that_move_or_are_laid_out_unlike_their_parameter():
    """New gradient storage each step (addresses re-uploaded), a transposed-layout gradient (staged), mixed gradient
    dtypes (read as float32)."""
    specs = [((3, 300), STATE_Q8, STATE_Q8), ((8, 16), STATE_F32, STATE_F32)]
    initial = _make(specs)
    ours, ref = _to(initial, DEV), _to(initial, "cpu")
    table = _table(ours, specs, [0, 1], [0, 0])
    for step in range(3):
        grads = _grads(initial, step)
        if step == 1:
            grads[0] = grads[0].t().contiguous().t()  # column-major [3, 300]
        if step == 2:
            grads[1] = grads[1].to(torch.bfloat16)
        _plain_step(table, ref, specs, grads, [0, 1], [0, 0])
        _compare(ours, ref, f"step {step}: ")


def test_non_contiguous_unquantized_parameter():
    """A non-overlapping dense, non-contiguous parameter with float moments of its own layout is walked in memory."""
    specs = [((16, 8), STATE_F32, STATE_BF16)]
    initial = _make(specs)
    for k in ("param", "exp_avg", "exp_avg_sq"):
        initial[0][k] = initial[0][k].t().contiguous().t()  # column-major: strides (1, 16)
    ours, ref = _to(initial, DEV), _to(initial, "cpu")
    assert not ours[0]["param"].is_contiguous()
    _plain_step(_table(ours, specs, [0], [0]), ref, specs, _grads(initial, 0), [0], [0])
    _compare(ours, ref)


def test_parameter_given_new_storage_is_stepped_there():
    """``p.data = new``: the table rebuilds and steps the new storage, not the abandoned one."""
    specs = [((3, 300), STATE_Q4, STATE_Q8)]
    initial = _make(specs)
    ours, ref = _to(initial, DEV), _to(initial, "cpu")
    table = _table(ours, specs, [0], [0])
    abandoned = ours[0]["param"].data
    kept = abandoned.clone()
    ours[0]["param"].data = abandoned * 2  # same tensor object (the table's), new storage
    ref[0]["param"] = ref[0]["param"] * 2
    _plain_step(table, ref, specs, _grads(initial, 0), [0], [0])
    assert torch.equal(abandoned, kept), "the step wrote into the parameter's old storage"
    _compare(ours, ref)


def test_invalid_layouts_raise():
    specs = [((3, 300), STATE_Q8, STATE_Q8)]
    t = _to(_make(specs), DEV)[0]
    lists = [[t["exp_avg"]], [t["exp_avg_scale"]], [t["exp_avg_sq"]], [t["exp_avg_sq_scale"]], [], [], [t["step"]]]
    with pytest.raises(ValueError, match="cols"):
        BlockwiseStepTable([t["param"]], lists, [(STATE_Q8, STATE_Q8, 100, 0, 0)])
    bad = list(lists)
    bad[1] = [t["exp_avg_scale"][:, :1]]
    with pytest.raises(ValueError, match="exp_avg_scale"):
        BlockwiseStepTable([t["param"]], bad, [(STATE_Q8, STATE_Q8, 300, 0, 0)])
    with pytest.raises(ValueError, match="exp_avg_sq"):
        BlockwiseStepTable([t["param"]], lists, [(STATE_Q8, STATE_Q4, 300, 0, 0)])
    with pytest.raises(ValueError, match="lists"):
        BlockwiseStepTable([t["param"]], lists[:6], [(STATE_Q8, STATE_Q8, 300, 0, 0)])
    # Stochastic rounding indexes the logical flat index: a parameter walked in memory order cannot take it.
    p = torch.randn(300, 3, device=DEV).to(torch.bfloat16).t()
    flat = [[torch.zeros_like(p)], [torch.empty(0, dtype=torch.uint8, device=DEV)]] * 2 + [[], [], [t["step"]]]
    table = BlockwiseStepTable([p], flat, [(STATE_F32, STATE_F32, 300, 0, 0)])
    kw = dict(HYPER, decoupled_weight_decay=True)
    with pytest.raises(ValueError, match="stochastic_rounding"):
        table.step_adam([torch.ones_like(p)], 1e-2, None, None, AdamHyperparameters(**kw, stochastic_rounding=True))


@triton.jit
def _divide_kernel(a_ptr, c_ptr, out_ptr, n, BLOCK: tl.constexpr):
    # Row program_id(1) of out: a / c[row] by the kernel's division by the bias correction.
    c = tl.load(c_ptr + tl.program_id(1))
    c_rcp = (1.0 / c.to(tl.float64)).to(tl.float32)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    a = tl.load(a_ptr + offs, mask=offs < n)
    tl.store(out_ptr + tl.program_id(1).to(tl.int64) * n + offs, _div_rn_by(a, c, c_rcp), mask=offs < n)


@pytest.mark.skipif(DEV != "cuda", reason="the GPU path's division (under the interpreter the kernel uses div_rn)")
def test_division_by_the_bias_correction_is_div_rn():
    """On a GPU the kernel divides sqrt(v) by sqrt(1 - beta2^step) with two Markstein corrections of the product
    with the rounded reciprocal (``_div_rn_by``): bit for bit IEEE division (torch's CUDA division) for divisors of
    three beta2 over 700 steps and 300 more spread over [2^-14, 1], and dividends the square roots of random float32
    bit patterns (subnormals to the largest finite), 0, inf and NaN."""
    gen = torch.Generator().manual_seed(11)
    steps = torch.arange(1, 701, dtype=torch.float64)
    divisors = [(1 - torch.tensor(beta2, dtype=torch.float64) ** steps).sqrt() for beta2 in (0.9, 0.999, 0.9999)]
    divisors.append(2.0 ** -(torch.rand(300, generator=gen, dtype=torch.float64) * 14))
    c = torch.cat(divisors).float()
    bits = torch.randint(0, 0x7F800000, (1 << 15,), generator=gen, dtype=torch.int32)
    special = torch.tensor([0.0, float("inf"), float("nan"), 1.4e-45, 3.4028235e38, 1.0])
    a = torch.cat((bits.view(torch.float32), special)).sqrt()
    a, c = a.to(DEV), c.to(DEV)
    out = torch.empty(c.numel(), a.numel(), device=DEV)
    _divide_kernel[(triton.cdiv(a.numel(), 1024), c.numel())](a, c, out, a.numel(), BLOCK=1024)
    expect = a[None, :] / c[:, None]
    same = (out.view(torch.int32) == expect.view(torch.int32)) | (out.isnan() & expect.isnan())
    assert bool(same.all()), f"{int((~same).sum())} of {same.numel()} quotients differ"


def test_step_launches_on_the_parameters_device(monkeypatch):
    """Triton launches on the current CUDA device: the step makes the parameters' device current first, as the
    native table does with a CUDA guard (parameters on cuda:1 while cuda:0 is current were stepped from cuda:0)."""
    import ampkernels._runtime

    guarded = []
    real = ampkernels._runtime.device_guard
    monkeypatch.setattr(ampkernels._runtime, "device_guard", lambda device: guarded.append(device) or real(device))
    specs = [((2, 300), STATE_Q8, STATE_Q8)]
    tensors = _to(_make(specs), DEV)
    table = _table(tensors, specs, [0], [0])
    grads = _grads(tensors, 1)
    kw = dict(HYPER, decoupled_weight_decay=True)
    table.step_adam([g.to(DEV) for g in grads], 1e-2, None, None, AdamHyperparameters(**kw))
    assert guarded == [tensors[0]["param"].device]
