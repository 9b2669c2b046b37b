"""FusedGradScaler: ``torch.amp.GradScaler`` on fused multi-tensor kernels.

Same constructor, methods, errors, state machine and state_dict as the stock scaler, and by default the same
numbers (scale after every update, unscaled gradients bit for bit, parameters over a run). What changes is the
cost: every gradient of an optimizer is unscaled and checked in one fused pass whose launch table is built once and
re-validated in C++ each step (stock loops over every parameter in Python and launches per ~110 tensors), the check
before a fused optimizer step reads the gradients without writing them, fp16/bf16 gradients are accepted, and with
optimizers that take the scale themselves (``_step_supports_amp_scaling``, e.g. torch's fused AdamW) nothing
synchronizes with the host, so the whole step can be captured in a CUDA graph.

Extras, off by default: :meth:`FusedGradScaler.clip_grad_norm_`, hysteresis, scale bounds and device-side telemetry.
"""

from __future__ import annotations

import functools
import inspect
import math
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.amp.grad_scaler import GradScaler, OptState, _refresh_per_optimizer_state

from ampkernels import dispatch
from ampkernels._constants import NO_CLIP, NormKind, norm_kind
from ampkernels.scaler import distributed, functional, reference
from ampkernels.scaler import state as scale_state

# Key of the per-optimizer state entry that holds a deferred divisor: after clip_grad_norm_ with a fused optimizer
# the gradients are still scaled, and the true gradients are ``grad / pending``; step() hands ``pending`` to the
# optimizer as its grad_scale.
_PENDING = "ampkernels_pending_grad_scale"


# The native gradient table's messages (csrc/scaler/grad_table.h), word for word: every backend raises them.
_SHARED_GRADIENT = (
    "ampkernels: argument 'params': parameters {} and {} have gradients that share memory (the same gradient tensor "
    "twice: one parameter twice, or a shared .grad; or overlapping views of one buffer); each gradient must belong "
    "to one parameter"
)
_EXPANDED_GRADIENT = (
    "ampkernels: argument 'params': parameter {} has a gradient whose elements share memory (an expanded tensor?), "
    "which cannot be unscaled in place; give it a gradient of its own (.clone())"
)


class _TorchGradTable:
    """The gradients of one optimizer on one device, for the Triton and plain-torch backends and for FSDP2's
    DTensor gradients (whose local shards it hands to the list op of any backend).

    Same interface as the native ``ampkernels._C.GradTable``; collects the gradients in Python on every call.
    """

    def __init__(self, params: list[torch.Tensor], device: torch.device, backend: str):
        self.params, self.device, self.backend = params, device, backend
        self._sparse: list[int] = []

    def refresh(self) -> bool:
        return False

    def sparse_params(self) -> list[int]:
        return self._sparse

    def unscale_reduce(self, scale, found_inf, factor, write, kind, per_tensor, max_norm, revalidate=True):
        grads, index, spans, self._sparse = [], [], [], []
        expanded = None
        for i, p in enumerate(self.params):
            g = p.grad
            if g is None:
                continue
            if distributed.is_dtensor(g):  # FSDP2: this rank's shard of the gradient
                g = g.to_local()
            _check_grad_dtype(i, g)
            if g.layout != torch.strided:
                self._sparse.append(i)
                continue
            if (
                expanded is None
                and not g.is_contiguous()
                and any(s == 0 and n > 1 for n, s in zip(g.shape, g.stride()))
            ):
                expanded = i
            if g.numel() and self.device.type != "meta":
                spans.append(functional.memory_span(g, i))
            grads.append(g)
            index.append(i)
        # The native table's checks and errors, in its order: every pass refuses a gradient reached through two
        # parameters (it would be unscaled twice, and counted twice in the norms); one that writes refuses an
        # expanded gradient, before anything is written.
        shared = functional.intersecting(spans)
        if shared is not None:
            raise RuntimeError(_SHARED_GRADIENT.format(*shared))
        if write and expanded is not None:
            raise RuntimeError(_EXPANDED_GRADIENT.format(expanded))
        res = functional.unscale_reduce_(
            grads,
            scale,
            found_inf,
            factor=factor,
            write=write,
            norm_type=NormKind(kind).norm_type,
            per_tensor=per_tensor,
            max_norm=None if max_norm == NO_CLIP else max_norm,
            backend=self.backend,
        )
        each = res.per_tensor_norms
        if each is not None:  # per parameter, 0 for parameters without a gradient
            full = torch.zeros(len(self.params), dtype=torch.float32, device=self.device)
            each = full.index_copy_(0, torch.tensor(index, dtype=torch.long, device=self.device), each)
        return res.norm, each, res.clip_coef


