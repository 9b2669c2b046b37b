"""Which part of the everything recipe moves the Llama model's loss through Hugging Face Trainer: each step's loss of
stock bf16 and of ampkernels with bf16 only, FP8 layers only, 8-bit AdamW state only, and both, trained on one
repeated batch (a model that memorizes: the regime where small differences in the update grow) or on a new batch
each step (the zoo's rows).

    python3 dev/models/trainer_loss_probe.py [--model llama-1b] [--data repeated,distinct]

Prints the per-step losses and each variant's last-step difference to stock, relative to stock's first loss (the
zoo's check: within 1%).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from benchmarks import bench_models, zoo_frameworks

VARIANTS = {
    "stock bf16": zoo_frameworks.Options(False, torch.bfloat16),
    "ours bf16": zoo_frameworks.Options(True, torch.bfloat16),
    "ours fp8": zoo_frameworks.Options(True, torch.bfloat16, float8=True),
    "ours 8-bit": zoo_frameworks.Options(True, torch.bfloat16, moments="8bit"),
    "ours fp8 + 8-bit": zoo_frameworks.Options(True, torch.bfloat16, float8=True, moments="8bit"),
}


def _model_of(name: str, small: bool, repeated: bool):
    def build():
        model = bench_models.MODELS[name][0](small)
        if repeated:
            batch_of, first = model.batch_of, []

            def batch_zero(i: int):
                # made when first asked for: outside the device context the model is built in
                if not first:
                    first.append(batch_of(0))
                return first[0]

            model = dataclasses.replace(model, batch_of=batch_zero)
        return model

    return build


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--data", default="repeated,distinct")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    small = device.type == "cpu"
    for data in args.data.split(","):
        print(f"== {args.model} through Trainer, {data} batches ({device})")
        stock = None
        for label, options in VARIANTS.items():
            run = zoo_frameworks.time_framework("trainer", _model_of(args.model, small, data == "repeated"), device,
                                                options)  # fmt: skip
            losses = run["step_losses"]
            stock = stock or losses
            drift = (losses[-1] - stock[-1]) / stock[0]
            print(f"{label:18s} last-step drift {drift:+.2%} | " + " ".join(f"{x:.3f}" for x in losses))
            if device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
