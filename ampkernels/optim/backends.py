"""The fused optimizers' backends (native, Triton, torch) of ``adam``, ``sgd`` and ``adam_blockwise``, registered
with :mod:`ampkernels.dispatch`. Each builds the step table of one bucket of parameters
(:meth:`OptimizerBackend.table`), which the optimizers re-check and launch every step through the same two calls
(:class:`BucketTable`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from ampkernels import dispatch
from ampkernels.optim.hyperparameters import AdamHyperparameters, SgdHyperparameters

Hyperparameters = AdamHyperparameters | SgdHyperparameters
#: The torch backend's step of a bucket: ``(grads, lr, grad_scale, found_inf, hyper)``, ``lr`` a float or a 0-d
#: float32 device tensor (the optimizer's reference step).
ReferenceStep = Callable[[list, "float | torch.Tensor", "torch.Tensor | None", "torch.Tensor | None", Any], None]


class BucketTable(Protocol):
    """The step table of one bucket, as every backend's :meth:`OptimizerBackend.table` returns it."""

    def ready(self) -> bool:
        """Re-checks the bucket before a step (every bucket is checked before any launches): False when a gradient
        appeared, disappeared or changed dtype or shape, or a parameter changed shape (or storage, for the native
        table) since the table was built; the plan must then be rebuilt. The native table raises RuntimeError for a
        gradient it cannot take (the rebuilt plan names the parameter). Writes no parameter."""
        ...

    def step(
        self,
        lr: float,
        lr_tensor: torch.Tensor | None,
        hyper: Hyperparameters,
        grad_scale: torch.Tensor | None,
        found_inf: torch.Tensor | None,
    ) -> None:
        """One step of every parameter of the bucket, after :meth:`ready` returned True. ``lr_tensor``: a 0-d
        float32 tensor on the bucket's device the kernels read instead of ``lr``, or None."""
        ...


@runtime_checkable
class OptimizerBackend(dispatch.Backend, Protocol):
    """What each backend of the optimizers' steps implements, with these signatures and return values."""

    #: Whether the blockwise step indexes the stochastic rounding stream of a non-contiguous parameter by the
    #: element's logical flat index, as the reference does. False: stochastic rounding on this backend needs
    #: contiguous bfloat16 parameters (the optimizer refuses others, naming the backend).
    strided_rounding: bool

    def table(
        self,
        kind: str,
        params: list[torch.Tensor],
        lists: list[list[torch.Tensor]],
        watch: list[torch.Tensor],
        grad_dtype: torch.dtype,
        layout: list[tuple[int, int, int, int, int]] | None,
        reference: ReferenceStep,
    ) -> BucketTable:
        """The step table of one bucket: ``params`` (one device and dtype, gradients of ``grad_dtype``), their state
        ``lists`` (``ampkernels.optim.optimizers`` order), ``watch`` (the group's parameters without a gradient:
        one appearing makes the table stale), ``kind`` ("adam" or "sgd"), ``layout`` (the blockwise step's
        per-parameter formats, salts and offsets; None: the plain step). ``reference`` is the step the torch
        backend runs (the others ignore it)."""
        ...


class _CheckedTable:
    """For the Python tables: the gradients are where the table was built for, and the parameters and their
    gradients have the shapes the state was made for (the native table checks this in C++, and sees new storage)."""

    __slots__ = ("params", "shapes", "watch", "grad_dtype")

    def __init__(self, params: list[torch.Tensor], watch: list[torch.Tensor], grad_dtype: torch.dtype) -> None:
        self.params = params
        self.shapes = [p.shape for p in params]
        self.watch = watch
        self.grad_dtype = grad_dtype

    def ready(self) -> bool:
        return all(
            p.grad is not None and p.grad.dtype == self.grad_dtype and p.shape == shape and p.grad.shape == shape
            for p, shape in zip(self.params, self.shapes, strict=True)
        ) and all(p.grad is None for p in self.watch)


class _NativeTable:
    """``ampkernels._C.OptimizerTable`` or ``BlockwiseAdamTable``: :meth:`BucketTable.ready` is its ``refresh``
    and :meth:`BucketTable.step` its ``step_<kind>``, bound once (a step calls into C++ directly). Anything else
    is the C++ table's (``addresses()``)."""

    __slots__ = ("inner", "ready", "step")

    def __init__(self, native: Any, kind: str) -> None:
        self.inner = native
        self.ready = native.refresh
        self.step = getattr(native, f"step_{kind}")

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "inner"), name)


