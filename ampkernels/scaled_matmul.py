"""``from ampkernels.scaled_matmul import scaled_matmul, ScaledLinear``: the public names of :mod:`ampkernels.matmul`
at their import path, with the backend queries of :mod:`ampkernels.dispatch` for this op. ``AUTO_LOG`` is what
``"auto"`` measured (read by the benchmark)."""

from __future__ import annotations

import torch

from ampkernels import dispatch
from ampkernels.matmul.api import ScaledLinear, clear_caches, scaled_matmul, select_backend
from ampkernels.matmul.backends import AUTO_CANDIDATES, SCALED_MATMUL
from ampkernels.matmul.launch import AUTO_LOG

BACKENDS = SCALED_MATMUL.names

__all__ = [
    "AUTO_CANDIDATES",
    "AUTO_LOG",
    "BACKENDS",
    "ScaledLinear",
    "clear_caches",
    "scaled_matmul",
    "select_backend",
    "why_not",
]


def why_not(backend: str, device: torch.device | str) -> str | None:
    """``dispatch.why_not("scaled_matmul", backend, device)``."""
    return dispatch.why_not("scaled_matmul", backend, device)


def _load_triton():
    """(``ampkernels.matmul.triton.scaled_matmul`` or None, None): its ``TUNING_LOG`` is read by
    benchmarks/bench_scaled_matmul.py."""
    return dispatch.triton_module("scaled_matmul"), None
