"""``from ampkernels.scaled_matmul import scaled_matmul, ScaledLinear``: the public names of :mod:`ampkernels.matmul`,
at the import path the library has always had. ``AUTO_LOG`` is what ``"auto"`` measured (read by the benchmark)."""

from ampkernels.dispatch import AUTO_CANDIDATES
from ampkernels.dispatch import MATMUL_BACKENDS as BACKENDS
from ampkernels.matmul.api import ScaledLinear, clear_caches, scaled_matmul, select_backend
from ampkernels.matmul.dispatch import AUTO_LOG

__all__ = ["AUTO_CANDIDATES", "AUTO_LOG", "BACKENDS", "ScaledLinear", "clear_caches", "scaled_matmul", "select_backend"]
