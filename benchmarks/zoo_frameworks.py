"""Zoo rows trained through the frameworks, stock against ``ampkernels.integrations``: the loop is the framework's.

- ``trainer``: BERT-base masked LM through Hugging Face ``Trainer`` (stock ``optim="adamw_torch_fused"``; ours
  ``ampkernels.integrations.transformers.Trainer``, i.e. FusedAdamW + FusedGradScaler + the fused clip);
  ``logging_nan_inf_filter=False`` so that neither pays Trainer's own per-step read of the loss.
- ``accelerate``: GPT-2 through a plain Accelerate loop (stock ``accelerate.Accelerator`` with torch's fused AdamW;
  ours ``ampkernels.integrations.accelerate.Accelerator`` with FusedAdamW).
- ``lightning``: GPT-2 through ``lightning.Trainer`` (stock ``precision="16-mixed"``, foreach AdamW since stock
  Lightning refuses to clip a fused optimizer; ours ``MixedPrecision("16-mixed")`` with FusedAdamW).
- ``trainer`` and ``lightning`` on ``llama-1b`` with everything asked for: ours with bf16 autocast, the fused norms,
  SiLU·up and loss (``fuse_modules(model, loss=True)``; Lightning: ``MixedPrecision(..., fuse=True)``), FP8 layers
  (``convert_to_float8`` tensorwise: ``Trainer(model=convert_to_float8(model))``, ``MixedPrecision("bf16-mixed",
  float8="tensorwise")``) and 8-bit AdamW state (``adamw_kwargs``, ``FusedAdamW(exp_avg_dtype="8bit", ...)``), against
  stock bf16 through the same framework. A CUDA-graphed step is not offered by either integration.

Each step: fp16 autocast (bf16 where named), clip to 1.0, AdamW (lr 1e-4). Time: the wall time of each step after
``WARMUP`` (from the synchronized end of one to the synchronized end of the next), ``ROUNDS`` runs of stock and ours
alternating, the median over all of a recipe's steps (a framework's occasional slow step, e.g. a garbage collection,
does not move it). Every step trains on samples of its own (``model.batch_of(step)``; Trainer shuffles them with its
seeded sampler), the same sequence for every recipe of a framework. The loss of each step of the first run is kept
(read after the run: no host sync per step); the last step's is checked against stock's, relative to the first's.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import ampkernels
from benchmarks.common import missing_package

WARMUP, STEPS = 3, 12
# NOTE: one run of 12 steps each, stock then ours, put Trainer/BERT at 0.974x on an H100 (single sample); with two
# rounds the first round's warm-up (Trainer/Llama 238 then 209 ms) weighed half the median.
ROUNDS = 3
LR, MAX_NORM = 1e-4, 1.0
FRAMEWORKS = {"trainer": ("bert-base", "transformers"), "accelerate": ("gpt2", "accelerate")}
FRAMEWORKS["lightning"] = ("gpt2", "lightning")
EVERYTHING_FRAMEWORKS = ("trainer", "lightning")


@dataclass(frozen=True)
class Options:
    """One recipe through a framework: ours (ampkernels.integrations) or stock, and what it asks for."""

    ours: bool
    autocast: torch.dtype = torch.float16  # on a GPU; the CPU runs bf16
    float8: bool = False  # ours: convert_to_float8(model, "tensorwise")
    moments: str | None = None  # ours: FusedAdamW's exp_avg_dtype / exp_avg_sq_dtype
    fuse: bool = False  # ours: fuse_modules(model, loss=True)

    def precision(self, device: torch.device) -> torch.dtype:
        return self.autocast if device.type == "cuda" else torch.bfloat16

    def adamw_kwargs(self) -> dict[str, str]:
        return {"exp_avg_dtype": self.moments, "exp_avg_sq_dtype": self.moments} if self.moments else {}

    def float8_options(self, device: torch.device) -> dict[str, Any]:
        """convert_to_float8's arguments: the size rule on a GPU; every layer of the tiny CPU models."""
        return {} if device.type == "cuda" else {"min_features": 0}


def why_not(framework: str) -> str | None:
    return missing_package(FRAMEWORKS[framework][1])


#: Called after each step's end is timed (dev/models/framework_profile.py steps a profiler here).
STEP_HOOKS: list[Callable[[], None]] = []


def _step_end(device: torch.device, times: list[float]) -> None:
    _sync(device)
    times.append(time.perf_counter())
    for hook in STEP_HOOKS:
        hook()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _converted(module: torch.nn.Module, options: Options, device: torch.device) -> torch.nn.Module:
    """``module`` with what ``options`` ask for done to it outside the framework (Trainer, Accelerate)."""
    from ampkernels.float8 import convert_to_float8, fuse_modules

    if options.fuse:
        fuse_modules(module, loss=True)
    if not options.float8:
        return module
    return convert_to_float8(module, "tensorwise", **options.float8_options(device))


def _recording(trainer_cls, losses: list[torch.Tensor]):
    """``trainer_cls`` keeping each training step's loss (a detached device tensor: no host read)."""

    class Recording(trainer_cls):
        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            losses.append(loss.detach())
            return loss

    return Recording


