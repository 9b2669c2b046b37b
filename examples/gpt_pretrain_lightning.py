"""GPT-style pretraining with Lightning, on ampkernels' precision plugin and FusedAdamW.

The changes against a stock Lightning script are two lines:

    trainer = L.Trainer(plugins=[MixedPrecision("16-mixed")], gradient_clip_val=1.0)  # instead of precision="16-mixed"
    optimizer = FusedAdamW(self.parameters(), ...)                                   # in configure_optimizers

`MixedPrecision` (from `ampkernels.integrations.lightning`) scales the loss with `FusedGradScaler` and runs
`gradient_clip_val` on its fused clip (unscale + check + norm + clip in one pass, no host sync); stock Lightning
refuses to clip an optimizer that takes the scale in its step, such as torch's `AdamW(fused=True)`, so the stock
recipe here is torch's default (foreach) AdamW. The model is Hugging Face `GPT2LMHeadModel` from `GPT2Config()`
(124M parameters, random weights), the data synthetic tokens: nothing is downloaded. The script trains the same model
from the same seed both ways and prints ms/step of each and the ratio.

    python examples/gpt_pretrain_lightning.py            # GPT-2 124M, batch 8 x 1024 tokens, fp16, on a GPU
    python examples/gpt_pretrain_lightning.py --smoke    # a tiny GPT on the CPU, a few steps
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import torch

from ampkernels import FusedAdamW

try:
    import lightning as L
    from lightning.pytorch.plugins.precision import MixedPrecision as StockMixedPrecision
    from transformers import GPT2Config, GPT2LMHeadModel

    from ampkernels.integrations.lightning import MixedPrecision
except ImportError as error:
    sys.exit(
        f"gpt_pretrain_lightning.py needs lightning and transformers ({error}): pip install lightning transformers"
    )


class GPT(L.LightningModule):
    def __init__(self, config: GPT2Config, args, fused: bool) -> None:
        super().__init__()
        self.model = GPT2LMHeadModel(config)
        self.args, self.fused = args, fused
        self.losses: list[torch.Tensor] = []

    def training_step(self, input_ids: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=input_ids, labels=input_ids).loss
        self.losses.append(loss.detach())  # read back after training: no host sync per step
        return loss

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]  # no weight decay on biases and norms
        rest = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
        options = dict(lr=self.args.lr, betas=(0.9, 0.95))
        return FusedAdamW(groups, **options) if self.fused else torch.optim.AdamW(groups, **options)


class StepTimer(L.Callback):
    """Times the steps after the first ``warmup`` (the device is synchronized at both ends)."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.start, self.ms = warmup, None, None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if batch_idx + 1 == self.warmup:
            _sync()
            self.start = time.perf_counter()

    def on_train_end(self, trainer, module) -> None:
        _sync()
        self.ms = (time.perf_counter() - self.start) * 1e3 / (trainer.global_step - self.warmup)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_config(smoke: bool) -> GPT2Config:
    if smoke:
        return GPT2Config(
            n_embd=32, n_layer=2, n_head=2, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0
        )
    return GPT2Config()  # GPT-2 124M: 12 layers of 768, vocab 50257, context 1024


def run(recipe: str, args, device: str) -> tuple[float, list[float]]:
    L.seed_everything(0, verbose=False)
    config = make_config(args.smoke)
    module = GPT(config, args, fused=recipe == "ampkernels")
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(config.vocab_size, (args.batch_size * args.steps, args.seq_len), generator=generator)
    loader = torch.utils.data.DataLoader(tokens, batch_size=args.batch_size)
    precision = "16-mixed" if args.dtype == "fp16" else "bf16-mixed"
    if recipe == "ampkernels":
        plugin = MixedPrecision(precision, device)
    else:  # what precision="16-mixed" builds (given explicitly, so that it also runs on the CPU for --smoke)
        scaler = torch.amp.GradScaler(device) if precision == "16-mixed" else None
        plugin = StockMixedPrecision(precision, device, scaler)
    timer = StepTimer(args.warmup)
    trainer = L.Trainer(
        accelerator=device,
        devices=1,
        max_steps=args.steps,
        plugins=[plugin],
        gradient_clip_val=1.0,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)
    losses = [float(x) for x in module.losses]
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    print(
        f"  {recipe:>10}: {timer.ms:8.2f} ms/step, loss {losses[0]:.4f} -> {losses[-1]:.4f} "
        f"({type(trainer.optimizers[0]).__name__}, scaler {type(scaler).__name__ if scaler is not None else 'none'})"
    )
    return timer.ms, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a tiny GPT on the CPU, a few steps (for CI)")
    parser.add_argument("--recipe", choices=("both", "stock", "ampkernels"), default="both")
    parser.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10, help="untimed first steps")
    parser.add_argument("--lr", type=float, default=6e-4)
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must be larger than --warmup ({args.warmup})")
    if args.smoke:
        args.batch_size, args.seq_len, args.steps, args.warmup = 2, 16, 4, 1
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    warnings.filterwarnings("ignore", ".*does not have many workers.*")  # synthetic data in memory
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(
        f"gpt_pretrain_lightning on {name}: {'tiny GPT' if args.smoke else 'GPT-2 124M'}, {args.dtype}, batch "
        f"{args.batch_size} x {args.seq_len} tokens, {args.steps - args.warmup} timed steps after {args.warmup}"
    )
    recipes = ("stock", "ampkernels") if args.recipe == "both" else (args.recipe,)
    results = {recipe: run(recipe, args, device) for recipe in recipes}
    if len(results) == 2:
        (stock_ms, stock_losses), (ours_ms, ours_losses) = results["stock"], results["ampkernels"]
        gap = max(abs(a - b) / abs(a) for a, b in zip(stock_losses, ours_losses))
        note = " (CPU smoke run: these sizes say nothing about speed)" if device == "cpu" else ""
        ratio = f"{stock_ms / ours_ms:.2f}x{note}"
        print(f"  speedup over stock Lightning: {ratio}; largest relative loss gap {gap:.1e}")


if __name__ == "__main__":
    main()
