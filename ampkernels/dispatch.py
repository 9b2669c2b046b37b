"""Which implementation runs each op, why another cannot, and how to override the choice.

Ops and their backends (``BACKENDS[op]``, in order of preference):

* ``unscale_reduce_``, ``update_scale_`` (the scaler's ops) and ``adam``, ``sgd`` (the fused optimizers):
  ``native`` (the C++ extension: CUDA kernels for CUDA tensors, CPU kernels for CPU tensors), ``triton`` (CUDA
  tensors; CPU tensors under ``TRITON_INTERPRET=1``, chosen there only when asked for: the interpreter is for tests),
  ``torch`` (plain PyTorch, :mod:`ampkernels.reference`).
* ``adam_blockwise`` (FusedAdam with low-precision moments or stochastic rounding): the same three, Triton first on
  CUDA tensors (measured faster there), native first on CPU tensors.
* ``scaled_matmul``: ``auto`` (Hopper: Triton or wgmma per problem, the faster as timed on first use), ``triton``,
  ``wgmma`` (the native sm_90a kernel), ``wmma`` (the native sm_75+ kernel), ``torch`` (the reference). On CPU
  tensors the default is ``torch``. ``cublas`` is a name of the float8 op only: asked for with 16-bit operands it
  raises (:func:`why_not` says why).
* ``scaled_matmul_float8`` (``scaled_matmul`` on float8 operands): ``auto`` (the fastest of Triton, wgmma and
  cuBLAS per problem, timed on first use; Triton only where neither native backend takes the problem), ``triton``
  (fp8 ``tl.dot``, sm_89+), ``wgmma`` (the native op
  ``scaled_matmul_fp8_wgmma_``, in builds with sm_90a that have it), ``cublas`` (``torch._scaled_mm``, the rest of
  the epilogue in torch ops after it; on CPU tensors torch's CPU kernel), ``torch`` (the reference). On CPU tensors
  the default is ``torch``.
* ``to_float8`` (the FP8 casts of :mod:`ampkernels.float8`): ``native`` (the CUDA kernels of the extension, the
  default on CUDA tensors: a launch costs a few microseconds of host time, Triton's launcher tens), ``triton`` (CUDA
  tensors; CPU tensors under ``TRITON_INTERPRET=1`` when asked for), ``torch`` (the reference, the default on CPU
  tensors).
* ``linear_cross_entropy`` (:func:`ampkernels.linear_cross_entropy`, its per-chunk loss and logits' gradient):
  ``triton`` (the default on CUDA tensors) and ``torch`` (the default on CPU tensors), chosen as ``float8_fused``;
  ``AMPKERNELS_BACKEND=native`` leaves it on its default.
* ``float8_fused`` (:func:`ampkernels.float8.rms_norm`, :func:`~ampkernels.float8.silu_mul` and
  :func:`~ampkernels.float8.rotary_embedding`, forward and backward): ``triton`` and ``torch``, chosen as for
  ``to_float8``; ``native`` (from ``AMPKERNELS_FLOAT8_BACKEND`` or ``AMPKERNELS_BACKEND``) leaves them on their
  default.

A missing piece never breaks ``import ampkernels``: it only removes a backend, and asking for that backend by name
raises with the reason (:func:`why_not`). Missing means an optional dependency that is not installed: ``triton``, or
the extension ``ampkernels._C`` not built. A piece that is there but fails to import (a module of ours raising
NameError or ImportError, an extension built against another torch) is never reported as unavailable: the first
:func:`why_not`, :func:`select`, :func:`native` or :func:`triton_module` that needs it raises
:class:`BackendImportError` from the original exception (for the extension that is ``import ampkernels`` itself,
which registers its fake ops). The choice (:func:`select`): the backend passed by the caller, else the
op's environment variable, else ``AMPKERNELS_BACKEND``, else the first that runs.

Environment variables read by ampkernels (``python -m ampkernels.info`` prints those set):

* ``AMPKERNELS_BACKEND`` = native|triton|torch: every op's backend. For scaled_matmul ``native`` means the native
  kernel that runs here (wgmma, else wmma; on float8 operands the fp8 wgmma op); ``triton`` and ``torch`` mean
  themselves.
* ``AMPKERNELS_SCALER_BACKEND`` = native|triton|torch: unscale_reduce_ and update_scale_ (FusedGradScaler, ops).
* ``AMPKERNELS_OPTIMIZER_BACKEND`` = native|triton|torch: FusedAdam/FusedAdamW/FusedSGD.
* ``AMPKERNELS_SCALED_MATMUL_BACKEND`` = auto|triton|wgmma|wmma|torch: scaled_matmul and ScaledLinear.
* ``AMPKERNELS_SCALED_MATMUL_FLOAT8_BACKEND`` = auto|triton|wgmma|cublas|torch: scaled_matmul on float8 operands.
* ``AMPKERNELS_FLOAT8_BACKEND`` = native|triton|torch: the FP8 casts (to_float8, to_float8_pair) and the fused kernels
  of ampkernels.float8 (rms_norm, silu_mul, rotary_embedding).
* ``AMPKERNELS_LOSS_BACKEND`` = triton|torch: the per-chunk step of linear_cross_entropy.
* ``AMPKERNELS_TUNE`` = 1 (default) | 0: 0 turns off timing (Triton's matmul config tuning and ``auto``'s choice
  between Triton and wgmma); fixed rules decide instead. Read once, when ampkernels is imported, into
  ``ampkernels.matmul.tuning.TUNE``, which a running process sets instead.
* ``TRITON_INTERPRET`` = 1 (Triton's own): Triton kernels run on CPU tensors in the interpreter; must be set before
  ampkernels imports its Triton kernels (``triton.jit`` reads it when it decorates them).

Debug switches are module attributes, not environment variables (tests and the probes in dev/ set them; call
``ampkernels.matmul.clear_caches()`` after changing one): ``ampkernels.matmul.tuning.WMMA_TILE`` and ``WGMMA_BN``
force the native WMMA and wgmma kernels' tile configurations; ``TMA_DESCRIPTORS`` and ``DIRECT_LAUNCH`` of
``ampkernels.matmul.triton.scaled_matmul`` choose how the Triton matmul builds its TMA descriptors and launches.

Read at build time by ``setup.py``: ``AMPKERNELS_NO_NATIVE=1`` (no C++ at all), ``AMPKERNELS_NO_CUDA=1`` (CPU
kernels only).

The backend variables are read on each choice; scaled_matmul remembers its choice per call signature, so call
``ampkernels.matmul.clear_caches()`` after changing them in a running process.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os

import torch

SCALER_OPS = ("unscale_reduce_", "update_scale_")
# "adam_blockwise": FusedAdam's step with low-precision moments or stochastic rounding (its own choice of backend).
OPTIMIZER_OPS = ("adam", "sgd", "adam_blockwise")
_MULTI_TENSOR_BACKENDS = ("native", "triton", "torch")
# "cublas" (torch._scaled_mm) takes float8 operands only: a 16-bit call asking for it raises (see why_not).
MATMUL_BACKENDS = ("auto", "triton", "wgmma", "wmma", "cublas", "torch")
FLOAT8_MATMUL_BACKENDS = ("auto", "triton", "wgmma", "cublas", "torch")
FLOAT8_CAST_BACKENDS = ("native", "triton", "torch")
FLOAT8_FUSED_BACKENDS = ("triton", "torch")
#: The backends "auto" chooses between, per problem (per op).
AUTO_CANDIDATES = ("triton", "wgmma")
FLOAT8_AUTO_CANDIDATES = ("triton", "wgmma", "cublas")
_AUTO_CANDIDATES = {"scaled_matmul": AUTO_CANDIDATES, "scaled_matmul_float8": FLOAT8_AUTO_CANDIDATES}
#: The elementwise ops of ampkernels.float8 (casts; fused norm, SiLU-up, RoPE).
FLOAT8_ELEMENTWISE_OPS = ("to_float8", "float8_fused")
#: Ops with a Triton kernel and the reference's math only (Triton the default on CUDA tensors, torch on CPU tensors).
TRITON_OR_TORCH_OPS = ("float8_fused", "linear_cross_entropy")

BACKENDS: dict[str, tuple[str, ...]] = {
    **{op: _MULTI_TENSOR_BACKENDS for op in SCALER_OPS + OPTIMIZER_OPS},
    "scaled_matmul": MATMUL_BACKENDS,
    "scaled_matmul_float8": FLOAT8_MATMUL_BACKENDS,
    "to_float8": FLOAT8_CAST_BACKENDS,
    "float8_fused": FLOAT8_FUSED_BACKENDS,
    "linear_cross_entropy": ("triton", "torch"),
}

GLOBAL_VARIABLE = "AMPKERNELS_BACKEND"
#: The environment variable that overrides each op's backend (before ``AMPKERNELS_BACKEND``).
VARIABLES: dict[str, str] = {
    **{op: "AMPKERNELS_SCALER_BACKEND" for op in SCALER_OPS},
    **{op: "AMPKERNELS_OPTIMIZER_BACKEND" for op in OPTIMIZER_OPS},
    "scaled_matmul": "AMPKERNELS_SCALED_MATMUL_BACKEND",
    "scaled_matmul_float8": "AMPKERNELS_SCALED_MATMUL_FLOAT8_BACKEND",
    "to_float8": "AMPKERNELS_FLOAT8_BACKEND",
    "float8_fused": "AMPKERNELS_FLOAT8_BACKEND",
    "linear_cross_entropy": "AMPKERNELS_LOSS_BACKEND",
}

#: Every environment variable ampkernels reads at run time (the docstring above says what each does).
ENVIRONMENT = (
    GLOBAL_VARIABLE,
    "AMPKERNELS_SCALER_BACKEND",
    "AMPKERNELS_OPTIMIZER_BACKEND",
    "AMPKERNELS_SCALED_MATMUL_BACKEND",
    "AMPKERNELS_SCALED_MATMUL_FLOAT8_BACKEND",
    "AMPKERNELS_FLOAT8_BACKEND",
    "AMPKERNELS_LOSS_BACKEND",
    "AMPKERNELS_TUNE",
    "TRITON_INTERPRET",
)

_TRITON_MODULES = {
    **{op: "ampkernels.scaler.triton.multi_tensor" for op in SCALER_OPS},
    "adam": "ampkernels.optim.triton.optimizers",
    "sgd": "ampkernels.optim.triton.optimizers",
    "adam_blockwise": "ampkernels.optim.triton.blockwise",
    "scaled_matmul": "ampkernels.matmul.triton.scaled_matmul",
    "scaled_matmul_float8": "ampkernels.matmul.triton.scaled_matmul",
    "to_float8": "ampkernels.float8.triton.casts",
    "float8_fused": "ampkernels.float8.triton.fused",
    "linear_cross_entropy": "ampkernels.loss.triton.cross_entropy",
}


# --------------------------------------------------------------------------------------------------------------------
# What is installed
# --------------------------------------------------------------------------------------------------------------------


# NOTE: plain dicts, not functools.cache: the float8 wrappers choose their backend inside compiled regions, and
# torch.compile traces a functools.cache wrapper into the wrapped function (an import, which it refuses: seen on the
# H200), while it reads a dict entry an eager call already filled (tests/test_dispatch.py).
_LOADED: dict[str, tuple] = {}
_NATIVE_OPS: dict[str, object] = {}


class BackendImportError(Exception):
    """A backend module of ampkernels is installed but fails to import: a bug in it, or a stale native build. Not an
    ImportError on purpose: nothing that handles a missing optional piece (``except ImportError``) may swallow it."""


def _not_installed(exc: BaseException, package: str) -> bool:
    """Whether ``exc`` says that ``package`` (or a module under it) is not installed, and ``package`` indeed cannot
    be found: a ``ModuleNotFoundError`` for ``triton.langauge`` (a typo of ours) while ``triton`` is installed is
    not a missing dependency."""
    if not isinstance(exc, ModuleNotFoundError) or exc.name is None:
        return False
    if exc.name != package and not exc.name.startswith(package + "."):
        return False
    top = package.split(".")[0]
    if top != package:  # ampkernels._C: its parent package is importing, so only the module itself can be missing
        return exc.name == package
    try:
        return importlib.util.find_spec(top) is None
    except (ImportError, ValueError):  # sys.modules[top] is None, or a module without a spec: not importable
        return True


def _import(module: str, package: str, reason, broken) -> tuple:
    """(module, None), or (None, ``reason(exc)``) when ``package`` (an optional dependency) is not installed;
    remembered. Any other failure raises :class:`BackendImportError` with ``broken(exc)`` from the original
    exception, every time: a module of ours that does not import is a bug to show, not a backend to skip."""
    loaded = _LOADED.get(module)
    if loaded is None:
        try:
            loaded = importlib.import_module(module), None
        except Exception as exc:
            if not _not_installed(exc, package):
                raise BackendImportError(broken(exc)) from exc
            loaded = None, reason(exc)
        _LOADED[module] = loaded
    return loaded


_BUILD = "`pip install --no-build-isolation -e .` (set CUDA_HOME for the CUDA kernels)"


def _load_native():
    return _import(
        "ampkernels._C",
        "ampkernels._C",
        lambda exc: f"ampkernels._C is not built ({exc}); build it with {_BUILD}",
        lambda exc: (
            f"ampkernels._C is built but does not load ({type(exc).__name__}: {exc}): a build against another torch "
            f"or older sources (an undefined symbol says so); rebuild it with {_BUILD}, or delete ampkernels/_C*.so "
            "to run without the native kernels"
        ),
    )


def native():
    """The native extension module (importing it registers the ``torch.ops.ampkernels`` ops), or ``None`` when it is
    not built. Raises :class:`BackendImportError` when it is built but does not load."""
    return _load_native()[0]


def _load_triton(module: str):
    return _import(
        module,
        "triton",
        lambda exc: f"triton is not installed ({exc})",
        lambda exc: f"{module} failed to import ({type(exc).__name__}: {exc}); triton itself is installed",
    )


def triton_module(op: str):
    """The Triton launch module of ``op`` (e.g. ``ampkernels.scaler.triton.multi_tensor``), or ``None`` when Triton is
    not installed. Raises :class:`BackendImportError` when the module fails to import for any other reason."""
    return _load_triton(_TRITON_MODULES[_check_op(op)])[0]


def triton_interpreting() -> bool:
    """Whether Triton kernels run in the interpreter (on CPU tensors) rather than on a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _native_op(name: str):
    if name not in _NATIVE_OPS:
        native()
        try:
            _NATIVE_OPS[name] = getattr(torch.ops.ampkernels, name)
        except (AttributeError, RuntimeError):
            _NATIVE_OPS[name] = None
    return _NATIVE_OPS[name]


