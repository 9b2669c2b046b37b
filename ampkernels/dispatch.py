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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

GLOBAL_VARIABLE = "AMPKERNELS_BACKEND"
#: The values ``AMPKERNELS_BACKEND`` takes (each op maps "native" to its own native kernels: :attr:`Op.native`).
GLOBAL_BACKENDS = ("native", "triton", "torch")

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


# --------------------------------------------------------------------------------------------------------------------
# The interface every backend implements, and the registry of ops
# --------------------------------------------------------------------------------------------------------------------


@runtime_checkable
class Backend(Protocol):
    """One implementation of an op. Each family declares a Protocol that extends this one with its launch methods
    (``ampkernels.scaler.backends.ScalerBackend`` and the like); its native, Triton and torch backends implement them
    with the same signatures and return values (tests/test_dispatch.py compares them), so that a caller holds a
    backend and calls it, never asks which one it holds."""

    #: The name users pass as ``backend=`` and set in the environment variables.
    name: str

    def why_not(self, device: torch.device) -> str | None:
        """``None`` when this backend runs on ``device``, else the reason it cannot. Must stay traceable by
        torch.compile (no imports after the first eager call: see :func:`_import`)."""
        ...


@dataclass(frozen=True, eq=False)
class Op:
    """An op and its backends, as its family registers it (:func:`register`)."""

    name: str
    #: What ``python -m ampkernels.info`` shows for the op.
    label: str
    #: The op's environment variable, read before ``AMPKERNELS_BACKEND``.
    variable: str
    #: Every backend, in the order the docs and ``info`` list them.
    backends: tuple[Backend, ...]
    #: The backend names in order of preference on a device: the default is the first that runs there.
    order: Callable[[torch.device], tuple[str, ...]]
    #: The family's Protocol, which every backend of the op implements.
    protocol: type
    #: What ``AMPKERNELS_BACKEND=native`` means for the op: the first of these that runs. Empty: the op has no
    #: native kernel and the variable leaves it on its default.
    native: tuple[str, ...] = ("native",)
    #: Whether ``AMPKERNELS_BACKEND=native`` where no native kernel of the op runs leaves it on its default (True:
    #: a preference, for ops with a reference fallback on every device) or raises (False).
    native_optional: bool = False
    #: The backends ``"auto"`` chooses between per problem, for ops that have ``auto``.
    auto: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(b.name for b in self.backends)

    def backend(self, name: str) -> Backend:
        return self._by_name[name]

    def __post_init__(self):
        by_name = {b.name: b for b in self.backends}
        if len(by_name) != len(self.backends):
            raise ValueError(f"ampkernels: op {self.name}: two backends share a name ({self.names})")
        object.__setattr__(self, "_by_name", by_name)


def native_first(device: torch.device) -> tuple[str, ...]:
    """The order of ops with native, Triton and torch backends: native first; Triton on CPU tensors only when asked
    for (the interpreter is for tests)."""
    return ("native", "triton", "torch") if device.type == "cuda" else ("native", "torch")


def kernels_on_cuda(names: tuple[str, ...]) -> Callable[[torch.device], tuple[str, ...]]:
    """The order ``names`` on CUDA tensors, the reference (``torch``) alone on any other."""
    return lambda device: names if device.type == "cuda" else ("torch",)


_OPS: dict[str, Op] = {}
#: Each registered op's backend names (in the order of :attr:`Op.backends`).
BACKENDS: dict[str, tuple[str, ...]] = {}
#: Each registered op's environment variable.
VARIABLES: dict[str, str] = {}


def register(op: Op) -> Op:
    """Registers ``op`` (once per name; a family does it when it is imported, and ``import ampkernels`` imports them
    all). Every backend must implement ``op.protocol``."""
    if op.name in _OPS:
        raise ValueError(f"ampkernels: op {op.name!r} is registered already")
    for backend in op.backends:
        if not isinstance(backend, op.protocol):
            raise TypeError(f"ampkernels: backend {backend.name!r} of {op.name} does not implement {op.protocol}")
    for name in op.native + op.auto:
        if name not in op.names:
            raise ValueError(f"ampkernels: op {op.name}: {name!r} is not one of its backends {op.names}")
    _OPS[op.name] = op
    BACKENDS[op.name] = op.names
    VARIABLES[op.name] = op.variable
    return op


