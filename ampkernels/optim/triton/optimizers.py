"""Launch code of the Triton fused optimizer steps (kernels: ``ampkernels.optim.triton.optimizers_kernels``): the
``StepTable`` of one bucket of parameters, its device metadata and the launches."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ampkernels import dispatch
from ampkernels._constants import CHUNK
from ampkernels._runtime import f64_bits, is_dense, num_sms, on_own_device, retain_if_capturing
from ampkernels.optim.hyperparameters import AdamHyperparameters, SgdHyperparameters
from ampkernels.optim.triton.optimizers_kernels import _GRAD, _adam_kernel, _prologue_kernel, _sgd_kernel

BLOCK = 1024
NUM_WARPS = 4
_PROGRAMS_PER_SM = 4
_PROLOGUE_BLOCK = 256


def _host_tensor(values, device: torch.device) -> torch.Tensor:
    """int64 host tensor of ``values``, pinned when it feeds a CUDA device (an asynchronous, capturable copy)."""
    host = torch.tensor(values, dtype=torch.int64)
    return host.pin_memory() if device.type == "cuda" else host


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


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
        lists: the state lists in ``ampkernels.optim.optimizers`` order (exp_avg/momentum_buffer, exp_avg_sq,
            max_exp_avg_sq, master_param, step), each one tensor per parameter or empty.
    """

    def __init__(self, kind: str, params: Sequence[torch.Tensor], lists: Sequence[Sequence[torch.Tensor]]) -> None:
        self.kind = kind
        self.params = list(params)
        self.lists = [list(x) for x in lists]
        self.device = self.params[0].device
        self._build()

    def _layout(self) -> tuple:
        """What the device metadata depends on: every parameter's address, size and strides and every state
        tensor's address (``p.data = new`` or an in-place resize moves them under the same tensor objects)."""
        return (
            tuple((p.data_ptr(), p.numel(), p.stride()) for p in self.params),
            tuple(x.data_ptr() for tensors in self.lists for x in tensors),
        )

    def _build(self) -> None:
        for i, p in enumerate(self.params):
            if not is_dense(p):
                raise ValueError(f"params[{i}] is not non-overlapping and dense; the fused kernels walk its memory")
        n = len(self.params)
        numels = [p.numel() for p in self.params]
        for row, tensors in enumerate(self.lists):
            for t, x in enumerate(tensors):
                if x.dim() > 0 and x.numel() != numels[t]:
                    raise ValueError(
                        f"optimizer state {row} of parameter {t} has {x.numel()} elements, the parameter {numels[t]}"
                    )
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
        self._grads_aligned = False
        self.lists_dev: torch.Tensor | None = None
        everything = [*self.params, *(x for tensors in self.lists for x in tensors if x.dim() > 0)]
        self.aligned = all(x.data_ptr() % 16 == 0 for x in everything)
        self._built_for = self._layout()

    def _prepare(self, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if self._layout() != self._built_for:
            self._build()
        for i, (p, g) in enumerate(zip(self.params, grads, strict=True)):
            if g.shape != p.shape:
                raise ValueError(f"the gradient of parameter {i} has shape {tuple(g.shape)}, the parameter {p.shape}")
        # Gradients laid out unlike their parameter (now) are read through a copy in the parameter's layout.
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
            # The kernels' 16-byte alignment hint covers the gradients too (a gradient may be an offset view).
            self._grads_aligned = all(ptr % 16 == 0 for ptr in ptrs)
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

    @on_own_device
    def step_adam(self, grads, lr, grad_scale, found_inf, hyper: AdamHyperparameters) -> None:
        """One Adam/AdamW step of every parameter (``reference.adam_step``); ``lr`` a float or a device tensor."""
        args, lr_is_tensor = self._common(grads, lr, grad_scale, found_inf)
        beta1, beta2, weight_decay = hyper.beta1, hyper.beta2, hyper.weight_decay
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
            float(hyper.eps),
            P_DTYPE=_TL_DTYPES[self.params[0].dtype],
            G_DTYPE=_TL_DTYPES[grads[0].dtype],
            S_DTYPE=_TL_DTYPES[state_dtype],
            HAS_MASTER=bool(self.lists[3]),
            AMSGRAD=bool(hyper.amsgrad),
            MAXIMIZE=bool(hyper.maximize),
            HAS_WD=weight_decay != 0,
            DECOUPLED=bool(hyper.decoupled_weight_decay),
            WEIGHT_SMALL=(1 - beta1) < 0.5,
            HAS_SCALE=grad_scale is not None,
            HAS_FOUND=found_inf is not None,
            LR_FROM_PTR=lr_is_tensor,
            ALIGNED=self.aligned and self._grads_aligned,
            INTERPRET=dispatch.triton_interpreting(),
            BLOCK_E=BLOCK,
            num_warps=NUM_WARPS,
        )

    @on_own_device
    def step_sgd(self, grads, lr, grad_scale, found_inf, hyper: SgdHyperparameters) -> None:
        """One SGD step of every parameter (``reference.sgd_step``); ``lr`` a float or a device tensor."""
        args, lr_is_tensor = self._common(grads, lr, grad_scale, found_inf)
        momentum, weight_decay = hyper.momentum, hyper.weight_decay
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
            float(1 - hyper.dampening),
            P_DTYPE=_TL_DTYPES[self.params[0].dtype],
            G_DTYPE=_TL_DTYPES[grads[0].dtype],
            S_DTYPE=_TL_DTYPES[state_dtype],
            HAS_MASTER=bool(self.lists[3]),
            HAS_MOMENTUM=has_momentum,
            NESTEROV=bool(hyper.nesterov),
            MAXIMIZE=bool(hyper.maximize),
            HAS_WD=weight_decay != 0,
            HAS_SCALE=grad_scale is not None,
            HAS_FOUND=found_inf is not None,
            LR_FROM_PTR=lr_is_tensor,
            ALIGNED=self.aligned and self._grads_aligned,
            INTERPRET=dispatch.triton_interpreting(),
            BLOCK_E=BLOCK,
            num_warps=NUM_WARPS,
        )
