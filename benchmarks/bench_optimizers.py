"""The optimizer step alone: ``ampkernels.FusedAdamW`` against torch's ``AdamW(fused=True)`` and ``(foreach=True)``,
and, with ``--only optimizers`` or ``--full``, its low-precision state against torch and torchao.

AdamW step: per parameter set, on copies of the same fp32 parameters and gradients in the same run, the step alone
(no scaler, no clipping; a step updates the parameters, which does not change the work). Floor: AdamW in fp32 reads
p, g, m, v and writes p, m, v: 28 B/param at the copy bandwidth measured in the same run.

Low-precision state, on llama-3.2-1b (``LOW_PRECISION_OPTIONS``): fp32 and bf16 parameters with fp32, bf16, 8-bit and
4-bit moments, master weights and stochastic rounding, all timed interleaved in one run, with the bytes each option
must move per parameter, the state it keeps (measured), its first step (allocation, compilation) and its ratios to
torch's fused fp32 step and to the torchao optimizer of the same format (torchao is optional: without it its rows
are skipped, and the report says so).

Peak memory of a whole training step (forward, backward, optimizer step) of ``benchmarks.models.LlamaStack`` with
each ampkernels option and torch's fused AdamW (``MEMORY_OPTIONS``), bf16 autocast where the parameters are fp32.

After the timed loops each ampkernels row is checked (``CHECK_NOTE``, ``LOW_PRECISION_CHECK_NOTE``): its state
against the exact trajectory and torch's, and one more step against torch's fused step or the reference.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ampkernels import FusedAdamW, reference
from ampkernels._constants import QUANT_MIN_NUMEL, STATE_Q4, STATE_Q8
from benchmarks.common import (
    CPU_CACHE_NOTE,
    check_cell,
    check_result,
    failure_lines,
    format_ms,
    format_table,
    free_device_memory,
    mismatch,
    plot_grouped_bars,
    synchronize,
    time_interleaved,
)
from benchmarks.param_sets import PARAM_SETS, Shape, make_params

NAME = "optimizers"
FLOOR_BYTES_PER_PARAM = 28
STOCK = "stock-fused"
# implementation -> label; the first is the baseline of the speedups.
IMPLEMENTATIONS = {
    STOCK: "torch AdamW(fused=True)",
    "stock-foreach": "torch AdamW(foreach=True)",
    "ampkernels": "ampkernels FusedAdamW",
}
OPTIONS = dict(lr=1e-3, weight_decay=0.01)
TIMING_NOTE = "time = wall time per step (host work included); GB/s = 28 B/param / time"

LOW_PRECISION_SET = "llama-3.2-1b"


@dataclass(frozen=True)
class LowPrecisionOption:
    """One row of the low-precision table: an optimizer, its parameters' dtype and its moments' storage."""

    key: str
    implementation: str
    dtype: str  # the parameters': "fp32" or "bf16"
    state: str  # the moments' storage as the table shows it
    short: str  # the plot's tick label
    family: str  # "torch", "ampkernels" or "torchao"
    param_dtype: torch.dtype
    # Storage of both moments, for the byte count: "fp32", "bf16", "q8"/"q4" (ampkernels' blockwise codes),
    # "ao8"/"ao4"/"aofp8" (torchao's OptimState8bit/4bit/Fp8).
    moments: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    master: bool = False  # a float32 master copy of the (bf16) parameters
    sr: bool = False  # bf16 parameters rounded stochastically
    torchao_peer: str | None = None  # the key of the torchao option with the same formats
    torchao_class: str | None = None
    cuda_only: bool = False

    @property
    def params(self) -> str:
        return f"{self.dtype} + SR" if self.sr else self.dtype

    @property
    def label(self) -> str:
        extra = ", fp32 master weights" if self.master else ", stochastic rounding" if self.sr else ""
        return f"{self.implementation}: {self.dtype} params, {self.moments_dtype} moments{extra}"

    @property
    def moments_dtype(self) -> str:
        return "fp32" if self.master else self.state


def _moments(dtype: torch.dtype) -> dict[str, Any]:
    return dict(exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype)


_F32, _BF16 = torch.float32, torch.bfloat16
_OURS, _TORCH, _AO = "ampkernels FusedAdamW", "torch AdamW(fused=True)", "torchao"
# fmt: off
LOW_PRECISION_OPTIONS = (
    # key, implementation, params, moments (as shown), plot tick, family, parameter dtype, moments (byte count)
    LowPrecisionOption("torch-fp32", _TORCH, "fp32", "fp32", "torch\nfp32", "torch", _F32, "fp32"),
    LowPrecisionOption("ampkernels-fp32", _OURS, "fp32", "fp32", "ours\nfp32", "ampkernels", _F32, "fp32"),
    LowPrecisionOption("ampkernels-8bit", _OURS, "fp32", "8-bit", "ours\n8-bit", "ampkernels", _F32, "q8",
                       kwargs=_moments(torch.uint8), torchao_peer="torchao-8bit"),
    LowPrecisionOption("ampkernels-4bit", _OURS, "fp32", "4-bit", "ours\n4-bit", "ampkernels", _F32, "q4",
                       kwargs=_moments(torch.uint4), torchao_peer="torchao-4bit"),
    LowPrecisionOption("torch-bf16", _TORCH, "bf16", "bf16", "torch\nbf16", "torch", _BF16, "bf16"),
    LowPrecisionOption("ampkernels-bf16-master", _OURS, "bf16", "fp32 + master", "ours\nmaster", "ampkernels",
                       _BF16, "fp32", kwargs=dict(master_weights=True), master=True),
    LowPrecisionOption("ampkernels-bf16-sr", _OURS, "bf16", "bf16", "ours\nbf16 SR", "ampkernels", _BF16, "bf16",
                       kwargs=_moments(torch.bfloat16) | dict(stochastic_rounding=True), sr=True,
                       torchao_peer="torchao-bf16-sr"),
    LowPrecisionOption("ampkernels-bf16-8bit-sr", _OURS, "bf16", "8-bit", "ours\n8-bit SR", "ampkernels", _BF16,
                       "q8", kwargs=_moments(torch.uint8) | dict(stochastic_rounding=True), sr=True,
                       torchao_peer="torchao-bf16-8bit"),
    LowPrecisionOption("torchao-8bit", f"{_AO} AdamW8bit", "fp32", "8-bit", "ao\n8bit", "torchao", _F32, "ao8",
                       torchao_class="AdamW8bit"),
    LowPrecisionOption("torchao-fp8", f"{_AO} AdamWFp8", "fp32", "fp8 e4m3", "ao\nfp8", "torchao", _F32, "aofp8",
                       torchao_class="AdamWFp8", cuda_only=True),
    LowPrecisionOption("torchao-4bit", f"{_AO} AdamW4bit", "fp32", "4-bit", "ao\n4bit", "torchao", _F32, "ao4",
                       torchao_class="AdamW4bit"),
    # torchao 0.18 names its plain AdamW (moments in the parameter's dtype) _AdamW.
    LowPrecisionOption("torchao-bf16-sr", f"{_AO} _AdamW", "bf16", "bf16", "ao\nbf16 SR", "torchao", _BF16, "bf16",
                       kwargs=dict(bf16_stochastic_round=True), sr=True, torchao_class="_AdamW"),
    LowPrecisionOption("torchao-bf16-8bit", f"{_AO} AdamW8bit", "bf16", "8-bit", "ao\n8bit SR", "torchao", _BF16,
                       "ao8", kwargs=dict(bf16_stochastic_round=True), sr=True, torchao_class="AdamW8bit"),
)
# fmt: on
LOW_PRECISION_BASELINE = "torch-fp32"
# The training-step memory rows: every ampkernels option and torch's fused step on fp32 and on bf16 parameters.
MEMORY_OPTIONS = tuple(o.key for o in LOW_PRECISION_OPTIONS if o.family in ("torch", "ampkernels"))
TRAINING_BATCH = (8, 2048)  # sequences x tokens on a GPU
# On the CPU a tiny stack (ffn 4 x dim, as LLAMA_STACK's): it checks the code path, there is no peak to measure.
CPU_LLAMA_STACK = dict(vocab=512, dim=128, layers=2, heads=4, ffn=512)
CPU_TRAINING_BATCH = (2, 64)
# torchao's 8-bit and FP8 states use blocks of 256 elements with a float32 scale each, its 4-bit state blocks of 128;
# it quantizes the tensors of >= 4096 elements that the block size divides (torchao/optim/adam.py, _new_buffer).
TORCHAO_BLOCK = {"ao8": 256, "aofp8": 256, "ao4": 128}
TORCHAO_QMAP_ENTRIES = {"ao8": 256, "aofp8": 0, "ao4": 16}  # float32 code tables, one per quantized moment
TORCHAO_MIN_NUMEL = 4096

LOW_PRECISION_NOTES = [
    "B/param: the bytes a step must move per parameter: the parameters read and written (written only with a "
    "master copy, which is read and written in fp32), the gradients read, both moments read and written in their "
    "storage: 8-bit codes 1 B, 4-bit 0.5 B, plus the block scales (ampkernels: a 1 B exponent per 128 elements "
    "along the last dimension; torchao: a float32 per 256 elements, per 128 for 4-bit); tensors of dim < 2 or "
    "< 4096 elements keep fp32 moments (ampkernels) or moments in the parameter's dtype (torchao quantizes tensors "
    "of >= 4096 elements that its block divides); torchao's code tables (1 KiB) stay in cache and are not counted",
    "state B/param: measured, the bytes of every tensor in optimizer.state but 'step' (torchao: the codes, scales "
    "and code tables inside its tensor subclasses), over the parameter count",
    "first step: wall time of each optimizer's very first step, synchronised: state allocation, plan building, "
    "and torchao's torch.compile of single_param_adam per shape and dtype (graphs already compiled in this process "
    "or cached on disk by an earlier run are reused, so its figure depends on the order and on the cache)",
    "the fp32 rows step one shared set of fp32 parameters and gradients, the bf16 rows one set of bf16 copies (the "
    "master-weights row its own: another optimizer's writes would make it resync its master every step), so "
    "that all the states fit in memory at once; the values do not change the work",
    "vs torch fp32: torch AdamW(fused=True) fp32 ms / ms; vs torchao: the torchao optimizer of the same formats, "
    "its ms / ms (AdamW8bit for 8-bit, AdamW4bit for 4-bit, _AdamW for bf16 moments); SR: bf16 parameters rounded "
    "stochastically after the fp32 update (torchao: bf16_stochastic_round=True)",
]


def _optimizer(implementation: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if implementation == "ampkernels":
        return FusedAdamW(params, **OPTIONS)
    return torch.optim.AdamW(params, fused=implementation == STOCK, foreach=implementation != STOCK, **OPTIONS)


def _copies(params: list[torch.nn.Parameter], dtype: torch.dtype | None = None) -> list[torch.nn.Parameter]:
    copies = [torch.nn.Parameter(p.detach().to(dtype or p.dtype, copy=True)) for p in params]
    for c, p in zip(copies, params, strict=True):
        c.grad = p.grad.to(dtype or p.grad.dtype, copy=True)
    return copies


def _wants_low_precision(ctx) -> bool:
    """The low-precision and memory tables run with --full, with ``--only optimizers`` and when the sets name
    llama-3.2-1b; not in the default run of every module (a minute more on the GPU, a few on the CPU)."""
    if ctx.full or LOW_PRECISION_SET in ctx.sets:
        return True
    return ctx.only == NAME


def run(ctx) -> dict[str, Any]:
    low_precision = _wants_low_precision(ctx)
    extra = len(LOW_PRECISION_OPTIONS) + len(MEMORY_OPTIONS) if low_precision else 0
    ctx.progress.reset(total=len(ctx.sets) + extra)
    rows: list[dict[str, Any]] = []
    param_sets: dict[str, dict[str, Any]] = {}
    for set_name in ctx.sets:
        shapes = PARAM_SETS[set_name](ctx.shrink)
        base = make_params(shapes, ctx.device)
        num_params = sum(p.numel() for p in base)
        param_sets[set_name] = {"num_tensors": len(base), "num_params": num_params}
        initial = [p.detach().clone() for p in base]  # for the exact trajectory of the check
        optimizers = {}
        for implementation in IMPLEMENTATIONS:
            optimizers[implementation] = _optimizer(implementation, _copies(base) if optimizers else base)
        timings = time_interleaved(
            {name: opt.step for name, opt in optimizers.items()}, ctx.device, ctx.repeats, ctx.target_loop_s
        )
        checks = _check_adamw(optimizers, {name: timing.calls for name, timing in timings.items()}, initial)
        param_sets[set_name]["trajectory_error"] = checks.pop("trajectory_error")
        del initial
        floor_bytes = FLOOR_BYTES_PER_PARAM * num_params
        floor_ms = floor_bytes / (ctx.copy_bandwidth_gbs * 1e9) * 1e3
        stock_ms = timings[STOCK].median_wall_ms
        for implementation, timing in timings.items():
            wall_ms = timing.median_wall_ms
            gbs = floor_bytes / (wall_ms * 1e-3) / 1e9
            rows.append(
                {
                    "set": set_name,
                    "implementation": implementation,
                    "label": IMPLEMENTATIONS[implementation],
                    "num_tensors": len(base),
                    "num_params": num_params,
                    "iterations": timing.iterations,
                    "repeats": len(timing.wall_ms),
                    "wall_ms": wall_ms,
                    "wall_ms_per_repeat": timing.wall_ms,
                    "device_ms": timing.median_device_ms,
                    "floor_ms": floor_ms,
                    "gbs": gbs,
                    "pct_of_copy": 100.0 * gbs / ctx.copy_bandwidth_gbs,
                    "x_floor": wall_ms / floor_ms,
                    "speedup_over_stock": stock_ms / wall_ms,
                    "steps": timing.calls,
                    "check": checks.get(implementation),
                }
            )
        del optimizers, base
        free_device_memory(ctx.device)
        ctx.progress.update(1)
    notes = [TIMING_NOTE, CHECK_NOTE] + ([CPU_CACHE_NOTE] if ctx.cpu_small else [])
    document = {"param_sets": param_sets, "notes": notes, "warnings": [], "rows": rows}
    if low_precision:
        document["low_precision"] = _low_precision(ctx)
        free_device_memory(ctx.device)
        document["training_memory"] = _training_memory(ctx)
        free_device_memory(ctx.device)
    return document


# ---- checks of what the timed steps computed ----

#: Float32 optimizers against torch's, step by step (tests/optim/test_optimizers.py, FP32_TOL).
FP32_TOL = dict(rtol=1e-5, atol=1e-6)
#: Low-precision states against the reference step (tests/optim/test_blockwise_adam.py: close(),
#: assert_state_matches).
BF16_TOL, FP32_BLOCKWISE_TOL = dict(rtol=2**-7, atol=1e-6), dict(rtol=1e-5, atol=1e-7)
# At most this share of the 8-bit/4-bit codes (and of the block exponents) may differ on a GPU, where FMA contraction
# moves a float32 moment by an ulp and, rarely, a code or a block's exponent across a rounding boundary.
CODES_DIFFERING = 0.01
MOMENTS = ("exp_avg", "exp_avg_sq")
_MAX_PROBLEMS = 3  # per check: the first few problems in full, then how many more
CHECK_NOTE = (
    "check, after the timed loops: (1) every state's step count equals the number of steps taken; (2) the state "
    "each implementation reached against the exact float64 AdamW trajectory for these constant gradients (m_n = "
    "(1 - beta1^n) g, v_n = (1 - beta2^n) g^2, each step p <- (1 - lr wd) p - lr g / (|g| + eps)), in units of the "
    "tests' float32 tolerance (rtol 1e-5, atol 1e-6): FusedAdamW's within 1 unit, or within twice the larger of "
    "torch's two per step times its own steps; (3) one more step of FusedAdamW and of torch AdamW(fused=True) from "
    "FusedAdamW's state: parameters, exp_avg, exp_avg_sq and step within the tests' float32 tolerance"
)
LOW_PRECISION_CHECK_NOTE = (
    "check (ampkernels rows), after the timed loops: every step count equals the steps taken, and one more step "
    "from the state each option reached matches the reference step (FusedAdamW(backend='torch') loaded with that "
    "state) as tests/optim/test_blockwise_adam.py does: bit for bit on the CPU; on a GPU float32 values within rtol "
    "1e-5, bfloat16 within rtol 2^-7, at most 1% of the 8-bit/4-bit codes and of the block exponents different"
)


def _summarized(problems: list[str]) -> list[str]:
    extra = len(problems) - _MAX_PROBLEMS
    return problems[:_MAX_PROBLEMS] + ([f"and {extra} more"] if extra > 0 else [])


def _param_list(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def step_count_problems(optimizer: torch.optim.Optimizer, calls: int) -> list[str]:
    counts = {float(state["step"]) for state in optimizer.state.values() if "step" in state}
    if len(optimizer.state) != len(_param_list(optimizer)):
        return [f"state for {len(optimizer.state)} of {len(_param_list(optimizer))} parameters"]
    return [] if counts == {float(calls)} else [f"step counts {sorted(counts)}, {calls} steps taken"]


def _exact_trajectory(p0: torch.Tensor, grad: torch.Tensor, steps: int) -> dict[str, torch.Tensor]:
    """Float64 parameter and moments after ``steps`` AdamW steps (OPTIONS, torch's default betas and eps) with the
    same gradient every step: the moments are then (1 - beta^n) g and (1 - beta2^n) g^2, the bias-corrected update is
    lr g / (|g| + eps) at every step, and p_n = a^n p_0 - u (1 - a^n) / (1 - a) with a = 1 - lr wd."""
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    lr, weight_decay = OPTIONS["lr"], OPTIONS["weight_decay"]
    g = grad.double()
    decay = 1.0 - lr * weight_decay
    update = lr * g / (g.abs() + eps)
    decayed = decay**steps
    param = decayed * p0.double() - update * ((1.0 - decayed) / (1.0 - decay) if weight_decay else steps)
    return {"param": param, "exp_avg": (1.0 - beta1**steps) * g, "exp_avg_sq": (1.0 - beta2**steps) * g * g}


def _error_units(value: torch.Tensor, exact: torch.Tensor) -> float:
    units = (value.detach().double() - exact).abs() / (FP32_TOL["atol"] + FP32_TOL["rtol"] * exact.abs())
    return float(units.nan_to_num(nan=math.inf).max())


def trajectory_error(
    optimizer: torch.optim.Optimizer, steps: int, initial: list[torch.Tensor] | None = None
) -> dict[str, float]:
    """The largest error of the moments (and of the parameters, given their ``initial`` values) of an AdamW
    optimizer after ``steps`` steps with constant gradients, against :func:`_exact_trajectory`, in units of FP32_TOL
    (|x - exact| / (atol + rtol |exact|)); inf where anything is not finite."""
    keys = MOMENTS if initial is None else ("param", *MOMENTS)
    worst = dict.fromkeys(keys, 0.0)
    params = _param_list(optimizer)
    for i, p in enumerate(params):
        exact = _exact_trajectory(p if initial is None else initial[i], p.grad, steps)
        state = optimizer.state[p]
        for key in keys:
            worst[key] = max(worst[key], _error_units(p if key == "param" else state[key], exact[key]))
    return worst


def trajectory_problems(
    ours: dict[str, float], steps: int, stock: dict[str, tuple[dict[str, float], int]]
) -> list[str]:
    """Where ``ours`` (a :func:`trajectory_error` after ``steps`` steps) is off: more than 1 unit and more than twice
    the largest error per step of the ``stock`` optimizers ({label: (error, steps)}) times ``steps`` (rounding errors
    of a float32 recursion grow at most linearly with the steps)."""
    problems = []
    for key, units in ours.items():
        per_step = max(error[key] / max(1, n) for error, n in stock.values())
        allowed = max(1.0, 2.0 * per_step * steps)
        if not units <= allowed:
            theirs = ", ".join(f"{label} {error[key]:.3g} after {n}" for label, (error, n) in stock.items())
            problems.append(
                f"{key} after {steps} steps: {units:.3g} tolerance units from the exact trajectory, at most "
                f"{allowed:.3g} allowed ({theirs})"
            )
    return problems


def _cloned_params(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    """A copy of every parameter of ``optimizer``, sharing its gradient (the steps only read gradients)."""
    clones = []
    for p in _param_list(optimizer):
        clone = torch.nn.Parameter(p.detach().clone())
        clone.grad = p.grad
        clones.append(clone)
    return clones


def _one_more_step_problems(
    optimizer: torch.optim.Optimizer,
    twin: torch.optim.Optimizer,
    twin_params: list[torch.Tensor],
    exact: bool,
    fp32_tol: dict[str, float],
) -> list[str]:
    """Steps ``optimizer`` and ``twin`` (holding copies of its parameters and state) once each, then compares
    parameters and state: bit for bit where ``exact``, else float32 values within ``fp32_tol``, bfloat16 ones within
    BF16_TOL and at most CODES_DIFFERING of the uint8 codes and block exponents apart; step counts always exactly."""
    optimizer.step()
    twin.step()
    problems = []
    for i, (p, q) in enumerate(zip(_param_list(optimizer), twin_params, strict=True)):
        theirs = twin.state[q]
        pairs = [("param", p, q)] + [(key, value, theirs.get(key)) for key, value in optimizer.state[p].items()]
        for key, mine, other in pairs:
            where = f"{key} of parameter {i}"
            if not isinstance(mine, torch.Tensor):
                if mine != other:
                    problems.append(f"{where}: {mine!r}, reference {other!r}")
                continue
            if not isinstance(other, torch.Tensor):
                problems.append(f"{where}: missing from the reference's state")
                continue
            mine, other = mine.detach(), other.detach().to(mine.device)
            if exact or key == "step":
                if not torch.equal(mine, other):
                    problems.append(f"{where}: not bit for bit the reference's")
            elif mine.dtype == torch.uint8:
                differ = float((mine != other).float().mean()) if mine.numel() else 0.0
                if differ > CODES_DIFFERING:
                    problems.append(f"{where}: {differ:.2%} of the codes differ from the reference's")
            else:
                found = mismatch(where, mine, other, **(BF16_TOL if mine.dtype == torch.bfloat16 else fp32_tol))
                if found:
                    problems.append(found)
    return problems


def _check_adamw(
    optimizers: dict[str, torch.optim.Optimizer], calls: dict[str, int], initial: list[torch.Tensor]
) -> dict[str, Any]:
    """The check of the AdamW table's ampkernels row (CHECK_NOTE), and every implementation's trajectory error.
    Takes the stock-foreach optimizer out of ``optimizers`` (freeing its memory) before the extra step."""
    errors = {name: trajectory_error(opt, calls[name], initial) for name, opt in optimizers.items()}
    problems = []
    for name, opt in optimizers.items():
        problems += [f"{IMPLEMENTATIONS[name]}: {p}" for p in step_count_problems(opt, calls[name])]
    ours = "ampkernels"
    stock = {IMPLEMENTATIONS[name]: (errors[name], calls[name]) for name in optimizers if name != ours}
    problems += trajectory_problems(errors[ours], calls[ours], stock)
    optimizers.pop("stock-foreach", None)
    free_device_memory(initial[0].device)
    fused = optimizers[ours]
    twin_params = _cloned_params(fused)
    twin = torch.optim.AdamW(twin_params, fused=True, **OPTIONS)
    for p, q in zip(_param_list(fused), twin_params, strict=True):
        twin.state[q] = {key: value.detach().clone() for key, value in fused.state[p].items()}
    extra_step = _one_more_step_problems(fused, twin, twin_params, False, FP32_TOL)
    problems += [f"one more step against torch fused: {p}" for p in extra_step]
    del twin, twin_params
    return {
        ours: check_result(_summarized(problems)),
        "trajectory_error": {name: dict(err, steps=calls[name]) for name, err in errors.items()},
    }


def _cloned_state_dict(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    sd = optimizer.state_dict()
    state = {
        key: {name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in entry.items()}
        for key, entry in sd["state"].items()
    }
    return {"state": state, "param_groups": sd["param_groups"]}


def _check_low_precision(option: LowPrecisionOption, optimizer: torch.optim.Optimizer, calls: int) -> str | None:
    """The check of an ampkernels row of the low-precision table (LOW_PRECISION_CHECK_NOTE); None for the others."""
    if option.family != "ampkernels":
        return None
    problems = step_count_problems(optimizer, calls)
    twin_params = _cloned_params(optimizer)
    twin = FusedAdamW(twin_params, backend="torch", **OPTIONS, **option.kwargs)
    twin.load_state_dict(_cloned_state_dict(optimizer))
    on_cpu = twin_params[0].device.type == "cpu"
    extra_step = _one_more_step_problems(optimizer, twin, twin_params, on_cpu, FP32_BLOCKWISE_TOL)
    problems += [f"one more step against the reference: {p}" for p in extra_step]
    return check_result(_summarized(problems))


# ---- the low-precision table ----


def _import_torchao() -> tuple[Any, str | None]:
    """(``torchao.optim``, None), or (None, why it cannot be used)."""
    try:
        import torchao.optim
    except Exception as error:  # not installed, or built for another torch
        return None, f"torchao cannot be imported ({type(error).__name__}: {error})"
    return torchao.optim, None


def _build(option: LowPrecisionOption, params: list[torch.nn.Parameter], torchao_optim: Any) -> torch.optim.Optimizer:
    if option.family == "torch":
        return torch.optim.AdamW(params, fused=True, **OPTIONS)
    if option.family == "ampkernels":
        return FusedAdamW(params, **OPTIONS, **option.kwargs)
    return getattr(torchao_optim, option.torchao_class)(params, **OPTIONS, **option.kwargs)


def _moment_bytes(shape: Shape, moments: str, param_size: int) -> tuple[int, int]:
    """(bytes of one moment of a tensor of ``shape``, bytes of its code table): what a step reads and writes."""
    numel = math.prod(shape)
    if moments in ("fp32", "bf16"):
        return numel * (4 if moments == "fp32" else 2), 0
    if moments in ("q8", "q4"):
        if len(shape) < 2 or numel < QUANT_MIN_NUMEL:
            return 4 * numel, 0
        codes, scales = reference.quant_layout(shape, STATE_Q8 if moments == "q8" else STATE_Q4)
        return math.prod(codes) + math.prod(scales), 0
    block = TORCHAO_BLOCK[moments]
    if numel < TORCHAO_MIN_NUMEL or numel % block:
        return param_size * numel, 0
    codes = numel // 2 if moments == "ao4" else numel
    return codes + 4 * (numel // block), 4 * TORCHAO_QMAP_ENTRIES[moments]


def byte_counts(option: LowPrecisionOption, shapes: list[Shape]) -> tuple[int, int]:
    """(bytes one step moves, bytes of the optimizer state but the step counts) for ``shapes``; see
    ``LOW_PRECISION_NOTES``."""
    param_size = torch.empty((), dtype=option.param_dtype).element_size()
    moved = state = 0
    for shape in shapes:
        numel = math.prod(shape)
        moment, table = _moment_bytes(shape, option.moments, param_size)
        moved += numel * param_size * (1 if option.master else 2) + numel * param_size  # params, gradients
        moved += 2 * 2 * moment  # both moments, read and written
        state += 2 * (moment + table)
        if option.master:
            moved += 2 * 4 * numel
            state += 4 * numel
    return moved, state


def _tensor_bytes(t: torch.Tensor) -> int:
    """Bytes held by ``t``: a tensor subclass (torchao's low-precision state) by the tensors inside it."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in ``optimizer.state`` but the step counts."""
    return sum(
        _tensor_bytes(value)
        for state in optimizer.state.values()
        for key, value in state.items()
        if key != "step" and isinstance(value, torch.Tensor)
    )


def _backend(optimizer: torch.optim.Optimizer) -> str | None:
    """The backend(s) the ampkernels optimizer's plan picked (its buckets), for the JSON."""
    plans = getattr(optimizer, "_plans", None)
    if not plans:
        return None
    return ",".join(sorted({bucket.backend for plan in plans.values() for bucket in plan.buckets}))


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200] if text else ''}"


