"""Triton backend of the multi-tensor AMP kernels (see ``dev/DESIGN.md``).

Kernels first, torch-facing wrappers after them:

* ``_unscale_reduce_kernel``: one launch per (dtype, alignment) group, persistent grid over the group's chunks; each
  chunk unscales (optionally in place), checks for non-finite inputs and reduces its norm partial into its own slot of
  a float32 ``partials`` buffer [C, 2] (no atomics, no memset).
* ``_finalize_kernel``: single program; ORs the flags into ``found_inf``, reduces the total norm in a fixed order
  (deterministic) and writes the clip coefficient.
* ``_per_tensor_norm_kernel``: one program per tensor, reduces that tensor's chunk partials (fixed order).
* ``_update_scale_kernel``: single program, the loss-scale update with hysteresis, bounds and telemetry.

The math matches ``ampkernels.reference`` exactly (same roundings); only the norms are accumulated in float32 (the
reference uses float64), so a norm is within float32 rounding of the reference and overflows beyond ~1.8e19.
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from collections.abc import Sequence
from itertools import groupby

import torch
import triton
import triton.language as tl

from ampkernels import reference
from ampkernels.triton import f64_bits, retain_if_capturing

# --------------------------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------------------------

_FLT_MAX = tl.constexpr(3.4028234663852886e38)
_DBL_MAX = tl.constexpr(1.7976931348623157e308)

# NORM constexpr values.
_NORM_NONE = 0
_NORM_L2 = 1
_NORM_INF = 2


@triton.jit
def _nanmax(a, b):
    # Plain tl.maximum / tl.max drop NaN; torch's max (the reference) propagates it.
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _nanmax_reduce(x):
    """Max over a 1-D block of values >= 0 or NaN that propagates NaN: tl.max plus a sum that is NaN iff a lane is.

    Built-in reductions rather than tl.reduce with a custom combine, which the interpreter runs element by element.
    """
    return tl.max(x, axis=0) + tl.sum(tl.where(x >= 0.0, 0.0, x), axis=0)


@triton.jit
def _unscale_block(
    x,
    base,
    offs,
    bound,
    inv,
    fac,
    acc,
    bad,
    WRITE: tl.constexpr,
    NORM: tl.constexpr,
    HAS_FACTOR: tl.constexpr,
    IS_FP64: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One loaded block ``x`` from ``base + offs`` (int64 offsets; with MASKED only those < ``bound`` are real)."""
    # Non-finite check on the *input* value: |x| <= MAX is an ordered compare, false for NaN and inf. float64 tensors
    # are checked and unscaled in float64 (like torch and the reference), everything else in float32; the norm
    # partials are float32 either way. (Folding the flag in right after the load keeps ptxas at fewer registers.)
    if IS_FP64:
        bad = bad | ((tl.abs(x) <= _DBL_MAX) == 0).to(tl.int32)
        v = x * inv.to(tl.float64)
        if HAS_FACTOR:
            v = v * fac.to(tl.float64)
    else:
        xf = x.to(tl.float32)
        bad = bad | ((tl.abs(xf) <= _FLT_MAX) == 0).to(tl.int32)
        v = xf * inv
        if HAS_FACTOR:
            v = v * fac
    if WRITE:
        if MASKED:
            tl.store(base + offs, v.to(x.dtype), mask=offs < bound)
        else:
            tl.store(base + offs, v.to(x.dtype))
    if NORM == 1:
        vn = v.to(x.dtype).to(tl.float32)  # the norm of the value as stored (rounded to the tensor's dtype)
        acc += vn * vn
    elif NORM == 2:
        acc = _nanmax(acc, tl.abs(v.to(x.dtype).to(tl.float32)))
    return acc, bad


