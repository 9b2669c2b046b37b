"""Fused, capturable drop-in optimizers: :class:`FusedAdam`, :class:`FusedAdamW` and :class:`FusedSGD`.

Each step is one fused kernel pass over all parameters of a (param group, device, parameter dtype, gradient dtype)
bucket (plus a one-thread-per-tensor prologue for the step counts), with no host synchronization:

* the gradients are only read, divided by ``grad_scale`` when a scaler hands one over (``scale / clip_coef``);
* a non-zero ``found_inf`` skips the step on the device: parameters, state and step counts stay bitwise unchanged;
* step counts are float32 device tensors and the bias corrections are computed on the device, so the step can be
  captured in a CUDA graph (pass the learning rate as a 0-d device tensor to change it between replays).

The launch metadata of each bucket is built once and re-validated in C++ each step (``ampkernels._C.OptimizerTable``),
so the host work per step does not loop over parameters in Python. ``state_dict`` uses torch's keys ('step',
'exp_avg', 'exp_avg_sq', 'max_exp_avg_sq', 'momentum_buffer') and loads from and into torch.optim.Adam/AdamW/SGD.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch

from ampkernels import dispatch, reference

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Order of the state lists a bucket hands to its backend (csrc/optimizer.h, OptimizerList 1..5).
_ADAM_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param", "step")
_SGD_KEYS = ("momentum_buffer", None, None, "master_param", "step")


def _check_lr(lr: Any, where: str) -> None:
    """A learning rate must be a number >= 0 (torch's rule, and NaN is refused too) or a 1-element tensor holding
    one. Host values (numbers, CPU tensors) are checked wherever they are read; a device tensor's value is checked
    here with one host read, which only set-up calls (construction, add_param_group) pay."""
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"{where}: Tensor lr must be 1-element, got shape {tuple(lr.shape)}")
        if not lr.dtype.is_floating_point:
            raise ValueError(f"{where}: Tensor lr must be floating point, got {lr.dtype}")
        value = float(lr)
    elif isinstance(lr, (int, float)) and not isinstance(lr, bool):
        value = float(lr)
    else:
        raise TypeError(f"{where}: lr must be a float or a 1-element tensor, got {type(lr).__name__}")
    if not value >= 0.0:
        raise ValueError(f"Invalid learning rate: {value} ({where}: lr must be >= 0)")


@dataclass
class _Bucket:
    """The parameters of one param group that share a device, a parameter dtype and a gradient dtype."""

    device: torch.device
    grad_dtype: torch.dtype
    params: list[torch.Tensor]
    lists: list[list[torch.Tensor]]  # per _ADAM_KEYS / _SGD_KEYS entry: one tensor per parameter, or empty
    backend: str
    watch: list[torch.Tensor] = field(default_factory=list)  # params of the group without a gradient at build time
    table: Any = None  # ampkernels._C.OptimizerTable (native) or ampkernels.triton.optimizers.StepTable (triton)
    # With master weights: each parameter's version counter when its master was last in sync with it. A write into
    # the parameter from outside (model.load_state_dict, an in-place copy_ under no_grad) bumps the counter; the
    # next step then takes the parameter as the truth and copies it into the master first.
    versions: list[int] = field(default_factory=list)

    def still_valid(self) -> bool:
        """For the Python backends: the gradients are where the bucket was built for (native: checked in C++)."""
        return all(p.grad is not None and p.grad.dtype == self.grad_dtype for p in self.params) and all(
            p.grad is None for p in self.watch
        )


@dataclass
class _Plan:
    """How one param group is stepped: its buckets, valid while the group's params and options stay the same."""

    params: tuple[torch.Tensor, ...]
    options: tuple
    buckets: list[_Bucket]


class _FusedOptimizer(torch.optim.Optimizer):
    """What FusedAdam and FusedSGD share: planning, lazy state, the scaler contract, state_dict compatibility."""

    # The scaler hands the loss scale (grad_scale) and the overflow flag (found_inf) to step() instead of unscaling
    # the gradients and skipping the step on the host.
    _step_supports_amp_scaling = True

    _KIND = ""  # "adam" or "sgd": names the tables' kernels (OptimizerTable/StepTable .step_<kind>)
    _STATE_KEYS: tuple = ()

    def __init__(self, params, defaults: dict[str, Any], backend: str | None) -> None:
        dispatch.check_backend(self._KIND, backend)
        self._requested_backend = backend
        self._plans: dict[int, _Plan] = {}
        super().__init__(params, defaults)

    # ---- construction checks ----

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        # torch's checks ran and appended the group; ours run on the normalised group and take it out again when
        # they reject it, so that a failed call leaves the optimizer as it was.
        index = len(self.param_groups) - 1
        group = self.param_groups[index]
        try:
            _check_lr(group["lr"], f"{type(self).__name__}: param group {index}")
            for i, p in enumerate(group["params"]):
                if not p.is_floating_point() or p.dtype not in _KERNEL_DTYPES:
                    raise TypeError(
                        f"{type(self).__name__}: parameter {i} of param group {index} has dtype "
                        f"{p.dtype}; the fused kernels take float32, float16 and bfloat16 parameters"
                    )
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise
        self._plans.clear()

    def resync_master_weights(self) -> None:
        """Copy every parameter into its float32 master copy (``master_weights=True``).

        Loads that bump a parameter's version counter (``model.load_state_dict``, ``p.copy_(x)`` under
        ``torch.no_grad()``) are detected and resynced by the next step. A write through ``p.data`` (for example
        ``p.data.copy_(x)``) bypasses the counter: call this after it, or the next step overwrites the parameter
        with the stale master.
        """
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    master = self.state.get(p, {}).get("master_param")
                    if master is not None:
                        master.copy_(p)
        for plan in self._plans.values():
            for bucket in plan.buckets:
                if bucket.versions:
                    bucket.versions = [p._version for p in bucket.params]

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_requested_backend", None)
        self._plans = {}
        for group in self.param_groups:  # groups from torch's state_dicts lack our keys
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, except that float32 state of float16/bfloat16 parameters (master weights) stays float32.

        Accepts state_dicts of torch.optim.Adam/AdamW/SGD (any of their forms) and of these classes; parameters
        without saved state get it lazily on their first step.
        """
        self._check_state_dict(state_dict)
        saved_groups = state_dict["param_groups"]
        saved_state = state_dict["state"]
        super().load_state_dict(state_dict)
        # torch casts every floating state tensor to its parameter's dtype; restore float32 where it was float32.
        saved_ids = chain.from_iterable(g["params"] for g in saved_groups)
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for saved_id, p in zip(saved_ids, params, strict=True):
            for key, value in saved_state.get(saved_id, {}).items():
                if isinstance(value, torch.Tensor) and key != "step" and value.dtype == torch.float32:
                    self.state[p][key] = value.to(p.device)
        self._plans.clear()

    def _check_state_dict(self, state_dict: Any) -> None:
        """Errors that name the bad entry, before torch's load (which would fail later, or at the next step)."""
        name = f"{type(self).__name__}.load_state_dict"
        if not isinstance(state_dict, dict):
            raise TypeError(f"{name}: expected a dict, got {type(state_dict).__name__}")
        for key, kind in (("state", dict), ("param_groups", list)):
            if key not in state_dict:
                raise KeyError(f"{name}: missing key '{key}'")
            if not isinstance(state_dict[key], kind):
                raise TypeError(f"{name}: '{key}' must be a {kind.__name__}, got {type(state_dict[key]).__name__}")
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"{name}: the state_dict has {len(groups)} param groups, the optimizer {len(self.param_groups)}"
            )
        for gi, (saved, group) in enumerate(zip(groups, self.param_groups)):
            if not isinstance(saved, dict) or not isinstance(saved.get("params"), (list, tuple)):
                raise TypeError(f"{name}: param_groups[{gi}] must be a dict with a 'params' list")
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"{name}: param_groups[{gi}] has {len(saved['params'])} params, the optimizer's "
                    f"{len(group['params'])}"
                )
            if "lr" in saved:
                _check_lr(saved["lr"], f"{name}: param_groups[{gi}]['lr']")
            for pi, (saved_id, p) in enumerate(zip(saved["params"], group["params"])):
                entry = state_dict["state"].get(saved_id)
                if entry is None:
                    continue
                if not isinstance(entry, dict):
                    raise TypeError(f"{name}: state[{saved_id!r}] must be a dict, got {type(entry).__name__}")
                for key, value in entry.items():
                    where = f"{name}: state[{saved_id!r}]['{key}'] (parameter {pi} of param group {gi})"
                    if key == "step":
                        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
                        ok = ok or (isinstance(value, torch.Tensor) and value.numel() == 1)
                        if not ok:
                            raise TypeError(f"{where} must be a number or a 1-element tensor, got {value!r}")
                    elif key in self._STATE_KEYS and value is not None:  # None: torch's SGD without momentum
                        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                            raise TypeError(f"{where} must be a floating-point tensor, got {type(value).__name__}")
                        if value.shape != p.shape:
                            raise ValueError(f"{where} has shape {tuple(value.shape)}, the parameter {tuple(p.shape)}")

    # ---- state ----

    def _state_dtype(self, p: torch.Tensor, group: dict[str, Any]) -> torch.dtype:
        return torch.float32 if group["master_weights"] and p.dtype != torch.float32 else p.dtype

    def _state_tensor(self, state: dict, key: str, p: torch.Tensor, dtype: torch.dtype, init=None) -> torch.Tensor:
        """``state[key]`` as a tensor shaped and strided like ``p`` of ``dtype`` on ``p``'s device (created or
        converted; a conversion happens only when a loaded state_dict differs, e.g. torch's CPU steps)."""
        value = state.get(key)
        if value is None:
            value = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            if init is not None:
                value.copy_(init)
        elif value.dtype != dtype or value.device != p.device or value.stride() != p.stride():
            value = torch.empty_like(p, dtype=dtype, memory_format=torch.preserve_format).copy_(value)
        state[key] = value
        return value

    def _step_tensor(self, state: dict, p: torch.Tensor, default: float = 0.0) -> torch.Tensor:
        value = state.get("step")
        if value is None:
            value = torch.tensor(default, dtype=torch.float32, device=p.device)
        elif not isinstance(value, torch.Tensor):
            value = torch.tensor(float(value), dtype=torch.float32, device=p.device)
        elif value.dtype != torch.float32 or value.device != p.device or value.dim() != 0:
            value = value.to(device=p.device, dtype=torch.float32).reshape(())
        state["step"] = value
        return value

    def _master_tensor(self, state: dict, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor | None:
        if not (group["master_weights"] and p.dtype != torch.float32):
            state.pop("master_param", None)  # master weights turned off: the parameter is the truth
            return None
        return self._state_tensor(state, "master_param", p, torch.float32, init=p.detach())

    def _init_state(self, p: torch.Tensor, group: dict[str, Any]) -> list[torch.Tensor | None]:
        """Creates or normalises ``self.state[p]``; returns its tensors in ``_STATE_KEYS`` order (None: absent)."""
        raise NotImplementedError

    # ---- planning ----

    def _options(self, group: dict[str, Any]) -> tuple:
        """Group options that change which state tensors exist (a change rebuilds the plan)."""
        raise NotImplementedError

    def _build_plan(self, index: int, group: dict[str, Any], exclude: frozenset[int] = frozenset()) -> _Plan:
        """Buckets for the group's parameters with a gradient (``exclude``: ids of parameters to leave out)."""
        name = type(self).__name__
        with_grad, watch = [], []
        # Two entries over one memory would be stepped twice, racing in the parallel kernels. One gradient tensor
        # shared by two parameters is fine, as in torch.optim: the kernels only read gradients.
        param_at: dict[tuple[torch.device, int], int] = {}
        for i, p in enumerate(group["params"]):
            if p.numel() and param_at.setdefault((p.device, p.data_ptr()), i) != i:
                raise ValueError(
                    f"{name}: parameters {param_at[(p.device, p.data_ptr())]} and {i} of param group {index} are "
                    "the same tensor (or share its memory); list each parameter once"
                )
            if id(p) in exclude:
                continue
            g = p.grad
            if g is None:
                watch.append(p)
                continue
            if g.is_sparse or g.layout != torch.strided:
                raise RuntimeError(f"{name} does not support sparse gradients (parameter {i} of param group {index})")
            if g.dtype not in _KERNEL_DTYPES:
                raise TypeError(
                    f"{name}: parameter {i} of param group {index} has a {g.dtype} gradient; "
                    "the fused kernels take float32, float16 and bfloat16 gradients"
                )
            if g.device != p.device:
                raise RuntimeError(
                    f"{name}: parameter {i} of param group {index} is on {p.device} but its gradient on {g.device}"
                )
            with_grad.append(p)

        grouped: dict[tuple, list[torch.Tensor]] = {}
        for p in with_grad:
            grouped.setdefault((p.device, p.dtype, p.grad.dtype), []).append(p)
        buckets = []
        for (device, _, grad_dtype), params in grouped.items():
            states = [self._init_state(p, group) for p in params]
            lists = [[s[k] for s in states] if states[0][k] is not None else [] for k in range(len(self._STATE_KEYS))]
            backend = dispatch.select(self._KIND, device, self._requested_backend)
            # Only the first bucket watches the group's gradient-less params: one check per step is enough.
            bucket = _Bucket(device, grad_dtype, params, lists, backend, watch if not buckets else [])
            if lists[3]:  # master weights: created from (or loaded for) the parameters as they are now
                bucket.versions = [p._version for p in params]
            if backend == "native":
                bucket.table = dispatch.native().OptimizerTable(self._KIND, params, lists, bucket.watch, grad_dtype)
            elif backend == "triton":
                from ampkernels.triton import optimizers as triton_optimizers

                bucket.table = triton_optimizers.StepTable(self._KIND, params, lists)
            buckets.append(bucket)
        return _Plan(tuple(group["params"]), self._options(group), buckets)

    def _plan(self, index: int, group: dict[str, Any], rebuild: bool = False) -> _Plan:
        plan = self._plans.get(index)
        if (
            rebuild
            or plan is None
            or plan.options != self._options(group)
            or not dispatch.same_params([group["params"]], plan.params)
            or (not plan.buckets and any(p.grad is not None for p in group["params"]))
        ):
            plan = self._plans[index] = self._build_plan(index, group)
        return plan

    # ---- the step ----

    @staticmethod
    def _lr_arguments(lr: float | torch.Tensor, device: torch.device) -> tuple[float, torch.Tensor | None]:
        """(lr as a float, lr as a device tensor the kernels read, or None). A host value is checked here, at no
        cost; a device tensor's value is not (that would synchronize): it was checked when its group was added."""
        if not isinstance(lr, torch.Tensor) or lr.device.type == "cpu":
            value = float(lr)  # a host value: reading it does not synchronize with any device
            if not value >= 0.0:
                raise ValueError(f"Invalid learning rate: {value} (ampkernels: argument 'lr' must be >= 0)")
            if not isinstance(lr, torch.Tensor) or device.type != "cpu":
                return value, None
        if lr.device != device:
            raise ValueError(f"ampkernels: argument 'lr': a tensor on {lr.device} for parameters on {device}")
        if lr.dtype != torch.float32 or lr.numel() != 1:
            raise ValueError(f"ampkernels: argument 'lr': expected a 1-element float32 tensor, got {lr.dtype}")
        return 0.0, lr

    def _hyper(self, group: dict[str, Any]) -> dict[str, Any]:
        """The group's hyperparameters as the kernels take them."""
        raise NotImplementedError

    def _reference_step(self, bucket: _Bucket, grads, lr, grad_scale, found_inf, hyper: dict[str, Any]) -> None:
        raise NotImplementedError

    def _launch(self, bucket: _Bucket, group: dict[str, Any], lr, lr_tensor, grad_scale, found_inf) -> bool:
        """Steps one bucket; False (nothing written) when its gradients no longer match the bucket."""
        hyper = self._hyper(group)
        if bucket.versions:
            self._resync_loaded(bucket)
        step = getattr(bucket.table, f"step_{self._KIND}") if bucket.backend != "torch" else None
        if bucket.backend == "native":  # re-checks the gradients in C++ and says whether it launched
            return step(lr, lr_tensor, grad_scale=grad_scale, found_inf=found_inf, **hyper)
        if not bucket.still_valid():
            return False
        grads = [p.grad for p in bucket.params]
        lr_value = lr_tensor if lr_tensor is not None else lr
        if bucket.backend == "triton":
            step(grads, lr_value, grad_scale, found_inf, **hyper)
        else:
            self._reference_step(bucket, grads, lr_value, grad_scale, found_inf, hyper)
            if bucket.versions:  # the reference writes the parameters with copy_, which counts as a version
                bucket.versions = [p._version for p in bucket.params]
        return True

    @staticmethod
    def _resync_loaded(bucket: _Bucket) -> None:
        """Copy parameters written from outside since the last step into their masters (they are the truth)."""
        versions = [p._version for p in bucket.params]
        if versions == bucket.versions:
            return
        masters = bucket.lists[3]
        for p, master, old, new in zip(bucket.params, masters, bucket.versions, versions, strict=True):
            if old != new:
                master.copy_(p)
        bucket.versions = versions

    def _step_buckets(self, buckets, group, grad_scale, found_inf, on) -> list[int] | None:
        """Steps ``buckets`` in order; None when all stepped, else the ids of the parameters stepped before the
        first stale bucket."""
        for done, bucket in enumerate(buckets):
            lr, lr_tensor = self._lr_arguments(group["lr"], bucket.device)
            if not self._launch(
                bucket, group, lr, lr_tensor, on(grad_scale, bucket.device), on(found_inf, bucket.device)
            ):
                # Only here, on the rare stale step, walk the parameters: 10k ids every step cost ~0.4 ms.
                return [id(p) for stepped in buckets[:done] for p in stepped.params]
        return None

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        grad_scale: torch.Tensor | None = None,
        found_inf: torch.Tensor | None = None,
    ):
        """One optimizer step over every parameter with a gradient.

        Args:
            closure: optional; re-evaluates the model and returns the loss (called under ``torch.enable_grad()``).
            grad_scale: optional float32 1-element tensor the gradients are divided by. Default: the
                ``grad_scale`` attribute a GradScaler sets before calling step().
            found_inf: optional float32 1-element tensor; non-zero skips the step on the device. Default: the
                ``found_inf`` attribute a GradScaler sets.

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grad_scale is None:
            grad_scale = getattr(self, "grad_scale", None)
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        per_device: dict[tuple[int, torch.device], torch.Tensor] = {}

        def on(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
            if t is None or t.device == device:
                return t
            key = (id(t), device)
            if key not in per_device:
                per_device[key] = dispatch.to_kernel_device(t, device)
            return per_device[key]

        for index, group in enumerate(self.param_groups):
            stepped = self._step_buckets(self._plan(index, group).buckets, group, grad_scale, found_inf, on)
            if stepped is not None:
                # A gradient appeared, disappeared or changed dtype since the plan was built. Each bucket checks its
                # gradients before it launches, so the buckets before the stale one stepped correctly: step the
                # rest from a plan without them, and build the full plan again on the next step.
                self._plans.pop(index, None)
                rest = self._build_plan(index, group, exclude=frozenset(stepped))
                if self._step_buckets(rest.buckets, group, grad_scale, found_inf, on) is not None:
                    raise RuntimeError(f"{type(self).__name__}: internal error: a freshly built plan was stale")
        return loss


class FusedAdam(_FusedOptimizer):
    """Drop-in :class:`torch.optim.Adam` (and, with ``decoupled_weight_decay=True``, AdamW) on fused kernels.

    Args:
        params: iterable of parameters or param-group dicts (float32, float16 or bfloat16 parameters).
        lr: learning rate >= 0, a float or a 0-d float32 tensor on the parameters' device (read by the kernel on
            every step, so a CUDA graph replays with the current value). Numbers and CPU tensors are checked at
            every step; a device tensor's value when its group is added (later checks would synchronize), so a
            negative or NaN value written into it afterwards is not caught.
        betas: (beta1, beta2), floats.
        eps: added to the denominator.
        weight_decay: L2 penalty (Adam) or decoupled decay (AdamW).
        amsgrad: use the running maximum of the second moment.
        maximize: maximize the objective.
        decoupled_weight_decay: AdamW's decay ``p *= 1 - lr * weight_decay`` instead of L2 in the gradient.
        master_weights: for float16/bfloat16 parameters, keep a float32 copy (state 'master_param') that the kernel
            updates, and float32 moments; the parameter is written from it in the same pass. Without it the moments
            have the parameter's dtype (as torch's) and the math is float32 either way. A parameter written from
            outside (``model.load_state_dict``, ``p.copy_`` under no_grad: anything that bumps ``p._version``) is
            copied into its master at the next step; after writes through ``p.data``, and for a step captured
            in a CUDA graph (replays run no Python), call :meth:`resync_master_weights`.
        backend: "native", "triton" or "torch"; default: the best available (``python -m ampkernels.info``).
        foreach, capturable, fused: accepted for compatibility with torch.optim.Adam and ignored (the step is always
            fused and capturable).
        differentiable: must be False.
    """

    _KIND = "adam"
    _STATE_KEYS = _ADAM_KEYS

    def __init__(
        self,
        params: Iterable,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        decoupled_weight_decay: bool = False,
        master_weights: bool = False,
        backend: str | None = None,
        foreach: bool | None = None,
        capturable: bool | None = None,
        fused: bool | None = None,
        differentiable: bool = False,
    ) -> None:
        del foreach, capturable, fused  # always fused and capturable
        if differentiable:
            raise ValueError(f"{type(self).__name__} does not support differentiable=True")
        if isinstance(lr, torch.Tensor):
            if lr.numel() != 1:
                raise ValueError("Tensor lr must be 1-element")
        elif not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if any(isinstance(b, torch.Tensor) for b in betas):
            raise ValueError(f"{type(self).__name__}: betas must be floats (tensor betas are not supported)")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            decoupled_weight_decay=decoupled_weight_decay,
            master_weights=master_weights,
        )
        super().__init__(params, defaults, backend)

    def _options(self, group):
        return (bool(group["amsgrad"]), bool(group["master_weights"]))

    def _init_state(self, p, group):
        state = self.state[p]
        dtype = self._state_dtype(p, group)
        exp_avg = self._state_tensor(state, "exp_avg", p, dtype)
        exp_avg_sq = self._state_tensor(state, "exp_avg_sq", p, dtype)
        max_sq = self._state_tensor(state, "max_exp_avg_sq", p, dtype) if group["amsgrad"] else None
        master = self._master_tensor(state, p, group)
        return [exp_avg, exp_avg_sq, max_sq, master, self._step_tensor(state, p)]

    def _hyper(self, group):
        beta1, beta2 = group["betas"]
        return dict(
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            amsgrad=bool(group["amsgrad"]),
            maximize=bool(group["maximize"]),
            decoupled_weight_decay=bool(group["decoupled_weight_decay"]),
        )

    def _reference_step(self, bucket, grads, lr, grad_scale, found_inf, hyper):
        exp_avgs, exp_avg_sqs, max_sqs, masters, steps = bucket.lists
        reference.adam_step(
            bucket.params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            max_sqs,
            steps,
            lr=lr,
            grad_scale=grad_scale,
            found_inf=found_inf,
            master_params=masters,
            **hyper,
        )


class FusedAdamW(FusedAdam):
    """Drop-in :class:`torch.optim.AdamW` on fused kernels: :class:`FusedAdam` with decoupled weight decay.

    Same arguments as :class:`FusedAdam` (``weight_decay`` defaults to 1e-2, as torch's AdamW).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        master_weights: bool = False,
        backend: str | None = None,
        foreach: bool | None = None,
        capturable: bool | None = None,
        fused: bool | None = None,
        differentiable: bool = False,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            maximize=maximize,
            decoupled_weight_decay=True,
            master_weights=master_weights,
            backend=backend,
            foreach=foreach,
            capturable=capturable,
            fused=fused,
            differentiable=differentiable,
        )