def ops() -> tuple[Op, ...]:
    """Every registered op, in the order they were registered."""
    return tuple(_OPS.values())


def _op(op: str) -> Op:
    spec = _OPS.get(op)
    if spec is None:
        raise ValueError(f"ampkernels: unknown op {op!r}; ops: {', '.join(_OPS)}")
    return spec


def backend(op: str, name: str) -> Backend:
    """The backend object of ``op`` called ``name`` (the custom ops carry backend names through the dispatcher,
    which takes no objects). Raises ValueError for a name that is not one of the op's."""
    return _op(op).backend(check_backend(op, name))


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


def native_op(name: str):
    """``torch.ops.ampkernels.<name>`` of the native extension, or ``None`` when the extension lacks it."""
    if name not in _NATIVE_OPS:
        native()
        try:
            _NATIVE_OPS[name] = getattr(torch.ops.ampkernels, name)
        except (AttributeError, RuntimeError):
            _NATIVE_OPS[name] = None
    return _NATIVE_OPS[name]


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
    for candidate in _op(op).backends:
        if isinstance(candidate, TritonBackend):
            return candidate.kernels()
    raise ValueError(f"ampkernels: op {op} has no Triton backend")


def triton_interpreting() -> bool:
    """Whether Triton kernels run in the interpreter (on CPU tensors) rather than on a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def native_reason(device: torch.device) -> str | None:
    """Why the native extension cannot run on ``device`` (None when it can)."""
    mod, err = _load_native()
    if mod is None:
        return err
    if device.type == "cuda" and not mod.with_cuda:
        return "ampkernels._C was built without CUDA (no CUDA toolkit or a CPU build of torch at build time)"
    if device.type not in ("cpu", "cuda"):
        return f"no native kernels for {device.type} tensors"
    return None


def triton_reason(module: str, device: torch.device) -> str | None:
    """Why the Triton kernels of ``module`` cannot run on ``device`` (None when they can)."""
    mod, err = _load_triton(module)
    if mod is None:
        return err
    if triton_interpreting():
        if device.type == "cpu":
            return None
        return f"TRITON_INTERPRET=1 runs the Triton kernels on the host: CPU tensors only, not {device.type}"
    if device.type == "cuda":
        return None
    return "Triton runs on CUDA tensors (or on CPU tensors under TRITON_INTERPRET=1)"


# Bases that families' backends extend: the name and the installation check, shared.


class NativeBackend:
    """The C++ extension (CUDA kernels for CUDA tensors, CPU kernels for CPU tensors)."""

    name = "native"

    def why_not(self, device: torch.device) -> str | None:
        return native_reason(device)


class TritonBackend:
    """Triton kernels in the module named by ``module`` (imported on first use)."""

    name = "triton"
    module: str

    def why_not(self, device: torch.device) -> str | None:
        return triton_reason(self.module, device)

    def kernels(self):
        """The launch module, or ``None`` when Triton is not installed."""
        return _load_triton(self.module)[0]


class AutoBackend:
    """``auto``: chooses among the op's :attr:`Op.auto` backends per problem (the fastest, timed on first use)."""

    name = "auto"


class TorchBackend:
    """Plain PyTorch (each family's reference): runs everywhere."""

    name = "torch"

    def why_not(self, device: torch.device) -> str | None:
        return None


# --------------------------------------------------------------------------------------------------------------------
# Why a backend cannot run
# --------------------------------------------------------------------------------------------------------------------


def check_backend(op: str, backend: str | None, argument: str = "backend") -> str | None:
    """``backend`` if it is ``None`` or one of ``op``'s backend names, else a ValueError naming ``argument`` and the
    valid names (an empty string is not "the default": it raises too)."""
    valid = _op(op).names
    if backend is not None and backend not in valid:
        where = f"environment variable {argument}" if argument.startswith("AMPKERNELS_") else f"argument '{argument}'"
        raise ValueError(
            f"ampkernels: {where}: expected one of {'/'.join(valid)} for {op} (or unset for the default), "
            f"got {backend!r}"
        )
    return backend


