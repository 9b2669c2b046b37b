"""Lightning precision plugins on :class:`~ampkernels.FusedGradScaler`, the fused clip and FP8.

One line: hand the plugin to the Trainer (or Fabric) instead of a ``precision=`` string::

    from ampkernels.integrations.lightning import MixedPrecision

    trainer = lightning.Trainer(plugins=[MixedPrecision("16-mixed")], gradient_clip_val=1.0)
    trainer = lightning.Trainer(plugins=[MixedPrecision("bf16-mixed", float8="tensorwise")])  # FP8 Linear layers
    trainer = lightning.Trainer(plugins=[MixedPrecision("bf16-mixed", float8="tensorwise", fuse=True)])  # and more

    from ampkernels.integrations.lightning import FabricMixedPrecision

    fabric = lightning.Fabric(plugins=[FabricMixedPrecision("16-mixed")])

What changes against Lightning's own ``MixedPrecision`` plugins (2.6):

- ``"16-mixed"`` scales the loss with a :class:`FusedGradScaler`;
- ``gradient_clip_val`` (clip by norm) runs ``FusedGradScaler.clip_grad_norm_``: unscale, check, norm and clip in
  one read-only pass, the clip folded into the step of an optimizer that takes the scale (ampkernels' optimizers,
  torch's ``fused=True``), which stock Lightning refuses to clip ("does not allow for gradient clipping"); clip by
  value works with them too. ``"bf16-mixed"`` has no scaler and clips with torch's ``clip_grad_norm_``;
- ``float8=`` converts the model's ``nn.Linear`` layers with :func:`ampkernels.float8.convert_to_float8` in the
  plugin's ``convert_module`` hook, which Lightning calls before ``configure_optimizers`` (Trainer) or in
  ``fabric.setup`` (Fabric);
- ``fuse=True`` runs :func:`ampkernels.float8.fuse_modules` with ``loss=True`` in the same hook: stock and Hugging
  Face RMSNorms and gated MLPs on the fused kernels, and the fused linear + cross-entropy in Hugging Face causal
  LMs (their training forward with labels then returns ``logits=None``);
- the Trainer plugin keeps the class name ``MixedPrecision``, under which Lightning files the plugin's state
  (the scaler's) in a checkpoint: checkpoints move between the stock plugin and this one both ways.

Fabric clips in its strategy, not in the plugin: ``fabric.clip_gradients`` unscales through the fused scaler (for
any optimizer) and clips with torch; ``plugin.clip_grad_norm_(optimizer, max_norm)`` is the fused clip.
"""

from __future__ import annotations

from typing import Any

import torch

from ampkernels.float8 import Float8Recipe, convert_to_float8, fuse_modules
from ampkernels.integrations._common import require
from ampkernels.optim import FusedAdam, FusedSGD
from ampkernels.scaler.grad_scaler import FusedGradScaler

lightning = require("lightning", "lightning", "lightning")

from lightning.fabric.plugins.precision import MixedPrecision as _FabricMixedPrecision  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision as _TrainerMixedPrecision  # noqa: E402
from lightning.pytorch.plugins.precision import Precision as _TrainerPrecision  # noqa: E402
from lightning.pytorch.utilities import GradClipAlgorithmType  # noqa: E402

__all__ = ["FabricMixedPrecision", "MixedPrecision"]


def _takes_scale(optimizer: Any) -> bool:
    """Whether the optimizer takes the loss scale in its step (and so is not unscaled before the clip by stock)."""
    return getattr(optimizer, "_step_supports_amp_scaling", False)


def _unwrap(optimizer: Any) -> Any:
    """The torch optimizer inside Fabric's (or Lightning's) wrapper: the object the scaler steps and keys by."""
    while type(optimizer).__name__ in ("_FabricOptimizer", "LightningOptimizer"):
        optimizer = optimizer.optimizer
    return optimizer


