"""What the library's ``nn.Module`` subclasses share."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


@contextmanager
def buffers_keep_dtype(module: nn.Module, names: tuple[str, ...]) -> Iterator[None]:
    """Around ``nn.Module._apply``: the buffers ``names`` keep the dtype they had, moved to the new device with their
    values, where ``model.half()`` or ``model.to(torch.bfloat16)`` would convert them (scales the kernels apply in
    float32: a float16 copy rounds them, or flushes small ones to zero)."""
    before = {name: module._buffers.get(name) for name in names}
    yield
    for name, old in before.items():
        new = module._buffers.get(name)
        if old is not None and new is not None and new.dtype != old.dtype:
            module._buffers[name] = old.to(device=new.device)
