"""One-line hookups of ampkernels into training frameworks (docs/integrations.md).

- :mod:`ampkernels.integrations.accelerate`: ``Accelerator(mixed_precision="fp16")`` on :class:`FusedGradScaler`
  and its fused clip, with no host sync per step.
- :mod:`ampkernels.integrations.transformers`: a Hugging Face ``Trainer`` on :class:`FusedAdamW` (any state
  format) and :class:`FusedGradScaler`, ``max_grad_norm`` on the fused clip.
- :mod:`ampkernels.integrations.lightning`: ``MixedPrecision`` / ``FabricMixedPrecision`` precision plugins
  (``"16-mixed"``, ``"bf16-mixed"``, FP8 through :func:`ampkernels.float8.convert_to_float8`).

Importing this package needs none of the frameworks; a submodule imports its framework when it is imported and,
without it, raises an ImportError that names the package to install (``pip install ampkernels[integrations]``
installs all three).
"""

from __future__ import annotations

import importlib
from typing import Any

_SUBMODULES = ("accelerate", "lightning", "transformers")
__all__ = list(_SUBMODULES)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
