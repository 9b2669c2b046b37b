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

    step = ampkernels.capture_step(train_step, x0, y0)  # runs `warmup` real steps on (x0, y0), then captures
    for x, y in loader:
        loss = step(x, y)  # copies x, y into the captured inputs and replays the graph
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

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


class CapturedStep:
    """One training step captured in a CUDA graph; calling it copies the inputs in and replays the graph.

    Args:
        step_fn: the step; takes tensors (and other arguments, which must then be the same at every call) and
            returns anything (typically the detached loss). It should begin with ``optimizer.zero_grad()``
            (``set_to_none=True``, the default), so that the captured backward writes fresh gradients.
        *example_args, **example_kwargs: a real batch. The ``warmup`` eager steps (needed before capture so that
            lazily created state — optimizer moments, the scaler's scale, cuBLAS workspaces, launch tables —
            exists) train on it, and the graph keeps copies of these tensors as its inputs.
        warmup: eager steps on a side stream before capture (3, as torch's whole-network capture recipe).
        pool: a memory pool handle (``torch.cuda.graph_pool_handle()``) to share with other graphs.
        transformers_mask_skip: capture under :func:`transformers_mask_skip`, for Hugging Face models called
            without an attention mask (otherwise their captured attention runs masked, about 2x slower).
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
        **example_kwargs: Any,
    ) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("ampkernels.capture_step: CUDA graphs need a CUDA device")
        if not (isinstance(warmup, int) and warmup >= 1):
            raise ValueError(f"ampkernels.capture_step: warmup must be an int >= 1, got {warmup!r}")
        leaves, self._spec = pytree.tree_flatten((example_args, example_kwargs))
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and leaf.device.type != "cuda":
                raise ValueError(
                    f"ampkernels.capture_step: input {i} is on {leaf.device}; graph inputs must be CUDA tensors"
                )
        self._leaves = [leaf.detach().clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        # The graph reads and writes the memory of everything the step uses (parameters, gradients, optimizer state,
        # launch tables and their pinned host sources) but holds no reference to it. A step_fn that is the only
        # owner of its model and optimizer (a closure built by a helper) would otherwise free them at once and the
        # replays would write into memory that later allocations get: seen as a drifting loss scale after 58
        # replays and an out-of-range gather in BERT's embeddings.
        self._step_fn = step_fn
        args, kwargs = pytree.tree_unflatten(self._leaves, self._spec)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                step_fn(*args, **kwargs)
        torch.cuda.current_stream().wait_stream(side)

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
        leaves, spec = pytree.tree_flatten((args, kwargs))
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
    **example_kwargs: Any,
) -> CapturedStep:
    """Capture ``step_fn(*example_args, **example_kwargs)`` in a CUDA graph; see :class:`CapturedStep`."""
    return CapturedStep(
        step_fn,
        *example_args,
        warmup=warmup,
        pool=pool,
        transformers_mask_skip=transformers_mask_skip,
        **example_kwargs,
    )
