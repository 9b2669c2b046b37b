"""Launch code of the Triton Adam step with low-precision moments and stochastic rounding (FusedAdam's
``exp_avg_dtype`` / ``exp_avg_sq_dtype`` / ``stochastic_rounding``; math in ``reference.adam_step_blockwise``,
kernels in ``ampkernels.optim.triton.blockwise_kernels``): the ``BlockwiseStepTable`` of one bucket of parameters."""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ampkernels import dispatch
from ampkernels._constants import QUANT_BLOCK, QUANT_CODES, STATE_BF16, STATE_F32, STATE_Q4, STATE_Q8
from ampkernels._runtime import f64_bits, is_dense, num_sms, on_own_device, retain_if_capturing
from ampkernels.optim.hyperparameters import AdamHyperparameters
from ampkernels.optim.triton.blockwise_kernels import (
    META_ROWS,
    _blockwise_adam_kernel,
    _blockwise_prologue_kernel,
)
from ampkernels.optim.triton.optimizers import _host_tensor

# Blocks of QUANT_BLOCK elements per work item: 16384 elements, the CHUNK of the other optimizer kernels.
ITEM_BLOCKS = 128
# Launch configuration per kind of launch group (``_launch_config``): blocks per tile (a [tile_blocks, 128] tile),
# warps, pipeline stages of the tile loop (Triton's num_stages: the next tiles' loads go ahead through shared
# memory) and a register cap for groups of whole blocks (None: the compiler's choice; rows of partial blocks need
# more). Every group with a quantized moment keeps four elements per thread in one layout (blockwise_kernels.py
# says why); more elements per thread need more registers, and the latency hiding of more programs per SM counts
# for more than the instructions they save. NOTE (H200, 1.1B params, dev/optimizers/NOTES.md "Low-precision
# state"): 8-bit with float32 parameters 4.42 ms with 3 stages (1 stage 4.74, 8 blocks and 2 stages 4.47);
# 8-bit with bfloat16 parameters 4.82 with 1 stage (2 stages 4.92); 4-bit 4.10 with 40 registers (uncapped, 56:
# 4.46; 48: 4.83; 8 blocks: 4.51); bfloat16 moments + stochastic rounding 3.88 with 8 blocks.
LAUNCH_CONFIGS: dict[str, tuple[int, int, int, int | None]] = {
    "q8": (4, 4, 3, None),
    "q8, 16-bit params": (4, 4, 1, None),
    "q4": (4, 4, 1, 40),
    "unquantized": (8, 4, 1, None),
}
_PROLOGUE_BLOCK = 256
# Programs per launch on a GPU: one per work item by default (the hardware scheduler balances them). A persistent
# grid larger than what fits on the GPU at once ends in a second wave that runs whole programs' shares alone, and
# what fits depends on the variant (registers as compiled for sm_90 with LAUNCH_CONFIGS: 56 for 8-bit moments with
# float32 parameters, 40 for 4-bit (capped), 70 for 8-bit with bfloat16 stochastic rounding, 64 for bfloat16
# moments; 72-102 for rows of partial blocks). The kernel loops over its items whatever the grid: set this to a
# measured occupancy to make it persistent.
PROGRAMS_PER_SM: int | None = None
# Every float operation rounded on its own, as the reference (Triton would fuse v * beta2 + omb2 * g * g and the
# lerp into FMAs, which moves a moment by an ulp and, now and then, a code across a rounding boundary).
_FP_FUSION = False

_QUANTIZED = (STATE_Q8, STATE_Q4)
_FORMATS = (STATE_F32, STATE_BF16, STATE_Q8, STATE_Q4)
_LIST_NAMES = ("exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale", "max_exp_avg_sq", "master_param", "step")
_TL_DTYPES = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.uint8: tl.uint8,
}
_MOMENT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MASK32 = 0xFFFFFFFF


def _programs(device: torch.device, num_items: int) -> int:
    if device.type != "cuda":
        return max(1, min(num_items, 4))  # the interpreter runs programs one after another
    if PROGRAMS_PER_SM is None:
        return num_items
    return max(1, min(num_items, num_sms(device) * PROGRAMS_PER_SM))


