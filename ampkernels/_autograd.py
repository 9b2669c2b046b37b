"""What the library's autograd Functions share."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch._C import _functions

_TWICE = (
    b"trying to differentiate twice a function that was marked with @once_differentiable "
    b"(ampkernels: its kernels have no double backward)"
)


def first_order(backward: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.autograd.function.once_differentiable`` that refuses every second derivative.

    ``once_differentiable`` marks the returned gradients non-differentiable only when an incoming gradient requires
    grad. A gradient penalty on a loss linear in the Function's output passes constant incoming gradients, so the
    returned gradients came back without a graph and their dependence on the saved tensors (the input, the weight)
    was dropped without an error. Here every backward run with grad mode on (``create_graph=True``) returns
    gradients whose differentiation raises."""

    @functools.wraps(backward)
    def wrapper(ctx: Any, *grads: Any) -> Any:
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        if not torch.is_grad_enabled():
            return outputs
        many = isinstance(outputs, tuple)
        outputs = outputs if many else (outputs,)
        marked = [None if v is None else v.detach().requires_grad_(True) for v in outputs]
        refused = _functions.DelayedError(_TWICE, len(marked))(*marked)
        refused = refused if isinstance(refused, tuple) else (refused,)
        return refused if many else refused[0]

    return wrapper
