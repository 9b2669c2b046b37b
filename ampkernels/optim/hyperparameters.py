"""The hyperparameters of one optimizer step, as every backend takes them: frozen dataclasses built once per param
group and step, and handed unchanged to the Triton launchers, the plain-PyTorch references and the native tables.

Each mirrors a C++ struct of ``csrc/optim/optimizer.h`` field for field (``AdamHyperparameters``,
``SgdHyperparameters``); the extension reads the fields by name, and a test checks that the two lists agree. The
learning rate is not among them: it may change between steps, and a 0-d device tensor lr is read by the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AdamHyperparameters:
    """One Adam/AdamW step's options (torch.optim.Adam's names and meanings).

    Attributes:
        beta1, beta2: the moments' decay rates, in [0, 1).
        eps: added to the denominator after the bias correction.
        weight_decay: L2 penalty added to the gradient, or with ``decoupled_weight_decay`` AdamW's decay
            ``p *= 1 - lr * weight_decay``.
        amsgrad: divide by the running maximum of the second moment.
        maximize: step up the gradient.
        decoupled_weight_decay: AdamW's decay instead of L2.
        stochastic_rounding: round updated bfloat16 parameters stochastically (the blockwise step; other
            parameters and the plain step ignore it).
        seed: the rounding stream's seed, an int in [0, 2**63).
    """

    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False
    maximize: bool = False
    decoupled_weight_decay: bool = False
    stochastic_rounding: bool = False
    seed: int = 0

    @classmethod
    def of_group(cls, group: dict[str, Any]) -> AdamHyperparameters:
        """The options of a FusedAdam param group (its ``betas`` split), as plain floats, bools and an int."""
        beta1, beta2 = group["betas"]
        return _frozen(
            cls,
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            amsgrad=bool(group["amsgrad"]),
            maximize=bool(group["maximize"]),
            decoupled_weight_decay=bool(group["decoupled_weight_decay"]),
            stochastic_rounding=bool(group.get("stochastic_rounding", False)),
            seed=int(group.get("seed", 0)),
        )


@dataclass(frozen=True)
class SgdHyperparameters:
    """One SGD step's options (torch.optim.SGD's names and meanings)."""

    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    maximize: bool = False

    @classmethod
    def of_group(cls, group: dict[str, Any]) -> SgdHyperparameters:
        """The options of a FusedSGD param group, as plain floats and bools."""
        return _frozen(
            cls,
            momentum=float(group["momentum"]),
            dampening=float(group["dampening"]),
            weight_decay=float(group["weight_decay"]),
            nesterov=bool(group["nesterov"]),
            maximize=bool(group["maximize"]),
        )


def _frozen(cls, **fields: Any) -> Any:
    """``cls(**fields)`` for a frozen dataclass without ``__post_init__``, every field given."""
    # NOTE: the instance dict written in one update: AdamHyperparameters.of_group took 1.9 us with the generated
    # __init__ (an object.__setattr__ a field), a cost every param group pays every step, and takes 1.3 so (the
    # keyword dicts it replaces: 0.5 us, built twice a bucket).
    instance = object.__new__(cls)
    instance.__dict__.update(fields)
    return instance