def _launch_config(fmt_m: int, fmt_v: int, p_dtype: torch.dtype) -> tuple[int, int, int, int | None]:
    """The ``LAUNCH_CONFIGS`` entry of a launch group."""
    if STATE_Q4 in (fmt_m, fmt_v):
        return LAUNCH_CONFIGS["q4"]
    if STATE_Q8 in (fmt_m, fmt_v):
        return LAUNCH_CONFIGS["q8" if p_dtype == torch.float32 else "q8, 16-bit params"]
    return LAUNCH_CONFIGS["unquantized"]


def _int32(value: int) -> int:
    """The uint32 ``value`` as the int32 of the same bits (a kernel argument of one type whatever its value)."""
    value &= _MASK32
    return value - (1 << 32) if value >= 1 << 31 else value


class BlockwiseStepTable:
    """Launch metadata of one bucket: parameters and state fixed (rebuilt when their storage moves), gradient
    addresses re-uploaded when the gradients move. No host synchronization; every launch can be captured.

    Args:
        params: parameters of one device and dtype (float32/float16/bfloat16); contiguous where a moment is quantized,
            else non-overlapping and dense.
        lists: seven lists, one tensor per parameter or empty when absent: exp_avg, exp_avg_scale, exp_avg_sq,
            exp_avg_sq_scale, max_exp_avg_sq (amsgrad), master_param (float32), step (float32, one element). A
            quantized moment is uint8 codes in ``reference.quant_layout`` with uint8 block exponents in its scale
            entry; any other moment is float32/bfloat16/float16 shaped and strided like its parameter, with an empty
            scale entry.
        layout: per parameter ``(fmt_m, fmt_v, cols, salt, offset)``: moment formats (``_constants.STATE_*``), the
            row length of the quantized moments (the last dimension; ignored when neither is quantized: the tensor
            is one row), the rounding stream's salt and the global flat offset of this shard.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        lists: Sequence[Sequence[torch.Tensor]],
        layout: Sequence[tuple[int, int, int, int, int]],
    ) -> None:
        if len(lists) != len(_LIST_NAMES):
            raise ValueError(f"lists must hold {len(_LIST_NAMES)} lists ({', '.join(_LIST_NAMES)}), got {len(lists)}")
        self.params = list(params)
        if not self.params:
            raise ValueError("params is empty")
        self.lists = [list(x) for x in lists]
        self.layout = [tuple(entry) for entry in layout]
        self.device = self.params[0].device
        self._build()

    def _layout(self) -> tuple:
        """What the device metadata depends on (``p.data = new`` moves storage under the same tensor objects)."""
        return (
            tuple((p.data_ptr(), p.numel(), p.stride()) for p in self.params),
            tuple(x.data_ptr() for tensors in self.lists for x in tensors),
        )

    def _check(self) -> list[tuple]:
        """Validates the tensors against ``layout``; per parameter (cols, blocks per row, blocks, group key)."""
        n = len(self.params)
        if len(self.layout) != n:
            raise ValueError(f"layout has {len(self.layout)} entries for {n} params")
        for name, tensors in zip(_LIST_NAMES, self.lists, strict=True):
            optional = name in ("max_exp_avg_sq", "master_param")
            if len(tensors) != n and not (optional and not tensors):
                raise ValueError(f"lists[{_LIST_NAMES.index(name)}] ({name}) has {len(tensors)} tensors for {n} params")
        dtype = self.params[0].dtype
        if dtype not in _MOMENT_DTYPES:
            raise ValueError(f"params[0] is {dtype}; the step takes float32, float16 or bfloat16 parameters")
        exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale, vmax, master, step = self.lists
        shapes = []
        for i, p in enumerate(self.params):
            if p.dtype != dtype or p.device != self.device:
                raise ValueError(f"params[{i}] is {p.dtype} on {p.device}, params[0] {dtype} on {self.device}")
            fmt_m, fmt_v, cols, _salt, offset = self.layout[i]
            if fmt_m not in _FORMATS or fmt_v not in _FORMATS:
                raise ValueError(f"layout[{i}] has moment formats {(fmt_m, fmt_v)}; expected _constants.STATE_*")
            if offset < 0:
                raise ValueError(f"layout[{i}] has offset {offset}; expected >= 0")
            numel = p.numel()
            quantized = fmt_m in _QUANTIZED or fmt_v in _QUANTIZED
            if quantized:
                if not p.is_contiguous() or p.dim() < 1 or cols != p.shape[-1]:
                    raise ValueError(
                        f"params[{i}] has a quantized moment: it must be contiguous with cols = its last dimension "
                        f"({tuple(p.shape)}, cols {cols})"
                    )
            else:
                cols = numel  # one row: any non-overlapping dense layout is walked in memory order
                if not is_dense(p):
                    raise ValueError(f"params[{i}] is not non-overlapping and dense; the kernel walks its memory")
            nblk = -(-cols // QUANT_BLOCK)
            blocks = (numel // cols if cols else 0) * nblk
            if blocks >= 2**31 or (quantized and cols >= 2**31 - QUANT_BLOCK):
                raise ValueError(
                    f"params[{i}] has {numel} elements in rows of {cols}: the kernel indexes blocks and "
                    "columns in int32"
                )
            moments = (
                (fmt_m, exp_avg[i], exp_avg_scale[i], "exp_avg"),
                (fmt_v, exp_avg_sq[i], exp_avg_sq_scale[i], "exp_avg_sq"),
            )
            for fmt, x, s, name in moments:
                if fmt in _QUANTIZED:
                    code_cols = (cols + 1) // 2 if fmt == STATE_Q4 else cols
                    expect = (numel // cols if cols else 0) * code_cols
                    if x.dtype != torch.uint8 or not x.is_contiguous() or x.numel() != expect or x.device != p.device:
                        raise ValueError(
                            f"{name}[{i}] must be {expect} contiguous uint8 codes on {p.device}, "
                            f"got {x.dtype} {tuple(x.shape)} on {x.device}"
                        )
                    if s.dtype != torch.uint8 or not s.is_contiguous() or s.numel() != blocks or s.device != p.device:
                        raise ValueError(
                            f"{name}_scale[{i}] must be {blocks} contiguous uint8 on {p.device}, "
                            f"got {s.dtype} {tuple(s.shape)} on {s.device}"
                        )
                else:
                    self._check_like(p, x, f"{name}[{i}]", _MOMENT_DTYPES, quantized)
            if vmax:
                self._check_like(p, vmax[i], f"max_exp_avg_sq[{i}]", _MOMENT_DTYPES, quantized)
            if master:
                self._check_like(p, master[i], f"master_param[{i}]", (torch.float32,), quantized)
            if step[i].dtype != torch.float32 or step[i].numel() != 1 or step[i].device != self.device:
                raise ValueError(f"step[{i}] must be a one-element float32 tensor on {self.device}")
            addrs = [p, exp_avg[i], exp_avg_sq[i]] + ([vmax[i]] if vmax else []) + ([master[i]] if master else [])
            full = cols % QUANT_BLOCK == 0 and all(x.data_ptr() % 16 == 0 for x in addrs)
            key = (
                fmt_m,
                fmt_v,
                exp_avg[i].dtype,
                exp_avg_sq[i].dtype,
                vmax[i].dtype if vmax else torch.float32,
                full,
            )
            shapes.append((cols, nblk, blocks, key))
        return shapes

    @staticmethod
    def _check_like(p, x, name, dtypes, contiguous) -> None:
        if x.dtype not in dtypes or x.device != p.device or x.shape != p.shape or x.stride() != p.stride():
            raise ValueError(
                f"{name} must be {'/'.join(str(d) for d in dtypes)} shaped and strided like its parameter "
                f"({tuple(p.shape)}, {p.stride()}), got {x.dtype} {tuple(x.shape)} {x.stride()}"
            )
        if contiguous and not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous (a moment of this parameter is quantized)")

    def _build(self) -> None:
        shapes = self._check()
        n = len(self.params)
        meta = [[0] * n for _ in range(META_ROWS)]
        for t, p in enumerate(self.params):
            cols, nblk, blocks, _ = shapes[t]
            _, _, _, salt, offset = self.layout[t]
            meta[0][t] = p.data_ptr()
            for row, tensors in enumerate(self.lists, start=1):
                if tensors:
                    meta[row][t] = tensors[t].data_ptr()
            meta[8][t], meta[9][t], meta[10][t] = cols, nblk, blocks
            meta[11][t], meta[12][t] = offset, _int32(salt)
        # Work items (tensor, first block), grouped by format: one launch per group, its formats constexpr.
        groups: dict[tuple, list[int]] = {}
        for t, (_, _, blocks, key) in enumerate(shapes):
            if blocks:
                groups.setdefault(key, []).append(t)
        items, self.groups = [], []
        for key, tensors in groups.items():
            start = len(items) // 2
            for t in tensors:
                for b0 in range(0, shapes[t][2], ITEM_BLOCKS):
                    items += (t, b0)
            self.groups.append((key, start, len(items) // 2 - start))
        self.num_items = len(items) // 2
        # Host sources of the uploads stay alive with this object (and with the process when captured): a copy
        # captured in a CUDA graph reads them again at every replay.
        self._meta_host = _host_tensor([v for row in meta for v in row] + items, self.device)
        dev = self._meta_host.to(self.device, non_blocking=True)
        self.meta = dev[: META_ROWS * n]
        items_dev = dev[META_ROWS * n :].view(-1, 2)
        self.groups = [(key, items_dev[start:], count) for key, start, count in self.groups]
        self.scalars = torch.zeros(n, 2, dtype=torch.float32, device=self.device)
        self.keys = torch.zeros(n, dtype=torch.int32, device=self.device)
        retain_if_capturing(self._meta_host, dev, self.scalars, self.keys)
        self.v_quantized = any(fmt_v in _QUANTIZED for _, fmt_v, *_ in self.layout)
        self.walks_memory = any(not p.is_contiguous() for p in self.params)
        self._grad_ptrs: tuple[int, ...] | None = None
        self.grads_dev: torch.Tensor | None = None
        self._built_for = self._layout()

    def _prepare(self, grads: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], torch.dtype]:
        if self._layout() != self._built_for:
            self._build()
        grads = list(grads)
        if len(grads) != len(self.params):
            raise ValueError(f"grads has {len(grads)} tensors for {len(self.params)} params")
        for i, (p, g) in enumerate(zip(self.params, grads, strict=True)):
            if g.shape != p.shape or g.device != p.device:
                raise ValueError(f"grads[{i}] is {tuple(g.shape)} on {g.device}, its parameter {tuple(p.shape)}")
        # One gradient dtype per launch: mixed ones are read as float32 (exact for float16/bfloat16). Gradients laid
        # out unlike their parameter (now) are read through a copy in the parameter's layout.
        g_dtype = grads[0].dtype if all(g.dtype == grads[0].dtype for g in grads) else torch.float32
        if g_dtype not in _MOMENT_DTYPES:
            raise ValueError(f"grads are {g_dtype}; the step reads float32, float16 or bfloat16 gradients")
        grads = [
            g
            if g.stride() == p.stride() and g.dtype == g_dtype
            else torch.empty_strided(p.shape, p.stride(), dtype=g_dtype, device=p.device).copy_(g)
            for p, g in zip(self.params, grads, strict=True)
        ]
        ptrs = tuple(g.data_ptr() for g in grads)
        if ptrs != self._grad_ptrs:
            self._grads_host = _host_tensor(list(ptrs), self.device)
            self.grads_dev = self._grads_host.to(self.device, non_blocking=True)
            retain_if_capturing(self._grads_host, self.grads_dev)  # a graph may replay them after the next upload
            self._grad_ptrs = ptrs
            self._grads_aligned = all(g.data_ptr() % 16 == 0 for g in grads if g.numel())
        return grads, g_dtype

    # (Over 80 lines: two launches, whose argument lists, one argument a line, are most of it.)
    @on_own_device
    def step_adam(self, grads, lr, grad_scale, found_inf, hyper: AdamHyperparameters) -> None:
        """One Adam/AdamW step of every parameter (``reference.adam_step_blockwise``), in place.

        ``lr``: a float or a 0-d float32 device tensor (read in the kernels). ``grad_scale``, ``found_inf``: None or
        one-element float32 device tensors (non-zero ``found_inf``: nothing is written). ``hyper.stochastic_rounding``
        applies to bfloat16 parameters; ``hyper.seed``: int, up to 64 bits. Salts and offsets come from ``layout``.
        """
        grads, g_dtype = self._prepare(grads)
        p_dtype = self.params[0].dtype
        beta1, beta2, weight_decay, seed = hyper.beta1, hyper.beta2, hyper.weight_decay, hyper.seed
        sr = bool(hyper.stochastic_rounding) and p_dtype == torch.bfloat16
        if hyper.amsgrad and (not self.lists[4] or self.v_quantized):
            raise ValueError("amsgrad needs max_exp_avg_sq and float32/bfloat16 second moments (exp_avg_sq)")
        if sr and self.walks_memory:
            # The rounding stream is indexed by the logical flat index; the kernel walks memory order.
            raise ValueError("stochastic_rounding needs contiguous parameters (a parameter here is not)")
        self._keep = grads  # staged copies must live until the kernels have read them
        n = len(self.params)
        lr_is_tensor = isinstance(lr, torch.Tensor)
        dummy = self.scalars
        scale_arg = grad_scale if grad_scale is not None else dummy
        found_arg = found_inf if found_inf is not None else dummy
        lr_ptr = lr if lr_is_tensor else dummy
        lr_bits = 0 if lr_is_tensor else f64_bits(lr)
        _blockwise_prologue_kernel[(triton.cdiv(n, _PROLOGUE_BLOCK),)](
            self.meta,
            n,
            self.scalars,
            self.keys,
            found_arg,
            lr_ptr,
            lr_bits,
            f64_bits(math.log2(beta1) if beta1 > 0 else -math.inf),
            f64_bits(math.log2(beta2) if beta2 > 0 else -math.inf),
            _int32(seed),
            _int32(seed >> 32),
            HAS_FOUND=found_inf is not None,
            LR_FROM_PTR=lr_is_tensor,
            SR=sr,
            BLOCK_T=_PROLOGUE_BLOCK,
        )
        interpreting = dispatch.triton_interpreting()
        w = struct.unpack("f", struct.pack("f", 1 - beta1))[0]  # the weight as the kernel holds it (reference)
        for (fmt_m, fmt_v, m_dtype, v_dtype, x_dtype, full), items, count in self.groups:
            tile_blocks, warps, stages, maxnreg = _launch_config(fmt_m, fmt_v, p_dtype)
            m_eb, m_mb = QUANT_CODES.get((fmt_m, False), (0, 0))
            v_eb, v_mb = QUANT_CODES.get((fmt_v, True), (0, 0))
            _blockwise_adam_kernel[(_programs(self.device, count),)](
                self.meta,
                self.grads_dev,
                items,
                n,
                count,
                self.scalars,
                self.keys,
                scale_arg,
                found_arg,
                lr_ptr,
                lr_bits,
                float(weight_decay),
                f64_bits(weight_decay),
                float(beta2),
                float(1 - beta1),
                float(1 - beta2),
                float(hyper.eps),
                P_DTYPE=_TL_DTYPES[p_dtype],
                G_DTYPE=_TL_DTYPES[g_dtype],
                M_DTYPE=_TL_DTYPES[m_dtype],
                V_DTYPE=_TL_DTYPES[v_dtype],
                X_DTYPE=_TL_DTYPES[x_dtype],
                FMT_M=fmt_m,
                FMT_V=fmt_v,
                M_EB=m_eb,
                M_MB=m_mb,
                V_EB=v_eb,
                V_MB=v_mb,
                HAS_MASTER=bool(self.lists[5]),
                AMSGRAD=bool(hyper.amsgrad),
                MAXIMIZE=bool(hyper.maximize),
                HAS_WD=weight_decay != 0,
                DECOUPLED=bool(hyper.decoupled_weight_decay),
                WEIGHT_SMALL=w < 0.5,
                HAS_SCALE=grad_scale is not None,
                HAS_FOUND=found_inf is not None,
                LR_FROM_PTR=lr_is_tensor,
                SR=sr,
                FULL=full,
                G_ALIGNED=full and self._grads_aligned,
                INTERPRET=interpreting,
                NB=tile_blocks,
                ITEM_BLOCKS=ITEM_BLOCKS,
                STAGES=stages,
                num_warps=warps,
                enable_fp_fusion=_FP_FUSION,
                **({"maxnreg": maxnreg} if maxnreg and full else {}),
            )
