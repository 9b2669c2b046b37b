"""Zoo rows trained through the frameworks, stock against ``ampkernels.integrations``: the loop is the framework's.

- ``trainer``: BERT-base masked LM through Hugging Face ``Trainer`` (stock ``optim="adamw_torch_fused"``; ours
  ``ampkernels.integrations.transformers.Trainer``, i.e. FusedAdamW + FusedGradScaler + the fused clip);
  ``logging_nan_inf_filter=False`` so that neither pays Trainer's own per-step read of the loss.
- ``accelerate``: GPT-2 through a plain Accelerate loop (stock ``accelerate.Accelerator`` with torch's fused AdamW;
  ours ``ampkernels.integrations.accelerate.Accelerator`` with FusedAdamW).
- ``lightning``: GPT-2 through ``lightning.Trainer`` (stock ``precision="16-mixed"``, foreach AdamW since stock
  Lightning refuses to clip a fused optimizer; ours ``MixedPrecision("16-mixed")`` with FusedAdamW).

Each step: fp16 autocast, clip to 1.0, AdamW (lr 1e-4). Time: the wall time of each step after ``WARMUP`` (from the
synchronized end of one to the synchronized end of the next), ``ROUNDS`` runs of stock and ours alternating, the
median over all of a recipe's steps (a framework's occasional slow step, e.g. a garbage collection, does not move
it); the loss: the mean training loss over every step of the first run, checked against stock's.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import ampkernels
from benchmarks.common import missing_package

WARMUP, STEPS = 3, 12
ROUNDS = 2  # NOTE: one run of 12 steps each, stock then ours, put Trainer/BERT at 0.974x on an H100 (single sample)
LR, MAX_NORM = 1e-4, 1.0
FRAMEWORKS = {"trainer": ("bert-base", "transformers"), "accelerate": ("gpt2", "accelerate")}
FRAMEWORKS["lightning"] = ("gpt2", "lightning")


def why_not(framework: str) -> str | None:
    return missing_package(FRAMEWORKS[framework][1])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _trainer(model, device: torch.device, ours: bool, workdir: str) -> tuple[list[float], float]:
    import transformers
    from accelerate.state import AcceleratorState

    from ampkernels.integrations.transformers import Trainer

    times: list[float] = []

    class StepTimes(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            _sync(device)
            times.append(time.perf_counter())

    ids, labels = model.batch_of(0)
    data = [{"input_ids": ids[i], "labels": labels[i]} for i in range(ids.shape[0])]
    args = transformers.TrainingArguments(
        workdir,
        max_steps=WARMUP + STEPS,
        per_device_train_batch_size=ids.shape[0],
        learning_rate=LR,
        max_grad_norm=MAX_NORM,
        fp16=device.type == "cuda",
        bf16=device.type == "cpu",
        use_cpu=device.type == "cpu",
        optim="adamw_torch_fused",
        logging_steps=10**9,
        logging_nan_inf_filter=False,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    AcceleratorState._reset_state(True)
    cls = Trainer if ours else transformers.Trainer
    output = cls(model=model.module, args=args, train_dataset=data, callbacks=[StepTimes()]).train()
    return times, output.training_loss


def _accelerate(model, device: torch.device, ours: bool, workdir: str) -> tuple[list[float], float]:
    import accelerate
    from accelerate.state import AcceleratorState

    from ampkernels.integrations.accelerate import Accelerator

    AcceleratorState._reset_state(True)
    mixed = "fp16" if device.type == "cuda" else "bf16"
    accelerator = (Accelerator if ours else accelerate.Accelerator)(mixed_precision=mixed, cpu=device.type == "cpu")
    params = model.module.parameters()
    optimizer = ampkernels.FusedAdamW(params, lr=LR) if ours else torch.optim.AdamW(params, lr=LR, fused=True)
    module, optimizer = accelerator.prepare(model.module, optimizer)
    batches = [tuple(t.to(device) for t in model.batch_of(i)) for i in range(4)]
    times, losses = [], []
    for step in range(WARMUP + STEPS):
        loss = model.loss_fn(module, *batches[step % len(batches)])
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(module.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        _sync(device)
        times.append(time.perf_counter())
    return times, float(torch.stack(losses).float().mean())


def _lightning(model, device: torch.device, ours: bool, workdir: str) -> tuple[list[float], float]:
    import lightning

    from ampkernels.integrations.lightning import MixedPrecision

    times: list[float] = []
    losses: list[torch.Tensor] = []

    class StepTimes(lightning.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            losses.append(outputs["loss"].detach())
            _sync(device)
            times.append(time.perf_counter())

    class Module(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model.module

        def training_step(self, batch, batch_idx):
            return model.loss_fn(self.net, *batch)

        def configure_optimizers(self):
            if ours:
                return ampkernels.FusedAdamW(self.parameters(), lr=LR)
            return torch.optim.AdamW(self.parameters(), lr=LR, foreach=True)

    precision = "16-mixed" if device.type == "cuda" else "bf16-mixed"
    batches = [model.batch_of(i) for i in range(WARMUP + STEPS)]
    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    trainer = lightning.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=1,
        max_steps=WARMUP + STEPS,
        gradient_clip_val=MAX_NORM,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[StepTimes()],
        default_root_dir=workdir,
        **({"plugins": [MixedPrecision(precision)]} if ours else {"precision": precision}),
    )
    trainer.fit(Module(), loader)
    return times, float(torch.stack(losses).float().mean())


RUNNERS: dict[str, Callable[..., tuple[list[float], float]]] = {
    "trainer": _trainer,
    "accelerate": _accelerate,
    "lightning": _lightning,
}


def time_framework(framework: str, model_of: Callable[[], Any], device: torch.device, ours: bool) -> dict[str, Any]:
    """One run: the times of the steps after the warm-up (ms), the mean training loss, peak memory."""
    import tempfile

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)
    with device:
        model = model_of()
    with tempfile.TemporaryDirectory() as workdir:
        times, loss = RUNNERS[framework](model, device, ours, workdir)
    if len(times) < WARMUP + 2:
        raise RuntimeError(f"{framework}: only {len(times)} steps ran")
    return {
        "description": f"{model.description}, through {framework}",
        "step_times_ms": [(end - start) * 1e3 for start, end in zip(times[WARMUP - 1 : -1], times[WARMUP:])],
        "per_batch": model.per_batch,
        "unit": model.unit,
        "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
        "final_loss": loss,
    }


def merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One zoo row from a recipe's runs: the median step over all of them, the first run's loss and the largest
    peak memory."""
    steps = [ms for run in runs for ms in run["step_times_ms"]]
    step_ms = statistics.median(steps)
    peaks = [run["peak_memory_gib"] for run in runs if run["peak_memory_gib"] is not None]
    return {
        "description": runs[0]["description"],
        "step_ms": step_ms,
        "step_ms_per_repeat": [statistics.median(run["step_times_ms"]) for run in runs],
        "per_second": runs[0]["per_batch"] / step_ms * 1e3,
        "unit": runs[0]["unit"],
        "peak_memory_gib": max(peaks) if peaks else None,
        "final_loss": runs[0]["final_loss"],
    }
