"""linear_cross_entropy on an FSDP2-sharded head (LinearCrossEntropy under ``fully_shard``): 2 ranks with gloo on
the CPU. Each rank trains its half of every global batch; the gathered head weight and the trunk must follow one
unsharded model trained on the two halves (gradients averaged, as FSDP2's reduce-scatter computes them), for each
reduction (``"none"`` runs the chunks again in the backward, on the weight FSDP2 gathers again for it)."""

from __future__ import annotations

import pytest
import torch
from distributed_harness import run_ranks
from torch import nn

import ampkernels

WORLD, STEPS, TOKENS, VOCAB = 2, 3, 96, 160


class _LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(32, 48)
        self.head = ampkernels.LinearCrossEntropy(48, VOCAB, bias=True, label_smoothing=0.1, z_loss=1e-3)

    def forward(self, x: torch.Tensor, target: torch.Tensor, reduction: str) -> torch.Tensor:
        self.head.reduction = reduction
        loss = self.head(torch.tanh(self.trunk(x)), target)
        return loss.mean() if reduction == "none" else loss


def _model(device) -> _LM:
    torch.manual_seed(0)
    return _LM().to(device)


def _batch(step: int):
    gen = torch.Generator().manual_seed(10 + step)
    target = torch.randint(0, VOCAB, (TOKENS,), generator=gen)
    target[::9] = -100
    return torch.randn(TOKENS, 32, generator=gen), target


def _unsharded(world: int, reduction: str) -> list[dict]:
    model = _model("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    half, params = TOKENS // world, []
    for step in range(STEPS):
        x, t = _batch(step)
        opt.zero_grad(set_to_none=True)
        for r in range(world):
            (model(x[r * half : (r + 1) * half], t[r * half : (r + 1) * half], reduction) / world).backward()
        opt.step()
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return params


def _sharded(rank: int, world: int, device, reduction: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    model = _model(device)
    fully_shard(model.head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    half, params = TOKENS // world, []
    for step in range(STEPS):
        x, t = _batch(step)
        opt.zero_grad(set_to_none=True)
        model(x[rank * half : (rank + 1) * half], t[rank * half : (rank + 1) * half], reduction).backward()
        opt.step()
        params.append({n: p.detach().full_tensor() for n, p in model.named_parameters()})
    return {"params": params, "reference": _unsharded(world, reduction) if rank == 0 else None}


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_sharded_head_trains_as_the_unsharded_model(tmp_path, reduction):
    ranks = run_ranks(tmp_path, _sharded, reduction, world=WORLD)
    reference = ranks[0]["reference"]
    for rank in ranks:
        for step, (got, expected) in enumerate(zip(rank["params"], reference)):
            assert got.keys() == expected.keys()
            for name in got:
                torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=f"{step} {name}")
