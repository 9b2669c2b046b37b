"""scaled_matmul: ``scale * (a @ b) + bias`` with fp32 accumulation, in one kernel.

* :mod:`ampkernels.matmul.api`: :func:`scaled_matmul`, :class:`ScaledLinear`, argument checks and normalization,
  the per-signature cache of checked calls;
* :mod:`ampkernels.matmul.library`: the ``torch.library`` ops ``ampkernels::scaled_mm_`` / ``ampkernels::scaled_mm``,
  their fake implementations and autograd;
* :mod:`ampkernels.matmul.launch`: the launch on the chosen backend and ``"auto"``'s per-problem timing (which
  backends exist and the default: :mod:`ampkernels.dispatch`);
* :mod:`ampkernels.matmul.tuning`: the tuning switches (timing on or off; tile configurations forced for the probes
  and tests).
"""

from ampkernels.matmul.api import ScaledLinear, clear_caches, scaled_matmul, select_backend

__all__ = ["ScaledLinear", "clear_caches", "scaled_matmul", "select_backend"]
