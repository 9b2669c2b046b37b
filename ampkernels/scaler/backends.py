"""The scaler's backends: one :class:`ScalerBackend` per implementation (native, Triton, torch) of
``unscale_reduce_`` and ``update_scale_``, registered with :mod:`ampkernels.dispatch`. The public wrappers in
:mod:`ampkernels.scaler.functional` check the arguments, ask dispatch for a backend and call it."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ampkernels import dispatch
from ampkernels._constants import NO_CLIP, NormKind
from ampkernels._runtime import is_dense
from ampkernels.scaler import distributed, reference

Norms = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


@runtime_checkable
class ScalerBackend(dispatch.Backend, Protocol):
    """What each backend of the scaler's ops implements, with these signatures and return values."""

    def unscale_reduce_(
        self,
        tensors: list[torch.Tensor],
        scale: torch.Tensor,
        found_inf: torch.Tensor,
        factor: torch.Tensor | None,
        write: bool,
        kind: NormKind,
        per_tensor: bool,
        max_norm: float | None,
    ) -> Norms:
        """The fused pass on checked arguments (:func:`ampkernels.scaler.unscale_reduce_`): (the norm, each
        tensor's norm, the clip coefficient), each None where not asked for."""
        ...

    def update_scale_(
        self,
        scale: torch.Tensor,
        growth_tracker: torch.Tensor,
        found_inf: torch.Tensor,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        hysteresis: int,
        hysteresis_tracker: torch.Tensor | None,
        min_scale: float,
        max_scale: float,
        history: torch.Tensor | None,
        counters: torch.Tensor | None,
    ) -> None:
        """The scale update on checked arguments (:func:`ampkernels.scaler.update_scale_`)."""
        ...

    def grad_table(self, params: list[torch.Tensor], device: torch.device):
        """A launch table of its own over ``params``' gradients (re-validated on each call), or None: the scaler
        then collects the gradients in Python each step and calls :meth:`unscale_reduce_`."""
        ...


def _staged(tensors: list[torch.Tensor], keep) -> dict[int, torch.Tensor]:
    """Contiguous copies of the tensors ``keep`` refuses, by index (read before anything is written, so that a view
    over a listed tensor is unscaled from its values as given, once)."""
    return {i: t.contiguous() for i, t in enumerate(tensors) if not keep(t)}


def _write_back(tensors: list[torch.Tensor], staged: dict[int, torch.Tensor]) -> None:
    for i, copy in staged.items():
        tensors[i].copy_(copy)


class NativeScaler(dispatch.NativeBackend):
    def unscale_reduce_(self, tensors, scale, found_inf, factor, write, kind, per_tensor, max_norm) -> Norms:
        clip = NO_CLIP if max_norm is None else float(max_norm)
        norm, each, coef = torch.ops.ampkernels.unscale_reduce_(
            tensors, scale, found_inf, factor, write, int(kind), per_tensor, clip
        )
        has_norm = kind is not NormKind.NONE
        return (
            norm if has_norm else None,
            each if has_norm and per_tensor else None,
            coef if has_norm and max_norm is not None else None,
        )

    def update_scale_(
        self, scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval, hysteresis,
        hysteresis_tracker, min_scale, max_scale, history, counters,
    ) -> None:  # fmt: skip
        if hysteresis_tracker is None:  # hysteresis 1: the tracker's value never matters, only that one exists
            hysteresis_tracker = torch.ones(1, dtype=torch.int32, device=scale.device)
        torch.ops.ampkernels.update_scale_(
            scale, growth_tracker, hysteresis_tracker, found_inf, float(growth_factor), float(backoff_factor),
            int(growth_interval), int(hysteresis), float(min_scale), float(max_scale), counters, history,
        )  # fmt: skip

    def grad_table(self, params, device):
        if any(distributed.is_dtensor(p) for p in params):  # FSDP2: the local shards, collected in Python
            return None
        return dispatch.native().GradTable(params, str(device))


class TritonScaler(dispatch.TritonBackend):
    module = "ampkernels.scaler.triton.multi_tensor"

    def unscale_reduce_(self, tensors, scale, found_inf, factor, write, kind, per_tensor, max_norm) -> Norms:
        # The Triton kernels walk flat memory: non-contiguous views go through a contiguous copy.
        staged = _staged(tensors, torch.Tensor.is_contiguous)
        flat = [staged.get(i, t) for i, t in enumerate(tensors)]
        coef = torch.empty((), dtype=torch.float32, device=found_inf.device) if max_norm is not None else None
        norm, each = self.kernels().unscale_reduce_(
            flat, scale, found_inf, factor=factor, write=write, norm_type=kind.norm_type, per_tensor=per_tensor,
            max_norm=max_norm, coef_out=coef,
        )  # fmt: skip
        if write:
            _write_back(tensors, staged)
        return norm, each, coef

    def update_scale_(
        self, scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval, hysteresis,
        hysteresis_tracker, min_scale, max_scale, history, counters,
    ) -> None:  # fmt: skip
        self.kernels().update_scale_(
            scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval, hysteresis=hysteresis,
            hysteresis_tracker=hysteresis_tracker, min_scale=min_scale, max_scale=max_scale, history=history,
            counters=counters,
        )  # fmt: skip

    def grad_table(self, params, device):
        return None


class TorchScaler(dispatch.TorchBackend):
    def unscale_reduce_(self, tensors, scale, found_inf, factor, write, kind, per_tensor, max_norm) -> Norms:
        # As the native op: a non-dense tensor is read through a copy taken before anything is written.
        staged = _staged(tensors, is_dense) if write else {}
        flat = [staged.get(i, t) for i, t in enumerate(tensors)]
        norm, each = reference.unscale_reduce_(
            flat, scale, found_inf, factor=factor, write=write, norm_type=kind.norm_type, per_tensor=per_tensor
        )
        _write_back(tensors, staged)
        coef = reference.clip_coef(norm, max_norm) if max_norm is not None else None
        return norm, each, coef

    def update_scale_(
        self, scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval, hysteresis,
        hysteresis_tracker, min_scale, max_scale, history, counters,
    ) -> None:  # fmt: skip
        reference.update_scale_(
            scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval, hysteresis=hysteresis,
            hysteresis_tracker=hysteresis_tracker, min_scale=min_scale, max_scale=max_scale, history=history,
            counters=counters,
        )  # fmt: skip

    def grad_table(self, params, device):
        return None


_BACKENDS = (NativeScaler(), TritonScaler(), TorchScaler())
UNSCALE_REDUCE = dispatch.register(
    dispatch.Op(
        "unscale_reduce_",
        "unscale_reduce_ (unscale + non-finite check + norm)",
        "AMPKERNELS_SCALER_BACKEND",
        _BACKENDS,
        dispatch.native_first,
        ScalerBackend,
    )
)
UPDATE_SCALE = dispatch.register(
    dispatch.Op(
        "update_scale_", "update_scale_", "AMPKERNELS_SCALER_BACKEND", _BACKENDS, dispatch.native_first, ScalerBackend
    )
)
