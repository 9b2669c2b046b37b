"""Hugging Face ``Trainer`` on :class:`~ampkernels.FusedAdamW` and :class:`~ampkernels.FusedGradScaler`.

One line: import the ``Trainer`` from here instead of from ``transformers``::

    from ampkernels.integrations.transformers import Trainer

    args = TrainingArguments("out", fp16=True, max_grad_norm=1.0, learning_rate=3e-4, weight_decay=0.01)
    trainer = Trainer(model=model, args=args, train_dataset=ds)  # every argument of transformers.Trainer
    trainer = Trainer(model=model, args=args, train_dataset=ds, adamw_kwargs={"exp_avg_dtype": "8bit",
                                                                              "exp_avg_sq_dtype": "8bit"})

What changes against stock ``Trainer``:

- the optimizer Trainer builds for ``optim="adamw_torch"`` / ``"adamw_torch_fused"`` (the default) is
  :class:`FusedAdamW`, with Trainer's param groups (weight decay off for biases and norms), learning rate, betas and
  eps, plus ``adamw_kwargs`` (any :class:`FusedAdamW` option: ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` =
  ``"bf16"``, ``"8bit"``, ``"4bit"``, ``stochastic_rounding``, ``master_weights``, ...). An optimizer passed in
  (``optimizers=`` or ``optimizer_cls_and_kwargs=``) is kept, as is any other ``optim``;
- Trainer's Accelerator is patched by :func:`ampkernels.integrations.accelerate.patch`: with ``fp16=True`` on a
  GPU the loss scaler is a :class:`FusedGradScaler` and ``max_grad_norm`` clips with
  ``FusedGradScaler.clip_grad_norm_`` (the clip folded into the FusedAdamW step; one read-only gradient pass);
- checkpoints are Trainer's own: ``optimizer.pt`` holds the FusedAdamW state_dict (any state format),
  ``scaler.pt`` the scaler's; ``trainer.train(resume_from_checkpoint=...)`` restores both.

Trainer itself reads a value back from the device after every step (``logging_nan_inf_filter`` checks the loss,
and it asks ``optimizer_step_was_skipped`` to hold the LR schedule on a skipped step); the integration adds no
host read of its own.
"""

from __future__ import annotations

from typing import Any

from ampkernels.integrations._common import require
from ampkernels.optim.optimizers import FusedAdamW
from ampkernels.scaler.grad_scaler import FusedGradScaler

transformers = require("transformers", "transformers", "transformers")

from ampkernels.integrations import accelerate as _accelerate  # noqa: E402  (Trainer runs on Accelerate)

__all__ = ["Trainer", "ADAMW_OPTIMS"]

#: The ``TrainingArguments.optim`` values whose torch AdamW becomes FusedAdamW.
ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused")


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` on :class:`FusedAdamW` and :class:`FusedGradScaler` (see the module docstring).

    Args:
        *args, **kwargs: as ``transformers.Trainer``.
        adamw_kwargs: extra :class:`FusedAdamW` arguments (state format, master weights, ...) for the AdamW that
            Trainer builds; only with ``args.optim`` in :data:`ADAMW_OPTIMS` (ValueError otherwise).
        scaler: the FusedGradScaler to use with ``fp16=True`` on a GPU; default: one with stock settings.
    """

    def __init__(
        self,
        *args: Any,
        adamw_kwargs: dict[str, Any] | None = None,
        scaler: FusedGradScaler | None = None,
        **kwargs: Any,
    ) -> None:
        if adamw_kwargs is not None and not isinstance(adamw_kwargs, dict):
            raise TypeError(
                f"ampkernels Trainer: argument 'adamw_kwargs' must be a dict, got {type(adamw_kwargs).__name__}"
            )
        # (set before Trainer.__init__, which creates the Accelerator)
        self._ampkernels_adamw_kwargs = dict(adamw_kwargs or {})
        self._ampkernels_scaler = scaler
        super().__init__(*args, **kwargs)
        optim = _optim_name(self.args.optim)
        if self._ampkernels_adamw_kwargs and optim not in ADAMW_OPTIMS:
            raise ValueError(
                f"ampkernels Trainer: argument 'adamw_kwargs' applies to the AdamW Trainer builds for optim in "
                f"{ADAMW_OPTIMS}, but args.optim is {optim!r}"
            )

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        _accelerate.patch(self.accelerator, scaler=self._ampkernels_scaler)

    def get_optimizer_cls_and_kwargs(self, args, model=None) -> tuple[Any, dict[str, Any]]:
        """As Trainer's, with :class:`FusedAdamW` (and ``adamw_kwargs``) for the torch AdamW optims."""
        cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args, model)
        if _optim_name(args.optim) not in ADAMW_OPTIMS:
            return cls, kwargs
        kwargs = {k: v for k, v in kwargs.items() if k not in ("fused", "foreach")}
        kwargs.update(self._ampkernels_adamw_kwargs)
        return FusedAdamW, kwargs


def _optim_name(optim: Any) -> str:
    return getattr(optim, "value", optim)