def wmma_op():
    """``torch.ops.ampkernels.scaled_matmul_wmma_``, or ``None`` when the extension lacks it."""
    return _native_op("scaled_matmul_wmma_")


def wgmma_op():
    """``torch.ops.ampkernels.scaled_matmul_wgmma_``, or ``None`` when the extension lacks it."""
    return _native_op("scaled_matmul_wgmma_")


def float8_cast_op():
    """``torch.ops.ampkernels.to_float8_native`` (the CUDA FP8 casts), or ``None`` when the extension lacks it."""
    return _native_op("to_float8_native")


def wgmma_float8_op():
    """``torch.ops.ampkernels.scaled_matmul_fp8_wgmma_``, or ``None`` when the extension lacks it."""
    return _native_op("scaled_matmul_fp8_wgmma_")


# --------------------------------------------------------------------------------------------------------------------
# Why a backend cannot run
# --------------------------------------------------------------------------------------------------------------------


def _check_op(op: str) -> str:
    if op not in BACKENDS:
        raise ValueError(f"ampkernels: unknown op {op!r}; ops: {', '.join(BACKENDS)}")
    return op


def check_backend(op: str, backend: str | None, argument: str = "backend") -> str | None:
    """``backend`` if it is ``None`` or one of ``op``'s backend names, else a ValueError naming ``argument`` and the
    valid names (an empty string is not "the default": it raises too)."""
    valid = BACKENDS[_check_op(op)]
    if backend is not None and backend not in valid:
        where = f"environment variable {argument}" if argument.startswith("AMPKERNELS_") else f"argument '{argument}'"
        raise ValueError(
            f"ampkernels: {where}: expected one of {'/'.join(valid)} for {op} (or unset for the default), "
            f"got {backend!r}"
        )
    return backend