def why_not(op: str, backend: str, device: torch.device | str) -> str | None:
    """``None`` when ``backend`` can run ``op`` on ``device``, else the reason it cannot."""
    check_backend(op, backend)
    return _OPS[op].backend(backend).why_not(torch.device(device))


@functools.cache
def _auto_candidates(device: torch.device, op: str) -> tuple[str, ...]:
    return tuple(name for name in _OPS[op].auto if why_not(op, name, device) is None)


def auto_candidates(device: torch.device, op: str = "scaled_matmul") -> tuple[str, ...]:
    """The backends "auto" chooses between (:attr:`Op.auto`) that run ``op`` on ``device`` (cached per device)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _auto_candidates(device, op)


# --------------------------------------------------------------------------------------------------------------------
# The choice
# --------------------------------------------------------------------------------------------------------------------


def requested(op: str, backend: str | None = None) -> tuple[str | None, str]:
    """(the backend asked for, who asked): ``backend`` (argument), else the op's variable, else the global one;
    ``(None, "default")`` when nobody asked. Raises ValueError for a name that is not one of the op's backends (a
    variable shared by several ops may name another's backend: this op then reads on, as if it were unset)."""
    spec = _op(op)
    check_backend(op, backend)
    if backend is not None:
        return backend, "argument 'backend'"
    value = os.environ.get(spec.variable)
    if (
        value
        and value not in spec.names
        and any(value in o.names for o in _OPS.values() if o.variable == spec.variable)
    ):
        value = None  # e.g. AMPKERNELS_FLOAT8_BACKEND=native: the casts'; the fused kernels have no native version
    if value:
        return check_backend(op, value, argument=spec.variable), spec.variable
    value = os.environ.get(GLOBAL_VARIABLE)
    if value:
        if value not in GLOBAL_BACKENDS:
            raise ValueError(
                f"ampkernels: environment variable {GLOBAL_VARIABLE}: expected one of "
                f"{'/'.join(GLOBAL_BACKENDS)}, got {value!r}"
            )
        return value, GLOBAL_VARIABLE  # "native" is resolved by choose() (Op.native)
    return None, "default"


def _default(spec: Op, device: torch.device) -> Backend:
    return next(spec.backend(name) for name in spec.order(device) if why_not(spec.name, name, device) is None)


def _global_native(spec: Op, device: torch.device) -> Backend:
    """``AMPKERNELS_BACKEND=native``: the first of the op's native kernels that runs here (:attr:`Op.native`)."""
    reasons = {name: why_not(spec.name, name, device) for name in spec.native}
    runs = [name for name, reason in reasons.items() if reason is None]
    if runs:
        return spec.backend(runs[0])
    if not reasons or spec.native_optional:
        return _default(spec, device)
    if len(reasons) == 1:
        ((name, reason),) = reasons.items()
        raise RuntimeError(
            f"ampkernels: {spec.name}: backend {name!r} ({GLOBAL_VARIABLE}) cannot run on {device}: {reason}"
        )
    detail = "; ".join(f"{name}: {reason}" for name, reason in reasons.items())
    raise RuntimeError(
        f"ampkernels: {spec.name}: {GLOBAL_VARIABLE}=native, and no native kernel runs on {device} ({detail})"
    )


def choose(op: str, device: torch.device | str, requested_backend: str | None = None) -> Backend:
    """The backend that runs ``op`` on ``device``: ``requested_backend`` (RuntimeError with the reason if it cannot
    run), else the op's environment variable, else ``AMPKERNELS_BACKEND``, else the first that runs
    (:attr:`Op.order`)."""
    spec = _op(op)
    device = torch.device(device)
    name, source = requested(op, requested_backend)
    if name is None:
        return _default(spec, device)
    if name == "native" and source == GLOBAL_VARIABLE:
        return _global_native(spec, device)
    if name not in spec.names:  # AMPKERNELS_BACKEND=triton/torch for an op without that backend: its default
        return _default(spec, device)
    reason = why_not(op, name, device)
    if reason is not None:
        raise RuntimeError(f"ampkernels: {op}: backend {name!r} ({source}) cannot run on {device}: {reason}")
    return spec.backend(name)


def select(op: str, device: torch.device | str, requested_backend: str | None = None) -> str:
    """The name of :func:`choose`'s backend."""
    return choose(op, device, requested_backend).name


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
