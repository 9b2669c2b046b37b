"""``convert_to_float8``: swap a model's ``nn.Linear`` layers for :class:`~ampkernels.float8.Float8Linear` in place."""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable

from torch import nn

from ampkernels.float8.linear import Float8DelayedScaling, Float8Linear, Float8Recipe, _check_all_gather, float8_fits

#: Where :func:`convert_to_float8` attaches the delayed recipe's state on the model.
DELAYED_STATE_NAME = "float8_scaling"


# (Over 80 lines: most of it is the docstring, the conversion's rules.)
def convert_to_float8(
    model: nn.Module,
    recipe: str | Float8Recipe = "tensorwise",
    module_filter: Callable[[nn.Module, str], bool] | None = None,
    *,
    min_features: int | None = None,
    fsdp_float8_all_gather: bool = False,
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
        min_features: the size rule. None (default): the rule measured on the H200 (docs/float8.md): a layer is
            converted when ``in_features`` and ``out_features`` are multiples of 16 and its GEMM FLOPs per cast
            element, 2KN / (K + N), are at least ``MIN_FLOPS_PER_CAST_ELEMENT``: 1536 for tensorwise and delayed
            scaling (a 1536 x 1536 layer), 3072 for rowwise (3072 x 3072); below that the casts cost more than
            the faster GEMM saves, at 16384 tokens. An int: both
            dimensions at least ``min_features`` instead; 0 converts every aligned layer.
        fsdp_float8_all_gather: tensorwise only: FSDP2 (``fully_shard``, applied after this call) all-gathers the
            converted layers' weights as FP8 codes, cast with the scale of the global amax (half the bytes of bf16
            weights); call :func:`ampkernels.float8.precompute_float8_scales` after each optimizer step to take
            every layer's amax in one all-reduce. Their weights become new Parameters around the same storage:
            build the optimizer after the conversion. A weight shared with another module (tied embeddings) is left
            out of it, with a warning: it stays the one Parameter both modules hold.

    Parameters, their ``requires_grad``, and the ``state_dict`` (keys and values) are unchanged, so a converted
    model's checkpoint loads into the plain model and back; optimizers built before the call keep working. A layer
    held under several names (one module reused) becomes one Float8Linear under all of them (``module_filter`` sees
    its first name). For ``"delayed"``, the scaling state (:class:`Float8DelayedScaling`, whose history is a
    non-persistent buffer of the model) becomes ``model.float8_scaling`` and a forward pre-hook updates the scales
    before each forward in training mode with grad enabled; a model that has one already is refused before any
    layer is swapped (convert its delayed layers in one call).

    The norms and activations between the layers stay as they are: :func:`~ampkernels.float8.fuse_modules` (its
    companion, called before or after) puts a stock model's RMSNorms and gated MLPs on the fused producers, whose
    outputs' amax the converted layers' casts then reuse.
    """
    recipe = Float8Recipe.named(recipe, **recipe_options)
    _check_all_gather(fsdp_float8_all_gather, recipe)
    if min_features is not None and (not isinstance(min_features, int) or min_features < 0):
        raise ValueError(
            f"convert_to_float8: argument 'min_features': expected None or an int >= 0, got {min_features!r}"
        )

    def wanted(module: nn.Module, name: str) -> bool:
        if type(module) is not nn.Linear:
            return False
        if not float8_fits(module.in_features, module.out_features, min_features, recipe):
            return False
        return module_filter is None or bool(module_filter(module, name))

    if isinstance(model, nn.Linear):
        if not wanted(model, ""):
            return model
        root = Float8Linear.from_linear(model, recipe, fsdp_float8_all_gather=fsdp_float8_all_gather)
        converted = [root]
    else:
        root = model
        # The layers to convert, each once: a module held under several names (a block reused in a model, an
        # nn.Sequential holding one layer twice) is judged under its first name and becomes one Float8Linear that
        # takes its place under every name.
        targets = {id(module): (name, module) for name, module in model.named_modules() if wanted(module, name)}
        if recipe.name == "delayed" and targets and hasattr(root, DELAYED_STATE_NAME):
            # (checked before anything is swapped: the new layers would otherwise keep scales of 1, with no update)
            raise ValueError(
                f"convert_to_float8: the model already has an attribute {DELAYED_STATE_NAME!r}; convert all its "
                "delayed layers in one call"
            )
        # A weight shared with another module (tied embeddings) keeps its plain Parameter: the wrapper would be a
        # second Parameter over the same storage (stepped twice per step) or, put in both modules, hand the other
        # one the FP8 codes FSDP2 gathers.
        holders = model.named_parameters(remove_duplicate=False) if fsdp_float8_all_gather else ()
        uses = Counter(id(p) for _, p in holders)
        untied = []
        replacements = {}
        for key, (name, module) in targets.items():
            gather = fsdp_float8_all_gather and uses[id(module.weight)] == 1
            if fsdp_float8_all_gather and not gather:
                untied.append(name)
            replacements[key] = Float8Linear.from_linear(module, recipe, fsdp_float8_all_gather=gather)
        for parent in list(model.modules()):
            holder = replacements.get(id(parent), parent)  # (an nn.Linear's own child layers go to its successor)
            for child, module in list(parent._modules.items()):  # (named_children would skip a repeated child)
                if module is not None and id(module) in replacements:
                    setattr(holder, child, replacements[id(module)])
        converted = list(replacements.values())
        if untied:
            warnings.warn(
                f"convert_to_float8: fsdp_float8_all_gather leaves out {untied}: their weights are shared with other "
                "modules (tied), so FSDP2 all-gathers them in their own dtype; they still compute in FP8",
                stacklevel=2,
            )
    if recipe.name == "delayed" and converted:
        if hasattr(root, DELAYED_STATE_NAME):
            raise ValueError(f"convert_to_float8: the model already has an attribute {DELAYED_STATE_NAME!r}")
        setattr(root, DELAYED_STATE_NAME, Float8DelayedScaling(root, converted, recipe))
        root.register_forward_pre_hook(_update_delayed_scales)
    return root


def initialize_deferred_state(model: nn.Module) -> None:
    """Writes now, instead of at its first use, the initial values of every delayed-scaling buffer of ``model`` that
    still lacks them: buffers made on the meta device and materialized by ``to_empty`` (FSDP2's deferred
    initialization) hold uninitialized memory until then. For code that copies a model's state before it runs a
    step, as :func:`ampkernels.capture_step` does to restore it after the warm-up."""
    for module in model.modules():
        if isinstance(module, Float8Linear) and module.recipe.name == "delayed":
            module._ensure_float8_state()
        scaling = getattr(module, DELAYED_STATE_NAME, None)
        if isinstance(scaling, Float8DelayedScaling):
            scaling._ensure_state()


def _update_delayed_scales(module: nn.Module, args) -> None:
    import torch

    if module.training and torch.is_grad_enabled():
        getattr(module, DELAYED_STATE_NAME).update()
