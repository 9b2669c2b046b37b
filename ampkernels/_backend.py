"""Which implementation runs each op, and why.

Order of preference: the native extension (CUDA C++ kernels for CUDA tensors, CPU C++ kernels for CPU tensors),
then Triton (CUDA tensors, or any tensors under ``TRITON_INTERPRET=1``), then plain PyTorch (``reference.py``).
A missing piece never breaks ``import ampkernels``: it only removes a backend, and asking for that backend by name
raises with the reason. ``AMPKERNELS_BACKEND=native|triton|torch`` overrides the choice process-wide.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

BACKENDS = ("native", "triton", "torch")


@functools.cache
def _load_native():
    try:
        return importlib.import_module("ampkernels._C"), None
    except ImportError as exc:  # not built, or built against another torch
        return None, (
            f"ampkernels._C could not be imported ({exc}); build it with "
            "`pip install --no-build-isolation -e .` (set CUDA_HOME for the CUDA kernels)"
        )


def native():
    """The native extension module, or ``None``."""
    return _load_native()[0]


@functools.cache
def _load_triton():
    try:
        import triton  # noqa: F401

        from ampkernels.triton import multi_tensor

        return multi_tensor, None
    except Exception as exc:  # ImportError, or a Triton that fails to initialise
        return None, f"triton is not usable ({type(exc).__name__}: {exc})"


def triton_module():
    """``ampkernels.triton.multi_tensor``, or ``None`` when Triton cannot be imported."""
    return _load_triton()[0]


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def why_not(backend: str, device: torch.device) -> str | None:
    """``None`` when ``backend`` can run on ``device``, else the reason it cannot."""
    device = torch.device(device)
    if backend == "native":
        mod, err = _load_native()
        if mod is None:
            return err
        if device.type == "cuda" and not mod.with_cuda:
            return "ampkernels._C was built without CUDA (no CUDA toolkit or a CPU build of torch at build time)"
        if device.type not in ("cpu", "cuda"):
            return f"no native kernels for {device.type} tensors"
        return None
    if backend == "triton":
        mod, err = _load_triton()
        if mod is None:
            return err
        if device.type == "cuda" or triton_interpreting():
            return None
        return "Triton runs on CUDA tensors (or on CPU tensors under TRITON_INTERPRET=1)"
    if backend == "torch":
        return None
    raise ValueError(f"ampkernels: argument 'backend': expected one of {BACKENDS}, got {backend!r}")


def select(device: torch.device, requested: str | None = None) -> str:
    """The backend to run on ``device``: ``requested`` (error if it cannot run), else the env override, else the
    first that can run. On CPU, Triton is chosen only when requested (the interpreter is for testing)."""
    device = torch.device(device)
    requested = requested or os.environ.get("AMPKERNELS_BACKEND") or None
    if requested is not None:
        reason = why_not(requested, device)
        if reason is not None:
            raise RuntimeError(f"ampkernels: backend {requested!r} cannot run on {device}: {reason}")
        return requested
    order = ("native", "triton", "torch") if device.type == "cuda" else ("native", "torch")
    for name in order:
        if why_not(name, device) is None:
            return name
    return "torch"


def same_params(groups: list, flat: tuple) -> bool:
    """Whether the parameter lists ``groups`` still hold exactly the objects ``flat`` (identity, in order): lets the
    scaler's and the optimizers' cached launch plans notice ``group["params"][i] = new_param``."""
    mod = native()
    if mod is not None:
        return mod.same_params(groups, flat)
    return sum(len(g) for g in groups) == len(flat) and all(
        a is b for a, b in zip((p for g in groups for p in g), flat)
    )


def to_kernel_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A scalar tensor (scale, factor, flag) on the ``device`` whose kernels read it. Asynchronous, except from a
    GPU to the CPU: the CPU kernels read the value at once, and a non-blocking device-to-host copy lands in pinned
    memory later (seen as garbage scales on CPU parameters)."""
    if t.device == device:
        return t
    return t.to(device, non_blocking=not (t.device.type == "cuda" and device.type == "cpu"))
