"""Hugging Face Accelerate on :class:`~ampkernels.FusedGradScaler` and its fused clip.

One line: import the ``Accelerator`` from here instead of from ``accelerate``::

    from ampkernels.integrations.accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="fp16")  # every argument of accelerate.Accelerator
    model, optimizer = accelerator.prepare(model, ampkernels.FusedAdamW(model.parameters(), lr=1e-3))
    ...
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(model.parameters(), 1.0)  # FusedGradScaler.clip_grad_norm_: one read-only pass
    optimizer.step()  # skipped on the device on overflow: no host sync
    if accelerator.optimizer_step_was_skipped:  # read only here (one host sync), when asked
        ...

An ``Accelerator`` built elsewhere (by a library) gets the same with :func:`patch` before its optimizers are
prepared. What changes against stock Accelerate (1.16):

- the loss scaler is a :class:`FusedGradScaler` with the stock scaler's settings and state (Accelerate makes one
  only for fp16 on a GPU; with no scaler, or under FSDP, DeepSpeed, XLA or Megatron-LM, nothing is replaced);
- ``accelerator.clip_grad_norm_(params, max_norm)`` runs ``FusedGradScaler.clip_grad_norm_`` when ``params`` are the
  parameters (with a gradient) of one prepared optimizer: unscale, check, norm and clip in one read-only pass, the
  clip folded into the step of an optimizer that takes the scale (ampkernels' optimizers, torch's ``fused=True``);
  without a scaler (bf16) the same parameters of an ampkernels optimizer are clipped by its ``clip_grad_norm_``
  (one read-only pass, the clip folded into its step); other parameter sets take Accelerate's own clip;
- ``optimizer.step_was_skipped`` / ``accelerator.optimizer_step_was_skipped`` keep answering for optimizers that
  take the scale and skip on the device. Accelerate infers a skipped step from whether the scaler called the
  optimizer's ``step``, which such an optimizer always is, so stock Accelerate reports "never skipped" for them.
  Here the step's non-finite flag is kept on the device and read when the property is read, not before: a loop
  that never asks pays no host sync. (A prepared LR scheduler asks after every step, to hold the schedule on a
  skipped step; that read is the one host sync of such a step.)
"""

from __future__ import annotations

import types
import warnings
from typing import Any

import torch

from ampkernels.integrations._common import require
from ampkernels.optim import FusedAdam, FusedSGD
from ampkernels.scaler.grad_scaler import FusedGradScaler

accelerate = require("accelerate", "accelerate", "accelerate")

from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402

__all__ = ["Accelerator", "patch"]

# Distributed types with a clip and a scaler of their own (Accelerate's clip_grad_norm_ branches on them).
_OWN_CLIP = {
    getattr(DistributedType, name)
    for name in ("FSDP", "DEEPSPEED", "XLA", "MEGATRON_LM")
    if hasattr(DistributedType, name)
}


class _AcceleratedOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper whose ``step_was_skipped`` is read from the device only when asked."""

    def step(self, closure=None):
        scaler = self.scaler
        optimizer = self.optimizer
        if not self.gradient_state.sync_gradients:
            return super().step(closure)  # (an accumulation step: nothing is stepped, the last answer stands)
        self._ampkernels_found_inf = None
        if scaler is None or not getattr(optimizer, "_step_supports_amp_scaling", False):
            # The scaler decides on the host whether to call step() (a host sync of its own): stock inference works.
            return super().step(closure)
        # The optimizer takes the scale and the non-finite flag on the device, so step() is always called: keep the
        # step's non-finite flags (the scaler forgets them at update()) for step_was_skipped to read when asked.
        scaler.step(optimizer, closure)
        self._ampkernels_found_inf = list(scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())
        scaler.update()
        self._is_overflow = None

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last optimizer step was skipped (non-finite gradients). For an optimizer that skips on the
        device this reads the step's flag back (a host sync) the first time it is asked after the step."""
        found = self.__dict__.get("_ampkernels_found_inf")
        if found is not None:
            self._is_overflow = any(f.item() != 0 for f in found)
            self._ampkernels_found_inf = None
        return bool(self._is_overflow)


def _fused_like(stock: torch.amp.GradScaler) -> FusedGradScaler:
    """A FusedGradScaler with ``stock``'s device, settings and state (its scale and growth tracker, if used)."""
    if not stock.is_enabled():
        return FusedGradScaler(stock._device, enabled=False)
    fused = FusedGradScaler(stock._device)
    fused.load_state_dict(stock.state_dict())
    return fused


def _adopt(prepared: Any, scaler: Any) -> None:
    """Make an optimizer Accelerate prepared (``AcceleratedOptimizer``) step with ``scaler`` and answer
    ``step_was_skipped`` lazily."""
    if type(prepared) is AcceleratedOptimizer:
        prepared.__class__ = _AcceleratedOptimizer  # (a subclass that only overrides methods)
    if isinstance(prepared, AcceleratedOptimizer) and prepared.scaler is not None and scaler is not None:
        prepared.scaler = scaler