def _why_not_native(device: torch.device) -> str | None:
    mod, err = _load_native()
    if mod is None:
        return err
    if device.type == "cuda" and not mod.with_cuda:
        return "ampkernels._C was built without CUDA (no CUDA toolkit or a CPU build of torch at build time)"
    if device.type not in ("cpu", "cuda"):
        return f"no native kernels for {device.type} tensors"
    return None


def _why_not_triton(op: str, device: torch.device) -> str | None:
    mod, err = _load_triton(_TRITON_MODULES[op])
    if mod is None:
        return err
    if triton_interpreting():
        if device.type == "cpu":
            return None
        return f"TRITON_INTERPRET=1 runs the Triton kernels on the host: CPU tensors only, not {device.type}"
    if device.type == "cuda":
        return None
    return "Triton runs on CUDA tensors (or on CPU tensors under TRITON_INTERPRET=1)"


def _why_not_matmul(backend: str, device: torch.device) -> str | None:
    if backend == "cublas":
        return (
            "'cublas' (torch._scaled_mm) runs float8 operands only; float16/bfloat16 operands run on "
            f"{'/'.join(n for n in MATMUL_BACKENDS if n != 'cublas')}"
        )
    if backend == "wmma":
        if device.type != "cuda":
            return "the WMMA kernel runs on CUDA tensors only"
        if wmma_op() is None:
            return _why_not_native(device) or (
                "ampkernels._C has no scaled_matmul_wmma_ op (built without its CUDA kernel); "
                "rebuild with `pip install --no-build-isolation -e .` and CUDA_HOME set"
            )
        return None
    if backend == "wgmma":
        if device.type != "cuda":
            return "the wgmma kernel runs on CUDA tensors only"
        if wgmma_op() is None:
            return _why_not_native(device) or "ampkernels._C has no scaled_matmul_wgmma_ op"
        mod = native()
        if not getattr(mod, "wgmma_built", False):
            arch_list = getattr(mod, "cuda_arch_list", "")
            return f"ampkernels._C was built for {arch_list!r}, without 9.0a (TORCH_CUDA_ARCH_LIST), which wgmma needs"
        capability = torch.cuda.get_device_capability(device)
        if capability != (9, 0):
            return f"wgmma needs a compute capability 9.0 GPU (H100, H200), this one is {capability[0]}.{capability[1]}"
        return None
    if backend == "auto":
        if auto_candidates(device):
            return None
        return f"'auto' chooses between {' and '.join(AUTO_CANDIDATES)} per problem, and neither runs here"
    raise AssertionError(backend)


