"""Fused, capturable drop-in optimizers: :class:`FusedAdam`, :class:`FusedAdamW` and :class:`FusedSGD`.

Each step is one fused kernel pass over all parameters of a (param group, device, parameter dtype, gradient dtype)
bucket (plus a one-thread-per-tensor prologue for the step counts), with no host synchronization:

* the gradients are only read, divided by ``grad_scale`` when a scaler hands one over (``scale / clip_coef``);
* a non-zero ``found_inf`` skips the step on the device: parameters, state and step counts stay bitwise unchanged;
* step counts are float32 device tensors and the bias corrections are computed on the device, so the step can be
  captured in a CUDA graph (pass the learning rate as a 0-d device tensor to change it between replays).

The launch metadata of each bucket is built once by its backend
(:meth:`ampkernels.optim.backends.OptimizerBackend.table`) and re-validated each step (in C++ for the native backend,
``ampkernels._C.OptimizerTable``, so that the host work per step does not loop over parameters in Python).
``state_dict`` uses torch's keys ('step', 'exp_avg', 'exp_avg_sq', 'max_exp_avg_sq', 'momentum_buffer') and loads
from and into torch.optim.Adam/AdamW/SGD.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch

from ampkernels import dispatch
from ampkernels.optim import backends as _backends  # (importing it registers the ops' backends)
from ampkernels.optim import reference, state_formats
from ampkernels.optim.hyperparameters import AdamHyperparameters, SgdHyperparameters

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Order of the state lists a bucket hands to its backend (csrc/optimizer.h, OptimizerList 1..5).
_ADAM_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param", "step")
_SGD_KEYS = ("momentum_buffer", None, None, "master_param", "step")
# The same for the blockwise Adam step (low-precision moments or stochastic rounding; csrc/optim/blockwise.h).
_BLOCKWISE_KEYS = (
    "exp_avg",
    "exp_avg_scale",
    "exp_avg_sq",
    "exp_avg_sq_scale",
    "max_exp_avg_sq",
    "master_param",
    "step",
)
_MASTER_ROW = {len(_ADAM_KEYS): 3, len(_BLOCKWISE_KEYS): 5}


def _is_dtensor(t: Any) -> bool:
    # DTensor (FSDP2's sharded parameters and gradients) wraps a local shard, which is what the kernels step.
    return type(t).__name__ == "DTensor" and hasattr(t, "_local_tensor")


def _local(t: torch.Tensor) -> torch.Tensor:
    t = t._local_tensor if _is_dtensor(t) else t
    # A weight FSDP2 all-gathers in FP8 (ampkernels.float8.fsdp.Float8AllGatherWeight) wraps its storage.
    return getattr(t, "_hp", t) if type(t).__name__ == "Float8AllGatherWeight" else t


def _shard_offset(p: torch.Tensor, where: str) -> int:
    """Flat index in the full tensor of the first element of this rank's shard of ``p`` (0 for a plain tensor).
    Only dim-0 sharding keeps a shard one contiguous range of the full tensor and every row whole."""
    if not _is_dtensor(p):
        return 0
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for placement in p.placements:
        if not (isinstance(placement, Replicate) or (isinstance(placement, Shard) and placement.dim == 0)):
            raise ValueError(
                f"{where}: low-precision state and stochastic rounding need parameters sharded on dim 0 (FSDP2's "
                f"default) or replicated, got placements {p.placements}"
            )
    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    row = 1
    for size in p.shape[1:]:
        row *= size
    return int(offset[0]) * row if offset else 0


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
    params: list[torch.Tensor]  # what the kernels step: the parameters, or a DTensor parameter's local shard
    lists: list[list[torch.Tensor]]  # per _ADAM_KEYS / _SGD_KEYS / _BLOCKWISE_KEYS entry: one per parameter, or []
    impl: _backends.OptimizerBackend  # the backend that steps it (its name: ``backend``)
    watch: list[torch.Tensor] = field(default_factory=list)  # params of the group without a gradient at build time
    table: _backends.BucketTable | None = None  # built by ``impl`` (OptimizerBackend.table)
    # With master weights: each parameter's storage address and version counter when its master was last in sync
    # with it. A write into the parameter from outside (model.load_state_dict, an in-place copy_ under no_grad)
    # bumps the counter, and ``p.data = t`` moves the storage; the next step then takes the parameter as the truth
    # and copies it into the master first.
    versions: list[tuple[int, int]] = field(default_factory=list)
    # The blockwise step: per parameter (first format, second format, row length, salt, shard offset).
    layout: list[tuple[int, int, int, int, int]] | None = None
    # DTensor (or FP8-all-gather) parameters whose local tensors are ``params``: their gradients (shards) are handed
    # over every step.
    sources: list[torch.Tensor] | None = None

    @property
    def backend(self) -> str:
        """The name of the backend that steps the bucket."""
        return self.impl.name

    @property
    def masters(self) -> list[torch.Tensor]:
        return self.lists[_MASTER_ROW[len(self.lists)]]

    def param_versions(self) -> list[tuple[int, int]]:
        """(storage address, version counter) of each parameter as the model holds it: a write into an FSDP2
        parameter (a DTensor's ``copy_``, as ``model.load_state_dict`` does) or an FP8-all-gather wrapper bumps that
        tensor's counter, not the one of the local tensor inside it that the kernels step; ``p.data = t`` bumps no
        counter but moves the storage."""
        if self.sources is None:
            return [(p.data_ptr(), p._version) for p in self.params]
        return [(_local(p).data_ptr(), p._version) for p in self.sources]

    def sources_or_params(self) -> list[torch.Tensor]:
        """The parameters as the optimizer's param groups hold them."""
        return self.params if self.sources is None else self.sources

    def hand_over_gradients(self) -> bool:
        """False when a parameter has another local tensor than the bucket steps: FSDP2 gives an FP8-all-gather
        weight's padded shard a new one when it re-pads it (after ``load_state_dict``, ``.to()``)."""
        for local, p in zip(self.params, self.sources, strict=True):  # (one pass: it runs every step)
            if _local(p) is not local:
                return False  # (the caller lets go of what was handed over so far)
            local.grad = None if p.grad is None else _local(p.grad)
        return True

    def let_go_of_gradients(self) -> None:
        """The local tensors of DTensor parameters drop the gradients handed over to them, once the step is queued
        (or refused): zero_grad() then frees them (held here they would stay alive through the next backward)."""
        if self.sources is not None:
            for local in self.params:
                local.grad = None


def _record_synced(synced: dict[int, tuple[int, int]], bucket: _Bucket, versions: list[tuple[int, int]]) -> None:
    """The masters of ``bucket`` are in sync with its parameters as ``versions`` describes them (``synced``: the
    optimizer's ``_master_synced``)."""
    bucket.versions = versions
    for p, version in zip(bucket.sources_or_params(), versions, strict=True):
        synced[id(p)] = version


def _reference_launch(step, bucket_ref, synced, grads, lr, grad_scale, found_inf, hyper) -> None:
    """The torch backend's step of a bucket (its table holds it, bound to all but the step's arguments): the
    optimizer's reference ``step``, then the parameters' versions recorded, as the reference writes them with copy_
    (which counts as a version). Holds the bucket weakly and not the optimizer: the bucket holds the table, and a
    reference cycle would keep both, and all the state, alive past the optimizer."""
    bucket = bucket_ref()
    step(bucket, grads, lr, grad_scale, found_inf, hyper)
    if bucket.versions:
        _record_synced(synced, bucket, bucket.param_versions())


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

    _KIND = ""  # "adam" or "sgd": the op, and the kind of step the backends' tables run
    _STATE_KEYS: tuple = ()

    def __init__(self, params, defaults: dict[str, Any], backend: str | None) -> None:
        dispatch.check_backend(self._KIND, backend)
        self._requested_backend = backend
        self._plans: dict[int, _Plan] = {}
        # id(parameter) -> (storage address, version counter) when its master copy was last in sync with it; kept
        # apart from the plans, which are rebuilt, so that a rebuilt plan still sees a parameter written before.
        self._master_synced: dict[int, tuple[int, int]] = {}
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
            self._check_group(group, index)
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise
        self._plans.clear()

    def _check_group(self, group: dict[str, Any], index: int, where: str | None = None) -> None:
        """Option checks of a subclass on a normalised param group (raise TypeError/ValueError); ``where`` prefixes
        the messages (default: the class and the group's index)."""

    def resync_master_weights(self) -> None:
        """Copy every parameter into its float32 master copy (``master_weights=True``).

        Loads that bump a parameter's version counter (``model.load_state_dict``, ``p.copy_(x)`` under
        ``torch.no_grad()``) or give it new storage (``p.data = t``) are detected and resynced by the next step. A
        write into ``p.data`` in place (for example ``p.data.copy_(x)``) bypasses both: call this after it, or the
        next step overwrites the parameter with the stale master.
        """
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    master = self.state.get(p, {}).get("master_param")
                    if master is not None:
                        master.copy_(_local(p))
        self._master_synced.clear()  # (the next plan records the parameters as they are now)
        for plan in self._plans.values():
            for bucket in plan.buckets:
                if bucket.versions:
                    self._record_synced(bucket, bucket.param_versions())

    def __getstate__(self) -> dict[str, Any]:
        # torch.optim.Optimizer keeps defaults, state and param_groups only: deepcopy, pickle and torch.save would
        # drop the backend the optimizer was built for.
        state = super().__getstate__()
        state["_requested_backend"] = self._requested_backend
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_requested_backend", None)
        self._plans = {}
        self._master_synced = {}
        for group in self.param_groups:  # groups from torch's state_dicts lack our keys
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, except that float32 state of float16/bfloat16 parameters (master weights) stays float32.

        Accepts state_dicts of torch.optim.Adam/AdamW/SGD (any of their forms) and of these classes; parameters
        without saved state get it lazily on their first step. DTensor entries (what :meth:`state_dict` gives for
        FSDP2's sharded parameters, and what torch.distributed.checkpoint loads into) are taken as this rank's
        shards, redistributed first if they are laid out otherwise than their parameter.
        """
        state_dict = self._local_entries(state_dict)
        self._check_state_dict(state_dict)
        saved_groups = state_dict["param_groups"]
        saved_state = state_dict["state"]
        # The state's storage options belong to this optimizer, not to the checkpoint: a state saved in another
        # format is converted to this optimizer's (quantized, or decoded to float32) when its parameters step.
        kept = [{key: group[key] for key in self._STORAGE_OPTIONS if key in group} for group in self.param_groups]
        # The other options come from the checkpoint: the mix must be a valid group (amsgrad saved with this
        # optimizer's 8-bit second moment, master weights saved with its stochastic rounding), checked before
        # anything is loaded.
        for gi, (saved, group, options) in enumerate(zip(saved_groups, self.param_groups, kept, strict=True)):
            merged = {**self.defaults, **saved, **options, "params": group["params"]}
            where = f"{type(self).__name__}.load_state_dict: param_groups[{gi}]"
            try:
                self._check_group(merged, gi, where)
            except (TypeError, ValueError) as error:
                storage = ", ".join(self._STORAGE_OPTIONS)
                raise type(error)(f"{error} (the state_dict's options, with this optimizer's {storage})") from None
        super().load_state_dict(state_dict)
        for group, options in zip(self.param_groups, kept, strict=True):
            group.update(options)
        # torch casts every state tensor to its parameter's dtype; restore the saved dtype (float32 master weights
        # and moments of float16/bfloat16 parameters, bfloat16 moments of float32 parameters, uint8 codes).
        for saved, group in zip(saved_groups, self.param_groups, strict=True):
            for saved_id, p in zip(saved["params"], group["params"], strict=True):
                entry = saved_state.get(saved_id, {})
                for key, value in entry.items():
                    if isinstance(value, torch.Tensor) and key != "step":
                        self.state[p][key] = value.to(_local(p).device)
                self._decode_loaded(self.state[p], entry, group, p)
        self._plans.clear()
        self._master_synced.clear()  # loaded masters are the truth

    #: Param-group options that say how the state is stored (kept by load_state_dict).
    _STORAGE_OPTIONS: tuple[str, ...] = ()

    def state_dict(self, dequantize: bool = False) -> dict[str, Any]:
        """As torch's. The state of an FSDP2 (DTensor) parameter is kept as its local shard and saved as a DTensor
        sharded like the parameter (dim 0 of the codes and block exponents of a quantized moment), so that
        torch.distributed.checkpoint saves and loads every rank's shard (torch's optimizers do the same).
        ``dequantize``: see :meth:`FusedAdam.state_dict`."""
        sd = super().state_dict()
        if dequantize:
            sd = self._dequantized(sd)
        return self._sharded_entries(sd)

    def _dequantized(self, sd: dict[str, Any]) -> dict[str, Any]:
        """Subclasses with quantized state: ``sd`` with that state decoded to float32."""
        return sd

    def _saved_entries(self, sd: dict[str, Any]):
        """(the state_dict's entry id, the parameter) of every parameter, in order."""
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        ids = chain.from_iterable(g["params"] for g in sd["param_groups"])
        return zip(ids, params, strict=True)

    def _sharded_entries(self, sd: dict[str, Any]) -> dict[str, Any]:
        for saved_id, p in self._saved_entries(sd):
            entry = sd["state"].get(saved_id)
            if entry is None or not _is_dtensor(p):
                continue
            from torch.distributed.tensor import DTensor

            local = _local(p)
            entry = sd["state"][saved_id] = dict(entry)  # (torch's state_dict shares the entries with self.state)
            for key, value in entry.items():
                if key == "step" or not isinstance(value, torch.Tensor) or value.dim() == 0:
                    continue
                # Param-shaped state has the parameter's global shape; codes and exponents that of dim 0 (their
                # formats allow dim-0 sharding only).
                shape = tuple(p.shape) if value.shape == local.shape else (p.shape[0], *value.shape[1:])
                stride = [1] * len(shape)
                for d in range(len(shape) - 2, -1, -1):
                    stride[d] = stride[d + 1] * shape[d + 1]
                entry[key] = DTensor.from_local(
                    value, p.device_mesh, p.placements, run_check=False, shape=shape, stride=tuple(stride)
                )
        return sd

    def _local_entries(self, state_dict: Any) -> Any:
        """``state_dict`` with its DTensor entries replaced by this rank's shards, laid out as their parameters."""
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict):
            return state_dict  # _check_state_dict says what is wrong
        state, changed = dict(state_dict["state"]), False
        saved_groups = state_dict.get("param_groups")
        if not isinstance(saved_groups, list):
            return state_dict
        for gi, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if not isinstance(saved, dict) or not isinstance(saved.get("params"), (list, tuple)):
                continue
            for saved_id, p in zip(saved["params"], group["params"]):
                entry = state.get(saved_id)
                if not isinstance(entry, dict) or not any(_is_dtensor(v) for v in entry.values()):
                    continue
                if not _is_dtensor(p):
                    raise TypeError(
                        f"{type(self).__name__}.load_state_dict: state[{saved_id!r}] (param group {gi}) holds "
                        "DTensors, but its parameter is a plain tensor"
                    )
                state[saved_id] = {
                    k: v.redistribute(p.device_mesh, p.placements).to_local() if _is_dtensor(v) else v
                    for k, v in entry.items()
                }
                changed = True
        return {**state_dict, "state": state} if changed else state_dict

    def _decode_loaded(self, state: dict, saved: dict, group: dict, p: torch.Tensor) -> None:
        """Subclasses: turn loaded state of another storage format into one the next step converts from."""

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
                    elif value is not None:  # None: torch's SGD without momentum
                        self._check_saved_tensor(key, value, entry, _local(p), saved, where)
                self._check_saved_entry(entry, f"{name}: state[{saved_id!r}] (parameter {pi} of param group {gi})")

    def _check_saved_entry(self, entry: dict, where: str) -> None:
        """Checks that one saved state entry holds what a step needs together (subclasses)."""

    def _check_saved_tensor(self, key: str, value: Any, entry: dict, p: torch.Tensor, group: dict, where: str) -> None:
        """Checks one saved state entry of parameter (or local shard) ``p``, saved with param group ``group``."""
        if key in self._STATE_KEYS:
            state_formats.check_saved_float(key, value, p.shape, where)

    # ---- state ----

    def _state_dtype(self, p: torch.Tensor, group: dict[str, Any]) -> torch.dtype:
        return torch.float32 if group["master_weights"] and p.dtype != torch.float32 else p.dtype

    def _master_tensor(self, state: dict, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor | None:
        if not (group["master_weights"] and p.dtype != torch.float32):
            state.pop("master_param", None)  # master weights turned off: the parameter is the truth
            return None
        return state_formats.float_state(state, "master_param", p, torch.float32, init=p.detach())

    def _init_state(self, p: torch.Tensor, group: dict[str, Any], blockwise: bool) -> list[torch.Tensor | None]:
        """Creates or normalises ``self.state[p]`` (tensors shaped like ``p``'s local shard); returns its tensors in
        ``_STATE_KEYS`` order, or ``_BLOCKWISE_KEYS`` order for the blockwise step (None: absent)."""
        raise NotImplementedError

    def _state_before_step(self, p: torch.Tensor, saved: dict[str, Any]) -> dict[str, Any]:
        """The state entry that parameter ``p``'s next step starts from when its entry is ``saved`` (a new dict; the
        optimizer is left as it is): a fresh one for an empty entry, else ``saved`` in the formats the step keeps
        (a loaded momentum buffer with its step count, float moments quantized, the step count a float32 tensor on
        the device). :class:`ampkernels.cuda_graph.StateSnapshot` restores through it: a captured step converts
        or creates the state once, at capture, and its replays run no Python to do it again."""
        index = next((i for i, g in enumerate(self.param_groups) if any(q is p for q in g["params"])), None)
        if index is None:
            return saved
        group = dict(self.param_groups[index])
        self._check_group(group, index)  # (options set on the group since its last step, normalised on a copy)
        held = self.state.get(p)
        self.state[p] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in saved.items()}
        try:
            self._init_state(p, group, self._blockwise(group, p.dtype))
            return self.state[p]
        finally:
            if held is None:
                del self.state[p]
            else:
                self.state[p] = held

    # ---- planning ----

    def _options(self, group: dict[str, Any]) -> tuple:
        """Group options that change which state tensors exist (a change rebuilds the plan)."""
        raise NotImplementedError

    def _build_plan(self, index: int, group: dict[str, Any]) -> _Plan:
        """Buckets for the group's parameters with a gradient. Everything that can refuse them is checked before
        any state is created or converted."""
        with_grad, watch = self._params_to_step(index, group)
        grouped: dict[tuple, list[torch.Tensor]] = {}
        for p in with_grad:
            grouped.setdefault((_local(p).device, p.dtype, p.grad.dtype, _local(p) is not p), []).append(p)
        salt: dict[int, int] = {}
        planned = []
        for (device, dtype, grad_dtype, wrapped), params in grouped.items():
            blockwise = self._blockwise(group, dtype)
            backend = dispatch.choose("adam_blockwise" if blockwise else self._KIND, device, self._requested_backend)
            layout = None
            if blockwise:
                self._check_rounding_layout(index, group, params, backend)
                if not salt:  # the rounding stream's salt: each parameter's index in the optimizer, as on every rank
                    salt = {id(q): i for i, q in enumerate(chain.from_iterable(g["params"] for g in self.param_groups))}
                layout = [self._layout_of(p, group, salt[id(p)]) for p in params]
            planned.append((device, grad_dtype, wrapped, params, backend, layout))
        # Only the first bucket watches the group's gradient-less params: one check per step is enough.
        buckets = [self._bucket(group, *spec, watch if i == 0 else []) for i, spec in enumerate(planned)]
        return _Plan(tuple(group["params"]), self._options(group), buckets)

    def _params_to_step(self, index: int, group: dict[str, Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(the group's parameters with a gradient, the local tensors of those without), each checked."""
        name = type(self).__name__
        with_grad, watch = [], []
        # Two entries over one memory would be stepped twice, racing in the parallel kernels. One gradient tensor
        # shared by two parameters is fine, as in torch.optim: the kernels only read gradients.
        param_at: dict[tuple[torch.device, int], int] = {}
        for i, p in enumerate(group["params"]):
            local = _local(p)
            where = f"parameter {i} of param group {index}"
            if local.is_meta:
                raise RuntimeError(
                    f"{name}: {where} is on the meta device, with no memory to step. Materializing a model "
                    "(to_empty) gives it new parameters: build the optimizer after that"
                )
            if local.numel() and param_at.setdefault((local.device, local.data_ptr()), i) != i:
                raise ValueError(
                    f"{name}: parameters {param_at[(local.device, local.data_ptr())]} and {i} of param group "
                    f"{index} are the same tensor (or share its memory); list each parameter once"
                )
            g = p.grad
            if g is None:
                watch.append(local)
                continue
            if g.is_sparse or g.layout != torch.strided:
                raise RuntimeError(f"{name} does not support sparse gradients ({where})")
            if g.dtype not in _KERNEL_DTYPES:
                raise TypeError(
                    f"{name}: {where} has a {g.dtype} gradient; the fused kernels take float32, float16 and "
                    "bfloat16 gradients"
                )
            if _local(g).device != local.device:
                raise RuntimeError(f"{name}: {where} is on {local.device} but its gradient on {_local(g).device}")
            if _is_dtensor(p) != _is_dtensor(g):
                raise RuntimeError(f"{name}: {where}: a DTensor and a plain tensor")
            if g.shape != p.shape:  # (``p.grad.data = t`` gets past the .grad setter's check)
                raise RuntimeError(
                    f"{name}: {where} has shape {tuple(p.shape)} but its gradient has shape {list(g.shape)}"
                )
            self._check_state_shapes(p, i, index)
            with_grad.append(p)
        return with_grad, watch

    def _bucket(self, group, device, grad_dtype, wrapped, params, backend, layout, watch) -> _Bucket:
        """The bucket of ``params`` (checked by :meth:`_build_plan`): their state, created or converted, and the
        step table of ``backend`` (an :class:`~ampkernels.optim.backends.OptimizerBackend`)."""
        blockwise = layout is not None
        states = [self._init_state(p, group, blockwise) for p in params]
        keys = _BLOCKWISE_KEYS if blockwise else self._STATE_KEYS
        lists = [[s[k] for s in states] if states[0][k] is not None else [] for k in range(len(keys))]
        locals_ = [_local(p) for p in params]
        bucket = _Bucket(device, grad_dtype, locals_, lists, backend, watch, layout=layout)
        if wrapped:
            bucket.sources = params
            bucket.hand_over_gradients()
        if bucket.masters:
            # Master weights created from (or loaded for) the parameters as they are now, or kept from an earlier
            # plan: those of parameters written since (``p.data = t`` before an option changed, or in a bucket
            # after the one found stale) are copied from the parameters first.
            versions = bucket.param_versions()
            for p, master, version in zip(params, bucket.masters, versions, strict=True):
                if self._master_synced.get(id(p), version) != version:
                    master.copy_(_local(p))
            self._record_synced(bucket, versions)
        reference = functools.partial(
            _reference_launch, type(self)._reference_step, weakref.ref(bucket), self._master_synced
        )
        bucket.table = backend.table(self._KIND, locals_, lists, watch, grad_dtype, layout, reference)
        return bucket

    def _check_state_shapes(self, p: torch.Tensor, i: int, index: int) -> None:
        """The state of parameter ``i`` of param group ``index`` has the shapes the parameter's (local) shape gives
        it: a parameter given another shape since (``p.data = t``) is refused naming it, before its state is read
        (a float state of another shape could even broadcast into it)."""
        state = self.state.get(p)
        if not state:
            return
        local = _local(p)
        for key, value in state.items():
            if key == "step" or not isinstance(value, torch.Tensor):
                continue
            expected = state_formats.expected_shape(state, key, value, local.shape)
            if tuple(value.shape) != expected:
                raise RuntimeError(
                    f"{type(self).__name__}: parameter {i} of param group {index} has shape {tuple(local.shape)}, but "
                    f"its state '{key}' has shape {tuple(value.shape)} (expected {expected}): the parameter "
                    "changed shape since its state was made (p.data = a tensor of another shape?). Give it back its "
                    "shape, or drop its state (del optimizer.state[p]) to start it afresh"
                )

    def _blockwise(self, group: dict[str, Any], dtype: torch.dtype) -> bool:
        """Whether the group's parameters of ``dtype`` take the blockwise step (FusedAdam's storage options)."""
        return False

    def _layout_of(self, p: torch.Tensor, group: dict[str, Any], salt: int) -> tuple[int, int, int, int, int]:
        """The blockwise step's (first format, second format, row length, salt, shard offset) of ``p``."""
        raise NotImplementedError

    def _check_rounding_layout(
        self, index: int, group: dict[str, Any], params: list, backend: _backends.OptimizerBackend
    ) -> None:
        """Subclasses: refuse parameters whose blockwise step ``backend`` cannot compute as the reference does."""

    def _plan(self, index: int, group: dict[str, Any]) -> _Plan:
        plan = self._plans.get(index)
        if (
            plan is None
            or plan.options != self._options(group)
            or not dispatch.same_params([group["params"]], plan.params)
            or (not plan.buckets and any(p.grad is not None for p in group["params"]))
        ):
            # Options set on the group since the last plan (a "4bit" string, a new mix) are normalised and checked
            # as the constructor checks them.
            self._check_group(group, index)
            plan = self._plans[index] = self._build_plan(index, group)
        return plan

    # ---- the step ----

    @staticmethod
    def _lr_arguments(lr: float | torch.Tensor, device: torch.device) -> tuple[float, torch.Tensor | None]:
        """(lr as a float, lr as a device tensor the kernels read, or None). A host value is checked here, at no
        cost; a device tensor's value is not (that would synchronize): it was checked when its group was added.
        A tensor of another floating dtype than float32 steps as torch's optimizers step with it: read as a host
        value on the CPU, converted to float32 on the device (a copy kernel, which a captured step replays)."""
        if not isinstance(lr, torch.Tensor) or lr.device.type == "cpu":
            value = float(lr)  # a host value: reading it does not synchronize with any device
            if not value >= 0.0:
                raise ValueError(f"Invalid learning rate: {value} (ampkernels: argument 'lr' must be >= 0)")
            if not isinstance(lr, torch.Tensor) or device.type != "cpu" or lr.dtype != torch.float32:
                return value, None
        if lr.device != device:
            raise ValueError(f"ampkernels: argument 'lr': a tensor on {lr.device} for parameters on {device}")
        if not lr.dtype.is_floating_point or lr.numel() != 1:
            raise ValueError(f"ampkernels: argument 'lr': expected a 1-element floating-point tensor, got {lr.dtype}")
        return 0.0, lr if lr.dtype == torch.float32 else lr.reshape(()).to(torch.float32)

    def _hyper(self, group: dict[str, Any]) -> AdamHyperparameters | SgdHyperparameters:
        """The group's hyperparameters as every backend takes them (built once per group and step)."""
        raise NotImplementedError

    @staticmethod
    def _reference_step(bucket: _Bucket, grads, lr, grad_scale, found_inf, hyper) -> None:
        """The torch backend's step of ``bucket`` (the reference)."""
        raise NotImplementedError

    def _ready(self, bucket: _Bucket, rebuilt: bool = False) -> bool:
        """Re-checks ``bucket`` for this step, before any bucket launches (DTensor parameters' gradients are handed
        over first); False: a gradient appeared, disappeared or changed, or a parameter changed shape or storage
        since the bucket was built, and its plan must be rebuilt. Writes no parameter. ``rebuilt``: the bucket was
        built for this step, and an error of the native check is raised as it is."""
        if bucket.sources is not None and not bucket.hand_over_gradients():
            bucket.let_go_of_gradients()
            if bucket.versions:  # (what was loaded into the new local tensors, before the plan is rebuilt)
                self._resync_loaded(bucket)
            return False
        try:
            ready = bucket.table.ready()  # (native: re-reads the gradients in C++, and arms the table's next step)
        except RuntimeError:  # a gradient of another shape: the rebuilt plan refuses it, naming the parameter
            if rebuilt:
                raise
            ready = False
        if not ready:
            bucket.let_go_of_gradients()
        return ready

    def _ready_plans(self) -> list[tuple[_Plan, Any, list[tuple[float, torch.Tensor | None]]]]:
        """Per param group: its plan, hyperparameters and each bucket's :meth:`_lr_arguments`, with every bucket
        ready to launch. Everything that can refuse the step is checked here, before any bucket steps: a refused
        step (a NaN lr, an option set to a value the constructor refuses, a parameter whose state no longer fits)
        leaves every parameter and all state as they were."""
        prepared = []
        for index, group in enumerate(self.param_groups):
            plan = self._plan(index, group)
            lrs = [self._lr_arguments(group["lr"], bucket.device) for bucket in plan.buckets]
            prepared.append((plan, self._hyper(group), lrs))
        for index, group in enumerate(self.param_groups):
            plan, hyper, _ = prepared[index]
            if all(self._ready(bucket) for bucket in plan.buckets):
                continue
            for bucket in plan.buckets:
                bucket.let_go_of_gradients()
            # Rebuilt (which names what cannot step) before any bucket launches; built from the gradients of now.
            del self._plans[index]
            plan = self._plans[index] = self._build_plan(index, group)
            if not all(self._ready(bucket, rebuilt=True) for bucket in plan.buckets):
                raise RuntimeError(f"{type(self).__name__}: internal error: a freshly built plan was stale")
            prepared[index] = (plan, hyper, [self._lr_arguments(group["lr"], b.device) for b in plan.buckets])
        return prepared

    def _launch(self, bucket: _Bucket, hyper, lr, lr_tensor, grad_scale, found_inf) -> None:
        """Steps one bucket, made ready by :meth:`_ready`."""
        if bucket.versions:
            self._resync_loaded(bucket)
        bucket.table.step(lr, lr_tensor, hyper, grad_scale, found_inf)

    def _record_synced(self, bucket: _Bucket, versions: list[tuple[int, int]]) -> None:
        """The masters of ``bucket`` are in sync with its parameters as ``versions`` describes them."""
        _record_synced(self._master_synced, bucket, versions)

    def _resync_loaded(self, bucket: _Bucket) -> None:
        """Copy parameters written from outside since the last step into their masters (they are the truth). One
        given another shape is left for the stale-bucket check (its plan is rebuilt, and refuses it by name)."""
        versions = bucket.param_versions()
        if versions == bucket.versions:
            return
        masters = bucket.masters
        params = bucket.params if bucket.sources is None else [_local(p) for p in bucket.sources]
        for i, (p, master, old, new) in enumerate(zip(params, masters, bucket.versions, versions, strict=True)):
            if old != new:
                if p.shape != master.shape:
                    versions[i] = old  # (not in sync)
                    continue
                master.copy_(p)
        self._record_synced(bucket, versions)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients by their total norm, folded into the next :meth:`step`; return the norm before
        clipping (a 0-d float32 tensor, no host sync).

        The same update as ``torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)`` then ``step()``, in one
        read-only pass over the gradients (the norm and the coefficient ``min(max_norm / (norm + 1e-6), 1)`` on the
        device) where torch's clip reads them twice and writes them once: the step divides them by ``1 / coef`` as
        it reads them, so the ``.grad`` tensors keep their unclipped values. :meth:`zero_grad` drops a clip that no
        step consumed; a second clip before the step measures the gradients as the first left them.

        For gradients that are not loss-scaled (bf16 or float32 training): with a
        :class:`~ampkernels.FusedGradScaler` use its ``clip_grad_norm_``, which folds the unscale in too. Only
        ``norm_type`` 2.0 and inf on one device's plain tensors are folded; other norms, parameters on several
        devices and DTensor gradients (FSDP2, whose norm needs a reduction) take torch's clip.
        """
        from ampkernels._constants import norm_kind
        from ampkernels.scaler.functional import unscale_reduce_

        max_norm, norm_type = float(max_norm), float(norm_type)
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        grads = [p.grad for p in params]
        try:
            folds = norm_kind(norm_type) is not None
        except ValueError:
            folds = False  # (a norm the kernels do not compute: torch's clip below)
        if (
            not folds
            or not grads
            or len({g.device for g in grads}) != 1
            or any(type(g) is not torch.Tensor for g in grads)
            or "_clip_divisor" in self.__dict__  # (a second clip: torch's, on gradients made to hold the first)
        ):
            self._materialize_clip(grads)
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
        device = grads[0].device
        one = torch.ones(1, dtype=torch.float32, device=device)
        found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        result = unscale_reduce_(grads, one, found_inf, write=False, norm_type=norm_type, max_norm=max_norm)
        self._clip_divisor = (1.0 / result.clip_coef).reshape(1)
        return result.norm

    def _materialize_clip(self, grads: list[torch.Tensor]) -> None:
        """Apply a pending folded clip to the gradients in place (before a clip that cannot fold)."""
        divisor = self.__dict__.pop("_clip_divisor", None)
        if divisor is not None:
            torch._foreach_div_(grads, divisor.reshape(()))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.__dict__.pop("_clip_divisor", None)  # (a folded clip belongs to the gradients it measured)
        super().zero_grad(set_to_none)

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
        clip = self.__dict__.pop("_clip_divisor", None)  # (clip_grad_norm_'s coefficient, as a divisor)
        if clip is not None:
            grad_scale = clip if grad_scale is None else grad_scale * clip
        per_device: dict[tuple[int, torch.device], torch.Tensor] = {}

        def on(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
            if t is None or t.device == device:
                return t
            key = (id(t), device)
            if key not in per_device:
                per_device[key] = dispatch.to_kernel_device(t, device)
            return per_device[key]

        try:
            for plan, hyper, lrs in self._ready_plans():
                for bucket, (lr, lr_tensor) in zip(plan.buckets, lrs, strict=True):
                    device = bucket.device
                    self._launch(bucket, hyper, lr, lr_tensor, on(grad_scale, device), on(found_inf, device))
        finally:
            for plan in self._plans.values():
                for bucket in plan.buckets:
                    bucket.let_go_of_gradients()
        return loss


class FusedAdam(_FusedOptimizer):
    """Drop-in :class:`torch.optim.Adam` (and, with ``decoupled_weight_decay=True``, AdamW) on fused kernels.

    Args:
        params: iterable of parameters or param-group dicts (float32, float16 or bfloat16 parameters).
        lr: learning rate >= 0, a float or a 0-d float32 tensor on the parameters' device (read by the kernel on
            every step, so a CUDA graph replays with the current value); a tensor of another floating dtype is
            converted to float32 at every step, as torch's optimizers take it. Numbers and CPU tensors are checked at
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
            outside (``model.load_state_dict``, ``p.copy_`` under no_grad: anything that bumps ``p._version``; or
            ``p.data = t``, which gives it new storage) is copied into its master at the next step; after in-place
            writes into ``p.data``, and for a step captured in a CUDA graph (replays run no Python), call
            :meth:`resync_master_weights`.
        exp_avg_dtype, exp_avg_sq_dtype: how the first and second moments are stored (names as TransformerEngine's
            FusedAdam): None (default: as above), ``torch.float32``, ``torch.bfloat16`` (rounded to nearest),
            ``torch.uint8`` or "8bit" (8-bit block floating point: 1.01 B per element), ``torch.uint4`` or "4bit"
            (4-bit: 0.51 B per element). Quantized moments are decoded, updated in float32 and encoded again in
            the same pass; codes and layout in ``ampkernels.reference`` (blocks of 128 along the last dimension,
            so dim-0 sharding never splits one). Tensors with fewer than 2 dimensions or 4096 elements keep
            float32 moments. With float16 parameters, a moment left at None is float32 when the other is set.
        stochastic_rounding: round updated bfloat16 parameters to bfloat16 stochastically (unbiased: up with the
            probability of the distance to the lower value) instead of to nearest, so that updates far below a
            bfloat16 ulp still add up without a float32 master copy. The random bits are a counter-based stream of
            (``seed``, the parameter's index in the optimizer, its step count, the element's index in the full
            tensor): reproducible, independent of the backend and launch, and of how FSDP2 shards the parameter.
            Float32 parameters are unaffected; float16 parameters are refused.
        seed: the stream's seed, an int in [0, 2**63); default ``torch.initial_seed() % 2**63``.
        backend: "native", "triton" or "torch"; default: the best available (``python -m ampkernels.info``).
        foreach, capturable, fused: accepted for compatibility with torch.optim.Adam and ignored (the step is always
            fused and capturable).
        differentiable: must be False.

    FSDP2 (``fully_shard``) parameters are stepped on their local shards, with the same results bit for bit as
    the unsharded parameters get (the state of a shard is the shard of the state).
    """

    _KIND = "adam"
    _STATE_KEYS = _ADAM_KEYS
    _STORAGE_OPTIONS = ("exp_avg_dtype", "exp_avg_sq_dtype", "stochastic_rounding")

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
        exp_avg_dtype: torch.dtype | str | None = None,
        exp_avg_sq_dtype: torch.dtype | str | None = None,
        stochastic_rounding: bool = False,
        seed: int | None = None,
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
            exp_avg_dtype=exp_avg_dtype,
            exp_avg_sq_dtype=exp_avg_sq_dtype,
            stochastic_rounding=stochastic_rounding,
            seed=torch.initial_seed() % 2**63 if seed is None else seed,
        )
        super().__init__(params, defaults, backend)

    # ---- storage options ----

    def _check_group(self, group, index, where=None):
        where = where or f"{type(self).__name__}: param group {index}"
        for key in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            group[key] = state_formats.option_dtype(group.get(key), f"{where}: {key}")
        seed = group.get("seed")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise ValueError(f"{where}: seed must be an int in [0, 2**63), got {seed!r}")
        if group["amsgrad"] and state_formats.quantized_option(group["exp_avg_sq_dtype"]):
            raise ValueError(f"{where}: amsgrad needs a float32 or bfloat16 exp_avg_sq_dtype, not a quantized one")
        if group["stochastic_rounding"]:
            if group["master_weights"]:
                raise ValueError(
                    f"{where}: stochastic_rounding and master_weights exclude each other (stochastic rounding is "
                    "what replaces the float32 master copy)"
                )
            for i, p in enumerate(group["params"]):
                if p.dtype == torch.float16:
                    raise TypeError(
                        f"{where}: parameter {i} is float16; stochastic_rounding rounds bfloat16 parameters "
                        "(use master_weights=True for float16)"
                    )

    def _format(self, p: torch.Tensor, group: dict[str, Any], key: str) -> int:
        """Storage format (``_constants.STATE_*``) of moment ``key`` of parameter ``p`` in the blockwise step."""
        dtype = group[key]
        if dtype is None:  # the default of the fused step: the state dtype, float32 where that is float16
            dtype = self._state_dtype(p, group)
            dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        return state_formats.storage_format(dtype, p, _local(p), f"{type(self).__name__}: {key}")

    def _blockwise(self, group, dtype):
        if group["stochastic_rounding"] and dtype == torch.bfloat16:
            return True
        state_dtype = torch.float32 if group["master_weights"] and dtype != torch.float32 else dtype
        # Anything else than "both moments in the state dtype" takes the blockwise step.
        return any(group[key] not in (None, state_dtype) for key in ("exp_avg_dtype", "exp_avg_sq_dtype"))

    def _layout_of(self, p, group, salt):
        local = _local(p)
        fmt_m, fmt_v = self._format(p, group, "exp_avg_dtype"), self._format(p, group, "exp_avg_sq_dtype")
        quantized = state_formats.is_quantized(fmt_m) or state_formats.is_quantized(fmt_v)
        cols = local.shape[-1] if quantized else local.numel()
        offset = _shard_offset(p, type(self).__name__) if group["stochastic_rounding"] else 0
        return (fmt_m, fmt_v, cols, salt, offset)

    def _check_rounding_layout(self, index, group, params, backend):
        # The rounding stream is indexed by the element's logical flat index (reference.adam_step_blockwise). The
        # native kernels walk a non-contiguous parameter (channels_last, a transposed view) in memory order and
        # index the stream in that order, the Triton kernel refuses it: both are refused here, naming the backend.
        if backend.strided_rounding or not group["stochastic_rounding"]:
            return
        for p in params:
            local = _local(p)
            if local.dtype == torch.bfloat16 and not local.is_contiguous():
                i = next(i for i, q in enumerate(group["params"]) if q is p)
                raise ValueError(
                    f"{type(self).__name__}: parameter {i} of param group {index} (shape {tuple(local.shape)}, "
                    f"strides {local.stride()}) is not contiguous: stochastic_rounding on the {backend.name} backend "
                    "needs contiguous bfloat16 parameters (make it contiguous, or use backend='torch')"
                )

    def _options(self, group):
        return (
            bool(group["amsgrad"]),
            bool(group["master_weights"]),
            group["exp_avg_dtype"],
            group["exp_avg_sq_dtype"],
            bool(group["stochastic_rounding"]),
        )

    # ---- state ----

    def _init_state(self, p, group, blockwise):
        state = self.state[p]
        local = _local(p)
        master = self._master_tensor(state, local, group)
        step = state_formats.step_count(state, local)
        if not blockwise:
            for key in state_formats.MOMENT_KEYS:  # codes of quantized moments the group no longer takes
                state_formats.decode_held(state, key, local.shape)
            dtype = self._state_dtype(local, group)
            exp_avg = state_formats.float_state(state, "exp_avg", local, dtype)
            exp_avg_sq = state_formats.float_state(state, "exp_avg_sq", local, dtype)
            max_sq = state_formats.float_state(state, "max_exp_avg_sq", local, dtype) if group["amsgrad"] else None
            return [exp_avg, exp_avg_sq, max_sq, master, step]
        fmt_m, fmt_v = self._format(p, group, "exp_avg_dtype"), self._format(p, group, "exp_avg_sq_dtype")
        exp_avg, exp_avg_scale = state_formats.moment(state, "exp_avg", local, fmt_m)
        exp_avg_sq, exp_avg_sq_scale = state_formats.moment(state, "exp_avg_sq", local, fmt_v)
        max_sq = None
        if group["amsgrad"]:
            max_sq = state_formats.float_state(state, "max_exp_avg_sq", local, state_formats.FORMAT_DTYPES[fmt_v])
        return [exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale, max_sq, master, step]

    # ---- state_dict ----

    def _check_saved_entry(self, entry, where):
        state_formats.check_saved_adam_entry(entry, where)

    def _check_saved_tensor(self, key, value, entry, p, group, where):
        if not state_formats.check_saved_codes(key, value, entry, p.shape, where):
            super()._check_saved_tensor(key, value, entry, p, group, where)

    def _decode_loaded(self, state, saved, group, p):
        """Quantized moments saved in another format than this optimizer stores them in are decoded to float32
        here (and quantized again, if so configured, when the parameter steps); the same format loads as is."""

        def kept(key: str, fmt: int) -> bool:
            return self._blockwise(group, p.dtype) and self._format(p, group, f"{key}_dtype") == fmt

        state_formats.decode_loaded(state, saved, _local(p), kept)

    def state_dict(self, dequantize: bool = False) -> dict[str, Any]:
        """As torch's; quantized moments are saved as their codes (``exp_avg_codes``, uint8), block exponents
        (``exp_avg_scale``) and width (``exp_avg_bits``), the compact state, which torch's optimizers refuse to
        step from; with ``dequantize=True`` they are decoded to float32 ``exp_avg``, which torch.optim.Adam/AdamW
        load. FSDP2 (DTensor) parameters' state is saved as DTensors (see :meth:`_FusedOptimizer.state_dict`).
        The param groups name their ``exp_avg_dtype`` and ``exp_avg_sq_dtype`` ("8bit", "bf16", ...: what the
        constructor takes), so that every value is a plain type."""
        return state_formats.encode_state_dict(super().state_dict(dequantize))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """See :meth:`_FusedOptimizer.load_state_dict`; quantized moments load as saved by :meth:`state_dict`
        (and, from checkpoints written before their codes had names of their own, as uint8 ``exp_avg``)."""
        where = f"{type(self).__name__}.load_state_dict"
        super().load_state_dict(state_formats.codes_under_moment_names(state_dict, where))

    def _dequantized(self, sd: dict[str, Any]) -> dict[str, Any]:
        shapes = ((saved_id, _local(p).shape) for saved_id, p in self._saved_entries(sd))
        return state_formats.dequantize_state_dict(sd, shapes)

    # ---- the step ----

    def _hyper(self, group):
        return AdamHyperparameters.of_group(group)

    @staticmethod
    def _reference_step(bucket, grads, lr, grad_scale, found_inf, hyper):
        if bucket.layout is not None:
            exp_avgs, exp_avg_scales, exp_avg_sqs, exp_avg_sq_scales, max_sqs, masters, steps = bucket.lists
            reference.adam_step_blockwise(
                bucket.params,
                grads,
                exp_avgs,
                exp_avg_scales,
                exp_avg_sqs,
                exp_avg_sq_scales,
                max_sqs,
                steps,
                formats=[(fmt_m, fmt_v) for fmt_m, fmt_v, *_ in bucket.layout],
                salts=[salt for *_, salt, _ in bucket.layout],
                offsets=[offset for *_, offset in bucket.layout],
                lr=lr,
                hyper=hyper,
                grad_scale=grad_scale,
                found_inf=found_inf,
                master_params=masters,
            )
            return
        exp_avgs, exp_avg_sqs, max_sqs, masters, steps = bucket.lists
        reference.adam_step(
            bucket.params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            max_sqs,
            steps,
            lr=lr,
            hyper=hyper,
            grad_scale=grad_scale,
            found_inf=found_inf,
            master_params=masters,
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
        exp_avg_dtype: torch.dtype | str | None = None,
        exp_avg_sq_dtype: torch.dtype | str | None = None,
        stochastic_rounding: bool = False,
        seed: int | None = None,
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
            exp_avg_dtype=exp_avg_dtype,
            exp_avg_sq_dtype=exp_avg_sq_dtype,
            stochastic_rounding=stochastic_rounding,
            seed=seed,
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

    def _init_state(self, p, group, blockwise):
        state = self.state[p]
        p = _local(p)
        master = self._master_tensor(state, p, group)
        if group["momentum"] == 0:
            return [None, None, None, master, None]
        had_buffer = state.get("momentum_buffer") is not None
        buf = state_formats.float_state(state, "momentum_buffer", p, self._state_dtype(p, group))
        # A buffer loaded without a step count (torch's SGD keeps none) is initialised: count it as one step.
        step = state_formats.step_count(state, p, default=1.0 if had_buffer else 0.0)
        return [buf, None, None, master, step]

    def _hyper(self, group):
        return SgdHyperparameters.of_group(group)

    @staticmethod
    def _reference_step(bucket, grads, lr, grad_scale, found_inf, hyper):
        bufs, _, _, masters, steps = bucket.lists
        reference.sgd_step(
            bucket.params,
            grads,
            bufs,
            steps,
            lr=lr,
            hyper=hyper,
            grad_scale=grad_scale,
            found_inf=found_inf,
            master_params=masters,
        )