def _owner(prepared: list, params: list[torch.Tensor]) -> torch.optim.Optimizer | None:
    """The one optimizer among ``prepared`` whose parameters with a gradient are those of ``params``, else None."""
    wanted = {id(p) for p in params if p.grad is not None}
    if not wanted:
        return None
    for opt in prepared:
        while isinstance(opt, AcceleratedOptimizer):
            opt = opt.optimizer
        if {id(p) for g in opt.param_groups for p in g["params"] if p.grad is not None} == wanted:
            return opt
    return None


def _prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement=None):
    prepared = type(self).prepare_optimizer(self, optimizer, device_placement=device_placement)
    _adopt(prepared, self.scaler)
    return prepared


def _clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2):
    scaler = self.scaler
    if self.distributed_type not in _OWN_CLIP:
        parameters = list(parameters)
        optimizer = _owner(self._optimizers, parameters)
        if optimizer is not None and isinstance(scaler, FusedGradScaler) and scaler.is_enabled():
            return scaler.clip_grad_norm_(optimizer, max_norm, norm_type)
        if optimizer is not None and scaler is None and isinstance(optimizer, (FusedAdam, FusedSGD)):
            return optimizer.clip_grad_norm_(max_norm, norm_type)  # (bf16: the clip folded into the step)
    return type(self).clip_grad_norm_(self, parameters, max_norm, norm_type=norm_type)


def patch(accelerator: accelerate.Accelerator, scaler: FusedGradScaler | None = None) -> accelerate.Accelerator:
    """Put an existing ``accelerate.Accelerator`` on :class:`FusedGradScaler` and the fused clip; returns it.

    Call it before ``accelerator.prepare(optimizer)`` (optimizers prepared before are moved over too, but state
    their scaler already holds stays with the old scaler). Calling it again does nothing.

    Args:
        accelerator: the ``accelerate.Accelerator`` (or subclass) to patch.
        scaler: the FusedGradScaler to use (e.g. ``FusedGradScaler(telemetry=True)``). Default: one with the
            settings and state of the stock scaler Accelerate made. Only where Accelerate made a plain
            ``torch.amp.GradScaler`` (fp16 on a GPU, no FSDP/DeepSpeed/XLA/Megatron-LM): a ValueError otherwise.
    """
    if not isinstance(accelerator, accelerate.Accelerator):
        raise TypeError(
            f"ampkernels.integrations.accelerate.patch: argument 'accelerator' must be an accelerate.Accelerator, "
            f"got {type(accelerator).__name__}"
        )
    if scaler is not None and not isinstance(scaler, FusedGradScaler):
        raise TypeError(
            "ampkernels.integrations.accelerate.patch: argument 'scaler' must be an ampkernels.FusedGradScaler, "
            f"got {type(scaler).__name__}"
        )
    if accelerator.__dict__.get("_ampkernels_patched"):
        if scaler is not None and scaler is not accelerator.scaler:
            raise ValueError("ampkernels.integrations.accelerate.patch: this Accelerator is patched already")
        return accelerator
    stock = accelerator.scaler
    if accelerator.distributed_type in _OWN_CLIP or getattr(accelerator, "is_fsdp2", False):
        if scaler is not None:
            raise ValueError(
                "ampkernels.integrations.accelerate.patch: argument 'scaler' was given, but distributed_type "
                f"{accelerator.distributed_type} (or FSDP2) brings its own scaler and clip"
            )
        warnings.warn(
            f"ampkernels.integrations.accelerate: distributed_type {accelerator.distributed_type} (or FSDP2) brings "
            "its own scaler and clip; the Accelerator is left as it is",
            stacklevel=2,
        )
        return accelerator
    if type(stock) is torch.amp.GradScaler:
        accelerator.scaler = _fused_like(stock) if scaler is None else scaler
    elif scaler is not None:
        if stock is not None:
            raise ValueError(
                "ampkernels.integrations.accelerate.patch: argument 'scaler' was given, but this Accelerator has a "
                f"{type(stock).__name__}, not the plain torch.amp.GradScaler a FusedGradScaler replaces"
            )
        raise ValueError(
            "ampkernels.integrations.accelerate.patch: argument 'scaler' was given, but this Accelerator has no "
            f"loss scaler (mixed_precision={accelerator.mixed_precision!r} on {accelerator.device}): Accelerate "
            "makes one only for fp16 on a GPU"
        )
    elif stock is not None and not isinstance(stock, FusedGradScaler):
        warnings.warn(
            f"ampkernels.integrations.accelerate: keeping this Accelerator's {type(stock).__name__}; "
            "FusedGradScaler replaces only a plain torch.amp.GradScaler",
            stacklevel=2,
        )
    for prepared in accelerator._optimizers:
        _adopt(prepared, accelerator.scaler)
    accelerator.prepare_optimizer = types.MethodType(_prepare_optimizer, accelerator)
    accelerator.clip_grad_norm_ = types.MethodType(_clip_grad_norm_, accelerator)
    accelerator._ampkernels_patched = True
    return accelerator


class Accelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` on :class:`FusedGradScaler` and its fused clip (see the module docstring).

    Args:
        *args, **kwargs: as ``accelerate.Accelerator``.
        scaler: the FusedGradScaler to use; default: one with the stock scaler's settings (``GradScalerKwargs``
            in ``kwargs_handlers`` apply). Only for fp16 on a GPU (:func:`patch` says more).
    """

    def __init__(self, *args: Any, scaler: FusedGradScaler | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        patch(self, scaler=scaler)
