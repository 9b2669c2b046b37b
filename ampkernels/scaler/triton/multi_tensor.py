"""Launch code of the Triton multi-tensor AMP ops (kernels: ``ampkernels.scaler.triton.multi_tensor_kernels``).

:func:`unscale_reduce_` and :func:`update_scale_` take arguments already checked by the public wrappers in
:mod:`ampkernels.ops` (one dtype per tensor among float32/float16/bfloat16/float64, non-overlapping and dense, all on
one device; 1-element float32 scalars): they build (and cache) the tensors' device metadata and launch.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from itertools import groupby

import torch
import triton.language as tl

from ampkernels import dispatch
from ampkernels._constants import TRITON_UNSCALE_CHUNK as CHUNK
from ampkernels._constants import NormKind, norm_kind
from ampkernels._runtime import device_guard, f64_bits, retain_if_capturing
from ampkernels.scaler import reference
from ampkernels.scaler.triton.multi_tensor_kernels import (
    _finalize_kernel,
    _per_tensor_norm_kernel,
    _unscale_reduce_kernel,
    _update_scale_kernel,
)

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


def _intersecting(signature) -> tuple[int, int] | None:
    """Two tensors (the smaller index first) of ``signature`` (``(data_ptr, numel, dtype)`` of non-overlapping and
    dense tensors) whose memory shares a byte, or None: the same tensor twice or overlapping views (the native op's
    ``find_intersecting``)."""
    spans = sorted((p, p + k * d.itemsize, i) for i, (p, k, d) in enumerate(signature) if k > 0)  # bytes [p, end)
    reach, owner = 0, -1
    for begin, end, i in spans:
        if owner >= 0 and begin < reach:
            return min(owner, i), max(owner, i)
        if end > reach:
            reach, owner = end, i
    return None


class TensorTable:
    """Device metadata of a tensor list (dev/design.md), built once with vectorised torch ops.

    Args:
        tensors: the tensors (float32/float16/bfloat16/float64, non-overlapping and dense, on ``device``).
        device: their device (default: that of ``tensors[0]``).

    Attributes (int64 views of one device buffer; T tensors, C chunks, in group-sorted order):
        addrs [T], numels [T], chunk_tensor [C], chunk_start [C], first_chunk [T+1], out_index [T].
        groups: ``[(dtype, t_begin, t_end, c_begin, c_end)]`` on the host; ``group_aligned[i]`` says whether every
        tensor of group i starts on a 16-byte boundary (tensors are grouped by dtype, then by that alignment).
        signature: ``((data_ptr, numel, dtype), ...)`` in the caller's order, the cache key.
        overlap: two tensors (indices in the caller's order) whose memory intersects, or None.
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
        self.overlap = _intersecting(self.signature)

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
    dev/scaler/NOTES.md, % of copy, two runs): read-only + norm 96.3-96.5 with a persistent grid of 8 programs
    per SM, 99.0-99.8 with one per chunk; in place 88.8-89.2 and 89.8-90.4."""
    if device.type != "cuda":
        return min(chunks, _INTERPRETER_PROGRAMS)
    return chunks


# (Over 80 lines: its docstring and three launches, whose argument lists, one argument a line, are most of it.)
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

    Same contract as ``reference.unscale_reduce_`` (dev/design.md, kernels 1 and 2), on arguments checked by
    :func:`ampkernels.ops.unscale_reduce_` (this function checks nothing but the shared memory its table finds).

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
    tensors = list(tensors)
    device = tensors[0].device if tensors else found_inf.device
    mode = norm_kind(norm_type)
    per_tensor = per_tensor and mode is not NormKind.NONE

    n = len(tensors)
    if n == 0:  # nothing to launch: the norms of nothing are 0
        if mode is NormKind.NONE:
            return None, None
        norm = torch.zeros((), dtype=torch.float32, device=device)
        if max_norm is not None:
            coef_out.fill_(float(reference.clip_coef(torch.zeros(()), max_norm)))
        return norm, (torch.zeros(0, dtype=torch.float32, device=device) if per_tensor else None)

    table = get_table(tensors, device)
    if write and table.overlap is not None:
        first, second = table.overlap
        raise ValueError(
            f"ampkernels: argument 'tensors': elements {first} and {second} share memory (the same tensor twice, or "
            "overlapping views) and would be unscaled twice (and raced on); pass each tensor once, or write=False"
        )

    n_chunks = table.num_chunks
    partials = torch.empty((max(n_chunks, 1), 2), dtype=torch.float64, device=device)
    norm = torch.empty((), dtype=torch.float32, device=device) if mode is not NormKind.NONE else None
    per = torch.empty(n, dtype=torch.float32, device=device) if per_tensor else None

    with device_guard(device):
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
                NORM=int(mode),
                HAS_FACTOR=factor is not None,
                CHUNK_SIZE=CHUNK,
                HALF=BLOCK // 2,
                INTERPRET=dispatch.triton_interpreting(),
                num_warps=NUM_WARPS,
            )
        if n_chunks or mode is not NormKind.NONE:
            _finalize_kernel[(1,)](
                partials,
                n_chunks,
                found_inf,
                norm if norm is not None else found_inf,
                coef_out if coef_out is not None else found_inf,
                float(max_norm) if max_norm is not None else 0.0,
                NORM=int(mode),
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
                NORM=int(mode),
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
    """Loss-scale update in one single-program launch (dev/design.md kernel 3; ``reference.update_scale_``), on
    arguments checked by :func:`ampkernels.ops.update_scale_`.

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
    device = scale.device
    has_history = history is not None and history.numel() > 0
    with device_guard(device):
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
