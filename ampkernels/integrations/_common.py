"""What the integrations share: importing a framework with an error that says how to install it."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, package: str, integration: str) -> ModuleType:
    """Import ``module`` (from the pip package ``package``) for ``ampkernels.integrations.<integration>``.

    Raises:
        ImportError: naming the package to install, when ``module`` cannot be imported; a ModuleNotFoundError
            with the missing module's ``name`` when it is not installed, as ``import`` itself raises.
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        kind = ModuleNotFoundError if isinstance(err, ModuleNotFoundError) else ImportError
        raise kind(
            f"ampkernels.integrations.{integration} needs the '{package}' package, which could not be imported "
            f"({err}). Install it with `pip install {package}` (or all frameworks: "
            "`pip install ampkernels[integrations]`)",
            name=err.name,
        ) from err