class _Setup:
    """What the Trainer and Fabric plugins share: arguments, the scaler, the FP8 conversion (a mixin placed before
    Lightning's plugin class, whose ``__init__(precision, device, scaler)`` and ``convert_module`` it extends)."""

    def __init__(
        self,
        precision: str = "16-mixed",
        device: str | None = None,
        scaler: FusedGradScaler | None = None,
        *,
        float8: str | Float8Recipe | None = None,
        float8_options: dict[str, Any] | None = None,
        fuse: bool = False,
    ) -> None:
        name = type(self).__name__
        if precision not in ("16-mixed", "bf16-mixed"):
            raise ValueError(f"{name}: argument 'precision' must be '16-mixed' or 'bf16-mixed', got {precision!r}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if scaler is not None and not isinstance(scaler, FusedGradScaler):
            raise TypeError(
                f"{name}: argument 'scaler' must be an ampkernels.FusedGradScaler, got {type(scaler).__name__}"
            )
        if precision == "bf16-mixed" and scaler is not None:
            raise ValueError(f"{name}: argument 'scaler': precision='bf16-mixed' does not use a scaler")
        if precision == "16-mixed" and scaler is None:
            scaler = FusedGradScaler(device)
        if float8 is not None:
            Float8Recipe.named(float8)  # a bad recipe name raises here, not at the first fit
        if float8_options is not None and not isinstance(float8_options, dict):
            raise TypeError(f"{name}: argument 'float8_options' must be a dict, got {type(float8_options).__name__}")
        if float8 is None and float8_options:
            raise ValueError(f"{name}: argument 'float8_options' was given without 'float8'")
        if not isinstance(fuse, bool):
            raise TypeError(f"{name}: argument 'fuse' must be a bool, got {type(fuse).__name__}")
        self.float8 = float8
        self.float8_options = dict(float8_options or {})
        self.fuse = fuse
        super().__init__(precision, device, scaler)

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        module = super().convert_module(module)
        if self.fuse:
            fuse_modules(module, loss=True)
        if self.float8 is None:
            return module
        return convert_to_float8(module, self.float8, **self.float8_options)


class MixedPrecision(_Setup, _TrainerMixedPrecision):
    """Lightning Trainer AMP plugin on :class:`FusedGradScaler` and the fused clip, with optional FP8.

    Args:
        precision: ``"16-mixed"`` (fp16 autocast, loss scaling) or ``"bf16-mixed"`` (bf16 autocast, no scaler).
        device: the autocast device, ``"cuda"`` or ``"cpu"``; default: ``"cuda"`` when a GPU is visible.
        scaler: the FusedGradScaler for ``"16-mixed"`` (e.g. ``FusedGradScaler(telemetry=True)``); default: one
            with stock settings.
        float8: a :func:`ampkernels.float8.convert_to_float8` recipe (``"tensorwise"``, ``"rowwise"``,
            ``"delayed"`` or a :class:`~ampkernels.float8.Float8Recipe`): its ``nn.Linear`` layers run in FP8.
        float8_options: more ``convert_to_float8`` arguments (``module_filter``, ``min_features``, recipe fields).
        fuse: run :func:`ampkernels.float8.fuse_modules` (``loss=True``) on the model: fused norms, SiLU·up and,
            in Hugging Face causal LMs, the fused loss.

    Checkpoints: Lightning files the plugin's state under the class name, ``"MixedPrecision"``, as the stock one.
    """

    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        # Lightning's MixedPrecision refuses to clip an optimizer that takes the scale; the fused clip handles it.
        _TrainerPrecision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: int | float) -> None:
        if self.scaler is not None:
            self.scaler.clip_grad_norm_(_unwrap(optimizer), clip_val)
        elif isinstance(_unwrap(optimizer), (FusedAdam, FusedSGD)):
            _unwrap(optimizer).clip_grad_norm_(clip_val)  # (bf16: the clip folded into the step)
        else:
            super().clip_grad_by_norm(optimizer, clip_val)

    def clip_grad_by_value(self, optimizer: torch.optim.Optimizer, clip_val: int | float) -> None:
        if self.scaler is not None and _takes_scale(_unwrap(optimizer)):
            self.scaler.unscale_(_unwrap(optimizer))  # (Lightning unscaled the other optimizers already)
        super().clip_grad_by_value(optimizer, clip_val)


class FabricMixedPrecision(_Setup, _FabricMixedPrecision):
    """Lightning Fabric AMP plugin on :class:`FusedGradScaler`, with optional FP8; arguments as
    :class:`MixedPrecision`.

    ``fabric.clip_gradients(model, optimizer, max_norm=...)`` works with every optimizer (stock Fabric refuses
    those that take the scale): it unscales through the fused scaler and clips with torch. :meth:`clip_grad_norm_`
    is the fused clip.
    """

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(_unwrap(optimizer))

    def clip_grad_norm_(
        self, optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip the gradients of ``optimizer`` (Fabric's wrapper or the torch optimizer) to ``max_norm``; returns
        their total norm before clipping, a 0-d tensor (no host sync).

        ``"16-mixed"``: ``FusedGradScaler.clip_grad_norm_`` (a step with non-finite gradients is skipped, its norm
        is inf; stock ``fabric.clip_gradients`` raises there unless ``error_if_nonfinite=False``).
        ``"bf16-mixed"``: an ampkernels optimizer's ``clip_grad_norm_`` (the clip folded into its step), else
        ``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters.
        """
        optimizer = _unwrap(optimizer)
        if self.scaler is not None:
            return self.scaler.clip_grad_norm_(optimizer, max_norm, norm_type)
        if isinstance(optimizer, (FusedAdam, FusedSGD)):
            return optimizer.clip_grad_norm_(max_norm, norm_type)
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
