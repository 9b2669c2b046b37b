"""FP8 casts of a layer's weight kept across the micro-batches of one optimizer step.

With gradient accumulation every micro-batch's forward would cast every weight again (an amax pass over the
high-precision weight, then the cast into both layouts), although the weights change only at the optimizer step.
Each :class:`~ampkernels.float8.Float8Linear` keeps its last weight casts in a :class:`WeightCasts` and reuses them
while all of these hold:

- the same weight tensor (a weak reference: ``layer.weight = new`` or ``layer.weight.data = new`` is a new
  tensor or a new storage), at the same storage address;
- the same version counter (any in-place change seen by autograd: ``with torch.no_grad(): w.mul_(2)``,
  ``load_state_dict``'s copy, a ``torch._foreach_*_`` update);
- no optimizer step since the cast: every ``torch.optim.Optimizer``'s ``step`` (ampkernels' fused optimizers, whose
  kernels write the parameters without touching their version counters, included) runs a global post-step hook that
  drops every cached cast;
- the same cast settings and, for delayed scaling, the same version of the layer's scale buffer (the once-per-step
  scale update writes it in place);
- the same CUDA graph capture (an entry made in one capture is used only in it; one made outside any only
  outside), as for the input casts.

An in-place write through ``.data`` (``w.data.mul_(2)``) bypasses the version counter: call
:func:`forget_weight_casts` after one. Nothing is cached while ``torch.compile`` traces (its graph keeps the casts it
needs itself) or for inference tensors (no version counter). Memory: the cached codes (1 byte per weight element
and layout) live from a layer's first forward after a step until the next step.
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

#: Caching on (tests and probes turn it off to compare against casting every time).
ENABLED = True


class CaptureTracker:
    """Numbers the CUDA graph captures seen by the calls that ask, so that a cache entry made in one capture is told
    apart from the next: a capture is new when a call inside one follows a call outside any. 0: not capturing."""

    def __init__(self) -> None:
        self.captures = 0
        self.was_capturing = False

    def current(self, x: torch.Tensor) -> int:
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        if capturing and not self.was_capturing:
            self.captures += 1
        self.was_capturing = capturing
        return self.captures if capturing else 0


CAPTURES = CaptureTracker()
_CACHES: weakref.WeakSet[WeightCasts] = weakref.WeakSet()


class WeightCasts:
    """One layer's cached weight casts, one entry per kind of cast (``"tensor"``, ``"row"``, ``"row_t"``)."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple] = {}
        _CACHES.add(self)

    def _key(self, weight: torch.Tensor, settings: tuple, scale: torch.Tensor | None) -> tuple:
        return (weight.data_ptr(), weight._version, settings, CAPTURES.current(weight),
                None if scale is None else scale._version)  # fmt: skip

    def get(self, kind: str, weight: torch.Tensor, settings: tuple, scale: torch.Tensor | None = None):
        """The casts made for ``weight`` with these settings and nothing changed since, else None."""
        if not ENABLED or torch.compiler.is_compiling() or weight.is_inference():
            return None
        entry = self.entries.get(kind)
        if entry is None:
            return None
        ref, key, casts = entry
        return casts if ref() is weight and key == self._key(weight, settings, scale) else None

    def put(self, kind: str, weight: torch.Tensor, settings: tuple, casts: tuple, scale=None) -> tuple:
        if ENABLED and not (torch.compiler.is_compiling() or weight.is_inference()):
            self.entries[kind] = (weakref.ref(weight), self._key(weight, settings, scale), casts)
        return casts

    def clear(self) -> None:
        self.entries.clear()

    # A copied or pickled layer starts with an empty cache (weak references neither copy nor pickle).
    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()


def forget_weight_casts() -> None:
    """Drops every cached FP8 weight cast: after writing weights in place through ``.data`` (which autograd's
    version counter does not see). Optimizer steps, in-place ops and ``load_state_dict`` need no call."""
    for cache in list(_CACHES):
        cache.clear()


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    forget_weight_casts()


register_optimizer_step_post_hook(_after_optimizer_step)
