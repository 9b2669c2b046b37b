"""Launch and tuning code of the Triton scaled_matmul (kernels: ``ampkernels.matmul.triton.scaled_matmul_kernels``).

``scaled_mm_(...)`` takes 2-D operands already checked by :func:`ampkernels.scaled_matmul` and picks a config:
measured per (GPU, dtypes, layouts, epilogue, M, N, K) for large problems, a heuristic for small ones and under the
interpreter. Everything that depends only on a call's metadata is cached per signature (:func:`launcher_for`).

Debug switches, module attributes read when a launcher is made (call ``ampkernels.matmul.clear_caches()`` after
changing one; tests set them with ``monkeypatch.setattr``): :data:`TMA_DESCRIPTORS` and :data:`DIRECT_LAUNCH`.
Whether the tuner may time is ``ampkernels.matmul.tuning.TUNE``.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections import deque
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ampkernels import dispatch
from ampkernels._constants import FLOAT8_DTYPES, SCALE_COL, SCALE_NONE, SCALE_ROW, SCALE_TENSOR  # noqa: F401 (scale_mode)
from ampkernels._runtime import capturing, num_sms, on_device_of_first_tensor, time_in_turns
from ampkernels.matmul import tuning
from ampkernels.matmul.triton.scaled_matmul_kernels import _scaled_mm_ptr_kernel, _scaled_mm_tma_kernel

try:  # triton >= 3.3
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton: pointer kernel only
    TensorDescriptor = None
try:
    from triton.compiler import CompiledKernel as _CompiledKernel
except ImportError:  # pragma: no cover
    _CompiledKernel = None
try:
    from triton.runtime import _allocation
except ImportError:  # pragma: no cover
    _allocation = None

#: Where the TMA kernel's descriptors are built: ``"device"`` (in the kernel, ``tl.make_tensor_descriptor``; where
#: this Triton has it) or ``"host"`` (``triton.tools.tensor_descriptor.TensorDescriptor`` per call; for comparing the
#: two). The device-side ones save the host its descriptor encoding per call (dev/matmul/NOTES.md).
TMA_DESCRIPTORS = "device"
#: Whether a launcher, after its first launch through ``JITFunction.run``, launches the compiled kernel directly
#: (skipping the JIT's argument binding, specialization and cache key per call: dev/matmul/NOTES.md).
#: False: every launch through the JIT, for checking the fast path against Triton's own.
DIRECT_LAUNCH = True

# --------------------------------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    block_m: int
    block_n: int
    block_k: int
    num_stages: int
    num_warps: int
    group_m: int = 8
    epilogue_split: int = 1  # TMA kernel: store the tile in this many pieces along N
    flatten: bool = False  # TMA kernel: tl.range(flatten=True) lets the next tile's loads overlap this epilogue
    programs_per_sm: int = 1
    stream_k: bool = False  # TMA kernel: the last partial wave's tiles shared out by k-iterations (see the kernel)

    def describe(self) -> str:
        extra = f" split{self.epilogue_split}" if self.epilogue_split > 1 else ""
        extra += " flat" if self.flatten else ""
        extra += " streamk" if self.stream_k else ""
        return (
            f"{self.block_m}x{self.block_n}x{self.block_k} s{self.num_stages} w{self.num_warps} g{self.group_m}"
            f"{extra} x{self.programs_per_sm}/SM"
        )


# NOTE: sm_90 shared memory is 227 KB per block: 128x256x64 bf16 is 48 KB a stage, so 3 stages plus a 128x128 store
# buffer fit, 4 stages only with a 16-bit output split in two. The candidates follow tutorial 09's space
# (128 x 128-256 x 64, 3-4 stages, 8 warps) plus the square-tile variants; see dev/matmul/NOTES.md, "The tuner".
HOPPER_TMA_CONFIGS = (
    Config(128, 256, 64, 3, 8, epilogue_split=2),
    Config(128, 256, 64, 3, 8, epilogue_split=2, flatten=True),
    Config(128, 256, 64, 4, 8, epilogue_split=2),
    Config(128, 128, 64, 4, 8),
    Config(256, 128, 64, 3, 8),
)
# Few output tiles (fewer 128x256 tiles than SMs, e.g. 3072x768 grad-weight: 72 tiles on 132 SMs): smaller tiles,
# two programs per SM for 64x128 (24 KB a stage: two CTAs of 4 stages fit), are tuned besides.
HOPPER_FEW_TILES_CONFIGS = (
    Config(64, 128, 64, 4, 4, programs_per_sm=2),
    Config(64, 256, 64, 3, 4),
)
# Tile counts that leave the last of a few waves partly idle (8192x768: 192 tiles of 128x256 on 132 SMs; 3072x768:
# 72): the same tiles with that wave shared out by k-iterations are tuned besides; they measured faster on some of
# these shapes and slower on others, so the tuner decides (dev/matmul/NOTES.md, "Stream-K in the Triton TMA kernel").
HOPPER_STREAM_K_CONFIGS = (
    Config(128, 256, 64, 3, 8, epilogue_split=2, stream_k=True),
    Config(128, 128, 64, 4, 8, stream_k=True),
)
# The same idle tail, 128x128 tiles in deeper or flattened pipelines (8192x768: 384 tiles, 2.9 waves): on
# 8192x768x3072 each step deeper and flattening measured faster, all of them faster than 128x256 tiles; 128x128x128
# s3 flat never won and was dropped (dev/matmul/NOTES.md, the 768-wide shapes).
HOPPER_IDLE_TAIL_CONFIGS = (
    Config(128, 128, 64, 5, 8),
    Config(128, 128, 64, 4, 8, flatten=True),
    Config(128, 128, 64, 5, 8, flatten=True),
    Config(128, 128, 64, 6, 8, flatten=True),
)
HOPPER_SMALL = Config(128, 128, 64, 4, 4)
# Ampere (and sm_90 fallbacks through pointers): 164 KB of shared memory, cp.async pipelines of 3-4 stages.
POINTER_CONFIGS = (
    Config(128, 256, 32, 3, 8),
    Config(128, 128, 32, 4, 4),
    Config(128, 128, 64, 3, 4),
    Config(64, 128, 32, 4, 4, programs_per_sm=2),
)
POINTER_SMALL = Config(64, 128, 32, 4, 4, programs_per_sm=2)
INTERPRETER_CONFIG = Config(32, 32, 32, 1, 4, group_m=2)


def _float8_configs(configs: tuple[Config, ...]) -> tuple[Config, ...]:
    """The same tiles with BLOCK_K doubled: a stage of 1-byte operands at 2 x BLOCK_K takes the bytes of a 16-bit one
    (128x256x128 FP8: 48 KB, as 128x256x64 bf16), so the same pipeline depths fit; FP8 wgmma consumes K 32 a step."""
    return tuple(dataclasses.replace(c, block_k=2 * c.block_k) for c in configs)


# Below this many multiply-adds a problem runs in microseconds: tuning it would cost more than it saves.
TUNE_MIN_MACS = 2**30


def tuning_enabled() -> bool:
    """Whether scaled_matmul may time (``ampkernels.matmul.tuning.TUNE``; never under the interpreter)."""
    return tuning.timing_enabled() and not dispatch.triton_interpreting()


@functools.cache
def _device_name(device_index: int) -> str:
    return torch.cuda.get_device_name(device_index)


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def _num_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: a few programs exercise the persistent loop
    return num_sms(device)


def device_descriptors() -> bool:
    """TMA descriptors built inside the kernel (``tl.make_tensor_descriptor`` + ``triton.set_allocator``, both in
    triton 3.6), unless :data:`TMA_DESCRIPTORS` is ``"host"`` (host-side ``TensorDescriptor``s)."""
    if TMA_DESCRIPTORS not in ("device", "host"):
        raise ValueError(
            "ampkernels.matmul.triton.scaled_matmul.TMA_DESCRIPTORS: expected 'device' or 'host', got "
            f"{TMA_DESCRIPTORS!r}"
        )
    available = hasattr(tl, "make_tensor_descriptor") and hasattr(triton, "set_allocator")
    if TMA_DESCRIPTORS == "host" and TensorDescriptor is not None:
        return False
    return available


def direct_launch() -> bool:
    """Launch cached compiled kernels without ``JITFunction.run`` (:data:`DIRECT_LAUNCH` False: never)."""
    return _CompiledKernel is not None and bool(DIRECT_LAUNCH)


def _uses_tma(device: torch.device) -> bool:
    if TensorDescriptor is None and not device_descriptors():
        return False
    if device.type != "cuda":
        return dispatch.triton_interpreting()
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index)[0] >= 9


def _tma_ok(t: torch.Tensor) -> bool:
    """Row- or column-major 2-D with a 16-byte aligned base and leading stride (TMA's rules)."""
    if t.data_ptr() % 16:
        return False
    rows, cols = t.shape
    if t.stride(1) == 1 and t.stride(0) >= cols:
        lead = t.stride(0)
    elif t.stride(0) == 1 and t.stride(1) >= rows:
        lead = t.stride(1)
    else:
        return False
    return (lead * t.element_size()) % 16 == 0


def is_float8(t: torch.Tensor) -> bool:
    return t.dtype in FLOAT8_DTYPES


def _col_major(t: torch.Tensor) -> bool:
    rows, cols = t.shape
    return not (t.stride(1) == 1 and t.stride(0) >= cols) and t.stride(0) == 1


# --------------------------------------------------------------------------------------------------------------------
# Launch
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    a: torch.Tensor
    b: torch.Tensor
    scale: torch.Tensor | None
    scale_mode: int
    alpha: float
    bias: torch.Tensor | None
    out: torch.Tensor
    accumulate: bool
    found_inf: torch.Tensor | None
    scale_a: torch.Tensor | None = None  # float8: one element or [M] (the dequantization factors)
    scale_b: torch.Tensor | None = None  # float8: one element or [N]
    amax_out: torch.Tensor | None = None  # float32, one element


def _factor_mode(factor: torch.Tensor | None) -> int:
    """The kernels' SCALE_A / SCALE_B: 0 absent, 1 one element, 2 a vector (per row of a / per column of b)."""
    if factor is None:
        return 0
    return 1 if factor.numel() == 1 else 2


# NOTE: Hopper's FP8 wgmma adds its products into an accumulator of reduced precision; Triton's default on sm_90
# keeps that for the whole K loop (max_num_imprecise_acc 2^30, cuBLAS's "fast accumulation"). Adding into the fp32
# accumulator after every BLOCK_K of K keeps a 16-bit output's error at torch._scaled_mm's, whose rounding dominates.
# An fp32 output (a weight gradient) shows the rest: promoting every BLOCK_K left it far less accurate than
# torch._scaled_mm's default, which promotes after every 32 of K; so does this kernel for fp32 outputs (the accuracy
# rule of tests/matmul/test_scaled_matmul_float8.py; measured: dev/float8/NOTES.md).
FP32_OUT_PROMOTION = 32


def _max_imprecise(a: torch.Tensor, out: torch.Tensor, cfg: Config) -> int:
    if not is_float8(a):
        return 0
    return FP32_OUT_PROMOTION if out.dtype == torch.float32 else cfg.block_k


_DUMMIES: dict[torch.device, torch.Tensor] = {}


def _dummy(device: torch.device) -> torch.Tensor:
    """A float32 stand-in for absent scale/bias/flag pointers (never read: masked or compiled out); cached, since
    allocating and filling one per call costs a kernel launch."""
    dummy = _DUMMIES.get(device)
    if dummy is None:
        dummy = _DUMMIES[device] = torch.ones(1, dtype=torch.float32, device=device)
    return dummy


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global scratch for device-side TMA descriptors (128 B each per program), from torch's caching allocator."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    """Installs :func:`_scratch` as Triton's allocator unless one is set. Triton keeps it in a ContextVar (3.6):
    per thread, so autograd's device threads start without one and this runs before every such launch."""
    try:
        missing = isinstance(_allocation._allocator.get(), _allocation.NullAllocator)
    except AttributeError:  # another Triton layout: set it every time (cheap)
        missing = True
    if missing:
        triton.set_allocator(_scratch)


def _direct_runner(compiled, grid):
    """``compiled[grid]``: a launcher of the compiled kernel that skips ``JITFunction.run`` (argument binding,
    specialization, cache key, global checks). Valid only for arguments of the same specialization, which the
    launcher cache key guarantees. None when this Triton's objects do not look as expected (then the JIT path)."""
    if not direct_launch() or not isinstance(compiled, _CompiledKernel):
        return None
    try:
        return compiled[tuple(grid) + (1,) * (3 - len(grid))]  # the compiled launcher indexes all three dims
    except Exception:  # noqa: BLE001 - any API drift: keep the JIT launch
        return None


class _Launcher:
    """Everything a launch needs that depends only on the launcher key (shapes, strides, dtypes, device,
    alignment, epilogue flags): kernel, grid, config and the constant arguments. Per call only the tensors and
    alpha change. Arguments are passed positionally in the kernel's order, so the JIT launch and the direct launch
    of the compiled kernel receive the same tuple."""

    __slots__ = (
        "kind", "kernel", "grid", "options", "tail", "dummy", "device_desc", "descs", "runner", "direct",
        "stream_k_tiles", "stream_k_columns", "partials_numel",
    )  # fmt: skip

    def __init__(self, p: Problem, plan: Plan, cfg: Config, direct: bool) -> None:
        M, K = p.a.shape
        N = p.b.shape[1]
        out = p.out
        num_tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
        slots = _num_programs(out.device) * cfg.programs_per_sm
        stream_k = cfg.stream_k and plan.kind == "tma"
        # Stream-K keeps every program busy even with fewer tiles than programs; it takes the tiles of the last,
        # partial wave (all of them when there is only one, then column by column: see the kernel).
        programs = slots if stream_k else max(1, min(num_tiles, slots))
        self.stream_k_columns = 1
        tile_columns = triton.cdiv(N, cfg.block_n)
        if stream_k and num_tiles <= slots and 1 < tile_columns <= slots:
            self.stream_k_columns = tile_columns
            programs = slots - slots % tile_columns
        self.stream_k_tiles = (num_tiles % programs if num_tiles > programs else num_tiles) if stream_k else 0
        self.partials_numel = programs * cfg.block_m * cfg.block_n if self.stream_k_tiles else 0
        self.kind = plan.kind
        self.grid = (programs,)
        self.options = {"num_stages": cfg.num_stages, "num_warps": cfg.num_warps}
        self.dummy = _dummy(out.device)
        self.runner = None
        self.direct = direct
        self.device_desc = False
        self.descs = None
        epilogue = (
            p.bias is not None,
            p.accumulate,
            p.found_inf is not None,
            _factor_mode(p.scale_a),
            _factor_mode(p.scale_b),
            p.amax_out is not None,
        )
        max_imprecise = _max_imprecise(p.a, p.out, cfg)
        if plan.kind == "tma":
            a_col, b_col = plan.a_col, plan.b_col
            stride_a = p.a.stride(1) if a_col else p.a.stride(0)
            stride_b = p.b.stride(1) if b_col else p.b.stride(0)
            self.kernel = _scaled_mm_tma_kernel
            self.device_desc = device_descriptors()
            if not self.device_desc:
                block_out = [cfg.block_m, cfg.block_n // cfg.epilogue_split]
                self.descs = (
                    ([K, M], [stride_a, 1], [cfg.block_k, cfg.block_m])
                    if a_col
                    else ([M, K], [stride_a, 1], [cfg.block_m, cfg.block_k]),
                    ([N, K], [stride_b, 1], [cfg.block_n, cfg.block_k])
                    if b_col
                    else ([K, N], [stride_b, 1], [cfg.block_k, cfg.block_n]),
                    ([M, N], [out.stride(0), 1], block_out) if plan.out_tma else None,
                )
            self.tail = (
                M, N, K, p.scale_mode, self.stream_k_tiles, stride_a, stride_b, out.stride(0),
                a_col, b_col, *epilogue, plan.out_tma, dispatch.triton_interpreting(), max_imprecise,
                cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, cfg.epilogue_split, programs, cfg.flatten,
                self.device_desc, bool(self.stream_k_tiles), self.stream_k_columns,
            )  # fmt: skip
        else:
            self.kernel = _scaled_mm_ptr_kernel
            self.tail = (
                M, N, K, p.scale_mode, p.a.stride(0), p.a.stride(1), p.b.stride(0), p.b.stride(1), out.stride(0),
                *epilogue, dispatch.triton_interpreting(), max_imprecise, cfg.block_m, cfg.block_n, cfg.block_k,
                cfg.group_m, programs,
            )  # fmt: skip

    def args(self, a, b, scale, alpha, bias, out, found_inf, scale_a=None, scale_b=None, amax_out=None) -> tuple:
        dummy = self.dummy
        scale = dummy if scale is None else scale
        bias = dummy if bias is None else bias
        found_inf = dummy if found_inf is None else found_inf
        # the float8 epilogue's pointers (amax as its int32 bits: see _record_amax)
        fp8 = (
            dummy if scale_a is None else scale_a,
            dummy if scale_b is None else scale_b,
            dummy if amax_out is None else amax_out.view(torch.int32),
        )
        if self.kind != "tma":
            return (a, b, out, scale, bias, found_inf, *fp8, alpha) + self.tail
        if self.partials_numel:  # per call: launches on other streams must not share them
            partials = torch.empty(self.partials_numel, dtype=torch.float32, device=out.device)
            flags = torch.zeros(self.grid[0], dtype=torch.int32, device=out.device)
        else:
            partials = flags = dummy
        if self.device_desc:
            return (a, b, None, out, scale, bias, found_inf, *fp8, partials, flags, alpha) + self.tail
        da, db, do = self.descs
        out_desc = None if do is None else TensorDescriptor(out, *do)
        descs = (TensorDescriptor(a, *da), TensorDescriptor(b, *db), out_desc)
        return descs + (out, scale, bias, found_inf, *fp8, partials, flags, alpha) + self.tail

    def __call__(self, a, b, scale, alpha, bias, out, found_inf, scale_a=None, scale_b=None, amax_out=None) -> None:
        args = self.args(a, b, scale, alpha, bias, out, found_inf, scale_a, scale_b, amax_out)
        if self.device_desc:
            _ensure_allocator()
        runner = self.runner
        if runner is not None:
            try:
                runner(*args)
                return
            except (IndexError, TypeError, ValueError):  # launcher API drift (raises before launching): JIT path
                self.runner = None
        try:
            compiled = self.kernel[self.grid](*args, **self.options)
        except RuntimeError as exc:
            if capturing() and "capturing" in str(exc):
                raise RuntimeError(
                    "ampkernels.scaled_matmul: this problem's Triton kernel was first needed inside a CUDA graph "
                    "capture, which forbids loading it (cuModuleLoadData): run the call once before capturing (the "
                    "warm-up torch.cuda.graphs asks for), which also tunes it"
                ) from exc
            raise
        if self.direct:
            self.direct = False  # one try per launcher
            self.runner = _direct_runner(compiled, self.grid)


@dataclass(frozen=True)
class Plan:
    """Which kernel runs a problem: ``kind`` is "tma" or "pointer"; layouts as the TMA kernel reads them."""

    kind: str
    a_col: bool = False
    b_col: bool = False
    out_tma: bool = False


def plan_for(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, force: str | None = None) -> Plan:
    """TMA when the GPU has it and both operands meet its alignment rules (K == 0 has no descriptor)."""
    use_tma = force != "pointer" and _uses_tma(out.device) and a.shape[1] > 0 and _tma_ok(a) and _tma_ok(b)
    if not use_tma:
        return Plan("pointer")
    out_tma = out.data_ptr() % 16 == 0 and (out.stride(0) * out.element_size()) % 16 == 0
    return Plan("tma", _col_major(a), _col_major(b), out_tma)


def _launch(p: Problem, plan: Plan, cfg: Config) -> None:
    """One launch through ``JITFunction.run`` (explicit configs: tests, dev probes)."""
    _Launcher(p, plan, cfg, direct=False)(
        p.a, p.b, p.scale, p.alpha, p.bias, p.out, p.found_inf, p.scale_a, p.scale_b, p.amax_out
    )


def _candidates(
    plan: Plan, out: torch.Tensor, M: int = 0, N: int = 0, accumulate: bool = False, float8: bool = False
) -> tuple[Config, ...]:
    if plan.kind == "tma":
        configs = HOPPER_TMA_CONFIGS
        sms = _num_programs(out.device)
        tiles = triton.cdiv(M, 128) * triton.cdiv(N, 256)
        if out.device.type == "cuda" and tiles < sms:
            configs += HOPPER_FEW_TILES_CONFIGS
        if out.device.type == "cuda" and tiles % sms and tiles < 4 * sms:  # an idle tail worth sharing out
            configs += HOPPER_STREAM_K_CONFIGS + HOPPER_IDLE_TAIL_CONFIGS
        operand_bytes = 2
        if float8:
            configs, operand_bytes = _float8_configs(configs), 1
        # Pointer stores are counted as an fp32 piece: an upper bound (see _shared_bytes).
        out_bytes = out.element_size() if plan.out_tma else 4
        return tuple(
            c
            for c in configs
            if _shared_bytes(c, out_bytes, accumulate, plan.out_tma, operand_bytes) <= HOPPER_SHARED_BYTES
        )
    return _float8_configs(POINTER_CONFIGS) if float8 else POINTER_CONFIGS


HOPPER_SHARED_BYTES = 227 * 1024  # per block, opted in
_BARRIER_BYTES = 2048  # mbarriers and alignment: 24-1,048 B measured


def _shared_bytes(
    cfg: Config, out_bytes: int, accumulate: bool = False, out_tma: bool = True, operand_bytes: int = 2
) -> int:
    """Shared memory of the TMA kernel: the operand ring, one piece of the output tile staged for the store, and
    with a flattened loop that accumulates through TMA a second piece for the previous output, which is loaded
    ahead like the operands. Within the barrier margin above what Triton 3.6 allocates for sm_90 on every
    candidate, for 16- and 32-bit outputs, accumulating or not (dev/matmul/NOTES.md, "Shared-memory estimate").
    Without the second piece, 128x128x64 s4 flat for fp32 out += a @ b looked like 192 KB; it takes 262,184 B, and
    the H200 rejected it and two more flattened candidates with OutOfResources. For pointer stores it is an upper
    bound: Triton stages no piece there unless the loop is flattened (128x256x64 s4 split2: 196,640 B, against
    262,144 + margin)."""
    ring = cfg.num_stages * (cfg.block_m + cfg.block_n) * cfg.block_k * operand_bytes
    piece = cfg.block_m * (cfg.block_n // cfg.epilogue_split)
    loaded = piece * 4 if accumulate and cfg.flatten and out_tma else 0
    return ring + piece * out_bytes + loaded + _BARRIER_BYTES


def _heuristic(plan: Plan, M: int, N: int, K: int, device: torch.device, float8: bool = False) -> Config:
    if device.type != "cuda":
        return INTERPRETER_CONFIG
    large = M * N * K >= TUNE_MIN_MACS
    if plan.kind == "tma":
        cfg = HOPPER_TMA_CONFIGS[0] if large else HOPPER_SMALL
    else:
        cfg = POINTER_CONFIGS[0] if large and _capability(device.index or 0)[0] >= 8 else POINTER_SMALL
    return _float8_configs((cfg,))[0] if float8 else cfg


_MAX_CACHED = 4096  # signatures per cache: dynamic shapes would otherwise grow the caches without bound
_TUNED: dict[tuple, Config] = {}
#: What the latest tunings measured (read by the benchmark and dev notes).
TUNING_LOG: deque[dict] = deque(maxlen=256)


def _tune(p: Problem, plan: Plan, key: tuple) -> Config:
    scratch_out = torch.zeros_like(p.out)
    scratch_flag = torch.zeros(1, dtype=torch.float32, device=p.out.device) if p.found_inf is not None else None
    scratch_amax = torch.zeros(1, dtype=torch.float32, device=p.out.device) if p.amax_out is not None else None
    trial = Problem(
        p.a, p.b, p.scale, p.scale_mode, p.alpha, p.bias, scratch_out, p.accumulate, scratch_flag,
        p.scale_a, p.scale_b, scratch_amax,
    )  # fmt: skip
    args = (
        trial.a, trial.b, trial.scale, trial.alpha, trial.bias, trial.out, trial.found_inf,
        trial.scale_a, trial.scale_b, trial.amax_out,
    )  # fmt: skip
    launchers: dict[Config, _Launcher] = {}
    for cfg in _candidates(plan, p.out, p.a.shape[0], p.b.shape[1], p.accumulate, is_float8(p.a)):
        try:
            # Timed as calls will run: the compiled kernel launched directly. Through JITFunction.run the host time
            # of a launch, which the L2 flush between runs did not always hide, skewed the timings
            # (dev/matmul/NOTES.md).
            launcher = _Launcher(trial, plan, cfg, direct=True)
            launcher(*args)  # compiles (and raises here when the config does not fit this GPU)
            launchers[cfg] = launcher
        except Exception as exc:  # out of shared memory / registers on this GPU: not a candidate here
            warnings.warn(
                f"ampkernels.scaled_matmul: config {cfg.describe()} failed: {type(exc).__name__}", stacklevel=3
            )
    timings = time_in_turns({cfg: functools.partial(launcher, *args) for cfg, launcher in launchers.items()})
    if not timings:
        raise RuntimeError("ampkernels.scaled_matmul: no Triton config compiled for this problem")
    best = min(timings, key=timings.get)
    TUNING_LOG.append({"key": repr(key), "ms": {c.describe(): t for c, t in timings.items()}, "best": best.describe()})
    return best


def choose_config(p: Problem, plan: Plan) -> Config:
    M, K = p.a.shape
    N = p.b.shape[1]
    device = p.out.device
    float8 = is_float8(p.a)
    if not tuning_enabled() or device.type != "cuda" or M * N * K < TUNE_MIN_MACS:
        return _heuristic(plan, M, N, K, device, float8)
    key = (
        _device_name(device.index if device.index is not None else torch.cuda.current_device()),
        p.a.dtype,
        p.out.dtype,
        *((p.b.dtype, _factor_mode(p.scale_a), _factor_mode(p.scale_b), p.amax_out is not None) if float8 else ()),
        plan,
        p.bias is not None,
        p.accumulate,
        p.found_inf is not None,
        M,
        N,
        K,
    )
    cfg = _TUNED.get(key)
    if cfg is None:
        if capturing():  # timing synchronizes, which a capture forbids: the next eager call tunes
            return _heuristic(plan, M, N, K, device, float8)
        with torch.cuda.device(device):  # do_bench times on the current device's stream
            cfg = _tune(p, plan, key)
        if len(_TUNED) >= _MAX_CACHED:
            _TUNED.clear()
        _TUNED[key] = cfg
    return cfg


# NOTE: host time per call is what the small transformer shapes lose to cuBLAS. Everything that depends only on the
# key below is computed once per key: plan, config (tuning), grid, constant arguments and, after the first launch,
# the compiled kernel's own launcher. See dev/matmul/NOTES.md, "Host time per call", for the measurements.
_LAUNCHERS: dict[tuple, _Launcher] = {}


def clear_caches() -> None:
    """Forgets cached launchers (after changing :data:`TMA_DESCRIPTORS`, :data:`DIRECT_LAUNCH` or the tuning
    switches of ``ampkernels.matmul.tuning``, read at creation)."""
    _LAUNCHERS.clear()


def _launcher_key(a, b, scale, scale_mode, bias, out, accumulate, found_inf, scale_a, scale_b, amax_out) -> tuple:
    # Alignment decides TMA eligibility (a, b, out) and Triton specializes every pointer on 16-byte alignment.
    aligned = (
        not a.data_ptr() & 15,
        not b.data_ptr() & 15,
        not out.data_ptr() & 15,
        scale is None or not scale.data_ptr() & 15,
        bias is None or not bias.data_ptr() & 15,
        found_inf is None or not found_inf.data_ptr() & 15,
    )
    return (
        a.shape,
        a.stride(),
        b.shape,
        b.stride(),
        out.stride(),
        a.dtype,
        b.dtype,
        out.dtype,
        out.device,
        scale_mode,
        None if scale is None else scale.dtype,
        None if bias is None else bias.dtype,
        accumulate,
        found_inf is None,
        aligned,
        *(
            ()
            if scale_a is None and scale_b is None and amax_out is None
            else (
                _factor_mode(scale_a),
                _factor_mode(scale_b),
                scale_a is None or not scale_a.data_ptr() & 15,
                scale_b is None or not scale_b.data_ptr() & 15,
                None if amax_out is None else not amax_out.data_ptr() & 15,
            )
        ),
    )


def launcher_for(
    a, b, scale, scale_mode, bias, out, accumulate, found_inf, scale_a=None, scale_b=None, amax_out=None
) -> _Launcher:
    """The cached launcher of a problem with these arguments' metadata (same contract as :func:`scaled_mm_`, M, N
    > 0); call it as ``launcher(a, b, scale, alpha, bias, out, found_inf[, scale_a, scale_b, amax_out])`` with
    tensors of the same metadata."""
    key = _launcher_key(a, b, scale, scale_mode, bias, out, accumulate, found_inf, scale_a, scale_b, amax_out)
    launcher = _LAUNCHERS.get(key)
    if launcher is None:
        p = Problem(a, b, scale, scale_mode, 1.0, bias, out, accumulate, found_inf, scale_a, scale_b, amax_out)
        plan = plan_for(a, b, out)
        launcher = _Launcher(p, plan, choose_config(p, plan), direct=True)
        if capturing():
            return launcher  # its config may be the untuned heuristic (see choose_config)
        if len(_LAUNCHERS) >= _MAX_CACHED:
            _LAUNCHERS.clear()
        _LAUNCHERS[key] = launcher
    return launcher


@on_device_of_first_tensor
def scaled_mm_(
    a: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor | None,
    scale_mode: int,
    alpha: float,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    accumulate: bool,
    found_inf: torch.Tensor | None,
    *,
    scale_a: torch.Tensor | None = None,
    scale_b: torch.Tensor | None = None,
    amax_out: torch.Tensor | None = None,
    config: Config | None = None,
    force: str | None = None,
) -> None:
    """``out (+)= alpha * scale * ((a @ b) * scale_a * scale_b) + bias`` on checked inputs (same contract as the
    WMMA op), then ``amax_out = max(amax_out, max |out|)``.

    a: [M, K], b: [K, N], fp16/bf16, or float8 (e4m3fn/e5m2, not both e5m2), any strides (TMA when aligned
    row/column-major; float8 is fast with a row-major and b column-major, "K-major", see the caller); scale: float32
    per ``scale_mode`` (0 none, 1 one element, 2 [M], 3 [N]); scale_a / scale_b (float8 only): float32, contiguous,
    one element or [M] / [N]; bias: [N] fp32 or a's dtype; out: [M, N] with unit column stride; found_inf, amax_out:
    1-element float32 or None. ``config``/``force`` ("pointer"): for tests and tuning (not cached).
    """
    M, K = a.shape
    N = b.shape[1]
    if M == 0 or N == 0:
        return
    alpha = float(alpha)
    if config is None and force is None:
        launcher_for(a, b, scale, scale_mode, bias, out, accumulate, found_inf, scale_a, scale_b, amax_out)(
            a, b, scale, alpha, bias, out, found_inf, scale_a, scale_b, amax_out
        )
        return
    p = Problem(a, b, scale, scale_mode, alpha, bias, out, accumulate, found_inf, scale_a, scale_b, amax_out)
    plan = plan_for(a, b, out, force)
    _launch(p, plan, config or choose_config(p, plan))