def _float8_capable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return None
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        return f"float8 Tensor Cores need compute capability 8.9 or newer, this GPU is {capability[0]}.{capability[1]}"
    return None


def _why_not_float8_matmul(backend: str, device: torch.device) -> str | None:
    if backend == "triton":
        return _why_not_triton("scaled_matmul_float8", device) or _float8_capable(device)
    if backend == "cublas":
        if not hasattr(torch, "_scaled_mm"):
            return f"this torch ({torch.__version__}) has no torch._scaled_mm"
        if device.type not in ("cpu", "cuda"):
            return f"torch._scaled_mm runs CUDA (and CPU) tensors, not {device.type}"
        return _float8_capable(device)
    if backend == "wgmma":
        reason = _why_not_matmul("wgmma", device)
        if reason is None and wgmma_float8_op() is None:
            reason = "ampkernels._C has no scaled_matmul_fp8_wgmma_ op (built without the fp8 wgmma kernel)"
        return reason
    if backend == "auto":
        if auto_candidates(device, "scaled_matmul_float8"):
            return None
        return f"'auto' chooses between {', '.join(FLOAT8_AUTO_CANDIDATES)} per problem, and none runs here"
    raise AssertionError(backend)


def why_not(op: str, backend: str, device: torch.device | str) -> str | None:
    """``None`` when ``backend`` can run ``op`` on ``device``, else the reason it cannot."""
    check_backend(op, backend)
    device = torch.device(device)
    if backend == "torch":
        return None
    if op == "scaled_matmul_float8" and backend != "native":
        return _why_not_float8_matmul(backend, device)
    if backend == "triton":
        return _why_not_triton(op, device)
    if backend == "native":
        reason = _why_not_native(device)
        if reason is None and op == "to_float8":
            if device.type != "cuda":
                return "the native FP8 casts run CUDA tensors only (CPU tensors take the reference)"
            if float8_cast_op() is None:
                return "ampkernels._C has no to_float8_native op (built before the native casts; rebuild it)"
        return reason
    return _why_not_matmul(backend, device)