class FusedSGD(_FusedOptimizer):
    """Drop-in :class:`torch.optim.SGD` on fused kernels.

    Args:
        params: iterable of parameters or param-group dicts (float32, float16 or bfloat16 parameters).
        lr: learning rate >= 0, a float or a 0-d float32 tensor on the parameters' device (checked as in
            :class:`FusedAdam`).
        momentum, dampening, weight_decay, nesterov, maximize: as torch.optim.SGD.
        master_weights, backend: as :class:`FusedAdam`.
        foreach, fused: accepted for compatibility and ignored. differentiable: must be False.

    State: 'momentum_buffer' (as torch) and, with momentum, 'step': a float32 count of applied steps, which tells
    the kernel on the device whether the buffer is initialised (torch's first-step rule ``buf = grad``) even when a
    skipped first step leaves it untouched. torch.optim.SGD ignores the extra key when loading.
    """

    _KIND = "sgd"
    _STATE_KEYS = _SGD_KEYS

    def __init__(
        self,
        params: Iterable,
        lr: float | torch.Tensor = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        master_weights: bool = False,
        backend: str | None = None,
        foreach: bool | None = None,
        fused: bool | None = None,
        differentiable: bool = False,
    ) -> None:
        del foreach, fused
        if differentiable:
            raise ValueError("FusedSGD does not support differentiable=True")
        if isinstance(lr, torch.Tensor):
            if lr.numel() != 1:
                raise ValueError("Tensor lr must be 1-element")
        elif lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
            master_weights=master_weights,
        )
        super().__init__(params, defaults, backend)

    def _options(self, group):
        return (group["momentum"] != 0, bool(group["master_weights"]))

    def _init_state(self, p, group):
        state = self.state[p]
        master = self._master_tensor(state, p, group)
        if group["momentum"] == 0:
            return [None, None, None, master, None]
        had_buffer = state.get("momentum_buffer") is not None
        buf = self._state_tensor(state, "momentum_buffer", p, self._state_dtype(p, group))
        # A buffer loaded without a step count (torch's SGD keeps none) is initialised: count it as one step.
        step = self._step_tensor(state, p, default=1.0 if had_buffer else 0.0)
        return [buf, None, None, master, step]

    def _hyper(self, group):
        return dict(
            momentum=float(group["momentum"]),
            dampening=float(group["dampening"]),
            weight_decay=float(group["weight_decay"]),
            nesterov=bool(group["nesterov"]),
            maximize=bool(group["maximize"]),
        )

    def _reference_step(self, bucket, grads, lr, grad_scale, found_inf, hyper):
        bufs, _, _, masters, steps = bucket.lists
        reference.sgd_step(
            bucket.params,
            grads,
            bufs,
            steps,
            lr=lr,
            grad_scale=grad_scale,
            found_inf=found_inf,
            master_params=masters,
            **hyper,
        )