@functools.lru_cache(maxsize=64)
def _takes_grad_scaler(step: Callable) -> bool:
    """Whether an optimizer's step takes the deprecated ``grad_scaler`` argument. Cached per step function:
    inspect.signature costs ~30 us, a tenth of the whole host budget of a 10k-tensor step."""
    return "grad_scaler" in inspect.signature(step).parameters


def _params_with_grad(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def _check_grad_dtype(index: int, grad: torch.Tensor) -> None:
    if grad.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        raise ValueError(
            f"ampkernels: parameter {index} has a gradient of dtype {grad.dtype}; gradients must be float32, "
            "float16, bfloat16 or float64"
        )


class FusedGradScaler(GradScaler):
    """A drop-in :class:`torch.amp.GradScaler` on fused, sync-free multi-tensor kernels.

    Args (as ``torch.amp.GradScaler``):
        device, init_scale, growth_factor, backoff_factor, growth_interval, enabled.
    Extras (keyword-only; the defaults give stock behaviour):
        hysteresis: back off only after this many overflowing steps since the last growth (Megatron-LM). Default 1.
        min_scale: the scale never drops below it. Default 2**-126 (stock would halve on to 0, then skip forever).
        max_scale: the scale never grows above it. Default: unbounded (stock). ``init_scale``,
            ``update(new_scale)`` and a loaded ``scale`` must lie within the bounds (with the default 2**-126 floor;
            ValueError otherwise): outside them the next update would move the scale the wrong way.
        telemetry: keep a device-side history of the scale, the update and skip counts, and the last gradient
            norm; read back only by :meth:`telemetry`.
        history_size: length of the scale history ring buffer.
        backend: ``"native"``, ``"triton"`` or ``"torch"``; default: the best available.
        process_group: for sharded gradients (FSDP2 / ZeRO-style: each rank's optimizer holds a different shard).
            The non-finite flag and the squared gradient norm are summed across the group's ranks in one
            all-reduce, so every rank makes the same skip decision, keeps the same scale and clips with the
            global norm. Not needed with DDP, whose gradients are already identical on every rank. A group of one
            rank communicates nothing. Parameters that are DTensors sharded across ranks (FSDP2) without it are
            refused (ValueError) at the first use of their optimizer.

    Example::

        scaler = FusedGradScaler()
        for batch in loader:
            optimizer.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(batch)
            scaler.scale(loss).backward()
            scaler.clip_grad_norm_(optimizer, max_norm=1.0)  # optional: unscale + check + norm + clip in one pass
            scaler.step(optimizer)
            scaler.update()
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = None,
        telemetry: bool = False,
        history_size: int = 1024,
        backend: str | None = None,
        process_group: Any = None,
    ) -> None:
        init_scale = scale_state.init_scale_value(init_scale)
        # Any int, as stock: an interval beyond the int32 growth tracker's reach means the scale never grows.
        if not (isinstance(growth_interval, int) and growth_interval >= 1):
            raise ValueError(f"FusedGradScaler: growth_interval must be an int >= 1, got {growth_interval!r}")
        valid_hysteresis = isinstance(hysteresis, int) and not isinstance(hysteresis, bool)
        if not (valid_hysteresis and 1 <= hysteresis <= scale_state.MAX_COUNT):
            raise ValueError(
                f"FusedGradScaler: hysteresis must be an int >= 1 and < 2**31 (its tracker is an int32 tensor), "
                f"got {hysteresis!r}"
            )
        if min_scale is not None and not (math.isfinite(min_scale) and min_scale > 0):
            raise ValueError(f"FusedGradScaler: min_scale must be finite and > 0, got {min_scale!r}")
        if max_scale is not None and not (max_scale > 0 and not math.isnan(max_scale)):
            raise ValueError(f"FusedGradScaler: max_scale must be > 0, got {max_scale!r}")
        if min_scale is not None and max_scale is not None and min_scale > max_scale:
            raise ValueError(f"FusedGradScaler: min_scale ({min_scale}) is above max_scale ({max_scale})")
        # The bounds (given, or the default floor 2**-126) hold from the first step: a scale outside them would be
        # moved the wrong way by the next update.
        problem = scale_state.bounds_problem(init_scale, min_scale, max_scale)
        if problem is not None:
            raise ValueError(f"FusedGradScaler: init_scale ({init_scale}) {problem}")
        if not (isinstance(history_size, int) and not isinstance(history_size, bool) and history_size >= 1):
            raise ValueError(f"FusedGradScaler: history_size must be an int >= 1, got {history_size!r}")
        dispatch.check_backend("unscale_reduce_", backend)
        if process_group is not None:
            distributed.check_process_group(process_group)
        if device == "cuda" and enabled and torch.cuda.amp.common.amp_definitely_not_available():
            # Said here, under our name: the base class would warn about torch.cuda.amp.GradScaler.
            warnings.warn(
                "FusedGradScaler is enabled on device 'cuda', but CUDA is not available: disabling it (scale() "
                "and step() pass through). To train on the CPU, pass the device: FusedGradScaler('cpu')",
                stacklevel=2,
            )
            enabled = False
        super().__init__(device, float(init_scale), growth_factor, backoff_factor, growth_interval, enabled)
        self._process_group = process_group
        self._hysteresis = hysteresis
        self._min_scale = min_scale
        self._max_scale = max_scale
        self._telemetry_enabled = telemetry
        self._history_size = int(history_size)
        self._backend = backend
        self._init_hysteresis_tracker = hysteresis
        self._hysteresis_tracker: torch.Tensor | None = None
        self._counters: torch.Tensor | None = None
        self._history: torch.Tensor | None = None
        self._last_grad_norm: torch.Tensor | None = None
        # optimizer -> (its parameters, [(device, table, params)]); weak so a dropped optimizer frees its tables
        self._grad_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    # ---- lazily created device state ----

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        super()._lazy_init_scale_growth_tracker(dev)
        self._hysteresis_tracker = torch.full((), self._init_hysteresis_tracker, dtype=torch.int32, device=dev)
        if self._telemetry_enabled:
            self._counters = torch.zeros(2, dtype=torch.int64, device=dev)
            self._history = torch.full((self._history_size,), math.nan, dtype=torch.float32, device=dev)

    def _initial_device_state(self) -> dict[str, float]:
        """The values :meth:`_lazy_init_scale_growth_tracker` gives each device tensor it creates (what a fresh
        scaler starts from; :class:`ampkernels.cuda_graph.StateSnapshot` resets them to these)."""
        return {
            "_scale": self._init_scale,
            "_growth_tracker": self._init_growth_tracker,
            "_hysteresis_tracker": self._init_hysteresis_tracker,
            "_counters": 0,
            "_history": math.nan,
        }

    def _tables(self, optimizer: torch.optim.Optimizer) -> list:
        """The launch tables of ``optimizer``'s gradients, one per device; rebuilt only when its parameter groups
        change (the tables themselves re-validate the gradients every call, in C++ for the native backend)."""
        groups = [g["params"] for g in optimizer.param_groups]
        cached = self._grad_tables.get(optimizer)
        if cached is not None and dispatch.same_params(groups, cached[0]):
            return cached[1]
        flat = tuple(p for params in groups for p in params)
        if self._process_group is None and any(distributed.sharded_across_ranks(p) for p in flat):
            # Each rank would then skip or take the step on its own shard's flag and clip with its shard's norm:
            # the shards of one model silently part ways.
            raise ValueError(
                "FusedGradScaler: argument 'process_group': the optimizer's parameters are DTensors sharded across "
                "ranks (FSDP2), so each rank holds a different part of the gradients; without the group each rank "
                "would decide alone whether to skip the step and clip with its own shard's norm. Pass the group "
                "the shards are spread over: FusedGradScaler(process_group=mesh.get_group()), or for HSDP the "
                "group of the mesh's shard dimension"
            )
        by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        for p in flat:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"expected param to be torch.Tensor, got {type(p).__name__}")
            by_device[p.device].append(p)
        tables = []
        for device, params in by_device.items():
            backend = dispatch.choose("unscale_reduce_", device, self._backend)
            table = backend.grad_table(params, device) or _TorchGradTable(params, device, backend.name)
            tables.append((device, table, params))
        self._grad_tables[optimizer] = (flat, tables)
        return tables

    # ---- the fused pass ----

    def _scale_on(self, device: torch.device) -> torch.Tensor:
        assert self._scale is not None
        return dispatch.to_kernel_device(self._scale, device)

    def _fused_pass(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        write: bool,
        scale: torch.Tensor | None = None,
        factor: torch.Tensor | None = None,
        kind: NormKind = NormKind.NONE,
        max_norm: float | None = None,
        revalidate: bool = True,
    ):
        """Run the fused kernel over every gradient of ``optimizer``.

        ``scale`` defaults to the loss scale; ``kind`` the norm to take, ``max_norm`` (None: no clip) the clip
        coefficient's. Returns ``({device: found_inf}, [(device, norm, coef)])``.
        """
        clip = NO_CLIP if max_norm is None else max_norm
        found_per_device: dict[torch.device, torch.Tensor] = {}
        results = []
        with torch.no_grad():
            for device, table, params in self._tables(optimizer):
                s = self._scale_on(device) if scale is None else dispatch.to_kernel_device(scale, device)
                f = None if factor is None else dispatch.to_kernel_device(factor, device)
                found = torch.zeros((), dtype=torch.float32, device=device)
                norm, _, coef = table.unscale_reduce(s, found, f, write, int(kind), False, clip, revalidate)
                sparse = table.sparse_params()
                if sparse:
                    if kind is not NormKind.NONE:
                        raise RuntimeError(
                            f"FusedGradScaler.clip_grad_norm_: parameter {sparse[0]} has a sparse gradient; "
                            "clip sparse gradients with torch.nn.utils.clip_grad_norm_ after unscale_()"
                        )
                    self._unscale_sparse(params, sparse, s, f, found, write)
                # As stock, a device none of whose parameters has a gradient records no check, so that step() on
                # an ordinary optimizer and update() raise for a forgotten backward. any() stops at the first
                # gradient: O(1) on an ordinary step.
                if any(p.grad is not None for p in params):
                    found_per_device[device] = found
                results.append((device, norm, coef))
        return found_per_device, results

    @staticmethod
    def _unscale_sparse(params, sparse, scale, factor, found, write) -> None:
        # Stock semantics for sparse gradients: check (and unscale) their values; coalesce fp16 ones first.
        inv = reference.inv_scale_of(scale) if write else torch.ones_like(scale)
        if factor is not None and write:
            inv = inv * factor
        for i in sparse:
            p = params[i]
            if p.grad.dtype is torch.float16:
                p.grad = p.grad.coalesce()
            torch._amp_foreach_non_finite_check_and_unscale_([p.grad._values()], found, inv.reshape(()))

    def _group_size(self) -> int:
        return distributed.group_size(self._process_group)

    def _all_reduce(self, found_per_device: dict, norms: list | None = None, kind: NormKind = NormKind.L2):
        """:func:`ampkernels.scaler.distributed.all_reduce` over this scaler's process group."""
        return distributed.all_reduce(found_per_device, self._scale.device, self._process_group, norms, kind)

    # ---- GradScaler API ----

    def scale(self, outputs: torch.Tensor | Iterable[torch.Tensor]) -> torch.Tensor | Iterable[torch.Tensor]:
        """Multiply a tensor, or a (nested) list/tuple/iterable of tensors, by the loss scale, as stock does.

        One difference: stock copies a GPU scale to a CPU output with ``non_blocking=True``, so the CPU multiply
        can read the pinned buffer before the copy lands (and its ``unscale_`` likewise: with GPU work queued, CPU
        gradients come out wrong). Here a GPU-to-CPU copy of the scale is blocking; every other copy stays
        asynchronous.
        """
        if not self._enabled:
            return outputs
        per_device: dict[torch.device, torch.Tensor] = {}

        def scale_on(device: torch.device) -> torch.Tensor:
            if self._scale is None:
                self._lazy_init_scale_growth_tracker(device)
            if device not in per_device:
                per_device[device] = dispatch.to_kernel_device(self._scale, device)
            return per_device[device]

        def apply_scale(val):
            if isinstance(val, torch.Tensor):
                return val * scale_on(val.device)
            if isinstance(val, Iterable):
                scaled = map(apply_scale, val)
                return type(val)(scaled) if isinstance(val, (list, tuple)) else scaled
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply_scale(outputs)

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        # Kept for code that calls the stock internal directly: v = g * 1 * inv_scale is exactly g * inv_scale. As
        # stock, found_inf is not written: each device's flag starts from a copy of it, set to 1 by a non-finite grad.
        one = torch.ones((), dtype=torch.float32, device=inv_scale.device)
        found_per_device, _ = self._fused_pass(optimizer, write=True, scale=one, factor=inv_scale)
        flags = {}
        for device, found in found_per_device.items():
            flag = found_inf.to(device=device, copy=True)
            flags[device] = flag.masked_fill_(found.reshape(()) != 0, 1.0)
        return flags

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        # Stock multiplies every gradient by 1.0 to find infs; a read-only pass finds the same at half the traffic.
        self._check_scale_growth_tracker("_check_inf_per_device")
        found_per_device, _ = self._fused_pass(optimizer, write=False)
        if self._group_size() > 1:
            self._all_reduce(found_per_device)
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = found_per_device
        return found_per_device

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale ``optimizer``'s gradients in place and check them for inf/NaN, in one fused pass.

        As :meth:`torch.amp.GradScaler.unscale_`, and fp16/bf16 gradients are accepted.
        """
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        elif state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        found_per_device, _ = self._fused_pass(optimizer, write=True)
        if self._group_size() > 1:
            self._all_reduce(found_per_device)
        state["found_inf_per_device"] = found_per_device
        state["stage"] = OptState.UNSCALED

    def clip_grad_norm_(
        self, optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Unscale, check and clip ``optimizer``'s gradients by their total norm; return the norm (no host sync).

        Is equivalent to ``scaler.unscale_(optimizer); torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)``
        in one read-only gradient pass plus, for ordinary optimizers, one in-place pass. With optimizers that take
        the scale themselves (``_step_supports_amp_scaling``, e.g. torch's fused AdamW) the unscale and the clip
        are folded into the optimizer step instead: the gradients hold their scaled values until :meth:`step`,
        which hands ``scale / clip_coef`` to the optimizer as its ``grad_scale``.

        Args:
            optimizer: the optimizer whose gradients to clip.
            max_norm: the largest allowed total norm.
            norm_type: 2.0 or inf run fused; any other p falls back to ``torch.nn.utils.clip_grad_norm_``.
        Returns:
            The total norm of the unscaled gradients (before clipping), a 0-d float32 tensor on the scale's device.
        """
        max_norm, norm_type = float(max_norm), float(norm_type)
        if not self._enabled:
            return torch.nn.utils.clip_grad_norm_(_params_with_grad(optimizer), max_norm, norm_type)
        self._check_scale_growth_tracker("clip_grad_norm_")
        if math.isnan(max_norm) or max_norm < 0:
            raise ValueError(f"FusedGradScaler.clip_grad_norm_: max_norm must be >= 0, got {max_norm}")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("clip_grad_norm_() is being called after step().")
        try:
            kind = norm_kind(norm_type)
        except ValueError:  # a norm the kernels do not compute: torch's clip, after a fused unscale_
            kind = None
        if kind is None:
            if self._group_size() > 1:
                raise NotImplementedError(
                    f"FusedGradScaler.clip_grad_norm_: norm_type={norm_type} is not supported with a process_group "
                    "(the global norm is reduced for norm_type 2.0 and inf)"
                )
            if state.get(_PENDING) is not None:
                raise RuntimeError(
                    "clip_grad_norm_: a fused (deferred) clip is pending for this optimizer; a second clip with "
                    f"norm_type={norm_type} is not supported on top of it"
                )
            if state["stage"] is OptState.READY:
                self.unscale_(optimizer)
            norm = torch.nn.utils.clip_grad_norm_(_params_with_grad(optimizer), max_norm, norm_type)
            self._last_grad_norm = norm
            return norm

        ready = state["stage"] is OptState.READY
        pending = state.get(_PENDING)
        defer = getattr(optimizer, "_step_supports_amp_scaling", False) and (ready or pending is not None)
        # The gradients hold true_grad * divisor: the loss scale when READY, the pending divisor after an earlier
        # deferred clip, 1 when already unscaled in place.
        if ready:
            divisor = None  # the loss scale
        elif pending is not None:
            divisor = pending
        else:
            divisor = torch.ones((), dtype=torch.float32, device=self._scale.device)
        distributed = self._group_size() > 1
        found_per_device, results = self._fused_pass(
            optimizer, write=False, scale=divisor, kind=kind, max_norm=None if distributed else max_norm
        )
        if distributed:  # the global norm and skip decision: one all-reduce
            norm = self._all_reduce(found_per_device, [n for _, n, _ in results], kind)
            coef = reference.clip_coef(norm, max_norm)
        else:
            norm, coef = self._combine_norms(results, kind, max_norm)
        if defer:
            base = self._scale if divisor is None else divisor
            state[_PENDING] = base / coef
        else:
            # Materialize: g = (g / divisor) * coef, in place.
            self._fused_pass(optimizer, write=True, scale=divisor, factor=coef, revalidate=False)
        if ready:
            state["found_inf_per_device"] = found_per_device
            state["stage"] = OptState.UNSCALED
        self._last_grad_norm = norm
        return norm

    def _combine_norms(self, results, kind: NormKind, max_norm: float):
        """The total norm and clip coefficient over devices (one device: straight from the kernel)."""
        if len(results) == 1:
            _, norm, coef = results[0]
            return norm, coef
        dev = self._scale.device
        if not results:
            norm = torch.zeros((), dtype=torch.float32, device=dev)
        elif kind is NormKind.L2:
            norm = torch.stack([n.to(dev) for _, n, _ in results]).double().pow(2).sum().sqrt().float()
        else:
            norm = torch.stack([n.to(dev) for _, n, _ in results]).max()
        return norm, reference.clip_coef(norm, max_norm)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> float | None:
        """As :meth:`torch.amp.GradScaler.step`: unscale if needed, then step unless a gradient was inf/NaN.

        With optimizers that take the scale themselves (``_step_supports_amp_scaling``) the check is a read-only
        pass and the skip decision stays on the device: no host synchronization. Other optimizers keep stock
        semantics (one host check of found_inf per step).
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")

        if not getattr(optimizer, "_step_supports_amp_scaling", False):
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"FusedGradScaler.step: {type(optimizer).__name__} cannot be captured in a CUDA graph: deciding "
                    "whether to skip its step needs a host sync. Use an optimizer that takes the scale and the skip "
                    "flag on the device: ampkernels.FusedAdamW, FusedAdam or FusedSGD (or torch's AdamW/Adam/SGD "
                    "with fused=True, capturable=True)"
                )
            if state["stage"] is OptState.READY:
                self.unscale_(optimizer)
            if len(state["found_inf_per_device"]) == 0:
                raise AssertionError("No inf checks were recorded for this optimizer.")
            retval = self._maybe_opt_step(optimizer, state, *args, **kwargs)
            state["stage"] = OptState.STEPPED
            return retval

        if _takes_grad_scaler(getattr(optimizer.step, "__func__", optimizer.step)):
            return super().step(optimizer, *args, **kwargs)  # the deprecated protocol: the optimizer drives us
        if state["stage"] is OptState.READY:
            self._check_inf_per_device(optimizer)
        found = list(state["found_inf_per_device"].values())
        if len(found) == 1 and found[0].device == self._scale.device:
            found_inf = found[0]
        else:
            found_inf = sum(t.to(self._scale.device, non_blocking=True) for t in found)
        user_scale = getattr(optimizer, "grad_scale", None)
        pending = state.get(_PENDING)
        if state["stage"] is OptState.READY:
            grad_scale = self._scale if user_scale is None else self._scale * user_scale
        elif pending is not None:
            grad_scale = pending if user_scale is None else pending * user_scale
        else:
            grad_scale = user_scale
        optimizer.grad_scale = grad_scale
        optimizer.found_inf = found_inf
        try:
            retval = optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale
            del optimizer.found_inf
        state["stage"] = OptState.STEPPED
        return retval

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """As :meth:`torch.amp.GradScaler.update`, on one device kernel (plus hysteresis, bounds, telemetry).

        ``new_scale`` (optional) sets the scale: a number, or a 1-element float tensor without grad on the scale's
        device or on the CPU. As the float32 the scale holds, it must be finite and > 0 and lie within
        ``[min_scale, max_scale]`` (min_scale defaults to 2**-126): a number or a CPU tensor that does not raises
        ValueError. The value of a tensor on the scale's device is checked on the device (reading it on the host
        would synchronize): an invalid one leaves the scale unchanged, as an overflowing step does.
        """
        if not self._enabled:
            return
        _scale, _growth_tracker = self._check_scale_growth_tracker("update")
        if new_scale is not None:
            self._set_scale(_scale, new_scale)
            self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
            return
        found_infs = [
            found_inf.to(device=_scale.device, non_blocking=True)
            for state in self._per_optimizer_states.values()
            for found_inf in state["found_inf_per_device"].values()
        ]
        if len(found_infs) == 0:
            raise AssertionError("No inf checks were recorded prior to update.")
        found_inf = found_infs[0] if len(found_infs) == 1 else torch.stack(found_infs).sum()
        functional.update_scale_(
            _scale,
            _growth_tracker,
            found_inf,
            self._growth_factor,
            self._backoff_factor,
            # NOTE: the int32 tracker reaches at most 2**31 - 1, so a longer interval never ends, as in stock (whose
            # tracker would overflow after 2**31 - 1 clean steps); the kernels take intervals of int32.
            min(self._growth_interval, scale_state.MAX_COUNT),
            hysteresis=self._hysteresis,
            hysteresis_tracker=self._hysteresis_tracker,
            min_scale=reference.FLOAT32_TINY if self._min_scale is None else self._min_scale,
            max_scale=math.inf if self._max_scale is None else self._max_scale,
            history=self._history,
            counters=self._counters,
            backend=self._backend,
        )
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    def _check_host_scale(self, value: float) -> float:
        if not scale_state.valid_scale(value):
            raise ValueError(f"FusedGradScaler.update: new_scale must be finite and > 0, got {value}")
        problem = scale_state.bounds_problem(value, self._min_scale, self._max_scale)
        if problem is not None:
            raise ValueError(f"FusedGradScaler.update: new_scale ({value}) {problem}")
        return float(value)

    def _set_scale(self, scale: torch.Tensor, new_scale: float | torch.Tensor) -> None:
        if isinstance(new_scale, (int, float)) and not isinstance(new_scale, bool):
            scale.fill_(self._check_host_scale(new_scale))
            return
        # Stock's error (type and message) for a tensor of the wrong kind.
        reason = (
            "new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
            "torch.FloatTensor with requires_grad=False."
        )
        if not isinstance(new_scale, torch.Tensor):
            raise TypeError(f"FusedGradScaler.update: {reason} Got {type(new_scale).__name__}")
        if new_scale.device not in (scale.device, torch.device("cpu")):
            raise AssertionError(reason)
        if new_scale.numel() != 1 or new_scale.requires_grad:
            raise AssertionError(reason)
        if new_scale.device.type == "cpu":
            scale.fill_(self._check_host_scale(float(new_scale)))
        else:
            lo, hi = scale_state.scale_bounds(self._min_scale, self._max_scale)
            new = new_scale.reshape(()).to(torch.float32)
            valid = torch.isfinite(new) & (new > 0) & (new >= lo) & (new <= hi)
            scale.copy_(torch.where(valid, new, scale))

    # ---- extras ----

    def telemetry(self) -> dict[str, Any]:
        """Read back the device-side telemetry (this synchronizes): ``scale_history`` (oldest first, at most
        ``history_size``), ``updates``, ``skipped_steps``, ``last_grad_norm`` (from :meth:`clip_grad_norm_`)."""
        if not self._telemetry_enabled:
            raise RuntimeError("FusedGradScaler: telemetry is off; construct the scaler with telemetry=True")
        last = None if self._last_grad_norm is None else float(self._last_grad_norm)
        if self._counters is None:
            return {"scale_history": [], "updates": 0, "skipped_steps": 0, "last_grad_norm": last}
        updates, skipped = (int(v) for v in self._counters.tolist())
        history = self._history.tolist()
        n = len(history)
        if updates <= n:
            ordered = history[:updates]
        else:
            start = updates % n
            ordered = history[start:] + history[:start]
        return {"scale_history": ordered, "updates": updates, "skipped_steps": skipped, "last_grad_norm": last}

    # ---- state ----

    def state_dict(self) -> dict[str, Any]:
        """As stock; extra entries only when the extras are in use (stock ignores unknown entries on load)."""
        state = super().state_dict()
        if state and (self._hysteresis != 1 or self._min_scale is not None or self._max_scale is not None):
            state["hysteresis"] = self._hysteresis
            tracker = (
                self._init_hysteresis_tracker
                if self._hysteresis_tracker is None
                else int(self._hysteresis_tracker.item())
            )
            # Below 0 after more overflows in a row than hysteresis; every value <= 0 backs off at the next
            # overflow, saved as 0 (the range load_state_dict takes).
            state["_hysteresis_tracker"] = max(tracker, 0)
            state["min_scale"] = self._min_scale
            state["max_scale"] = self._max_scale
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As stock, with every entry checked before any is loaded: a missing, wrong-typed or out-of-range entry
        raises naming the key and leaves the scaler as it was."""
        if not self._enabled:
            return
        if not isinstance(state_dict, dict):
            raise TypeError(f"FusedGradScaler.load_state_dict: expected a dict, got {type(state_dict).__name__}")
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler."
            )
        values = scale_state.checked_values(state_dict, self._min_scale, self._max_scale)
        # Everything checked: nothing below raises.
        super().load_state_dict({**state_dict, **values})
        if "hysteresis" in state_dict:
            self._hysteresis = int(state_dict["hysteresis"])
            self._init_hysteresis_tracker = int(state_dict.get("_hysteresis_tracker", self._hysteresis))
            if self._hysteresis_tracker is not None:
                self._hysteresis_tracker.fill_(self._init_hysteresis_tracker)
            self._min_scale = state_dict.get("min_scale")
            self._max_scale = state_dict.get("max_scale")

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        if self._enabled:
            if self._hysteresis_tracker is not None:
                state["_init_hysteresis_tracker"] = int(self._hysteresis_tracker.item())
            state["_hysteresis_tracker"] = None
            state["_counters"] = None
            state["_history"] = None
            state["_last_grad_norm"] = None
        state["_grad_tables"] = None  # launch tables hold raw pointers: rebuilt after unpickling
        if state.get("_process_group") is not None:
            warnings.warn(
                "FusedGradScaler: a process group cannot be pickled; the unpickled scaler has process_group=None",
                stacklevel=2,
            )
            state["_process_group"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._grad_tables = weakref.WeakKeyDictionary()
