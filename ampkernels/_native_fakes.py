"""How an op of the native extension gets its fake (meta) implementation, so that ``torch.compile`` can trace it and
``torch.library.opcheck`` can test it: each family registers its ops' fakes beside their Python wrappers with
:func:`native_fake` (``ampkernels.scaler.library``, ``ampkernels.matmul.library``, ``ampkernels.float8.casts``), and
the argument checks they share are here. The schemas are in csrc/ (one ``TORCH_LIBRARY_FRAGMENT`` per family).
Nothing is registered when the extension is missing.

The checks are the C++ ops' own (csrc/*/*_ops.cpp), with their messages' argument names, so that a traced call fails
as the op would: a fake that accepted what the op refuses gave torch.compile outputs of a shape the op never returns
(a norm for norm_type=1), or failed with an unrelated error (unpacking a 3-D x). Only what depends on the data
pointers (overlap, alignment) and the CUDA-only device rule are left to the op. They are Python rather than C++ Meta
kernels calling the ops' own checks: those read sizes as int64, which a tensor with symbolic sizes refuses
(torch.compile with dynamic shapes). tests/test_native_fakes.py compares the two sets of errors case by case, so that
one cannot drift from the other unnoticed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ampkernels import dispatch

#: Every op of the native extension: tests/test_native_fakes.py checks this list against the registered schemas.
NATIVE_OPS = (
    "unscale_reduce_",
    "update_scale_",
    "scaled_matmul_wmma_",
    "scaled_matmul_wgmma_",
    "scaled_matmul_fp8_wgmma_",
    "to_float8_native",
)
#: The fakes registered so far, by op name (every family's, once ``import ampkernels`` has run).
FAKES: dict[str, Callable] = {}


def native_fake(*names: str) -> Callable[[Callable], Callable]:
    """Decorator: the fake of the native ops ``names``, registered now if the extension has them."""

    def register(fn: Callable) -> Callable:
        for name in names:
            if name not in NATIVE_OPS:
                raise ValueError(f"native_fake: {name!r} is not in NATIVE_OPS")
            FAKES[name] = fn
            if dispatch.native() is not None and hasattr(torch.ops.ampkernels, name):
                torch.library.register_fake(f"ampkernels::{name}")(fn)
        return fn

    return register


def check(cond, arg: str, message) -> None:
    torch._check(cond, lambda: f"ampkernels: argument '{arg}': {message() if callable(message) else message}")


def check_scalar_float(t, arg: str, device=None) -> None:
    check(t.dtype == torch.float32, arg, lambda: f"expected a float32 tensor, got {t.dtype}")
    check(t.numel() == 1, arg, lambda: f"expected a 1-element tensor, got {t.numel()} elements")
    if device is not None:
        check(t.device == device, arg, lambda: f"expected a tensor on {device}, got one on {t.device}")
