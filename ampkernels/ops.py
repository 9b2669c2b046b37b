"""The scaler's functional ops at their documented path, ``ampkernels.ops.unscale_reduce_`` and the others: defined
in :mod:`ampkernels.scaler.functional`."""

from ampkernels.scaler.functional import UnscaleResult, check_and_norm, unscale_, unscale_reduce_, update_scale_

__all__ = ["UnscaleResult", "check_and_norm", "unscale_", "unscale_reduce_", "update_scale_"]