@triton.jit(do_not_specialize=["c_begin", "c_end"])
def _unscale_reduce_kernel(
    addrs,
    numels,
    chunk_tensor,
    chunk_start,
    partials,
    scale,
    factor,
    c_begin,
    c_end,
    DTYPE: tl.constexpr,
    IS_FP64: tl.constexpr,
    ALIGNED: tl.constexpr,
    WRITE: tl.constexpr,
    NORM: tl.constexpr,
    HAS_FACTOR: tl.constexpr,
    CHUNK_SIZE: tl.constexpr,
    HALF: tl.constexpr,
):
    """Chunks ``c_begin .. c_end-1`` (one dtype group); writes ``partials[c] = (flag, acc)``.

    Loop iterations cover ``2 * HALF`` elements.
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    # Exactly torch's scale.double().reciprocal().float(); an fp64 division is correctly rounded on GPU.
    inv = (1.0 / tl.load(scale).to(tl.float64)).to(tl.float32)
    fac = 1.0
    if HAS_FACTOR:
        fac = tl.load(factor)
    lanes = tl.arange(0, HALF)
    for c in range(c_begin + pid, c_end, nprog):
        t = tl.load(chunk_tensor + c)
        # chunk_start is a multiple of CHUNK_SIZE by construction: the hint keeps 16-byte vector accesses possible.
        start = tl.multiple_of(tl.load(chunk_start + c), CHUNK_SIZE)
        n = tl.load(numels + t)
        ptr = tl.load(addrs + t).to(tl.pointer_type(DTYPE))
        # NOTE: a pointer made from an integer has unknown alignment, so Triton would emit scalar loads/stores.
        # The host puts tensors whose data_ptr is a multiple of 16 bytes in their own group (ALIGNED=True) and only
        # there asserts it with tl.multiple_of; with the CHUNK_SIZE hint on `start` and unmasked full blocks below
        # this gives 16-byte accesses (checked by compiling for sm_90 with Triton 3.8: ld/st.global.v4.b32, v2.b64
        # for float64; the unaligned variant compiles to scalar b16/b32 accesses). Unaligned groups stay correct.
        if ALIGNED:
            ptr = tl.multiple_of(ptr, 16)
        base = ptr + start
        m = tl.minimum(n - start, CHUNK_SIZE)  # elements of this chunk (int64)
        full = (m // (2 * HALF)) * (2 * HALF)
        acc = tl.zeros([HALF], dtype=tl.float32)
        bad = tl.zeros([HALF], dtype=tl.int32)
        # Full blocks unmasked (a mask against an arbitrary numel would also defeat vectorisation), each as two
        # halves loaded before either is used: more bytes in flight per thread for few registers (NOTE at BLOCK).
        for off in range(0, full, 2 * HALF):
            oa = off + lanes
            ob = off + HALF + lanes
            xa = tl.load(base + oa)
            xb = tl.load(base + ob)
            acc, bad = _unscale_block(xa, base, oa, m, inv, fac, acc, bad, WRITE, NORM, HAS_FACTOR, IS_FP64, False)
            acc, bad = _unscale_block(xb, base, ob, m, inv, fac, acc, bad, WRITE, NORM, HAS_FACTOR, IS_FP64, False)
        for off in range(full, m, HALF):  # the tail: at most two masked halves
            oa = off + lanes
            xa = tl.load(base + oa, mask=oa < m, other=0.0)
            acc, bad = _unscale_block(xa, base, oa, m, inv, fac, acc, bad, WRITE, NORM, HAS_FACTOR, IS_FP64, True)
        tl.store(partials + 2 * c, tl.max(bad, axis=0).to(tl.float32))
        if NORM == 1:
            tl.store(partials + 2 * c + 1, tl.sum(acc, axis=0))
        elif NORM == 2:
            tl.store(partials + 2 * c + 1, _nanmax_reduce(acc))


@triton.jit(do_not_specialize=["n_chunks"])
def _finalize_kernel(
    partials,
    n_chunks,
    found_inf,
    norm_out,
    coef_out,
    max_norm,
    NORM: tl.constexpr,
    HAS_COEF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Single program: flags -> found_inf, total norm -> norm_out, clip coefficient -> coef_out (fixed order)."""
    lanes = tl.arange(0, BLOCK)
    bad = tl.zeros([BLOCK], dtype=tl.float32)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for c0 in range(0, n_chunks, BLOCK):
        idx = c0 + lanes
        mask = idx < n_chunks
        bad = tl.maximum(bad, tl.load(partials + 2 * idx, mask=mask, other=0.0))
        if NORM == 1:
            acc += tl.load(partials + 2 * idx + 1, mask=mask, other=0.0)
        elif NORM == 2:
            acc = _nanmax(acc, tl.load(partials + 2 * idx + 1, mask=mask, other=0.0))
    # Only ever set, never cleared (like torch): a store of 1.0 under a mask, no read-modify-write.
    tl.store(found_inf, 1.0, mask=tl.max(bad, axis=0) > 0.0)
    if NORM != 0:
        if NORM == 1:
            # sqrt in float64 then one rounding: the correctly rounded float32 sqrt (53 >= 2 * 24 + 2 bits).
            norm = tl.sqrt(tl.sum(acc, axis=0).to(tl.float64)).to(tl.float32)
        else:
            norm = _nanmax_reduce(acc)
        tl.store(norm_out, norm)
        if HAS_COEF:
            # torch: clamp(max_norm / (norm + 1e-6), max=1); python / tensor is reciprocal() * max_norm in float32.
            # The float64 reciprocal rounded once to float32 is the correctly rounded float32 reciprocal.
            recip = (1.0 / (norm + 1e-6).to(tl.float64)).to(tl.float32)
            coef = recip * max_norm
            coef = tl.where(coef > 1.0, 1.0, coef)  # NaN stays NaN, like torch.clamp
            tl.store(coef_out, coef)


