"""Triton kernels of ampkernels (``multi_tensor``, ``optimizers``, ``scaled_matmul``) and what they share."""

from __future__ import annotations

import contextlib
import functools
import struct

import torch


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (read once per device: the query is not free)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def device_guard(device: torch.device):
    """Makes ``device`` current while Triton launches: Triton launches on the current CUDA device and its current
    stream, so tensors on cuda:1 while cuda:0 is current would be worked on from cuda:0, on a stream that nothing
    which wrote them is ordered with (the native ops take the same guard in C++)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def on_device_of_first_tensor(fn):
    """Runs ``fn`` (a launcher whose first argument is a tensor) under :func:`device_guard` of that tensor's device."""

    @functools.wraps(fn)
    def launch(t: torch.Tensor, *args, **kwargs):
        with device_guard(t.device):
            return fn(t, *args, **kwargs)

    return launch


def on_own_device(method):
    """Runs ``method`` (of a launcher object with a ``device``) under :func:`device_guard` of ``self.device``."""

    @functools.wraps(method)
    def launch(self, *args, **kwargs):
        with device_guard(self.device):
            return method(self, *args, **kwargs)

    return launch


def capturing() -> bool:
    """A CUDA graph capture is running on the current stream: no host syncs (timing, tuning) now, and nothing
    settled now that the capture's provisional choices would freeze."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def time_in_turns(runs: dict) -> dict:
    """Mean ms of each of ``runs`` (key -> callable, launching on the current device) over two passes of
    ``triton.testing.do_bench`` (L2 flushed before every run), the second pass in reverse order. NOTE (H200): the
    GPU runs at its power cap and slows as it warms (dev/matmul/power_probe.py), so in one pass the first candidates
    had an edge (8192^3: 1.42 ms first, the same kernel 1.58 in the benchmark); the reversed pass evens that out."""
    import triton.testing

    passes: dict = {key: [] for key in runs}
    for order in (list(runs), list(reversed(runs))):
        for key in order:
            passes[key].append(triton.testing.do_bench(runs[key], warmup=5, rep=25))
    return {key: sum(times) / len(times) for key, times in passes.items()}


_RETAINED_FOR_GRAPHS: list[torch.Tensor] = []


def retain_if_capturing(*tensors: torch.Tensor) -> None:
    """Keep ``tensors`` for the life of the process when a CUDA graph is being captured now: the graph reads them at
    every replay (a table's pinned upload source, its device copy) but holds no reference to them, and the table
    may be rebuilt or evicted while the graph still replays (the C++ tables do the same: csrc/common/tensor_table.h)."""
    if capturing():
        _RETAINED_FOR_GRAPHS.extend(tensors)


def f64_bits(x: float) -> int:
    """The bits of ``x`` as a float64, as an int64 kernel argument (Triton passes Python floats as float32)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def is_dense(t: torch.Tensor) -> bool:
    """``t`` covers its memory exactly once (a permutation of a contiguous tensor): the kernel may walk memory."""
    expected = 1
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride(), strict=True) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def plain_eager(*tensors) -> bool:
    """Whether an op may skip the ``torch.library`` dispatcher and launch directly: no tracing, compiling, mode or
    tensor subclass needs to see it, and every tensor of ``tensors`` (None allowed) is a plain eager tensor.
    NOTE: the custom-op dispatcher costs tens of microseconds of host time per call, as much as the FP8 cast of a
    4096^2 tensor (dev/matmul/NOTES.md, host time per call)."""
    if (
        torch.compiler.is_compiling()
        or torch._C._len_torch_dispatch_stack()
        or torch._C._is_torch_function_mode_enabled()
    ):
        return False
    return all(t is None or type(t) is torch.Tensor for t in tensors)


def eager_or_op(launch, op, args: tuple, backend: str, mutated: tuple = ()):
    """An op's call, with its plain-eager fast path in one place: ``launch(*args)`` (the backend's method) directly
    when :func:`plain_eager` holds for the tensor arguments, bumping the version counters of ``mutated`` as the op's
    ADInplaceOrView kernel would; else ``op(*args, backend)`` through the dispatcher (``torch.library`` ops take the
    backend's name last), for tracing, compiling, modes and tensor subclasses."""
    if plain_eager(*(a for a in args if a is None or isinstance(a, torch.Tensor))):
        result = launch(*args)
        for t in mutated:
            if t is not None:
                torch.autograd.graph.increment_version(t)
        return result
    return op(*args, backend)