def _trainer(model, device: torch.device, options: Options, workdir: str) -> tuple[list[float], list[torch.Tensor]]:
    import transformers
    from accelerate.state import AcceleratorState

    from ampkernels.integrations.transformers import Trainer

    times: list[float] = []
    losses: list[torch.Tensor] = []

    class StepTimes(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            _step_end(device, times)

    # (ids, labels) for masked LM; (ids,) for a causal LM, whose labels are its ids. As many samples as the steps
    # take, each seen once (in Trainer's shuffled order, the same for every recipe: its sampler is seeded).
    batches = [model.batch_of(step) for step in range(WARMUP + STEPS)]
    data = [{"input_ids": b[0][i], "labels": b[-1][i]} for b in batches for i in range(b[0].shape[0])]
    args = transformers.TrainingArguments(
        workdir,
        max_steps=WARMUP + STEPS,
        per_device_train_batch_size=batches[0][0].shape[0],
        learning_rate=LR,
        max_grad_norm=MAX_NORM,
        fp16=options.precision(device) == torch.float16,
        bf16=options.precision(device) == torch.bfloat16,
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
    module = _converted(model.module, options, device)
    if options.ours:
        trainer = _recording(Trainer, losses)(
            module, args, train_dataset=data, callbacks=[StepTimes()], adamw_kwargs=options.adamw_kwargs()
        )
    else:
        trainer = _recording(transformers.Trainer, losses)(module, args, train_dataset=data, callbacks=[StepTimes()])
    trainer.train()
    return times, losses


def _accelerate(model, device: torch.device, options: Options, workdir: str) -> tuple[list[float], list[torch.Tensor]]:
    import accelerate
    from accelerate.state import AcceleratorState

    from ampkernels.integrations.accelerate import Accelerator

    AcceleratorState._reset_state(True)
    mixed = "fp16" if options.precision(device) == torch.float16 else "bf16"
    cls = Accelerator if options.ours else accelerate.Accelerator
    accelerator = cls(mixed_precision=mixed, cpu=device.type == "cpu")
    module = _converted(model.module, options, device)
    params = module.parameters()
    if options.ours:
        optimizer = ampkernels.FusedAdamW(params, lr=LR, **options.adamw_kwargs())
    else:
        optimizer = torch.optim.AdamW(params, lr=LR, fused=True)
    module, optimizer = accelerator.prepare(module, optimizer)
    batches = [tuple(t.to(device) for t in model.batch_of(step)) for step in range(WARMUP + STEPS)]
    times, losses = [], []
    for step in range(WARMUP + STEPS):
        loss = model.loss_fn(module, *batches[step])
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(module.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        _step_end(device, times)
    return times, losses


def _lightning(model, device: torch.device, options: Options, workdir: str) -> tuple[list[float], list[torch.Tensor]]:
    import lightning

    from ampkernels.integrations.lightning import MixedPrecision

    times: list[float] = []
    losses: list[torch.Tensor] = []

    class StepTimes(lightning.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            losses.append(outputs["loss"].detach())
            _step_end(device, times)

    class Module(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model.module

        def training_step(self, batch, batch_idx):
            return model.loss_fn(self.net, *batch)

        def configure_optimizers(self):
            if options.ours:
                return ampkernels.FusedAdamW(self.parameters(), lr=LR, **options.adamw_kwargs())
            return torch.optim.AdamW(self.parameters(), lr=LR, foreach=True)

    precision = "16-mixed" if options.precision(device) == torch.float16 else "bf16-mixed"
    float8 = {"float8": "tensorwise", "float8_options": options.float8_options(device)} if options.float8 else {}
    float8 = {**float8, "fuse": True} if options.fuse else float8
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
        **({"plugins": [MixedPrecision(precision, **float8)]} if options.ours else {"precision": precision}),
    )
    trainer.fit(Module(), loader)
    return times, losses


RUNNERS: dict[str, Callable[..., tuple[list[float], list[torch.Tensor]]]] = {
    "trainer": _trainer,
    "accelerate": _accelerate,
    "lightning": _lightning,
}


def time_framework(
    framework: str, model_of: Callable[[], Any], device: torch.device, options: Options
) -> dict[str, Any]:
    """One run: the times of the steps after the warm-up (ms), every step's loss, peak memory."""
    import tempfile

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)
    with device:
        model = model_of()
    with tempfile.TemporaryDirectory() as workdir:
        times, losses = RUNNERS[framework](model, device, options, workdir)
    if len(times) < WARMUP + 2 or len(losses) != len(times):
        raise RuntimeError(f"{framework}: {len(times)} steps timed and {len(losses)} losses kept")
    step_losses = [float(x) for x in torch.stack(losses).float().cpu()]
    return {
        "description": f"{model.description}, through {framework}",
        "step_times_ms": [(end - start) * 1e3 for start, end in zip(times[WARMUP - 1 : -1], times[WARMUP:])],
        "per_batch": model.per_batch,
        "unit": model.unit,
        "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
        "step_losses": step_losses,
        "final_loss": step_losses[-1],
    }


def merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One zoo row from a recipe's runs: the median step over all of them, the first run's losses and the largest
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
        "step_losses": runs[0]["step_losses"],
        "final_loss": runs[0]["final_loss"],
    }
