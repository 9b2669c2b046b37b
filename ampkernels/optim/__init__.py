"""Fused, capturable optimizers: :class:`FusedAdam`, :class:`FusedAdamW` and :class:`FusedSGD`, with float32,
bfloat16 and blockwise 8-bit / 4-bit state, their plain-PyTorch references in :mod:`ampkernels.optim.reference` and
Triton kernels in :mod:`ampkernels.optim.triton`. The native kernels are in ``csrc/optim/``. The moments' storage
formats and their state_dict encoding are in :mod:`ampkernels.optim.state_formats`; the hyperparameters every backend
takes, :class:`AdamHyperparameters` and :class:`SgdHyperparameters`, in :mod:`ampkernels.optim.hyperparameters`."""

from ampkernels.optim.hyperparameters import AdamHyperparameters, SgdHyperparameters
from ampkernels.optim.optimizers import FusedAdam, FusedAdamW, FusedSGD

__all__ = ["AdamHyperparameters", "FusedAdam", "FusedAdamW", "FusedSGD", "SgdHyperparameters"]
