"""``convert_to_float8``: swap a model's ``nn.Linear`` layers for :class:`~ampkernels.float8.Float8Linear` in place."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ampkernels.float8.linear import Float8DelayedScaling, Float8Linear, Float8Recipe, float8_fits

# NOTE: provisional until the sweep of benchmarks/bench_float8.py ("layer sizes") has measured where FP8 overtakes
# bf16 for forward + backward of one layer at 16384 tokens on the H200; docs/float8.md records the measurement.
MIN_FEATURES = 1024
#: Where :func:`convert_to_float8` attaches the delayed recipe's state on the model.
DELAYED_STATE_NAME = "float8_scaling"


def convert_to_float8(
    model: nn.Module,
    recipe: str | Float8Recipe = "tensorwise",
    module_filter: Callable[[nn.Module, str], bool] | None = None,
    *,
    min_features: int = MIN_FEATURES,
    **recipe_options,
) -> nn.Module:
    """Replaces, in place, every ``nn.Linear`` of ``model`` (its own type, not a subclass) by a
    :class:`Float8Linear` that shares its parameters, and returns ``model`` (or the new layer when ``model`` itself
    is an ``nn.Linear``).

    Args:
        recipe: ``"tensorwise"``, ``"rowwise"``, ``"delayed"`` or a :class:`Float8Recipe`; ``recipe_options``
            override the named recipe's fields (e.g. ``amax_history_len=1024, amax_compute_algo="most_recent",
            margin=1`` for ``"delayed"``).
        module_filter: ``(module, fully_qualified_name) -> bool``, like torchao's ``module_filter_fn``: only layers
            for which it returns True are converted. Applied after the size rule.
        min_features: the size rule: a layer is converted only when ``in_features`` and ``out_features`` are
            multiples of 16 and both at least ``min_features`` (smaller products do not gain from FP8: the casts
            cost more than the faster GEMM saves; see docs/float8.md for the measurement). 0 converts every aligned
            layer.

    Parameters, their ``requires_grad``, and the ``state_dict`` (keys and values) are unchanged, so a converted
    model's checkpoint loads into the plain model and back; optimizers built before the call keep working. For
    ``"delayed"``, the scaling state (:class:`Float8DelayedScaling`, whose history is a non-persistent buffer of the
    model) becomes ``model.float8_scaling`` and a forward pre-hook updates the scales before each forward in
    training mode with grad enabled.
    """
    recipe = Float8Recipe.named(recipe, **recipe_options)
    if not isinstance(min_features, int) or min_features < 0:
        raise ValueError(f"convert_to_float8: argument 'min_features': expected an int >= 0, got {min_features!r}")

    def wanted(module: nn.Module, name: str) -> bool:
        if type(module) is not nn.Linear or not float8_fits(module.in_features, module.out_features, min_features):
            return False
        return module_filter is None or bool(module_filter(module, name))

    if isinstance(model, nn.Linear):
        if not wanted(model, ""):
            return model
        root = Float8Linear.from_linear(model, recipe)
        converted = [root]
    else:
        root = model
        converted = []
        for name, module in list(model.named_modules()):
            if not wanted(module, name):
                continue
            parent_name, _, child = name.rpartition(".")
            new = Float8Linear.from_linear(module, recipe)
            setattr(model.get_submodule(parent_name), child, new)
            converted.append(new)
    if recipe.name == "delayed" and converted:
        if hasattr(root, DELAYED_STATE_NAME):
            raise ValueError(f"convert_to_float8: the model already has an attribute {DELAYED_STATE_NAME!r}")
        setattr(root, DELAYED_STATE_NAME, Float8DelayedScaling(root, converted, recipe))
        root.register_forward_pre_hook(_update_delayed_scales)
    return root


def _update_delayed_scales(module: nn.Module, args) -> None:
    import torch

    if module.training and torch.is_grad_enabled():
        getattr(module, DELAYED_STATE_NAME).update()
