"""Helpers of the framework integration tests (tests/test_integrations_*.py): a tiny model and its data, a counter
of host reads of tensors, and a CPU stand-in for the fp16 setup Accelerate makes only on a GPU."""

from __future__ import annotations

import collections
import contextlib

import torch

#: Host reads of a tensor's value: on a GPU tensor each one waits for the device (a host sync).
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")

#: Scaler settings that make a short run overflow (so steps are skipped and the scale backs off) and grow.
SCALER_KWARGS = dict(init_scale=2.0**20, growth_interval=3)


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))


def batches(n: int, device: str = "cpu", seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(64, 16, generator=g).to(device), torch.randn(64, 8, generator=g).to(device)) for _ in range(n)]


@contextlib.contextmanager
def count_host_reads():
    """Counts, per method, the calls of :data:`HOST_READS` on any tensor inside the block (calls from Python; what
    C++ reads internally is not seen: on CPU this counts the reads a GPU run would pay as syncs)."""
    counts: collections.Counter = collections.Counter()
    saved = {name: torch.Tensor.__dict__.get(name) for name in HOST_READS}

    def counting(name, original):
        def read(self, *args, **kwargs):
            counts[name] += 1
            return original(self, *args, **kwargs)

        return read

    for name in HOST_READS:
        setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    try:
        yield counts
    finally:
        for name, original in saved.items():
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)


def reset_accelerate_state() -> None:
    """Accelerate keeps its state in process-wide singletons: forget them between Accelerators."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def stock_fp16_scaler(monkeypatch, **scaler_kwargs) -> None:
    """Make ``accelerate.Accelerator(mixed_precision="fp16")`` build its stock ``torch.amp.GradScaler`` with
    ``scaler_kwargs`` (unless its handlers say otherwise), also where it is built for a caller that passes no
    ``GradScalerKwargs`` (Trainer), and on the CPU do what it does on a GPU: autocast to fp16 and keep that scaler
    (on the CPU, Accelerate 1.16 silently trains in fp32 with no scaler). Stock and ampkernels runs both go
    through it, so both start from the same stock scaler (the integration copies its settings)."""
    import accelerate
    import accelerate.accelerator

    original_get = accelerate.accelerator.get_grad_scaler

    def get_grad_scaler(distributed_type=None, **kwargs):
        return original_get(distributed_type, **{**scaler_kwargs, **kwargs})

    original_init = accelerate.Accelerator.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        if self.state.mixed_precision == "fp16" and self.device.type == "cpu" and self.scaler is None:
            self.native_amp = True
            handler = self.scaler_handler.to_kwargs() if self.scaler_handler is not None else {}
            self.scaler = torch.amp.GradScaler("cpu", **{**scaler_kwargs, **handler})

    monkeypatch.setattr(accelerate.accelerator, "get_grad_scaler", get_grad_scaler)
    monkeypatch.setattr(accelerate.Accelerator, "__init__", init)
