"""Capture a whole AMP training step (forward, backward, scaler, optimizer) in one CUDA graph and replay it.

What makes a step capturable: nothing in it may wait for the host. With :class:`ampkernels.FusedGradScaler` and an
optimizer that takes the scale and the skip flag on the device (``ampkernels.FusedAdamW``/``FusedAdam``/``FusedSGD``,
or torch's with ``fused=True, capturable=True``), the non-finite check, the clip, the skip and the scale update all
stay on the device, so an overflowing step is still skipped and the scale still backs off during replay. Stock
``torch.amp.GradScaler.step`` with an ordinary optimizer reads ``found_inf`` on the host and cannot be captured.
Hugging Face models called without an attention mask need ``transformers_mask_skip=True`` to keep flash attention
in the graph (see :func:`transformers_mask_skip`).

Example::

    scaler = ampkernels.FusedGradScaler()
    opt = ampkernels.FusedAdamW(model.parameters(), lr=torch.tensor(1e-3, device="cuda"))

    def train_step(x, y):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.clip_grad_norm_(opt, max_norm=1.0)
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    # Warm-up and capture leave model, opt and scaler as they were: the first replay is the first training step.
    step = ampkernels.capture_step(train_step, x0, y0, models=model, optimizers=opt, scalers=scaler)
    for x, y in loader:
        loss = step(x, y)  # copies x, y into the captured inputs and replays the graph
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import sys
import types
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ampkernels.float8.convert import initialize_deferred_state

HOST_SYNC_HINT = (
    "something in the step waits for the host: .item(), float(tensor), printing a tensor, a data-dependent shape, "
    "torch.amp.GradScaler.step with an ordinary optimizer, or clip_grad_norm_(error_if_nonfinite=True). Use "
    "ampkernels.FusedGradScaler with ampkernels.FusedAdamW/FusedAdam/FusedSGD (or torch's with fused=True, "
    "capturable=True) and keep the step free of host reads"
)


@contextlib.contextmanager
def transformers_mask_skip() -> Iterator[None]:
    """While active, Hugging Face transformers drops an absent attention mask during CUDA graph capture as in eager.

    transformers 5 counts stream capture as tracing (``transformers.utils.import_utils.is_tracing``) and then builds
    the full attention mask even for a batch without one, which keeps SDPA off flash attention: a captured BERT-base
    step (batch 32, seq 512, fp16) replayed in 107 ms against 52 ms eager, with 11 GiB more memory (H200). Inside
    this context stream capture does not count as tracing, so a model called without ``attention_mask`` takes the
    same attention kernels as in eager mode. A batch that does carry a padding mask then makes transformers read it
    on the host, which fails the capture with an error instead of baking a data-dependent choice into the graph.
    Does nothing when transformers is not imported.
    """
    import_utils = sys.modules.get("transformers.utils.import_utils")
    original = getattr(import_utils, "is_cuda_stream_capturing", None)
    if original is None:
        yield
        return
    import_utils.is_cuda_stream_capturing = lambda: False
    try:
        yield
    finally:
        import_utils.is_cuda_stream_capturing = original


_mask_skip = transformers_mask_skip  # the constructor's flag of the same name shadows it

# State that optimizers create on their first step, and what a fresh optimizer starts it from when it is not zero:
# ampkernels' master weights start as the parameter itself (in float32).
_FRESH_FROM_PARAM = ("master_param",)
_FIND_MAX_ITEMS = 64  # items of one list or dict that capture_step looks at when it searches step_fn


def _as_list(objs: Any, kind: type | tuple[type, ...], name: str) -> list:
    if objs is None:
        return []
    out = [objs] if isinstance(objs, kind) else list(objs)
    for i, obj in enumerate(out):
        if not isinstance(obj, kind):
            expected = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            raise TypeError(f"ampkernels.capture_step: {name}[{i}] is a {type(obj).__name__}, not a {expected}")
    return out


def _same_kind(value: Any, saved: Any) -> bool:
    """Whether ``saved`` can be written back as ``value``: tensors of one shape and dtype, or two plain values."""
    if isinstance(value, torch.Tensor) or isinstance(saved, torch.Tensor):
        return (
            isinstance(value, torch.Tensor)
            and isinstance(saved, torch.Tensor)
            and value.shape == saved.shape
            and value.dtype == saved.dtype
        )
    return saved is not None


class StateSnapshot:
    """A copy of everything a training step can write in ``models``, ``optimizers`` and ``scalers``, restorable in
    place: :meth:`restore` copies the saved values back into the same tensors (a CUDA graph keeps their addresses).

    Saved: parameters and buffers of the models (BatchNorm running statistics and ``num_batches_tracked``), the
    optimizers' parameters, their gradients, the optimizers' state tensors and other state values, tensor values in
    their param groups (a 0-d ``lr``), the scalers' scale, growth tracker and other device state (ampkernels'
    hysteresis tracker and telemetry counters), their per-optimizer stages, and the CPU and CUDA random number
    generators' states. State that did not exist when the snapshot was taken (what an optimizer or a scaler creates
    on its first step) is reset to what a fresh one starts from: zeros (step counts 0), ampkernels' ``master_param``
    the parameter's value, a scaler's scale its ``init_scale``; and state that ampkernels' optimizers converted at
    their first step (a loaded torch checkpoint: quantized, or given a step count) to the saved values in the
    formats the step keeps. It stays allocated, so that what was captured over it keeps its addresses. Delayed FP8
    scaling state that a model made on the meta device has not initialized yet (``ampkernels.float8``: it does so
    at its first use) is initialized before the copy.

    Costs one copy of every saved tensor that exists when the snapshot is taken, on its device: for a fresh
    optimizer, the parameters, buffers and existing gradients; for a resumed one, its state as well.
    """

    def __init__(self, models: Iterable = (), optimizers: Iterable = (), scalers: Iterable = ()) -> None:
        self.models = _as_list(models, torch.nn.Module, "models")
        self.optimizers = _as_list(optimizers, torch.optim.Optimizer, "optimizers")
        self.scalers = _as_list(scalers, torch.amp.GradScaler, "scalers")
        tensors: dict[int, torch.Tensor] = {}
        for model in self.models:
            initialize_deferred_state(model)  # (else the copy would keep a deferred model's uninitialized memory)
            for t in (*model.parameters(), *model.buffers()):
                tensors.setdefault(id(t), t)
        for opt in self.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    tensors.setdefault(id(p), p)
        self._tensors = [(t, t.detach().clone()) for t in tensors.values()]
        self._params = [t for t in tensors.values() if isinstance(t, torch.nn.Parameter) or t.requires_grad]
        self._grads = [(p, p.grad, None if p.grad is None else p.grad.detach().clone()) for p in self._params]
        self._opt_state = [self._save_optimizer(opt) for opt in self.optimizers]
        self._scaler_state = [self._save_scaler(scaler) for scaler in self.scalers]
        self._cpu_rng = torch.get_rng_state()
        self._cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    @staticmethod
    def _save_optimizer(opt: torch.optim.Optimizer):
        state = {}
        for p, entry in opt.state.items():
            state[id(p)] = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
        groups = [
            {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in g.items() if k != "params"}
            for g in opt.param_groups
        ]
        return state, groups

    @staticmethod
    def _save_scaler(scaler: torch.amp.GradScaler):
        if not scaler.is_enabled():
            return {}, {}, None
        saved = {}
        for name, value in vars(scaler).items():
            if isinstance(value, torch.Tensor):
                saved[name] = value.detach().clone()
        stages = {k: {**v, "found_inf_per_device": dict(v["found_inf_per_device"])} for k, v in
                  scaler._per_optimizer_states.items()}  # fmt: skip
        return saved, stages, getattr(scaler, "_last_grad_norm", None)

    @torch.no_grad()
    def restore(self, rebind_gradients: bool = True) -> None:
        """Write the saved values back in place; reset state created since the snapshot to its fresh values.

        Args:
            rebind_gradients: ``True``: each ``.grad`` is again the tensor it was (or None), holding its saved
                values. ``False`` (after a capture, whose gradients are the graph's buffers): the saved values are
                written into the current ``.grad``, zeros where there was none; a scaler's last gradient norm
                stays the graph's tensor (NaN until the first replay), so that telemetry reports the replays'.
        """
        for t, saved in self._tensors:
            # Through .data, which does not count as a write to the parameter (detach() would bump its version):
            # an optimizer with master weights takes a bumped parameter for a load and would resync from it.
            t.data.copy_(saved)
        for p, grad, saved in self._grads:
            if grad is not None:
                grad.copy_(saved)
            if rebind_gradients or p.grad is None:
                p.grad = grad
            elif p.grad is not grad and saved is not None:
                p.grad.copy_(saved)
            elif p.grad is not grad:
                p.grad.zero_()  # the step's own gradient buffer: a set_to_none step rewrites it at every replay
        for opt, (state, groups) in zip(self.optimizers, self._opt_state, strict=True):
            self._restore_optimizer(opt, state, groups)
        for scaler, saved in zip(self.scalers, self._scaler_state, strict=True):
            self._restore_scaler(scaler, *saved, keep_outputs=not rebind_gradients)
        torch.set_rng_state(self._cpu_rng)
        if self._cuda_rng is not None:
            torch.cuda.set_rng_state_all(self._cuda_rng)

    @staticmethod
    def _restore_optimizer(opt: torch.optim.Optimizer, state: dict, groups: list) -> None:
        for group, saved in zip(opt.param_groups, groups):
            for k, v in saved.items():
                if isinstance(v, torch.Tensor) and isinstance(group.get(k), torch.Tensor):
                    group[k].copy_(v)
                else:
                    group[k] = v
        # ampkernels' optimizers convert a loaded state at a parameter's first step and create some state that is
        # not zero (the code width of quantized moments): an entry the warm-up converted or created (a value of
        # another shape, dtype or type than saved, or not saved) is restored to what the next step starts from,
        # which replays (no Python) never make again; an entry it left alone, to the saved values as they are.
        before_step = getattr(opt, "_state_before_step", None)
        for p, entry in list(opt.state.items()):
            saved = state.get(id(p), {})
            if before_step is not None and not all(_same_kind(v, saved.get(k)) for k, v in entry.items()):
                saved = before_step(p, saved)
            for k, v in list(entry.items()):
                if k in saved:
                    old = saved[k]
                    if isinstance(v, torch.Tensor) and isinstance(old, torch.Tensor) and v.shape == old.shape:
                        v.copy_(old)
                    else:
                        entry[k] = old.clone() if isinstance(old, torch.Tensor) else old
                elif isinstance(v, torch.Tensor):
                    if k in _FRESH_FROM_PARAM:
                        v.copy_(p.detach())
                    else:
                        v.zero_()
                elif isinstance(v, (int, float)) and not isinstance(v, bool):
                    entry[k] = type(v)(0)

    @staticmethod
    def _restore_scaler(scaler, saved: dict, stages: dict, last_grad_norm, keep_outputs: bool) -> None:
        if not scaler.is_enabled():
            return
        if hasattr(scaler, "_initial_device_state"):
            fresh = scaler._initial_device_state()
        else:
            fresh = {"_scale": scaler._init_scale, "_growth_tracker": scaler._init_growth_tracker}
        for name, value in vars(scaler).items():
            if not isinstance(value, torch.Tensor) or name == "_last_grad_norm":
                continue
            if name in saved:
                value.copy_(saved[name])
            elif name in fresh:
                value.fill_(fresh[name])
        scaler._per_optimizer_states.clear()
        scaler._per_optimizer_states.update(stages)
        if hasattr(scaler, "_last_grad_norm"):
            current = scaler._last_grad_norm
            if keep_outputs and isinstance(current, torch.Tensor) and current is not last_grad_norm:
                # The captured step's norm, rewritten at every replay: kept for telemetry, NaN until the first one.
                current.fill_(math.nan if last_grad_norm is None else last_grad_norm.item())
            else:
                scaler._last_grad_norm = last_grad_norm


def snapshot_state(models: Any = None, optimizers: Any = None, scalers: Any = None) -> StateSnapshot:
    """Save the training state of ``models``, ``optimizers`` and ``scalers`` (each one object or an iterable of
    them); ``.restore()`` writes it back in place. See :class:`StateSnapshot`."""
    return StateSnapshot(models, optimizers, scalers)


def _find_state(step_fn: Callable[..., Any]) -> tuple[list, list, list]:
    """The modules, optimizers and scalers ``step_fn`` reaches: through its closure, the globals it names, a bound
    method's object and a ``functools.partial``'s arguments, following the functions found there (three levels),
    and two levels into lists, tuples, dicts (their first 64 items) and the attributes of the objects found there."""
    kinds = (torch.nn.Module, torch.optim.Optimizer, torch.amp.GradScaler)
    found: dict[int, Any] = {}
    seen: set[int] = set()

    def consider(obj: Any, depth: int, nest: int = 2) -> None:
        if id(obj) in seen or isinstance(obj, (types.ModuleType, type, str, bytes, int, float, bool, torch.Tensor)):
            return
        seen.add(id(obj))
        if isinstance(obj, kinds):
            found.setdefault(id(obj), obj)
        elif isinstance(obj, functools.partial):
            for item in (obj.func, *obj.args, *obj.keywords.values()):
                consider(item, depth)
        elif isinstance(obj, types.MethodType):
            consider(obj.__func__, depth)
            consider(obj.__self__, depth)
        elif isinstance(obj, types.FunctionType):
            if depth > 0:
                scan_function(obj, depth - 1)
        elif nest and isinstance(obj, (list, tuple, set, frozenset, dict)):
            # The first items only: a closure may hold a whole dataset, and what a step trains sits at the front.
            for item in itertools.islice(obj.values() if isinstance(obj, dict) else obj, _FIND_MAX_ITEMS):
                consider(item, depth, nest - 1)
        elif nest and hasattr(obj, "__dict__"):
            for item in vars(obj).values():
                consider(item, depth, nest - 1)

    def names(code: types.CodeType):
        yield from code.co_names
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                yield from names(const)

    def scan_function(fn: types.FunctionType, depth: int) -> None:
        for cell in fn.__closure__ or ():
            try:
                consider(cell.cell_contents, depth)
            except ValueError:  # an empty cell
                pass
        for name in names(fn.__code__):
            if name in fn.__globals__:
                consider(fn.__globals__[name], depth)

    consider(step_fn, 3)
    objs = list(found.values())
    return (
        [o for o in objs if isinstance(o, kinds[0])],
        [o for o in objs if isinstance(o, kinds[1])],
        [o for o in objs if isinstance(o, kinds[2])],
    )


class CapturedStep:
    """One training step captured in a CUDA graph; calling it copies the inputs in and replays the graph.

    Args:
        step_fn: the step; takes tensors (and other arguments, which must then be the same at every call) and
            returns anything (typically the detached loss). It should begin with ``optimizer.zero_grad()``
            (``set_to_none=True``, the default), so that the captured backward writes fresh gradients.
        *example_args, **example_kwargs: a batch of the shapes and dtypes the graph replays; the graph keeps
            copies of these tensors as its inputs.
        warmup: eager steps on a side stream before capture (3, as torch's whole-network capture recipe); they
            create what the step creates lazily (optimizer moments, the scaler's scale, cuBLAS workspaces, launch
            tables), which must exist before capture.
        pool: a memory pool handle (``torch.cuda.graph_pool_handle()``) to share with other graphs.
        transformers_mask_skip: capture under :func:`transformers_mask_skip`, for Hugging Face models called
            without an attention mask (otherwise their captured attention runs masked, about 2x slower).
        models, optimizers, scalers: what the step trains, each one object or a list (``torch.nn.Module``,
            ``torch.optim.Optimizer``, ``torch.amp.GradScaler`` or :class:`ampkernels.FusedGradScaler`). When all
            three are left out they are found from ``step_fn``: its closure, the globals it names, a bound method's
            object, a ``functools.partial``'s arguments, and two levels into the lists and dicts (their first 64
            items) and objects held there. State reached in other ways (deeper, or tensors the step writes
            directly) is not found: name it here. A warning says when nothing was found.
        restore: ``True`` (default): the warm-up steps and the capture leave the parameters, buffers, gradients,
            optimizer state, scaler state and random number generators exactly as they were before the call (see
            :class:`StateSnapshot`), so the first replay is the first training step and a graphed run follows
            the eager one. State created by the warm-up is reset to a fresh optimizer's or scaler's starting
            values (zeros, step 0, the init scale). Exception: ``torch.optim.SGD`` with momentum and
            ``dampening != 0`` treats its first step specially and captures a later one, so its first replay
            starts from a zero buffer. Costs one copy of the saved tensors that exist at the call (the
            parameters, buffers and gradients, plus the optimizer state of an optimizer that has stepped),
            freed when the capture ends. ``False``: the warm-up steps train on the example batch.
    Returns (when called): ``step_fn``'s output as captured. Its tensors are the graph's own and are overwritten
        by the next replay: clone what you keep.
    """

    def __init__(
        self,
        step_fn: Callable[..., Any],
        *example_args: Any,
        warmup: int = 3,
        pool: Any = None,
        transformers_mask_skip: bool = False,
        models: Any = None,
        optimizers: Any = None,
        scalers: Any = None,
        restore: bool = True,
        **example_kwargs: Any,
    ) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("ampkernels.capture_step: CUDA graphs need a CUDA device")
        if not (isinstance(warmup, int) and warmup >= 1):
            raise ValueError(f"ampkernels.capture_step: warmup must be an int >= 1, got {warmup!r}")
        # (keyword arguments by name, as a call matches them: a replay may pass them in another order)
        leaves, self._spec = pytree.tree_flatten((example_args, dict(sorted(example_kwargs.items()))))
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and leaf.device.type != "cuda":
                raise ValueError(
                    f"ampkernels.capture_step: input {i} is on {leaf.device}; graph inputs must be CUDA tensors"
                )
        snapshot = None
        if restore:
            if models is None and optimizers is None and scalers is None:
                models, optimizers, scalers = _find_state(step_fn)
                if not (models or optimizers or scalers):
                    warnings.warn(
                        "ampkernels.capture_step: found no model, optimizer or scaler in step_fn; the warm-up steps "
                        "train on the example batch. Pass models=, optimizers=, scalers= (or restore=False)",
                        stacklevel=3,
                    )
            snapshot = StateSnapshot(models, optimizers, scalers)
        self._leaves = [leaf.detach().clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        # The graph reads and writes the memory of everything the step uses (parameters, gradients, optimizer state,
        # launch tables and their pinned host sources) but holds no reference to it. A step_fn that is the only
        # owner of its model and optimizer (a closure built by a helper) would otherwise free them at once, and the
        # replays would write into memory that later allocations get.
        self._step_fn = step_fn
        args, kwargs = pytree.tree_unflatten(self._leaves, self._spec)

        try:
            self._warm_up_and_capture(step_fn, args, kwargs, warmup, pool, transformers_mask_skip, snapshot)
        except BaseException:
            if snapshot is not None:
                # A step that fails in the warm-up or the capture (a host sync) leaves the state as it was too: not
                # trained on the example batch, no scaler stage "unscaled" with a flag the failed capture never
                # computed, no gradient in the graph's pool; an eager fallback then starts from the call's state.
                torch.cuda.synchronize()  # (a failed warm-up may leave kernels queued on its stream)
                snapshot.restore()
            raise
        if snapshot is not None:
            # Capture runs no kernels, but its host side moves the scaler's stages, points gradients at the graph's
            # buffers (which stay: replays write them) and may create state in the graph's pool: set it all back.
            snapshot.restore(rebind_gradients=False)

    def _warm_up_and_capture(self, step_fn, args, kwargs, warmup, pool, transformers_mask_skip, snapshot) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                step_fn(*args, **kwargs)
        torch.cuda.current_stream().wait_stream(side)
        if snapshot is not None:
            snapshot.restore()  # the capture records the first step from the state before the call

        self.graph = torch.cuda.CUDAGraph()
        masks = _mask_skip() if transformers_mask_skip else contextlib.nullcontext()
        try:
            with masks, torch.cuda.graph(self.graph, pool=pool):
                self._output = step_fn(*args, **kwargs)
        except RuntimeError as exc:
            if "not permitted when stream is capturing" in str(exc) or "StreamCapture" in str(exc):
                raise RuntimeError(f"ampkernels.capture_step: capture failed: {HOST_SYNC_HINT}. ({exc})") from exc
            raise

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = pytree.tree_flatten((args, dict(sorted(kwargs.items()))))
        if spec != self._spec:
            raise ValueError(
                "ampkernels.CapturedStep: called with another argument structure than at capture "
                f"({spec} vs {self._spec})"
            )
        for i, (static, new) in enumerate(zip(self._leaves, leaves)):
            if isinstance(static, torch.Tensor):
                if not isinstance(new, torch.Tensor) or new.shape != static.shape or new.dtype != static.dtype:
                    got = f"{tuple(new.shape)} {new.dtype}" if isinstance(new, torch.Tensor) else type(new).__name__
                    raise ValueError(
                        f"ampkernels.CapturedStep: input {i} must be a tensor of shape {tuple(static.shape)} and "
                        f"dtype {static.dtype} (a graph replays fixed shapes; capture another step for others), "
                        f"got {got}"
                    )
                if new.data_ptr() != static.data_ptr():
                    static.copy_(new, non_blocking=True)
            elif new != static:
                raise ValueError(
                    f"ampkernels.CapturedStep: non-tensor input {i} was {static!r} at capture and is {new!r} now; "
                    "the graph replays what was captured"
                )
        self.graph.replay()
        return self._output


def capture_step(
    step_fn: Callable[..., Any],
    *example_args: Any,
    warmup: int = 3,
    pool: Any = None,
    transformers_mask_skip: bool = False,
    models: Any = None,
    optimizers: Any = None,
    scalers: Any = None,
    restore: bool = True,
    **example_kwargs: Any,
) -> CapturedStep:
    """Capture ``step_fn(*example_args, **example_kwargs)`` in a CUDA graph; see :class:`CapturedStep`.

    By default the warm-up and the capture leave the step's model, optimizer and scaler as they were: the first
    replay is the first training step."""
    return CapturedStep(
        step_fn,
        *example_args,
        warmup=warmup,
        pool=pool,
        transformers_mask_skip=transformers_mask_skip,
        models=models,
        optimizers=optimizers,
        scalers=scalers,
        restore=restore,
        **example_kwargs,
    )