@functools.cache
def _auto_candidates(device: torch.device, op: str) -> tuple[str, ...]:
    return tuple(name for name in _AUTO_CANDIDATES[op] if why_not(op, name, device) is None)


def auto_candidates(device: torch.device, op: str = "scaled_matmul") -> tuple[str, ...]:
    """The backends "auto" chooses between that run ``op`` (scaled_matmul or scaled_matmul_float8) on ``device``
    (:data:`AUTO_CANDIDATES`, :data:`FLOAT8_AUTO_CANDIDATES`; cached per device)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _auto_candidates(device, op)


# --------------------------------------------------------------------------------------------------------------------
# The choice
# --------------------------------------------------------------------------------------------------------------------


def requested(op: str, backend: str | None = None) -> tuple[str | None, str]:
    """(the backend asked for, who asked): ``backend`` (argument), else the op's variable, else the global one;
    ``(None, "default")`` when nobody asked. Raises ValueError for a name that is not one of the op's backends."""
    check_backend(op, backend)
    if backend is not None:
        return backend, "argument 'backend'"
    variable = VARIABLES[op]
    value = os.environ.get(variable)
    if value == "native" and op == "float8_fused":
        value = None  # AMPKERNELS_FLOAT8_BACKEND=native: the casts; the fused kernels have no native version
    if value:
        return check_backend(op, value, argument=variable), variable
    value = os.environ.get(GLOBAL_VARIABLE)
    if value:
        if value not in _MULTI_TENSOR_BACKENDS:
            raise ValueError(
                f"ampkernels: environment variable {GLOBAL_VARIABLE}: expected one of "
                f"{'/'.join(_MULTI_TENSOR_BACKENDS)}, got {value!r}"
            )
        return value, GLOBAL_VARIABLE  # for scaled_matmul, "native" is resolved by select()
    return None, "default"