def _timed_first_step(optimizer: torch.optim.Optimizer, device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    optimizer.step()
    synchronize(device)
    return (time.perf_counter() - start) * 1e3


def _low_precision(ctx) -> dict[str, Any]:
    shapes = PARAM_SETS[LOW_PRECISION_SET](ctx.shrink)
    fp32 = make_params(shapes, ctx.device)
    bf16 = _copies(fp32, torch.bfloat16)
    num_params = sum(p.numel() for p in fp32)
    torchao_optim, torchao_error = _import_torchao()
    skipped: list[dict[str, str]] = []
    optimizers: dict[str, torch.optim.Optimizer] = {}
    first_ms: dict[str, float] = {}
    for option in LOW_PRECISION_OPTIONS:
        reason = None
        if option.family == "torchao" and torchao_optim is None:
            reason = torchao_error
        elif option.family == "torchao" and not hasattr(torchao_optim, option.torchao_class):
            reason = f"torchao.optim has no {option.torchao_class}"
        elif option.cuda_only and ctx.device.type != "cuda":
            reason = "CUDA only here (float8 state)"
        if reason is None:
            if option.param_dtype == torch.float32:
                params = fp32
            else:
                params = _copies(fp32, torch.bfloat16) if option.master else bf16
            try:
                optimizer = _build(option, params, torchao_optim)
                first_ms[option.key] = _timed_first_step(optimizer, ctx.device)
                optimizers[option.key] = optimizer
            except Exception as error:  # an option this version does not have, or a backend that cannot run it
                reason = _first_line(error)
        if reason is not None:
            skipped.append({"key": option.key, "label": option.label, "reason": reason})
            ctx.progress.update(1)
    # The first step counted as the first warm-up call; two more cover what settles on a second step.
    timings = time_interleaved(
        {key: opt.step for key, opt in optimizers.items()},
        ctx.device,
        ctx.repeats,
        ctx.target_loop_s,
        warmup_iterations=2,
    )
    by_key = {o.key: o for o in LOW_PRECISION_OPTIONS}
    rows, warnings = [], []
    for key, timing in timings.items():
        option, optimizer = by_key[key], optimizers[key]
        moved, modelled_state = byte_counts(option, shapes)
        measured_state = state_bytes(optimizer)
        if abs(measured_state - modelled_state) > 0.01 * modelled_state:
            warnings.append(
                f"{option.label}: the state holds {measured_state / num_params:.3f} B/param, the byte count "
                f"assumes {modelled_state / num_params:.3f} (its B/param may be off)"
            )
        wall_ms = timing.median_wall_ms
        gbs = moved / (wall_ms * 1e-3) / 1e9
        rows.append(
            {
                "set": LOW_PRECISION_SET,
                "key": key,
                "label": option.label,
                "implementation": option.implementation,
                "family": option.family,
                "param_dtype": option.dtype,
                "params": option.params,
                "state": option.state,
                "backend": _backend(optimizer) if option.family == "ampkernels" else None,
                "iterations": timing.iterations,
                "repeats": len(timing.wall_ms),
                "wall_ms": wall_ms,
                "wall_ms_per_repeat": timing.wall_ms,
                "device_ms": timing.median_device_ms,
                "first_step_ms": first_ms[key],
                "bytes_per_param": moved / num_params,
                "gbs": gbs,
                "pct_of_copy": 100.0 * gbs / ctx.copy_bandwidth_gbs,
                "state_bytes_per_param": measured_state / num_params,
                "modelled_state_bytes_per_param": modelled_state / num_params,
                "torchao_peer": option.torchao_peer,
                "steps": timing.calls + 1,  # the first step, timed on its own, and the loop's
                "check": _check_low_precision(option, optimizer, timing.calls + 1),
            }
        )
        ctx.progress.update(1)
    wall = {row["key"]: row["wall_ms"] for row in rows}
    for row in rows:
        baseline, peer = wall.get(LOW_PRECISION_BASELINE), wall.get(row["torchao_peer"])
        row["vs_torch_fp32"] = None if baseline is None else baseline / row["wall_ms"]
        row["vs_torchao"] = None if peer is None else peer / row["wall_ms"]
    torchao_version = getattr(sys.modules.get("torchao"), "__version__", None) if torchao_optim else None
    return {
        "set": LOW_PRECISION_SET,
        "num_tensors": len(shapes),
        "num_params": num_params,
        "torchao": torchao_version,
        "rows": rows,
        "skipped": skipped,
        "notes": [*LOW_PRECISION_NOTES, LOW_PRECISION_CHECK_NOTE],
        "warnings": warnings,
    }


# ---- peak memory of a training step ----


def _training_memory(ctx) -> dict[str, Any]:
    try:
        from benchmarks.models import LLAMA_STACK, LlamaStack
    except ImportError as error:
        ctx.progress.update(len(MEMORY_OPTIONS))
        return {"skipped": f"benchmarks.models.LlamaStack cannot be imported ({error})", "rows": []}
    on_gpu = ctx.device.type == "cuda"
    config = dict(LLAMA_STACK) if on_gpu else dict(CPU_LLAMA_STACK)
    batch, seq = TRAINING_BATCH if on_gpu else CPU_TRAINING_BATCH
    generator = torch.Generator(device=ctx.device).manual_seed(0)
    tokens, targets = (
        torch.randint(config["vocab"], (batch, seq), generator=generator, device=ctx.device) for _ in range(2)
    )
    by_key = {o.key: o for o in LOW_PRECISION_OPTIONS}
    rows = []
    for key in MEMORY_OPTIONS:
        option = by_key[key]
        row: dict[str, Any] = {"key": key, "label": option.label, "implementation": option.implementation}
        row |= {"params": option.params, "state": option.state}
        free_device_memory(ctx.device)
        row["baseline_gib"] = torch.cuda.memory_allocated(ctx.device) / 2**30 if on_gpu else None
        torch.manual_seed(0)
        model = LlamaStack(**config).to(ctx.device, option.param_dtype)
        row["num_params"] = sum(p.numel() for p in model.parameters())
        try:
            optimizer = _build(option, list(model.parameters()), None)
            step = _training_step(model, optimizer, tokens, targets, autocast=option.param_dtype == torch.float32)
            step()  # warm-up: allocates the optimizer state, builds the plans
            synchronize(ctx.device)
            if on_gpu:
                torch.cuda.reset_peak_memory_stats(ctx.device)
                row["resident_gib"] = torch.cuda.memory_allocated(ctx.device) / 2**30
            start = time.perf_counter()
            step()
            synchronize(ctx.device)
            row["step_ms"] = (time.perf_counter() - start) * 1e3
            row["peak_gib"] = torch.cuda.max_memory_allocated(ctx.device) / 2**30 if on_gpu else None
            row["state_gib"] = state_bytes(optimizer) / 2**30
            del optimizer, step
        except Exception as error:  # an option this version does not have, or a backend that cannot run it
            row["error"] = _first_line(error)
        rows.append(row)
        del model
        ctx.progress.update(1)
    stock = next((r for r in rows if r["key"] == LOW_PRECISION_BASELINE and r.get("peak_gib") is not None), None)
    for row in rows:
        peak = row.get("peak_gib")
        row["vs_torch_fp32_gib"] = None if stock is None or peak is None else peak - stock["peak_gib"]
    return {
        "model": "LlamaStack",
        "config": config,
        "batch": [batch, seq],
        "autocast": "bf16 autocast for fp32 parameters; bf16 parameters run without autocast",
        "rows": rows,
        "notes": [
            "peak: torch.cuda.max_memory_allocated over one training step (forward, cross-entropy on fp32 logits, "
            "backward, optimizer step, zero_grad(set_to_none=True)) after a warm-up step, reset before it",
            "resident: allocated when the measured step starts (parameters and optimizer state, no gradients)",
        ]
        + ([] if on_gpu else ["CPU: a tiny stack that checks the code path; no peak is measured off the GPU"]),
    }


def _training_step(model, optimizer, tokens, targets, autocast: bool) -> Callable[[], None]:
    def step() -> None:
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


# ---- report, summary, plot ----


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _low_precision_report(document: dict[str, Any], section: dict[str, Any]) -> list[str]:
    on_gpu = document["mode"] == "gpu"
    headers = ["implementation", "params", "moments", "ms", "first step ms", "B/param", "GB/s"]
    headers += ["% copy"] if on_gpu else []
    headers += ["state B/param", "vs torch fp32", "vs torchao", "check"]
    table_rows = []
    for row in section["rows"]:
        cells = [row["implementation"], row["params"], row["state"], format_ms(row["wall_ms"])]
        cells += [format_ms(row["first_step_ms"]), f"{row['bytes_per_param']:.2f}", f"{row['gbs']:.1f}"]
        cells += [f"{row['pct_of_copy']:.0f}%"] if on_gpu else []
        cells += [f"{row['state_bytes_per_param']:.2f}", _ratio(row["vs_torch_fp32"]), _ratio(row["vs_torchao"])]
        table_rows.append([*cells, check_cell(row)])
    title = (
        f"{section['set']} ({section['num_tensors']} tensors, {section['num_params'] / 1e6:.2f}M params): AdamW step "
        "by state precision, timed interleaved"
    )
    lines = [title, format_table(headers, table_rows, "lll" + "r" * (len(headers) - 4) + "l")]
    lines += failure_lines(section["rows"])
    skipped = section["skipped"]
    torchao_missing = [s for s in skipped if s["key"].startswith("torchao") and s["reason"].startswith("torchao ")]
    if torchao_missing:
        lines.append(f"torchao rows skipped ({len(torchao_missing)}): {torchao_missing[0]['reason']}")
    lines += [f"skipped: {s['label']}: {s['reason']}" for s in skipped if s not in torchao_missing]
    lines += [f"note: {note}" for note in section["notes"]]
    return lines + section["warnings"]


def _stack_text(section: dict[str, Any]) -> str:
    config, (batch, seq) = section["config"], section["batch"]
    return (
        f"{section['model']} (vocab {config['vocab']}, dim {config['dim']}, {config['layers']} layers, ffn "
        f"{config['ffn']}), batch {batch} x {seq} tokens"
    )


def _memory_report(section: dict[str, Any]) -> list[str]:
    if "skipped" in section:
        return [f"training-step memory skipped: {section['skipped']}"]
    title = f"{_stack_text(section)}: peak memory of a training step"
    headers = ["optimizer", "params", "moments", "peak GiB", "vs torch fp32 GiB", "resident GiB", "state GiB"]
    table_rows = []
    for row in section["rows"]:
        implementation = row["implementation"]
        if "error" in row:
            table_rows.append([implementation, row["params"], row["state"], "failed", "", "", ""])
            continue
        delta = row["vs_torch_fp32_gib"]
        table_rows.append(
            [
                implementation,
                row["params"],
                row["state"],
                _gib(row["peak_gib"]),
                "-" if delta is None else f"{delta:+.2f}",
                _gib(row.get("resident_gib")),
                f"{row['state_gib']:.3f}",
            ]
        )
    lines = [title, format_table(headers, table_rows, "lllrrrr")]
    lines += [f"failed: {row['label']}: {row['error']}" for row in section["rows"] if "error" in row]
    return lines + [f"note: {note}" for note in [section["autocast"], *section["notes"]]]


def report(document: dict[str, Any]) -> str:
    # On the CPU the sizes fit in the caches: no % of copy or x floor there (CPU_CACHE_NOTE).
    on_gpu = document["mode"] == "gpu"
    headers = ["set", "implementation", "iters", "time ms"]
    headers += ["device ms", "GB/s", "% copy", "x floor", "speedup"] if on_gpu else ["GB/s", "speedup"]
    headers.append("check")
    table_rows = []
    for row in document["rows"]:
        cells = [row["set"], row["label"], str(row["iterations"]), format_ms(row["wall_ms"])]
        if on_gpu:
            cells += [format_ms(row["device_ms"]), f"{row['gbs']:.1f}", f"{row['pct_of_copy']:.0f}%"]
            cells.append(f"{row['x_floor']:.2f}")
        else:
            cells.append(f"{row['gbs']:.1f}")
        table_rows.append([*cells, f"{row['speedup_over_stock']:.2f}x", check_cell(row)])
    set_lines = [
        f"{name}: {info['num_tensors']} tensors, {info['num_params'] / 1e6:.2f}M params"
        for name, info in document["param_sets"].items()
    ]
    notes = [f"note: {note}" for note in document["notes"]]
    align = "ll" + "r" * (len(headers) - 3) + "l"
    failed = failure_lines(document["rows"])
    parts = [format_table(headers, table_rows, align), *failed, "", *set_lines, *notes, *document["warnings"]]
    if "low_precision" in document:
        parts += ["", *_low_precision_report(document, document["low_precision"])]
    if "training_memory" in document:
        parts += ["", *_memory_report(document["training_memory"])]
    return "\n".join(parts)


def summary(document: dict[str, Any]) -> list[str]:
    """Per parameter set: the ampkernels AdamW step against torch's fused and foreach ones; then the low-precision
    options against torch fused fp32 and torchao, and their training-step peaks."""
    lines = []
    for set_name in document["param_sets"]:
        by = {r["implementation"]: r for r in document["rows"] if r["set"] == set_name}
        ours = by["ampkernels"]
        lines.append(
            f"{set_name} AdamW step: FusedAdamW {ours['wall_ms']:.3g} ms, {ours['speedup_over_stock']:.2f}x torch "
            f"fused, {by['stock-foreach']['wall_ms'] / ours['wall_ms']:.2f}x torch foreach"
        )
    on_gpu = document["mode"] == "gpu"
    section = document.get("low_precision")
    for row in section["rows"] if section else []:
        if row["family"] != "ampkernels" or row["key"] == "ampkernels-fp32":
            continue
        rate = f", {row['pct_of_copy']:.0f}% of copy" if on_gpu else ""
        versus = f", {row['vs_torchao']:.2f}x torchao" if row["vs_torchao"] is not None else ""
        lines.append(
            f"{section['set']} {row['label'].removeprefix(_OURS + ': ')}: {row['wall_ms']:.3g} ms{rate}, "
            f"{row['state_bytes_per_param']:.2f} B/param of state, {_ratio(row['vs_torch_fp32'])} torch fused fp32"
            f"{versus}"
        )
    memory = document.get("training_memory", {})
    peaks = {r["key"]: r for r in memory.get("rows", []) if r.get("peak_gib") is not None}
    if LOW_PRECISION_BASELINE in peaks:
        others = ", ".join(
            f"{r['params']} + {r['state']} {r['peak_gib']:.1f} ({r['vs_torch_fp32_gib']:+.1f})"
            for key, r in peaks.items()
            if key.startswith("ampkernels")
        )
        stock = peaks[LOW_PRECISION_BASELINE]["peak_gib"]
        lines.append(f"{memory['model']} training step peak GiB: torch fused fp32 {stock:.1f}; FusedAdamW {others}")
    return lines


def markdown(document: dict[str, Any]) -> list[str]:
    """The low-precision and training-memory tables in markdown, for ``benchmarks.report`` (empty for documents of
    a run without them)."""
    lines: list[str] = []
    section = document.get("low_precision")
    if section:
        on_gpu = document["mode"] == "gpu"
        lines += [
            f"{section['set']} ({section['num_tensors']} tensors, {section['num_params'] / 1e6:.2f}M params), AdamW "
            "step by state precision:",
            "",
            "| implementation | params | moments | ms | first step ms | B/param | GB/s"
            + (" | % of copy" if on_gpu else "")
            + " | state B/param | vs torch fp32 | vs torchao |",
            "|---|---|---|---:|---:|---:|---:|" + ("---:|" if on_gpu else "") + "---:|---:|---:|",
        ]
        for r in section["rows"]:
            rate = f"{r['gbs']:.0f} | {r['pct_of_copy']:.0f}%" if on_gpu else f"{r['gbs']:.0f}"
            lines.append(
                f"| {r['implementation']} | {r['params']} | {r['state']} | {format_ms(r['wall_ms'])} | "
                f"{format_ms(r['first_step_ms'])} | {r['bytes_per_param']:.2f} | {rate} | "
                f"{r['state_bytes_per_param']:.2f} | {_ratio(r['vs_torch_fp32'])} | {_ratio(r['vs_torchao'])} |"
            )
        lines += [""] + [f"- skipped: {s['label']}: {s['reason']}" for s in section["skipped"]]
        lines += [f"- {note}" for note in section["notes"] + section["warnings"]]
    memory = document.get("training_memory")
    if memory and memory.get("rows"):
        lines += [
            "",
            f"{_stack_text(memory)}: peak memory of a training step:",
            "",
            "| optimizer | params | moments | peak GiB | vs torch fp32 GiB | state GiB |",
            "|---|---|---|---:|---:|---:|",
        ]
        for r in memory["rows"]:
            if "error" in r:
                lines.append(
                    f"| {r['implementation']} | {r['params']} | {r['state']} | failed: {r['error'][:80]} | | |"
                )
                continue
            delta = "-" if r["vs_torch_fp32_gib"] is None else f"{r['vs_torch_fp32_gib']:+.2f}"
            lines.append(
                f"| {r['implementation']} | {r['params']} | {r['state']} | {_gib(r['peak_gib'])} | {delta} | "
                f"{r['state_gib']:.3f} |"
            )
        lines += [""] + [f"- {note}" for note in [memory["autocast"], *memory["notes"]]]
    return lines


def plot(document: dict[str, Any], path: Path, title: str) -> bool:
    time_ms = {(row["set"], row["implementation"]): row["wall_ms"] for row in document["rows"]}
    sets = list(document["param_sets"])
    series = {label: [time_ms.get((s, impl)) for s in sets] for impl, label in IMPLEMENTATIONS.items()}
    panels = {"AdamW step": (sets, series)}
    section = document.get("low_precision")
    if section and section["rows"]:
        by_key = {o.key: o for o in LOW_PRECISION_OPTIONS}
        on_gpu = document["mode"] == "gpu"
        for dtype in ("fp32", "bf16"):
            rows = [row for row in section["rows"] if row["param_dtype"] == dtype]
            if not rows:
                continue
            # The tick carries the share of copy bandwidth (GPU only: CPU_CACHE_NOTE), the bar its ms.
            groups = [
                by_key[row["key"]].short + (f"\n{row['pct_of_copy']:.0f}% copy" if on_gpu else "") for row in rows
            ]
            panel = f"{section['set']}, {dtype} parameters: ms per step by state"
            panels[panel] = (groups, {"low-precision state (ms per step)": [row["wall_ms"] for row in rows]})
    return plot_grouped_bars(path, title, panels, ylabel="time per step, ms (log)", tick_fontsize=8)
