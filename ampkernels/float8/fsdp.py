"""FP8 all-gather for FSDP2: a tensorwise :class:`~ampkernels.float8.Float8Linear` whose sharded weight is sent as
FP8 codes (1 byte per element instead of the 2 or 4 of bf16 or fp32 weights), cast with the scale of the *global*
amax, so that every rank, and one unsharded process, computes with the same FP8 weight bit for bit.

Two tensor subclasses carry it through ``torch.distributed.fsdp.fully_shard``:

* :class:`Float8AllGatherWeight` wraps the high-precision weight (``convert_to_float8(...,
  fsdp_float8_all_gather=True)`` puts it in the layers before ``fully_shard``). Every op sees the plain tensor
  inside (the optimizer updates it in place); the ops FSDP2 shards it with keep the wrapper. It implements FSDP2's
  all-gather extension: ``fsdp_pre_all_gather`` casts this rank's shard to FP8 with the global scale,
  ``fsdp_post_all_gather`` wraps the gathered codes.
* :class:`Float8GatheredWeight` is the unsharded weight a layer computes with: FP8 codes ``[N, K]`` and their 0-d
  ``scale_inv``, with the parameter's shape and dtype outside. ``Float8Linear`` reads the codes straight into its
  GEMMs; any other op sees the dequantized weight ``codes * scale_inv``.

The global scale: :func:`precompute_float8_scales` takes the amaxes of every such weight of a model in one
all-reduce (call it after each optimizer step, as torchao's ``precompute_float8_dynamic_scale_for_fsdp``). A scale
is used only while the weight it was taken from is unchanged: an optimizer step (any ``torch.optim.Optimizer``, the
fused ones included) or an in-place write (``copy_``, ``load_state_dict``) since then makes the all-gather take the
amax itself, with one all-reduce per layer. So a forgotten call costs collectives, never a stale scale.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map_only

from ampkernels.float8 import reference

aten = torch.ops.aten

# The ops FSDP2 shards and re-allocates a parameter with: their results stay a Float8AllGatherWeight (torchao keeps
# the same set for its float8 weight wrapper).
_SHARDING_OPS = {
    aten.detach.default,
    aten.alias.default,
    aten.empty_like.default,
    aten.new_zeros.default,
    aten.slice.Tensor,
    aten.copy_.default,
    aten.view.default,
    aten.as_strided.default,
    aten._to_copy.default,
    aten._pin_memory.default,
    aten.split.Tensor,
    aten.clone.default,
}
# The ops FSDP2 makes the unsharded parameter with (as_strided to the unpadded shape; nn.Parameter's detach).
_VIEW_OPS = {aten.detach.default, aten.alias.default, aten.as_strided.default, aten.view.default}

# Optimizer steps taken in this process (a global step hook, registered with the first wrapper): a precomputed scale
# records the count it was taken at, and is stale once it moved.
_steps_seen = 0
_hook = None


def _count_step(optimizer, args, kwargs) -> None:
    global _steps_seen
    _steps_seen += 1


def _register_step_hook() -> None:
    global _hook
    if _hook is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _hook = register_optimizer_step_post_hook(_count_step)


def _writes_first_argument(func) -> bool:
    arguments = func._schema.arguments
    return bool(arguments) and arguments[0].alias_info is not None and arguments[0].alias_info.is_write


def _local(t: torch.Tensor) -> torch.Tensor:
    # FSDP2's sharded parameter is a DTensor around this rank's shard.
    return t._local_tensor if type(t).__name__ == "DTensor" and hasattr(t, "_local_tensor") else t


class Float8AllGatherWeight(torch.Tensor):
    """A high-precision weight that FSDP2 all-gathers as FP8 (see the module docstring). ``hp``: the plain tensor it
    wraps (its shape, strides, dtype and device are the wrapper's); ``float8_dtype``: the codes' dtype."""

    @staticmethod
    def __new__(cls, hp: torch.Tensor, float8_dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            hp.size(),
            strides=hp.stride(),
            storage_offset=hp.storage_offset(),
            dtype=hp.dtype,
            layout=hp.layout,
            device=hp.device,
            requires_grad=hp.requires_grad,
        )

    def __init__(self, hp: torch.Tensor, float8_dtype: torch.dtype) -> None:
        self._hp = hp
        self._float8_dtype = float8_dtype
        # From precompute_float8_scales: (scale, optimizer step count, a weak reference to the parameter it was given
        # (this wrapper, or the DTensor around it: in-place writes bump the version of that outermost tensor), its
        # version), or None.
        self._precomputed: tuple[torch.Tensor, int, weakref.ref, int] | None = None
        _register_step_hook()

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        float8_dtype = None

        def unwrap(t: Float8AllGatherWeight) -> torch.Tensor:
            nonlocal float8_dtype
            float8_dtype = t._float8_dtype
            return t._hp

        out = func(*tree_map_only(cls, unwrap, args), **tree_map_only(cls, unwrap, kwargs))
        if isinstance(out, torch.Tensor) and _writes_first_argument(func):
            return args[0]  # in place (copy_, add_, ...): the destination itself, wrapper or not
        if func not in _SHARDING_OPS:
            return out
        return tree_map_only(torch.Tensor, lambda t: cls(t, float8_dtype), out)

    def __tensor_flatten__(self):
        return ["_hp"], (self._float8_dtype,)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Float8AllGatherWeight(inner["_hp"], *meta)

    def __reduce_ex__(self, protocol):
        # torch.save of a state_dict: the plain weight (a converted model's checkpoint loads into the plain model).
        # The Parameter itself (a pickled model: torch.save(model), a module sent to spawned processes) stays one,
        # wrapped: as a plain tensor it would lose requires_grad, and no optimizer would step it.
        if isinstance(self, nn.Parameter):
            return _rebuild_parameter, (self._hp.detach(), self._float8_dtype, self.requires_grad)
        return self._hp.__reduce_ex__(protocol)

    def __repr__(self) -> str:
        return f"Float8AllGatherWeight({self._hp!r}, float8_dtype={self._float8_dtype})"

    # ---- the scale ----

    def _valid_scale(self) -> torch.Tensor | None:
        if self._precomputed is None:
            return None
        scale, steps, param, version = self._precomputed
        param = param()
        return scale if steps == _steps_seen and param is not None and version == param._version else None

    def _global_scale(self, mesh) -> torch.Tensor:
        """The scale of the whole weight's amax: precomputed, or this shard's amax all-reduced now."""
        scale = self._valid_scale()
        if scale is None:
            amax = _shard_amaxes([self._hp])
            if mesh is not None and mesh.size() > 1:
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group())
            scale = reference.float8_scale(amax[0], self._float8_dtype)
        return scale

    # ---- FSDP2's all-gather extension ----

    def fsdp_pre_all_gather(self, mesh, outer_size=None, outer_stride=None, module=None, mp_policy=None):
        """This rank's shard as FP8 codes (padded to FSDP2's even shard rows) and, as metadata, its scale_inv."""
        from ampkernels.float8.casts import to_float8

        hp = self._hp
        scale = self._global_scale(mesh)
        rows = hp.shape[0]
        padded = rows if outer_size is None else -(-outer_size[0] // mesh.size())
        if hp.numel():
            data, scale_inv = to_float8(hp.reshape(rows, -1), self._float8_dtype, scale=scale.reshape(1))
            codes = data.view(hp.shape)
        else:
            codes, scale_inv = torch.empty(hp.shape, dtype=self._float8_dtype, device=hp.device), scale.reciprocal()
        if padded > rows:  # FSDP2 gathers equal shards: the last ranks' are padded (with zero codes)
            pad = torch.zeros((padded - rows, *hp.shape[1:]), dtype=torch.uint8, device=hp.device)
            codes = torch.cat((codes.view(torch.uint8), pad)).view(self._float8_dtype)
        return (codes,), (scale_inv.reshape(()),)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """The gathered codes as a :class:`Float8GatheredWeight` of dtype ``param_dtype``."""
        (codes,), (scale_inv,) = all_gather_outputs, metadata
        if out is not None:  # FSDP2 refilled the codes' storage in place; only the scale is new
            _local(out)._scale_inv.copy_(scale_inv)
            return None
        return Float8GatheredWeight(codes, scale_inv.clone(), param_dtype), (codes,)


def _rebuild_parameter(hp: torch.Tensor, float8_dtype: torch.dtype, requires_grad: bool) -> nn.Parameter:
    return nn.Parameter(Float8AllGatherWeight(hp, float8_dtype), requires_grad=requires_grad)


class Float8GatheredWeight(torch.Tensor):
    """An unsharded weight as FP8 ``codes`` and their float32 0-d ``scale_inv`` (``weight ≈ codes.float() *
    scale_inv``), with ``dtype`` (the parameter's) outside. :class:`~ampkernels.float8.Float8Linear` computes
    with the codes; every other op sees the dequantized weight (views and clones keep the codes)."""

    @staticmethod
    def __new__(cls, codes: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            codes.size(),
            strides=codes.stride(),
            storage_offset=codes.storage_offset(),
            dtype=dtype,
            layout=codes.layout,
            device=codes.device,
            requires_grad=False,
        )

    def __init__(self, codes: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> None:
        self._codes = codes
        self._scale_inv = scale_inv

    __torch_function__ = torch._C._disabled_torch_function_impl

    def dequantized(self) -> torch.Tensor:
        return (self._codes.float() * self._scale_inv).to(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _VIEW_OPS and isinstance(args[0], cls):
            self = args[0]
            return cls(func(self._codes, *args[1:], **kwargs), self._scale_inv, self.dtype)
        if func is aten.clone.default and isinstance(args[0], cls):  # (deepcopy)
            self = args[0]
            return cls(func(self._codes, *args[1:], **kwargs), self._scale_inv.clone(), self.dtype)
        return func(*tree_map_only(cls, cls.dequantized, args), **tree_map_only(cls, cls.dequantized, kwargs))

    def __tensor_flatten__(self):
        return ["_codes", "_scale_inv"], (self.dtype,)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Float8GatheredWeight(inner["_codes"], inner["_scale_inv"], *meta)

    def __repr__(self) -> str:
        return f"Float8GatheredWeight(codes={self._codes.dtype}{list(self.shape)}, dtype={self.dtype})"


def _shard_amaxes(tensors: list[torch.Tensor]) -> torch.Tensor:
    """float32 [len(tensors)]: max |t| of each (0 for an empty shard; NaN for a shard with a NaN), in one
    multi-tensor kernel per dtype (torch's infinity norm: exact, it is a max)."""
    nonempty = [i for i, t in enumerate(tensors) if t.numel()]
    amaxes = torch.zeros(len(tensors), dtype=torch.float32, device=tensors[0].device)
    if nonempty:
        norms = torch._foreach_norm([tensors[i] for i in nonempty], ord=math.inf)
        values = torch.stack([n.float() for n in norms])
        if len(nonempty) == len(tensors):
            return values
        amaxes[nonempty] = values
    return amaxes


@torch.no_grad()
def precompute_float8_scales(module: nn.Module | Iterable[torch.Tensor]) -> None:
    """Takes the global amax of every FP8-all-gathered weight of ``module`` (a model, or its parameters) in one
    all-reduce per device mesh (and codes' dtype), and keeps each weight's scale for its next all-gathers. Call it
    after each optimizer step, on every rank: the amaxes are all-reduced. Without it (or after the weights changed
    since) each all-gather takes its own amax: the same scale, one all-reduce per layer instead of one in all. No
    host sync."""
    params = module.parameters() if isinstance(module, nn.Module) else module
    groups: dict[tuple, tuple] = {}  # one all-reduce per mesh, one scale computation per (mesh, codes' dtype)
    for p in params:
        local = _local(p)
        if isinstance(local, Float8AllGatherWeight):
            mesh = getattr(p, "device_mesh", None)
            # The mesh dimensions the shards differ along: HSDP's 2-D mesh replicates them along its first.
            dims = tuple(d for d, placement in enumerate(getattr(p, "placements", ())) if placement.is_shard())
            key = (id(mesh), dims, local._float8_dtype)
            groups.setdefault(key, (mesh, dims, local._float8_dtype, []))[3].append(p)
    for mesh, dims, float8_dtype, weights in groups.values():
        locals_ = [_local(p) for p in weights]
        amaxes = _shard_amaxes([w._hp for w in locals_])
        for dim in dims:
            if mesh.size(dim) > 1:
                dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
        scales = reference.float8_scale(amaxes, float8_dtype).unbind(0)
        for p, w, scale in zip(weights, locals_, scales):
            w._precomputed = (scale, _steps_seen, weakref.ref(p), p._version)


def wrap_float8_all_gather(weight: nn.Parameter, float8_dtype: torch.dtype) -> nn.Parameter:
    """``weight`` as a new Parameter around a :class:`Float8AllGatherWeight` of the same storage."""
    if isinstance(weight, Float8AllGatherWeight):
        return weight
    if type(weight) not in (nn.Parameter, torch.Tensor):
        raise ValueError(
            f"fsdp_float8_all_gather: expected a plain weight, got a {type(weight).__name__} (convert the model "
            "before fully_shard)"
        )
    return nn.Parameter(Float8AllGatherWeight(weight.detach(), float8_dtype), requires_grad=weight.requires_grad)


__all__ = [
    "Float8AllGatherWeight",
    "Float8GatheredWeight",
    "precompute_float8_scales",
    "wrap_float8_all_gather",
]