def _default(op: str, device: torch.device) -> str:
    if op in ("scaled_matmul", "scaled_matmul_float8"):
        if device.type != "cuda":
            return "torch"
        if len(auto_candidates(device, op)) > 1:
            return "auto"
        order = (
            ("triton", "wgmma", "wmma", "torch") if op == "scaled_matmul" else ("triton", "wgmma", "cublas", "torch")
        )
    elif op in FLOAT8_ELEMENTWISE_OPS or op in TRITON_OR_TORCH_OPS:
        order = BACKENDS[op] if device.type == "cuda" else ("torch",)
    elif op == "adam_blockwise" and device.type == "cuda":
        # NOTE (H200, 1.1B params): Triton's blockwise step runs 8-bit moments in 5.4 ms and bfloat16 + stochastic
        # rounding in 4.1 ms, the CUDA kernel in 12.0 and 7.5 ms (dev/optimizers/NOTES.md).
        order = ("triton", "native", "torch")
    else:
        order = ("native", "triton", "torch") if device.type == "cuda" else ("native", "torch")
    return next(name for name in order if why_not(op, name, device) is None)


def select(op: str, device: torch.device | str, requested_backend: str | None = None) -> str:
    """The backend that runs ``op`` on ``device``: ``requested_backend`` (RuntimeError with the reason if it cannot
    run), else the op's environment variable, else ``AMPKERNELS_BACKEND``, else the first that runs."""
    device = torch.device(device)
    name, source = requested(op, requested_backend)
    if name is None:
        return _default(op, device)
    if (op in FLOAT8_ELEMENTWISE_OPS or op in TRITON_OR_TORCH_OPS) and name == "native" and source == GLOBAL_VARIABLE:
        # AMPKERNELS_BACKEND=native: the native casts where they run, else the op's default
        if name not in BACKENDS[op] or why_not(op, name, device) is not None:
            return _default(op, device)
    if op in ("scaled_matmul", "scaled_matmul_float8") and name == "native":
        # AMPKERNELS_BACKEND=native: the native kernel that runs here
        reasons = {k: why_not(op, k, device) for k in (("wgmma", "wmma") if op == "scaled_matmul" else ("wgmma",))}
        ok = [k for k, reason in reasons.items() if reason is None]
        if ok:
            return ok[0]
        detail = "; ".join(f"{k}: {reason}" for k, reason in reasons.items())
        raise RuntimeError(f"ampkernels: {op}: {source}=native, and no native kernel runs on {device} ({detail})")
    reason = why_not(op, name, device)
    if reason is not None:
        raise RuntimeError(f"ampkernels: {op}: backend {name!r} ({source}) cannot run on {device}: {reason}")
    return name


def clear_caches() -> None:
    """Forgets what was learnt about the installation (after building the extension in a running process)."""
    _LOADED.clear()
    _NATIVE_OPS.clear()
    _auto_candidates.cache_clear()


# --------------------------------------------------------------------------------------------------------------------
# Helpers shared by the callers of the multi-tensor ops
# --------------------------------------------------------------------------------------------------------------------


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
