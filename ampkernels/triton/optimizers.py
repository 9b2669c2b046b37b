"""Triton backend of the fused optimizer steps (``ampkernels.optimizers``; math in ``reference.adam_step`` /
``reference.sgd_step`` and ``csrc/optimizer.h``).

Kernels first, the table class after them:

* ``_prologue_kernel``: one lane per tensor; advances the float32 step counts and writes the per-tensor constants
  (Adam: step size and sqrt of the second bias correction, in float64; SGD: whether this is the first step).
* ``_adam_kernel`` / ``_sgd_kernel``: persistent grid over the chunks of every parameter of the launch.

Both return at once when ``found_inf`` is non-zero. Float64 scalars travel as int64 bit patterns (Triton passes
Python floats as float32).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ampkernels.triton import f64_bits, num_sms, retain_if_capturing

CHUNK = 16384
_CHUNK = tl.constexpr(CHUNK)
BLOCK = 1024
NUM_WARPS = 4
_PROGRAMS_PER_SM = 4
_PROLOGUE_BLOCK = 256


def _host_tensor(values, device: torch.device) -> torch.Tensor:
    """int64 host tensor of ``values``, pinned when it feeds a CUDA device (an asynchronous, capturable copy)."""
    host = torch.tensor(values, dtype=torch.int64)
    return host.pin_memory() if device.type == "cuda" else host


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}

# Rows of the address array (same order as csrc/optimizer.h OptimizerList); tl.constexpr because Triton 3.6
# kernels may read only constexpr globals.
_GRAD, _EXP_AVG, _EXP_AVG_SQ, _MAX_EXP_AVG_SQ, _MASTER, _STEP = (tl.constexpr(row) for row in range(6))


@triton.jit
def _f64(bits):
    return bits.to(tl.int64).to(tl.float64, bitcast=True)


@triton.jit
def _skipped(found_inf, HAS_FOUND: tl.constexpr):
    if HAS_FOUND:
        return tl.load(found_inf) != 0.0
    return False


@triton.jit(do_not_specialize=["num_tensors", "lr_bits", "log2_beta1_bits", "log2_beta2_bits"])
def _prologue_kernel(
    lists,
    num_tensors,
    scalars,
    found_inf,
    lr_ptr,
    lr_bits,
    log2_beta1_bits,
    log2_beta2_bits,
    IS_ADAM: tl.constexpr,
    HAS_FOUND: tl.constexpr,
    LR_FROM_PTR: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    if _skipped(found_inf, HAS_FOUND):
        return
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask = t < num_tensors
    step_ptr = tl.load(lists + _STEP * num_tensors + t, mask=mask, other=0).to(tl.pointer_type(tl.float32))
    mask = mask & (tl.load(lists + _STEP * num_tensors + t, mask=mask, other=0) != 0)
    step = tl.load(step_ptr, mask=mask, other=0.0)
    if IS_ADAM:
        step = step + 1.0
        tl.store(step_ptr, step, mask=mask)
        if LR_FROM_PTR:
            lr = tl.load(lr_ptr).to(tl.float64)
        else:
            lr = _f64(lr_bits)
        s = step.to(tl.float64)
        # beta^step as exp2(step * log2(beta)) in float64: within a few float64 ulps of pow, far below float32.
        bc1 = 1.0 - tl.exp2(s * _f64(log2_beta1_bits))
        bc2 = 1.0 - tl.exp2(s * _f64(log2_beta2_bits))
        tl.store(scalars + 2 * t, (lr / bc1).to(tl.float32), mask=mask)
        tl.store(scalars + 2 * t + 1, tl.sqrt(bc2).to(tl.float32), mask=mask)
    else:
        tl.store(scalars + 2 * t, tl.where(step == 0.0, 1.0, 0.0), mask=mask)
        tl.store(step_ptr, step + 1.0, mask=mask)


@triton.jit
def _chunk(addrs, numels, chunk_tensor, chunk_start, c):
    t = tl.load(chunk_tensor + c)
    start = tl.multiple_of(tl.load(chunk_start + c), 16)
    size = tl.minimum(tl.load(numels + t) - start, _CHUNK)
    return t, start, size


@triton.jit
def _ptr(lists, row, num_tensors, t, start, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    p = tl.load(lists + row * num_tensors + t).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        p = tl.multiple_of(p, 16)
    return p + start


@triton.jit
def _lerp(start, end, weight, WEIGHT_SMALL: tl.constexpr):
    # torch.lerp's two formulas (weight < 0.5 or not).
    if WEIGHT_SMALL:
        return start + weight * (end - start)
    return end - (end - start) * (1.0 - weight)


@triton.jit(do_not_specialize=["num_tensors", "num_chunks", "lr_bits", "wd", "wd_bits", "beta2", "omb1", "omb2", "eps"])
def _adam_kernel(
    addrs,
    numels,
    chunk_tensor,
    chunk_start,
    lists,
    num_tensors,
    num_chunks,
    scalars,
    grad_scale,
    found_inf,
    lr_ptr,
    lr_bits,
    wd,
    wd_bits,
    beta2,
    omb1,
    omb2,
    eps,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    S_DTYPE: tl.constexpr,
    HAS_MASTER: tl.constexpr,
    AMSGRAD: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    HAS_WD: tl.constexpr,
    DECOUPLED: tl.constexpr,
    WEIGHT_SMALL: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_FOUND: tl.constexpr,
    LR_FROM_PTR: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    if _skipped(found_inf, HAS_FOUND):
        return
    inv = 1.0
    if HAS_SCALE:
        inv = (1.0 / tl.load(grad_scale).to(tl.float64)).to(tl.float32)  # as GradScaler.unscale_ rounds it
    if LR_FROM_PTR:
        lr = tl.load(lr_ptr).to(tl.float64)
    else:
        lr = _f64(lr_bits)
    decay = (1.0 - lr * _f64(wd_bits)).to(tl.float32)  # float64, as the native kernels
    lanes = tl.arange(0, BLOCK_E)
    for c in range(tl.program_id(0), num_chunks, tl.num_programs(0)):
        t, start, size = _chunk(addrs, numels, chunk_tensor, chunk_start, c)
        p_ptr = tl.load(addrs + t).to(tl.pointer_type(P_DTYPE))
        if ALIGNED:
            p_ptr = tl.multiple_of(p_ptr, 16)
        p_ptr += start
        g_ptr = _ptr(lists, _GRAD, num_tensors, t, start, G_DTYPE, ALIGNED)
        m_ptr = _ptr(lists, _EXP_AVG, num_tensors, t, start, S_DTYPE, ALIGNED)
        v_ptr = _ptr(lists, _EXP_AVG_SQ, num_tensors, t, start, S_DTYPE, ALIGNED)
        step_size = tl.load(scalars + 2 * t)
        bc2_sqrt = tl.load(scalars + 2 * t + 1)
        for off in range(0, size, BLOCK_E):
            idx = off + lanes
            mask = idx < size
            g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32) * inv
            if MAXIMIZE:
                g = -g
            if HAS_MASTER:
                w_ptr = _ptr(lists, _MASTER, num_tensors, t, start, tl.float32, ALIGNED)
                p = tl.load(w_ptr + idx, mask=mask, other=0.0)
            else:
                p = tl.load(p_ptr + idx, mask=mask, other=0.0).to(tl.float32)
            if HAS_WD:
                if DECOUPLED:
                    p = p * decay
                else:
                    g = g + wd * p
            m = _lerp(tl.load(m_ptr + idx, mask=mask, other=0.0).to(tl.float32), g, omb1, WEIGHT_SMALL)
            v = tl.load(v_ptr + idx, mask=mask, other=0.0).to(tl.float32) * beta2 + omb2 * g * g
            second = v
            if AMSGRAD:
                x_ptr = _ptr(lists, _MAX_EXP_AVG_SQ, num_tensors, t, start, S_DTYPE, ALIGNED)
                vmax = tl.maximum(
                    tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32), v, propagate_nan=tl.PropagateNan.ALL
                )
                tl.store(x_ptr + idx, vmax.to(S_DTYPE), mask=mask)
                second = vmax
            denom = tl.div_rn(tl.sqrt_rn(second), bc2_sqrt) + eps
            p = p - step_size * tl.div_rn(m, denom)
            tl.store(m_ptr + idx, m.to(S_DTYPE), mask=mask)
            tl.store(v_ptr + idx, v.to(S_DTYPE), mask=mask)
            if HAS_MASTER:
                tl.store(w_ptr + idx, p, mask=mask)
            tl.store(p_ptr + idx, p.to(P_DTYPE), mask=mask)


@triton.jit(do_not_specialize=["num_tensors", "num_chunks", "lr_bits", "wd", "momentum", "omd"])
def _sgd_kernel(
    addrs,
    numels,
    chunk_tensor,
    chunk_start,
    lists,
    num_tensors,
    num_chunks,
    scalars,
    grad_scale,
    found_inf,
    lr_ptr,
    lr_bits,
    wd,
    momentum,
    omd,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    S_DTYPE: tl.constexpr,
    HAS_MASTER: tl.constexpr,
    HAS_MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    HAS_WD: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_FOUND: tl.constexpr,
    LR_FROM_PTR: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    if _skipped(found_inf, HAS_FOUND):
        return
    inv = 1.0
    if HAS_SCALE:
        inv = (1.0 / tl.load(grad_scale).to(tl.float64)).to(tl.float32)
    if LR_FROM_PTR:
        lr = tl.load(lr_ptr)
    else:
        lr = _f64(lr_bits).to(tl.float32)
    lanes = tl.arange(0, BLOCK_E)
    for c in range(tl.program_id(0), num_chunks, tl.num_programs(0)):
        t, start, size = _chunk(addrs, numels, chunk_tensor, chunk_start, c)
        p_ptr = tl.load(addrs + t).to(tl.pointer_type(P_DTYPE))
        if ALIGNED:
            p_ptr = tl.multiple_of(p_ptr, 16)
        p_ptr += start
        g_ptr = _ptr(lists, _GRAD, num_tensors, t, start, G_DTYPE, ALIGNED)
        first = False
        if HAS_MOMENTUM:
            first = tl.load(scalars + 2 * t) != 0.0
        for off in range(0, size, BLOCK_E):
            idx = off + lanes
            mask = idx < size
            g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32) * inv
            if MAXIMIZE:
                g = -g
            if HAS_MASTER:
                w_ptr = _ptr(lists, _MASTER, num_tensors, t, start, tl.float32, ALIGNED)
                p = tl.load(w_ptr + idx, mask=mask, other=0.0)
            else:
                p = tl.load(p_ptr + idx, mask=mask, other=0.0).to(tl.float32)
            if HAS_WD:
                g = g + wd * p
            if HAS_MOMENTUM:
                b_ptr = _ptr(lists, _EXP_AVG, num_tensors, t, start, S_DTYPE, ALIGNED)
                buf = tl.load(b_ptr + idx, mask=mask, other=0.0).to(tl.float32)
                buf = tl.where(first, g, buf * momentum + omd * g)
                tl.store(b_ptr + idx, buf.to(S_DTYPE), mask=mask)
                if NESTEROV:
                    g = g + momentum * buf
                else:
                    g = buf
            p = p - lr * g
            if HAS_MASTER:
                tl.store(w_ptr + idx, p, mask=mask)
            tl.store(p_ptr + idx, p.to(P_DTYPE), mask=mask)


# --------------------------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------------------------


def _programs(device: torch.device, num_chunks: int) -> int:
    if device.type != "cuda":
        return max(1, min(num_chunks, 8))  # the interpreter runs programs one after another
    return max(1, min(num_chunks, num_sms(device) * _PROGRAMS_PER_SM))


class StepTable:
    """Launch metadata of one bucket (same layout as the native table): parameters and state fixed, gradient
    addresses re-uploaded when the gradients move.

    Args:
        kind: "adam" or "sgd".
        params: parameters of one device and dtype, non-overlapping and dense.
        lists: the state lists in ``ampkernels.optimizers`` order (exp_avg/momentum_buffer, exp_avg_sq,
            max_exp_avg_sq, master_param, step), each one tensor per parameter or empty.
    """

    def __init__(self, kind: str, params: Sequence[torch.Tensor], lists: Sequence[Sequence[torch.Tensor]]) -> None:
        self.kind = kind
        self.params = list(params)
        self.lists = [list(x) for x in lists]
        self.device = self.params[0].device
        for i, p in enumerate(self.params):
            if not (p.is_contiguous() or p.is_non_overlapping_and_dense()):
                raise ValueError(f"params[{i}] is not non-overlapping and dense; the fused kernels walk its memory")
        n = len(self.params)
        numels = [p.numel() for p in self.params]
        chunk_tensor, chunk_start = [], []
        for t, numel in enumerate(numels):
            for start in range(0, numel, CHUNK):
                chunk_tensor.append(t)
                chunk_start.append(start)
        self.num_chunks = len(chunk_tensor)
        self._host_lists = [[0] * n for _ in range(6)]
        for row, tensors in enumerate(self.lists, start=1):
            for t, x in enumerate(tensors):
                self._host_lists[row][t] = x.data_ptr()
        meta = [p.data_ptr() for p in self.params] + numels + chunk_tensor + chunk_start
        # Host sources of the uploads stay alive with this object (and with the process when captured): a copy
        # captured in a CUDA graph reads them again at every replay.
        self._meta_host = _host_tensor(meta, self.device)
        self.meta = self._meta_host.to(self.device, non_blocking=True)
        self.addrs = self.meta[:n]
        self.numels = self.meta[n : 2 * n]
        self.chunk_tensor = self.meta[2 * n : 2 * n + self.num_chunks]
        self.chunk_start = self.meta[2 * n + self.num_chunks :]
        self.scalars = torch.zeros(max(n, 1), 2, dtype=torch.float32, device=self.device)
        retain_if_capturing(self._meta_host, self.meta, self.scalars)
        self._grad_ptrs: tuple[int, ...] | None = None
        self.lists_dev: torch.Tensor | None = None
        everything = [*self.params, *(x for tensors in self.lists for x in tensors if x.dim() > 0)]
        self.aligned = all(x.data_ptr() % 16 == 0 for x in everything)

    def _prepare(self, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        # Gradients laid out unlike their parameter are read through a copy in the parameter's layout.
        grads = [
            g
            if g.stride() == p.stride()
            else torch.empty_strided(p.shape, p.stride(), dtype=g.dtype, device=p.device).copy_(g)
            for p, g in zip(self.params, grads, strict=True)
        ]
        ptrs = tuple(g.data_ptr() for g in grads)
        if ptrs != self._grad_ptrs:
            self._host_lists[_GRAD.value] = list(ptrs)
            self._lists_host = _host_tensor(self._host_lists, self.device)
            self.lists_dev = self._lists_host.to(self.device, non_blocking=True)
            retain_if_capturing(self._lists_host, self.lists_dev)  # a graph may replay them after the next upload
            self._grad_ptrs = ptrs
        return grads

    def _common(self, grads, lr, grad_scale, found_inf):
        grads = self._prepare(grads)
        lr_is_tensor = isinstance(lr, torch.Tensor)
        self._keep = grads  # staged copies must live until the kernels have read them
        return dict(
            grad_scale=grad_scale if grad_scale is not None else self.scalars,
            found_inf=found_inf if found_inf is not None else self.scalars,
            lr_ptr=lr if lr_is_tensor else self.scalars,
            lr_bits=0 if lr_is_tensor else f64_bits(lr),
        ), lr_is_tensor

    def _prologue(self, args, lr_is_tensor, is_adam, beta1=0.5, beta2=0.5):
        n = len(self.params)
        _prologue_kernel[(triton.cdiv(n, _PROLOGUE_BLOCK),)](
            self.lists_dev,
            n,
            self.scalars,
            args["found_inf"],
            args["lr_ptr"],
            args["lr_bits"],
            f64_bits(math.log2(beta1) if beta1 > 0 else -math.inf),
            f64_bits(math.log2(beta2) if beta2 > 0 else -math.inf),
            IS_ADAM=is_adam,
            HAS_FOUND=args["found_inf"] is not self.scalars,
            LR_FROM_PTR=lr_is_tensor,
            BLOCK_T=_PROLOGUE_BLOCK,
        )

    def step_adam(
        self,
        grads,
        lr,
        grad_scale,
        found_inf,
        *,
        beta1,
        beta2,
        eps,
        weight_decay,
        amsgrad,
        maximize,
        decoupled_weight_decay,
    ) -> None:
        """One Adam/AdamW step of every parameter (``reference.adam_step``); ``lr`` a float or a device tensor."""
        args, lr_is_tensor = self._common(grads, lr, grad_scale, found_inf)
        self._prologue(args, lr_is_tensor, True, beta1, beta2)
        state_dtype = self.lists[0][0].dtype
        _adam_kernel[(_programs(self.device, self.num_chunks),)](
            self.addrs,
            self.numels,
            self.chunk_tensor,
            self.chunk_start,
            self.lists_dev,
            len(self.params),
            self.num_chunks,
            self.scalars,
            args["grad_scale"],
            args["found_inf"],
            args["lr_ptr"],
            args["lr_bits"],
            float(weight_decay),
            f64_bits(weight_decay),
            float(beta2),
            float(1 - beta1),
            float(1 - beta2),
            float(eps),
            P_DTYPE=_TL_DTYPES[self.params[0].dtype],
            G_DTYPE=_TL_DTYPES[grads[0].dtype],
            S_DTYPE=_TL_DTYPES[state_dtype],
            HAS_MASTER=bool(self.lists[3]),
            AMSGRAD=bool(amsgrad),
            MAXIMIZE=bool(maximize),
            HAS_WD=weight_decay != 0,
            DECOUPLED=bool(decoupled_weight_decay),
            WEIGHT_SMALL=(1 - beta1) < 0.5,
            HAS_SCALE=grad_scale is not None,
            HAS_FOUND=found_inf is not None,
            LR_FROM_PTR=lr_is_tensor,
            ALIGNED=self.aligned,
            BLOCK_E=BLOCK,
            num_warps=NUM_WARPS,
        )

    def step_sgd(
        self, grads, lr, grad_scale, found_inf, *, momentum, dampening, weight_decay, nesterov, maximize
    ) -> None:
        """One SGD step of every parameter (``reference.sgd_step``); ``lr`` a float or a device tensor."""
        args, lr_is_tensor = self._common(grads, lr, grad_scale, found_inf)
        has_momentum = momentum != 0
        if has_momentum:
            self._prologue(args, lr_is_tensor, False)
        state_dtype = self.lists[0][0].dtype if self.lists[0] else self.params[0].dtype
        _sgd_kernel[(_programs(self.device, self.num_chunks),)](
            self.addrs,
            self.numels,
            self.chunk_tensor,
            self.chunk_start,
            self.lists_dev,
            len(self.params),
            self.num_chunks,
            self.scalars,
            args["grad_scale"],
            args["found_inf"],
            args["lr_ptr"],
            args["lr_bits"],
            float(weight_decay),
            float(momentum),
            float(1 - dampening),
            P_DTYPE=_TL_DTYPES[self.params[0].dtype],
            G_DTYPE=_TL_DTYPES[grads[0].dtype],
            S_DTYPE=_TL_DTYPES[state_dtype],
            HAS_MASTER=bool(self.lists[3]),
            HAS_MOMENTUM=has_momentum,
            NESTEROV=bool(nesterov),
            MAXIMIZE=bool(maximize),
            HAS_WD=weight_decay != 0,
            HAS_SCALE=grad_scale is not None,
            HAS_FOUND=found_inf is not None,
            LR_FROM_PTR=lr_is_tensor,
            ALIGNED=self.aligned,
            BLOCK_E=BLOCK,
            num_warps=NUM_WARPS,
        )