@triton.jit
def _per_tensor_norm_kernel(partials, first_chunk, out_index, per_out, NORM: tl.constexpr, BLOCK: tl.constexpr):
    """Program t: ``per_out[out_index[t]]`` = norm over partials[first_chunk[t] : first_chunk[t+1]] (fixed order)."""
    t = tl.program_id(0)
    c_lo = tl.load(first_chunk + t)
    c_hi = tl.load(first_chunk + t + 1)
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for c0 in range(c_lo, c_hi, BLOCK):
        idx = c0 + lanes
        vals = tl.load(partials + 2 * idx + 1, mask=idx < c_hi, other=0.0)
        if NORM == 1:
            acc += vals
        else:
            acc = _nanmax(acc, vals)
    if NORM == 1:
        res = tl.sqrt(tl.sum(acc, axis=0).to(tl.float64)).to(tl.float32)
    else:
        res = _nanmax_reduce(acc)
    tl.store(per_out + tl.load(out_index + t), res)


@triton.jit(do_not_specialize=["growth_bits", "backoff_bits", "growth_interval", "hysteresis", "history_len"])
def _update_scale_kernel(
    scale,
    growth_tracker,
    found_inf,
    hysteresis_tracker,
    counters,
    history,
    growth_bits,
    backoff_bits,
    growth_interval,
    hysteresis,
    min_scale,
    max_scale,
    history_len,
    HAS_HYST: tl.constexpr,
    HAS_COUNTERS: tl.constexpr,
    HAS_HISTORY: tl.constexpr,
):
    """DESIGN.md kernel 3. ``*_bits`` are the float64 bit patterns of the factors (Triton float args are fp32)."""
    growth = growth_bits.to(tl.int64).to(tl.float64, bitcast=True)
    backoff = backoff_bits.to(tl.int64).to(tl.float64, bitcast=True)
    s = tl.load(scale)
    found = tl.load(found_inf) != 0.0  # NaN counts as found, like the reference
    gt = tl.load(growth_tracker)

    # Products in float64, one rounding to float32 (torch's _amp_update_scale_). Bounds compared in float32: with
    # monotone rounding, max(a, fp32(b)) == fp32(max(a, b)) for a float32 a, so this equals the reference.
    backed = (s.to(tl.float64) * backoff).to(tl.float32)
    backed = tl.where(backed < min_scale, min_scale, backed)
    grown = (s.to(tl.float64) * growth).to(tl.float32)
    grown_ok = tl.abs(grown) <= _FLT_MAX
    grown = tl.where(max_scale < grown, max_scale, grown)

    successful = gt + 1
    grow = successful == growth_interval
    if HAS_HYST:
        ht = tl.load(hysteresis_tracker)
        new_s = tl.where(found, tl.where(ht - 1 <= 0, backed, s), tl.where(grow & grown_ok, grown, s))
        tl.store(hysteresis_tracker, tl.where(found, ht - 1, tl.where(grow, hysteresis, ht)))
    else:
        new_s = tl.where(found, backed, tl.where(grow & grown_ok, grown, s))
    tl.store(scale, new_s)
    tl.store(growth_tracker, tl.where(found, 0, tl.where(grow, 0, successful)))
    if HAS_COUNTERS:
        n = tl.load(counters)
        tl.store(counters, n + 1)
        tl.store(counters + 1, tl.load(counters + 1) + found.to(tl.int64))
        if HAS_HISTORY:
            tl.store(history + n % history_len, new_s)


