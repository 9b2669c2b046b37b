"""Which part of a whole-step CUDA graph of BERT-base (batch 32, seq 512, fp16 autocast) misbehaves or is slow.

Each configuration runs in its own process (a device-side assert ends the CUDA context): eager ms/step, then
ampkernels.capture_step, the model's index buffers checked after capture and after replays, graphed ms/step.
Usage on the GPU machine: python3 dev/graph_bert_probe.py            (all configurations, one JSON line each)
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

CONFIGS = [
    {"optimizer": "ampkernels", "scaler": "fused", "dropout": 0.1, "profile": True},
    {"optimizer": "ampkernels", "scaler": "fused", "dropout": 0.1, "mask_skip": False},
    {"optimizer": "torch-fused", "scaler": "fused", "dropout": 0.1},
    {"optimizer": "ampkernels", "scaler": "fused", "dropout": 0.0},
]


def probe(config: dict) -> dict:
    import torch
    import transformers

    import ampkernels

    result = dict(config)
    torch.manual_seed(0)
    bert = transformers.BertConfig(
        hidden_dropout_prob=config["dropout"], attention_probs_dropout_prob=config["dropout"]
    )
    model = transformers.BertForMaskedLM(bert).cuda().train()
    if config["optimizer"] == "ampkernels":
        opt = ampkernels.FusedAdamW(model.parameters(), lr=1e-4)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, capturable=True)
    scaler = ampkernels.FusedGradScaler() if config["scaler"] == "fused" else None

    def step(ids):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(input_ids=ids, labels=ids).loss
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.clip_grad_norm_(opt, 1.0)
            scaler.step(opt)
            scaler.update()
        return loss.detach()

    ids = torch.randint(0, bert.vocab_size, (32, 512), device="cuda")
    embeddings = model.bert.embeddings
    buffers = {name: buf.clone() for name, buf in embeddings.named_buffers()}

    def buffers_intact() -> bool:
        return all(torch.equal(buf, buffers[name]) for name, buf in embeddings.named_buffers())

    def timed(fn, n=10) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            fn(ids)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3 / n

    for _ in range(3):
        step(ids)
    result["eager_ms"] = timed(step)
    result["buffers_intact_after_eager"] = buffers_intact()
    graphed = ampkernels.capture_step(step, ids, transformers_mask_skip=config.get("mask_skip", True))
    torch.cuda.synchronize()
    result["buffers_intact_after_capture"] = buffers_intact()
    result["graph_nodes"] = graphed.graph.num_nodes() if hasattr(graphed.graph, "num_nodes") else None
    print(json.dumps(result), flush=True)  # what is known so far, in case the replay kills the process
    loss = graphed(ids)
    torch.cuda.synchronize()
    result["buffers_intact_after_replay"] = buffers_intact()
    result["replay_loss"] = float(loss)
    result["graphed_ms"] = timed(graphed)
    result["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    if config.get("profile"):
        result["eager_kernels"] = top_kernels(step, ids)
        result["graphed_kernels"] = top_kernels(graphed, ids)
    return result


def top_kernels(fn, ids, top: int = 10) -> list:
    """The ``top`` CUDA kernels of one call by time: [name, ms, calls]."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(ids)
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    return [[e.key[:90], round(e.self_device_time_total / 1e3, 3), e.count] for e in kernels[:top]]


def main() -> None:
    if len(sys.argv) > 1:
        print(json.dumps(probe(json.loads(sys.argv[1]))), flush=True)
        return
    for config in CONFIGS:
        try:
            done = subprocess.run(
                [sys.executable, __file__, json.dumps(config)], capture_output=True, text=True, timeout=90
            )
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            tail = [line for line in done.stderr.splitlines() if "Error" in line or "error" in line][-2:]
            print(lines[-1] if lines else json.dumps(config), "| rc", done.returncode, "|", " / ".join(tail)[:300])
        except subprocess.TimeoutExpired:
            print(json.dumps(config), "| timed out")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