class _TritonTable(_CheckedTable):
    """``ampkernels.optim.triton``'s ``StepTable`` or ``BlockwiseStepTable``, which take the gradients and one
    ``lr`` argument. Anything else is the Triton table's."""

    __slots__ = ("inner", "launch")

    def __init__(self, triton: Any, kind: str, params, watch, grad_dtype) -> None:
        super().__init__(params, watch, grad_dtype)
        self.inner = triton
        self.launch = getattr(triton, f"step_{kind}")

    def step(self, lr, lr_tensor, hyper, grad_scale, found_inf) -> None:
        grads = [p.grad for p in self.params]
        self.launch(grads, lr_tensor if lr_tensor is not None else lr, grad_scale, found_inf, hyper)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "inner"), name)


class _TorchTable(_CheckedTable):
    """The optimizer's reference step (plain PyTorch)."""

    __slots__ = ("reference",)

    def __init__(self, reference: ReferenceStep, params, watch, grad_dtype) -> None:
        super().__init__(params, watch, grad_dtype)
        self.reference = reference

    def step(self, lr, lr_tensor, hyper, grad_scale, found_inf) -> None:
        grads = [p.grad for p in self.params]
        self.reference(grads, lr_tensor if lr_tensor is not None else lr, grad_scale, found_inf, hyper)


class NativeOptimizer(dispatch.NativeBackend):
    # NOTE: the native kernels walk a non-contiguous parameter in memory order, and index the stream in that order.
    strided_rounding = False

    def table(self, kind, params, lists, watch, grad_dtype, layout, reference) -> BucketTable:
        native = dispatch.native()
        if layout is not None:
            return _NativeTable(native.BlockwiseAdamTable(params, lists, layout, watch, grad_dtype), kind)
        return _NativeTable(native.OptimizerTable(kind, params, lists, watch, grad_dtype), kind)


class TritonOptimizer(dispatch.TritonBackend):
    # NOTE: the Triton blockwise kernel refuses non-contiguous parameters.
    strided_rounding = False

    def __init__(self, module: str):
        self.module = module

    def table(self, kind, params, lists, watch, grad_dtype, layout, reference) -> BucketTable:
        kernels = self.kernels()
        if layout is not None:
            triton = kernels.BlockwiseStepTable(params, lists, layout)
        else:
            triton = kernels.StepTable(kind, params, lists)
        return _TritonTable(triton, kind, params, watch, grad_dtype)


class TorchOptimizer(dispatch.TorchBackend):
    strided_rounding = True

    def table(self, kind, params, lists, watch, grad_dtype, layout, reference) -> BucketTable:
        return _TorchTable(reference, params, watch, grad_dtype)


def _blockwise_order(device: torch.device) -> tuple[str, ...]:
    # NOTE: on CUDA tensors Triton's blockwise step is the faster (dev/optimizers/NOTES.md).
    return ("triton", "native", "torch") if device.type == "cuda" else ("native", "torch")


_VARIABLE = "AMPKERNELS_OPTIMIZER_BACKEND"
_STEPS = "ampkernels.optim.triton.optimizers"
ADAM = dispatch.register(
    dispatch.Op(
        "adam",
        "adam (FusedAdam, FusedAdamW)",
        _VARIABLE,
        (NativeOptimizer(), TritonOptimizer(_STEPS), TorchOptimizer()),
        dispatch.native_first,
        OptimizerBackend,
    )
)
SGD = dispatch.register(
    dispatch.Op(
        "sgd",
        "sgd (FusedSGD)",
        _VARIABLE,
        (NativeOptimizer(), TritonOptimizer(_STEPS), TorchOptimizer()),
        dispatch.native_first,
        OptimizerBackend,
    )
)
ADAM_BLOCKWISE = dispatch.register(
    dispatch.Op(
        "adam_blockwise",
        "adam_blockwise (FusedAdam with low-precision moments or stochastic rounding)",
        _VARIABLE,
        (NativeOptimizer(), TritonOptimizer("ampkernels.optim.triton.blockwise"), TorchOptimizer()),
        _blockwise_order,
        OptimizerBackend,
    )
)