# --------------------------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------------------------

#: Elements per chunk (DESIGN.md).
CHUNK = 65536
#: Elements per loop iteration of ``_unscale_reduce_kernel``, as two halves of 1024 loaded up front: 16 per thread at
#: 4 warps (2 or 4 16-byte loads in flight per thread).
#: NOTE (ptxas sm_90, Triton 3.8): this takes 30-48 registers for every variant, so 8 or more programs of 4 warps
#: are resident per SM. 8 warps x 2048 (one load each) needed ~40-48 registers, i.e. only 5-6 resident programs per
#: SM; 8 warps x 4096 in one piece needed 105-125 (2 per SM). Caveat: for 16-bit dtypes with write=True ptxas sinks
#: the second half's load below the first half's store, so only 8 elements (16 bytes) per thread are in flight there.
BLOCK = 2048
NUM_WARPS = 4
_FINALIZE_BLOCK = 1024
_PER_TENSOR_BLOCK = 512
_INTERPRETER_PROGRAMS = 32  # a few programs, each looping over several chunks, exercise the kernel's chunk loop
_CACHE_SIZE = 8

_TL_DTYPES = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float64: tl.float64,
}

# (device, signature) -> TensorTable, least recently used first.
_TABLE_CACHE: OrderedDict[tuple, TensorTable] = OrderedDict()


def _pad_even(seg: torch.Tensor) -> torch.Tensor:
    # Every view starts 16-byte aligned, so the kernels' pointer specialisation does not vary with T or C.
    return torch.cat([seg, seg.new_zeros(1)]) if seg.numel() % 2 else seg


