"""FusedAdamW's low-precision state under FSDP2 (fully_shard): 2 ranks with gloo on the CPU (always), with NCCL on 2
GPUs (when present).

Each rank trains its half of every global batch with the model sharded along dim 0; after every step the full
parameters (``p.full_tensor()``) must equal, bit for bit, those of one unsharded model stepped by the same optimizer
on the same global batch. The unsharded run sums the two half-batch gradients and halves them, which is what FSDP2's
averaging reduce-scatter computes exactly (a sum of two and a division by 2 are exact up to rounding once); the
gradients are compared first, so that a mismatch there is the harness's and one after it the optimizer's.

What must survive sharding: which tensors get quantized moments (decided on the global numel), blocks along the
last dimension (dim-0 shards never split one, also for an odd number of rows), and the stochastic-rounding stream
(keyed by the parameter's index in the optimizer and the element's flat index in the full tensor).
"""

from __future__ import annotations

import pytest
import torch
from distributed_harness import load_checkpoint, needs_two_gpus, run_ranks, save_checkpoint
from torch import nn

from ampkernels import FusedAdamW
from benchmarks.models import RMSNorm

WORLD = 2
STEPS = 5
GLOBAL_BATCH = 16
SEED = 1234  # the stochastic-rounding stream's seed, the same in every run

CONFIGS = {
    "q8": dict(params=torch.float32, options=dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)),
    "q4": dict(params=torch.float32, options=dict(exp_avg_dtype="4bit", exp_avg_sq_dtype="4bit")),
    "bf16_sr": dict(params=torch.bfloat16, options=dict(stochastic_rounding=True)),
}


