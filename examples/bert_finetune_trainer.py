"""BERT fine-tuning (sequence classification) with Hugging Face `Trainer`, on ampkernels.

The one change against a stock script is the import:

    from ampkernels.integrations.transformers import Trainer   # instead of: from transformers import Trainer

With it, the AdamW that Trainer builds is `FusedAdamW`, and with `fp16=True` the loss scaler is `FusedGradScaler`
with `max_grad_norm` on its fused clip (docs/integrations.md). The model is `BertForSequenceClassification` built
from `BertConfig()` (BERT-base shapes, random weights) and the data is synthetic (the label is a function of the
tokens, so the loss falls): nothing is downloaded. The script trains the same model from the same seed with stock
`Trainer` and with ours, and prints ms/step of each and the ratio.

    python examples/bert_finetune_trainer.py            # BERT-base, batch 32 x 128 tokens, fp16, on a GPU
    python examples/bert_finetune_trainer.py --smoke    # a tiny BERT on the CPU (bf16), a few steps
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch

try:
    import transformers
    from transformers import BertConfig, BertForSequenceClassification, TrainerCallback, TrainingArguments

    from ampkernels.integrations.transformers import Trainer
except ImportError as error:
    sys.exit(
        f"bert_finetune_trainer.py needs Hugging Face transformers and accelerate ({error}): "
        "pip install transformers accelerate"
    )


class SyntheticClassification(torch.utils.data.Dataset):
    """Random token sequences; the label says whether the first token's id is odd."""

    def __init__(self, size: int, seq_len: int, vocab: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(1, vocab, (size, seq_len), generator=generator)
        self.labels = self.input_ids[:, 0] % 2

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.input_ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": self.labels[i]}


class StepTimer(TrainerCallback):
    """Times the optimizer steps after the first ``warmup`` (the device is synchronized at both ends)."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.start, self.ms = warmup, None, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.warmup:
            _sync()
            self.start = time.perf_counter()

    def on_train_end(self, args, state, control, **kwargs):
        _sync()
        self.ms = (time.perf_counter() - self.start) * 1e3 / (state.global_step - self.warmup)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_config(smoke: bool) -> BertConfig:
    if smoke:
        return BertConfig(
            vocab_size=128,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=64,
            num_labels=2,
        )
    return BertConfig(num_labels=2)  # BERT-base: 12 layers of 768


def run(recipe: str, args, on_gpu: bool) -> tuple[float, list[float]]:
    transformers.set_seed(0)
    model = BertForSequenceClassification(make_config(args.smoke))
    dataset = SyntheticClassification(args.batch_size * args.steps, args.seq_len, model.config.vocab_size)
    timer = StepTimer(args.warmup)
    with tempfile.TemporaryDirectory() as output_dir:
        training_args = TrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=args.batch_size,
            max_steps=args.steps,
            learning_rate=args.lr,
            weight_decay=0.01,
            warmup_steps=min(10, args.steps // 4),
            max_grad_norm=1.0,
            fp16=on_gpu and args.dtype == "fp16",  # fp16 needs a GPU; on the CPU the smoke run uses bf16
            bf16=not on_gpu or args.dtype == "bf16",
            use_cpu=not on_gpu,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            seed=0,
        )
        trainer_class = transformers.Trainer if recipe == "stock" else Trainer
        trainer = trainer_class(model=model, args=training_args, train_dataset=dataset, callbacks=[timer])
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # the losses are printed below
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    optimizer = type(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer)
    scaler = getattr(trainer.accelerator, "scaler", None)
    print(
        f"  {recipe:>10}: {timer.ms:8.2f} ms/step, loss {losses[0]:.4f} -> {losses[-1]:.4f} "
        f"({optimizer.__name__}, scaler {type(scaler).__name__ if scaler is not None else 'none'})"
    )
    return timer.ms, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a tiny BERT on the CPU, a few steps (for CI)")
    parser.add_argument("--recipe", choices=("both", "stock", "ampkernels"), default="both")
    parser.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10, help="untimed first steps")
    parser.add_argument("--lr", type=float, default=5e-5)
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must be larger than --warmup ({args.warmup})")
    if args.smoke:
        args.batch_size, args.seq_len, args.steps, args.warmup = 4, 16, 4, 1
    on_gpu = torch.cuda.is_available() and not args.smoke
    name = torch.cuda.get_device_name() if on_gpu else "CPU"
    dtype = args.dtype if on_gpu else "bf16"
    print(
        f"bert_finetune_trainer on {name}: {'tiny BERT' if args.smoke else 'BERT-base'}, {dtype}, batch "
        f"{args.batch_size} x {args.seq_len} tokens, {args.steps - args.warmup} timed steps after {args.warmup}"
    )
    recipes = ("stock", "ampkernels") if args.recipe == "both" else (args.recipe,)
    results = {recipe: run(recipe, args, on_gpu) for recipe in recipes}
    if len(results) == 2:
        (stock_ms, stock_losses), (ours_ms, ours_losses) = results["stock"], results["ampkernels"]
        gap = max(abs(a - b) / abs(a) for a, b in zip(stock_losses, ours_losses))
        note = " (CPU smoke run: these sizes say nothing about speed)" if not on_gpu else ""
        print(f"  speedup over stock Trainer: {stock_ms / ours_ms:.2f}x{note}; largest relative loss gap {gap:.1e}")


if __name__ == "__main__":
    main()