class TensorTable:
    """Device metadata of a tensor list (DESIGN.md), built once with vectorised torch ops.

    Args:
        tensors: the tensors (float32/float16/bfloat16/float64, non-overlapping and dense, on ``device``).
        device: their device (default: that of ``tensors[0]``).

    Attributes (int64 views of one device buffer; T tensors, C chunks, in group-sorted order):
        addrs [T], numels [T], chunk_tensor [C], chunk_start [C], first_chunk [T+1], out_index [T].
        groups: ``[(dtype, t_begin, t_end, c_begin, c_end)]`` on the host; ``group_aligned[i]`` says whether every
        tensor of group i starts on a 16-byte boundary (tensors are grouped by dtype, then by that alignment).
        signature: ``((data_ptr, numel, dtype), ...)`` in the caller's order, the cache key.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], device: torch.device | None = None):
        if device is None:
            device = tensors[0].device if len(tensors) else torch.device("cpu")
        self.device = torch.device(device)
        ptrs = [t.data_ptr() for t in tensors]
        numels = [t.numel() for t in tensors]
        dtypes = [t.dtype for t in tensors]
        self.signature = tuple(zip(ptrs, numels, dtypes, strict=True))
        n = len(tensors)
        self.num_tensors = n
        live = [p for p, k in zip(ptrs, numels, strict=True) if k > 0]
        self.has_duplicates = len(set(live)) != len(live)  # the same data twice (partial overlaps are not detected)

        rank: dict = {}
        for d in dtypes:
            rank.setdefault(d, len(rank))  # dtype groups in order of first appearance
        keys = [(rank[d], p % 16 != 0 and k > 0) for p, k, d in self.signature]
        order = sorted(range(n), key=keys.__getitem__)  # stable: caller's order inside a group

        order_t = torch.tensor(order, dtype=torch.int64)
        addrs = torch.tensor(ptrs, dtype=torch.int64)[order_t] if n else torch.zeros(0, dtype=torch.int64)
        numel_t = torch.tensor(numels, dtype=torch.int64)[order_t] if n else torch.zeros(0, dtype=torch.int64)
        nchunks = (numel_t + (CHUNK - 1)) // CHUNK
        first_chunk = torch.zeros(n + 1, dtype=torch.int64)
        torch.cumsum(nchunks, 0, out=first_chunk[1:])
        self.num_chunks = int(first_chunk[-1])
        chunk_tensor = torch.repeat_interleave(torch.arange(n, dtype=torch.int64), nchunks)
        chunk_start = (torch.arange(self.num_chunks, dtype=torch.int64) - first_chunk[chunk_tensor]) * CHUNK

        fc = first_chunk.tolist()
        self.groups = []
        self.group_aligned = []
        pos = 0
        for (_rank, unaligned), members in groupby(order, key=keys.__getitem__):
            cnt = len(list(members))
            self.groups.append((dtypes[order[pos]], pos, pos + cnt, fc[pos], fc[pos + cnt]))
            self.group_aligned.append(not unaligned)
            pos += cnt

        segs = [addrs, numel_t, chunk_tensor, chunk_start, first_chunk, order_t]
        padded = [_pad_even(s) for s in segs]
        # The one host-to-device copy. Its source stays alive with this object: a copy captured in a CUDA graph
        # reads it again at every replay.
        self._host = torch.cat(padded)
        if self.device.type == "cuda":
            self._host = self._host.pin_memory()
        self.buffer = self._host.to(self.device, non_blocking=True)
        retain_if_capturing(self._host, self.buffer)  # the table cache may evict this table while a graph replays it
        views = []
        off = 0
        for s, p in zip(segs, padded, strict=True):
            views.append(self.buffer[off : off + s.numel()])
            off += p.numel()
        self.addrs, self.numels, self.chunk_tensor, self.chunk_start, self.first_chunk, self.out_index = views


def get_table(tensors: Sequence[torch.Tensor], device: torch.device | None = None) -> TensorTable:
    """The cached ``TensorTable`` of ``tensors`` (built on a miss; at most 8 tables are kept, LRU)."""
    if device is None:
        device = tensors[0].device if len(tensors) else torch.device("cpu")
    key = (torch.device(device), tuple((t.data_ptr(), t.numel(), t.dtype) for t in tensors))
    table = _TABLE_CACHE.get(key)
    if table is not None:
        _TABLE_CACHE.move_to_end(key)
        return table
    table = TensorTable(tensors, device)
    _TABLE_CACHE[key] = table
    while len(_TABLE_CACHE) > _CACHE_SIZE:
        _TABLE_CACHE.popitem(last=False)
    return table


def clear_table_cache() -> None:
    """Drop every cached ``TensorTable``."""
    _TABLE_CACHE.clear()


def _num_programs(device: torch.device, chunks: int) -> int:
    """One program per chunk on a GPU, as the CUDA kernels launch. NOTE (H200, Llama-1B fp32 gradients,
    dev/triton_grid_probe.py, % of copy, two runs): read-only + norm 96.3-96.5 with a persistent grid of 8 programs
    per SM, 99.0-99.8 with one per chunk; in place 88.8-89.2 and 89.8-90.4."""
    if device.type != "cuda":
        return min(chunks, _INTERPRETER_PROGRAMS)
    return chunks


# triton.jit returns an InterpretedFunction when TRITON_INTERPRET=1 was set before this module was imported.
_INTERPRETED = type(_unscale_reduce_kernel).__name__ == "InterpretedFunction"


def _interpreted() -> bool:
    """Whether the kernels run in the Triton interpreter (on CPU tensors) instead of on a GPU."""
    return _INTERPRETED


def _check_backend(device: torch.device, what: str) -> None:
    if _interpreted():
        if device.type != "cpu":
            raise RuntimeError(
                f"{what} is on {device}, but TRITON_INTERPRET=1 runs the kernels on the host: "
                "use CPU tensors (or unset TRITON_INTERPRET before importing ampkernels)"
            )
    elif device.type != "cuda":
        raise RuntimeError(
            f"{what} is on {device}: the Triton kernels need a CUDA device "
            "(or TRITON_INTERPRET=1, set before importing ampkernels, for CPU tensors)"
        )


def _device_guard(device: torch.device):
    # Triton launches on the current CUDA device: make it the tensors' device (tensors on cuda:1, current cuda:0).
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _check_scalar(x, name: str, device: torch.device, dtype: torch.dtype, numel: int = 1) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.device != device:
        raise ValueError(f"{name} must be on {device}, got {x.device}")
    if x.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {x.dtype}")
    if x.numel() != numel:
        raise ValueError(f"{name} must have {numel} element(s), got {x.numel()}")
    if numel > 1 and not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _is_non_overlapping_and_dense(t: torch.Tensor) -> bool:
    if t.numel() <= 1 or t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride(), strict=True) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _check_tensor_list(tensors: Sequence[torch.Tensor], device: torch.device) -> None:
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if t.device != device:
            raise ValueError(
                f"tensors[{i}] is on {t.device}, expected {device} (the device of tensors[0]); "
                "all tensors must share one device"
            )
        if t.dtype not in _TL_DTYPES:
            raise TypeError(
                f"tensors[{i}] has unsupported dtype {t.dtype} (supported: float32, float16, bfloat16, float64)"
            )
        if t.layout != torch.strided:
            raise TypeError(f"tensors[{i}] has layout {t.layout}; only strided tensors are supported")
        if not _is_non_overlapping_and_dense(t):
            raise ValueError(
                f"tensors[{i}] is not non-overlapping and dense (shape {tuple(t.shape)}, stride "
                f"{t.stride()}); stage it through a contiguous buffer"
            )


def _norm_mode(norm_type) -> int:
    if norm_type is None:
        return _NORM_NONE
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)):
        raise TypeError(f"norm_type must be None, 2.0 or inf, got {norm_type!r}")
    if float(norm_type) == 2.0:
        return _NORM_L2
    if math.isinf(norm_type) and norm_type > 0:
        return _NORM_INF
    raise ValueError(f"norm_type must be None, 2.0 or inf, got {norm_type!r}")


def unscale_reduce_(
    tensors: Sequence[torch.Tensor],
    scale: torch.Tensor,
    found_inf: torch.Tensor,
    *,
    factor: torch.Tensor | None = None,
    write: bool = True,
    norm_type: float | None = None,
    per_tensor: bool = False,
    max_norm: float | None = None,
    coef_out: torch.Tensor | None = None,
):
    """Fused unscale (in place unless ``write=False``), non-finite check and norm over a tensor list.

    Same contract as ``reference.unscale_reduce_`` (DESIGN.md kernels 1 and 2).

    Args:
        tensors: list of tensors, any mix of float32/float16/bfloat16/float64, all on one device, each non-overlapping
            and dense. Overwritten with ``cast(g * inv_scale [* factor])`` when ``write`` (float32 math, float64 for
            float64 tensors, as the reference).
        scale: float32 [1] (any 1-element shape) on the device; ``inv_scale = fp32(1 / fp64(scale))`` in the kernel.
        found_inf: float32 [1] on the device; set to 1.0 when any input element is inf/NaN, never cleared.
        factor: optional float32 [1] on the device, multiplied after unscaling (e.g. a clip coefficient).
        write: whether to write the unscaled values back.
        norm_type: None, 2.0 or inf: the norm of the unscaled values to return.
        per_tensor: also return the norm of each tensor (needs ``norm_type``).
        max_norm: with ``coef_out``: write ``min(max_norm / (norm + 1e-6), 1)`` (float32) into ``coef_out``.
        coef_out: float32 [1] (0-d or 1-element) on the device, the clip coefficient output.

    Returns:
        ``(norm, per_tensor_norms)``: float32 0-d tensor and float32 [len(tensors)] (caller's order) on the device;
        ``(None, None)`` without ``norm_type``, ``per_tensor_norms`` is None unless ``per_tensor``.
    """
    if isinstance(tensors, torch.Tensor):
        raise TypeError("tensors must be a list or tuple of tensors, got a single torch.Tensor")
    tensors = list(tensors)
    if not isinstance(found_inf, torch.Tensor):
        raise TypeError(f"found_inf must be a torch.Tensor, got {type(found_inf).__name__}")
    device = tensors[0].device if tensors else found_inf.device
    _check_tensor_list(tensors, device)
    _check_scalar(scale, "scale", device, torch.float32)
    _check_scalar(found_inf, "found_inf", device, torch.float32)
    if factor is not None:
        _check_scalar(factor, "factor", device, torch.float32)
    mode = _norm_mode(norm_type)
    if per_tensor and mode == _NORM_NONE:
        raise ValueError("per_tensor=True needs norm_type (2.0 or inf)")
    if (max_norm is None) != (coef_out is None):
        raise ValueError("max_norm and coef_out must be given together")
    if max_norm is not None:
        if mode == _NORM_NONE:
            raise ValueError("max_norm needs norm_type (2.0 or inf)")
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
            raise TypeError(f"max_norm must be a real number, got {type(max_norm).__name__}")
        _check_scalar(coef_out, "coef_out", device, torch.float32)
    _check_backend(device, "tensors[0]" if tensors else "found_inf")

    n = len(tensors)
    if n == 0:  # nothing to launch: the norms of nothing are 0
        if mode == _NORM_NONE:
            return None, None
        norm = torch.zeros((), dtype=torch.float32, device=device)
        if max_norm is not None:
            coef_out.fill_(float(reference.clip_coef(torch.zeros(()), max_norm)))
        return norm, (torch.zeros(0, dtype=torch.float32, device=device) if per_tensor else None)

    table = get_table(tensors, device)
    if write and table.has_duplicates:
        raise ValueError(
            "tensors contains the same non-empty tensor twice: with write=True it would be unscaled twice "
            "(and raced on)"
        )

    n_chunks = table.num_chunks
    partials = torch.empty((max(n_chunks, 1), 2), dtype=torch.float32, device=device)
    norm = torch.empty((), dtype=torch.float32, device=device) if mode != _NORM_NONE else None
    per = torch.empty(n, dtype=torch.float32, device=device) if per_tensor else None

    with _device_guard(device):
        for (dtype, _, _, c_begin, c_end), aligned in zip(table.groups, table.group_aligned, strict=True):
            if c_end == c_begin:
                continue
            _unscale_reduce_kernel[(_num_programs(device, c_end - c_begin),)](
                table.addrs,
                table.numels,
                table.chunk_tensor,
                table.chunk_start,
                partials,
                scale,
                factor if factor is not None else scale,
                c_begin,
                c_end,
                DTYPE=_TL_DTYPES[dtype],
                IS_FP64=dtype == torch.float64,
                ALIGNED=aligned,
                WRITE=bool(write),
                NORM=mode,
                HAS_FACTOR=factor is not None,
                CHUNK_SIZE=CHUNK,
                HALF=BLOCK // 2,
                num_warps=NUM_WARPS,
            )
        if n_chunks or mode != _NORM_NONE:
            _finalize_kernel[(1,)](
                partials,
                n_chunks,
                found_inf,
                norm if norm is not None else found_inf,
                coef_out if coef_out is not None else found_inf,
                float(max_norm) if max_norm is not None else 0.0,
                NORM=mode,
                HAS_COEF=max_norm is not None,
                BLOCK=_FINALIZE_BLOCK,
                num_warps=4,
            )
        if per_tensor:
            _per_tensor_norm_kernel[(n,)](
                partials,
                table.first_chunk,
                table.out_index,
                per,
                NORM=mode,
                BLOCK=_PER_TENSOR_BLOCK,
                num_warps=4,
            )
    return norm, per


def update_scale_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    *,
    hysteresis: int = 1,
    hysteresis_tracker: torch.Tensor | None = None,
    min_scale: float = reference.FLOAT32_TINY,
    max_scale: float = math.inf,
    history: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
) -> None:
    """Loss-scale update in one single-program launch (DESIGN.md kernel 3; ``reference.update_scale_``).

    Args:
        scale: float32 [1], updated in place.
        growth_tracker: int32 [1], successful steps since the last growth/backoff (as torch's GradScaler).
        found_inf: float32 [1], non-zero when this step overflowed.
        growth_factor: multiplier on growth; the product with the scale is taken in float64 and rounded once.
        backoff_factor: multiplier on overflow, same rounding.
        growth_interval: successful steps (>= 1) between growths.
        hysteresis: overflowing steps (>= 1) tolerated since the last growth before backing off.
        hysteresis_tracker: int32 [1], needed when ``hysteresis > 1``; reset to ``hysteresis`` on growth.
        min_scale: lower bound of the scale after a backoff (compared in float32).
        max_scale: upper bound of the scale after a growth (compared in float32).
        history: float32 [N] ring buffer of the scale after each update (needs ``counters``).
        counters: int64 [2], (updates, skipped steps).
    """
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"scale must be a torch.Tensor, got {type(scale).__name__}")
    device = scale.device
    _check_scalar(scale, "scale", device, torch.float32)
    _check_scalar(growth_tracker, "growth_tracker", device, torch.int32)
    _check_scalar(found_inf, "found_inf", device, torch.float32)
    for name, val in (("growth_interval", growth_interval), ("hysteresis", hysteresis)):
        if isinstance(val, bool) or not isinstance(val, int):
            raise TypeError(f"{name} must be an int, got {type(val).__name__}")
        if not 1 <= val < 2**31:
            raise ValueError(f"{name} must be >= 1, got {val}")
    for name, val in (
        ("growth_factor", growth_factor),
        ("backoff_factor", backoff_factor),
        ("min_scale", min_scale),
        ("max_scale", max_scale),
    ):
        if isinstance(val, bool) or not isinstance(val, (int, float)):
            raise TypeError(f"{name} must be a real number, got {type(val).__name__}")
    if hysteresis_tracker is not None:
        _check_scalar(hysteresis_tracker, "hysteresis_tracker", device, torch.int32)
    elif hysteresis != 1:
        raise ValueError("hysteresis > 1 needs a hysteresis_tracker (int32 [1], initialised to hysteresis)")
    if counters is not None:
        _check_scalar(counters, "counters", device, torch.int64, numel=2)
    has_history = history is not None and history.numel() > 0
    if history is not None:
        if counters is None:
            raise ValueError("history needs counters (its write position is counters[0])")
        _check_scalar(history, "history", device, torch.float32, numel=history.numel())
    _check_backend(device, "scale")

    with _device_guard(device):
        _update_scale_kernel[(1,)](
            scale,
            growth_tracker,
            found_inf,
            hysteresis_tracker if hysteresis_tracker is not None else growth_tracker,
            counters if counters is not None else growth_tracker,
            history if has_history else scale,
            f64_bits(growth_factor),
            f64_bits(backoff_factor),
            int(growth_interval),
            int(hysteresis),
            float(min_scale),
            float(max_scale),
            max(history.numel(), 1) if has_history else 1,
            HAS_HYST=hysteresis_tracker is not None,
            HAS_COUNTERS=counters is not None,
            HAS_HISTORY=has_history,
            num_warps=1,
        )