class _Net(nn.Module):
    """[B, 64] -> [B, 16]. The weights of ``fc1`` (96 x 64: two halves of 48 rows), ``fc2`` (65 x 96: 33 + 32 rows)
    and ``fc3`` (64 x 65: an odd row, which 4-bit codes end with half a byte) have >= 4096 elements, so quantized
    moments, while every shard of the first two has fewer (the decision is on the full tensor). ``out.weight``
    (16 x 64) is below 4096 (float32 moments); ``norm.weight`` and the biases are 1-D, ``fc2.bias`` of odd length."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 96)
        self.norm = RMSNorm(96)
        self.fc2 = nn.Linear(96, 65)
        self.fc3 = nn.Linear(65, 64)
        self.out = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        silu = torch.nn.functional.silu
        h = silu(self.norm(self.fc1(x)))
        return self.out(silu(self.fc3(silu(self.fc2(h)))))


QUANTIZED = ("fc1.weight", "fc2.weight", "fc3.weight")
FLOAT32_MOMENTS = ("out.weight", "norm.weight", "fc2.bias")


def _model(config: str, device: torch.device) -> _Net:
    torch.manual_seed(0)
    return _Net().to(device=device, dtype=CONFIGS[config]["params"])


def _optimizer(config: str, model: nn.Module) -> FusedAdamW:
    # lr 1e-2: large enough that every step moves the bfloat16 parameters by more than an ulp somewhere.
    return FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, seed=SEED, **CONFIGS[config]["options"])


def _batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 64, generator=gen).to(device), torch.randn(GLOBAL_BATCH, 16, generator=gen).to(
        device
    )


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x.to(model.fc1.weight.dtype)).float() - y).square().mean()


def _state_dtypes(opt: FusedAdamW, model: nn.Module) -> dict[str, str]:
    return {name: str(opt.state[p]["exp_avg"].dtype) for name, p in model.named_parameters() if p in opt.state}


def _unsharded(config: str, device: torch.device) -> dict:
    """The single-process run: the same model and optimizer, the global batch as two halves whose gradients are
    accumulated and halved (as FSDP2 averages them)."""
    model = _model(config, device)
    opt = _optimizer(config, model)
    record = {"grads": [], "params": []}
    half = GLOBAL_BATCH // WORLD
    for step in range(STEPS):
        x, y = _batch(step, device)
        opt.zero_grad(set_to_none=True)
        for r in range(WORLD):
            _loss(model, x[r * half : (r + 1) * half], y[r * half : (r + 1) * half]).backward()
        for p in model.parameters():
            p.grad.mul_(1.0 / WORLD)
        record["grads"].append({n: p.grad.cpu().clone() for n, p in model.named_parameters()})
        opt.step()
        record["params"].append({n: p.detach().cpu().clone() for n, p in model.named_parameters()})
    record["state_dtypes"] = _state_dtypes(opt, model)
    return record


def _sharded(rank: int, config: str, device: torch.device) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (WORLD,))
    model = _model(config, device)
    for layer in (model.fc1, model.fc2, model.fc3, model.out, model):
        fully_shard(layer, mesh=mesh)
    opt = _optimizer(config, model)
    record = {"grads": [], "params": []}
    half = GLOBAL_BATCH // WORLD
    for step in range(STEPS):
        x, y = _batch(step, device)
        opt.zero_grad(set_to_none=True)
        _loss(model, x[rank * half : (rank + 1) * half], y[rank * half : (rank + 1) * half]).backward()
        record["grads"].append({n: p.grad.full_tensor().cpu() for n, p in model.named_parameters()})
        opt.step()
        record["params"].append({n: p.detach().full_tensor().cpu() for n, p in model.named_parameters()})
    record["state_dtypes"] = _state_dtypes(opt, model)
    record["local_rows"] = {n: p.to_local().shape[0] for n, p in model.named_parameters()}
    return record


def _sharded_and_reference(rank: int, world: int, device: torch.device, config: str) -> dict:
    result = {"sharded": _sharded(rank, config, device)}
    if rank == 0:  # the reference, on the same kind of device and in the same kind of process
        result["unsharded"] = _unsharded(config, device)
    return result


def _run(tmp_path, config: str, backend: str = "gloo") -> tuple[list[dict], dict]:
    ranks = run_ranks(tmp_path, _sharded_and_reference, config, world=WORLD, backend=backend)
    return [rank["sharded"] for rank in ranks], ranks[0]["unsharded"]


def _check(ranks: list[dict], reference: dict, config: str) -> None:
    names = list(reference["params"][0])
    assert ranks[0]["local_rows"]["fc2.weight"] == 33 and ranks[1]["local_rows"]["fc2.weight"] == 32
    for name in QUANTIZED + FLOAT32_MOMENTS:
        want = "torch.bfloat16" if config == "bf16_sr" else "torch.uint8" if name in QUANTIZED else "torch.float32"
        assert reference["state_dtypes"][name] == want, (name, reference["state_dtypes"])
    for r, rec in enumerate(ranks):
        assert rec["state_dtypes"] == reference["state_dtypes"], f"rank {r}: other state formats than unsharded"
        for step in range(STEPS):
            for name in names:
                got, want = rec["grads"][step][name], reference["grads"][step][name]
                assert torch.equal(got, want), f"rank {r} step {step} {name}: gradients differ (the harness)"
                got, want = rec["params"][step][name], reference["params"][step][name]
                assert got.dtype == want.dtype == CONFIGS[config]["params"]
                diff = (got.float() - want.float()).abs().max().item()
                assert torch.equal(got, want), f"rank {r} step {step} {name}: parameters differ (max {diff:.3g})"
    # The parameters did move, every step (so the comparison is of updates, not of the initial weights).
    for step in range(1, STEPS):
        for name in names:
            before, after = reference["params"][step - 1][name], reference["params"][step][name]
            assert not torch.equal(before, after), f"step {step}: {name} did not change"


@pytest.mark.parametrize("config", list(CONFIGS))
def test_fsdp2_lowbit_matches_unsharded(tmp_path, config):
    ranks, reference = _run(tmp_path, config)
    _check(ranks, reference, config)


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("config", list(CONFIGS))
def test_fsdp2_lowbit_matches_unsharded_nccl(tmp_path, config):
    ranks, reference = _run(tmp_path, config, backend="nccl")
    _check(ranks, reference, config)


# --------------------------------------------------------------------------------------------------------------------
# torch.distributed.checkpoint of the sharded optimizer state
# --------------------------------------------------------------------------------------------------------------------

CHECKPOINT_CONFIGS = {"fp32": dict(params=torch.float32, options={}), **CONFIGS}


def _checkpoint_worker(rank, world, device, config, out_dir, full):
    """Trains 2 steps, saves model and optimizer with DCP, takes a 3rd step; then a fresh model and optimizer (other
    initial weights, no state) load the checkpoint and take the same 3rd step. Every rank's shards must agree.
    ``full``: instead of sharded files, the consolidated state dicts rank 0 gets with ``full_state_dict=True,
    cpu_offload=True`` (one file's worth, as for an export), loaded back with ``broadcast_from_rank0=True``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    half = GLOBAL_BATCH // WORLD
    mesh = init_device_mesh(device.type, (WORLD,))

    def build(seed):
        torch.manual_seed(seed)
        model = _Net().to(dtype=CHECKPOINT_CONFIGS[config]["params"])
        for layer in (model.fc1, model.fc2, model.fc3, model.out, model):
            fully_shard(layer, mesh=mesh)
        opt = FusedAdamW(
            model.parameters(), lr=1e-2, weight_decay=0.1, seed=SEED, **CHECKPOINT_CONFIGS[config]["options"]
        )
        return model, opt

    def step(model, opt, index):
        x, y = _batch(index, device)
        opt.zero_grad(set_to_none=True)
        _loss(model, x[rank * half : (rank + 1) * half], y[rank * half : (rank + 1) * half]).backward()
        opt.step()

    def shards(opt):
        # every state tensor of every parameter, as this rank's local shard
        return {
            (i, k): (v.to_local() if hasattr(v, "to_local") else v).clone()
            for i, entry in enumerate(opt.state_dict()["state"].values())
            for k, v in entry.items()
            if isinstance(v, torch.Tensor)
        }

    model, opt = build(0)
    for index in range(2):
        step(model, opt, index)
    saved = save_checkpoint(model, opt, out_dir, full)
    kinds = sorted(
        {
            type(v).__name__
            for e in saved["optim"].get("state", {}).values()  # (full: empty off rank 0)
            for k, v in e.items()
            if k != "step" and not isinstance(v, int)
        }
    )
    before = shards(opt)
    step(model, opt, 2)
    want = [p.detach().to_local().clone() for p in model.parameters()]

    model2, opt2 = build(1)
    load_checkpoint(model2, opt2, saved, out_dir, full)
    loaded = shards(opt2)
    step(model2, opt2, 2)
    got = [p.detach().to_local().clone() for p in model2.parameters()]
    result = {
        "kinds": kinds,
        "state_equal": sorted(before) == sorted(loaded) and all(torch.equal(before[k], loaded[k]) for k in before),
        "params_equal": all(torch.equal(a, b) for a, b in zip(want, got)),
        "dtypes": sorted({str(v.dtype) for v in before.values()}),
    }
    return result


@pytest.mark.parametrize("full", [False, True], ids=["sharded", "full"])
@pytest.mark.parametrize("config", list(CHECKPOINT_CONFIGS))
def test_fsdp2_optimizer_state_round_trips_through_distributed_checkpoint(tmp_path, config, full):
    """The sharded state is saved as DTensors (before, DCP took every rank's local shard for the same replicated
    tensor and loaded rank 0's everywhere); after a load the state and the next step are the original's bit for
    bit, on both ranks (fc2's 65 rows shard unevenly). The same through a consolidated state dict on rank 0 (its
    gathering takes plain Python values only: the param groups' torch.dtype options once failed it)."""
    for r, result in enumerate(run_ranks(tmp_path, _checkpoint_worker, config, str(tmp_path), full, world=WORLD)):
        if full and r != 0:
            assert result["kinds"] == [], result  # only rank 0 holds the consolidated state
        else:
            assert result["kinds"] == (["Tensor"] if full else ["DTensor"]), result
        if config in ("q8", "q4"):
            assert "torch.uint8" in result["dtypes"], result
        assert result["state_equal"], f"rank {r}: loaded state differs"
        assert result["params_equal"], f"rank {r}: the step after the load differs"


# --------------------------------------------------------------------------------------------------------------------
# Master weights: a load into the sharded parameters
# --------------------------------------------------------------------------------------------------------------------


def _master_weights_run(rank: int, device: torch.device, sharded: bool) -> list[dict]:
    """bfloat16 parameters with float32 master weights: 2 steps, then model.load_state_dict of the initial weights
    (a rollback), then 2 more steps. The load is the truth: the next step must resync the masters from it."""
    model = _model("bf16_sr", device)
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (WORLD,))
        for layer in (model.fc1, model.fc2, model.fc3, model.out, model):
            fully_shard(layer, mesh=mesh)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, master_weights=True)
    half, record = GLOBAL_BATCH // WORLD, []
    for step in range(4):
        if step == 2:
            model.load_state_dict(initial)
        x, y = _batch(step, device)
        opt.zero_grad(set_to_none=True)
        for r in [rank] if sharded else range(WORLD):
            _loss(model, x[r * half : (r + 1) * half], y[r * half : (r + 1) * half]).backward()
        if not sharded:
            for p in model.parameters():
                p.grad.mul_(1.0 / WORLD)
        opt.step()
        record.append(
            {n: (p.full_tensor() if sharded else p).detach().cpu().clone() for n, p in model.named_parameters()}
        )
    return record


def _master_weights_worker(rank, world, device):
    result = {"sharded": _master_weights_run(rank, device, sharded=True)}
    if rank == 0:
        result["unsharded"] = _master_weights_run(rank, device, sharded=False)
    return result


def test_fsdp2_master_weights_resync_after_a_load(tmp_path):
    """model.load_state_dict into FSDP2 parameters copies into the DTensors, whose local shards (what the optimizer
    steps) keep their version counters: the load must still count as one, or the next step writes the stale
    master weights over the loaded parameters. Every step equals the unsharded run's, bit for bit."""
    ranks = run_ranks(tmp_path, _master_weights_worker, world=WORLD)
    reference = ranks[0]["unsharded"]
    for r, rank in enumerate(ranks):
        for step, (got, want) in enumerate(zip(rank["sharded"], reference, strict=True)):
            for name in want:
                assert torch.equal(got[name], want[name]), f"rank {r} step {step} {name}: parameters differ"
