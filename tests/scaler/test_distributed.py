"""FusedGradScaler across processes: 2 ranks with gloo on the CPU (always), with NCCL on 2 GPUs (when present).

Each scenario runs in freshly spawned processes; every rank saves what it saw and the test compares the ranks with
each other and with a single-process run over the same numbers.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from distributed_harness import needs_two_gpus, run_ranks

from ampkernels import FusedGradScaler

WORLD = 2
STEPS = 5
OVERFLOW_STEP = 2  # on this step one gradient of rank 1 alone holds an inf
SHAPES = [(37,), (64, 33), (1000,), (5, 7), (16385,), (3,), (129, 2), (8,)]
INIT_SCALE = 2.0**10
MAX_NORM = 1.0


def _params(indices, device):
    gen = torch.Generator().manual_seed(1234)
    every = [torch.randn(shape, generator=gen) for shape in SHAPES]
    return [torch.nn.Parameter(every[i].clone().to(device)) for i in indices]


def _true_grad(step: int, index: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + index)
    return torch.randn(SHAPES[index], generator=gen) * 0.3


def _make_optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, fused=True)


def _train_shard(indices, device, kind, scaler, overflow_here):
    """STEPS steps of scaled gradients -> clip_grad_norm_ -> step -> update over the parameters ``indices``."""
    params = _params(indices, device)
    opt = _make_optimizer(kind, params)
    record = {"norm": [], "scale": [], "params": [], "skipped": []}
    for step in range(STEPS):
        scale = float(scaler.scale(torch.ones((), device=device)))  # as scaler.scale(loss) would, and the value
        for p, i in zip(params, indices):
            g = _true_grad(step, i) * scale
            if overflow_here and step == OVERFLOW_STEP and i == indices[-1]:
                g[len(g) // 2] = math.inf
            p.grad = g.to(device)
        before = [p.detach().clone() for p in params]
        norm = scaler.clip_grad_norm_(opt, MAX_NORM)
        scaler.step(opt)
        scaler.update()
        record["norm"].append(float(norm))
        record["scale"].append(scaler.get_scale())
        record["params"].append([p.detach().cpu().clone() for p in params])
        record["skipped"].append(all(torch.equal(a, p.detach()) for a, p in zip(before, params)))
    return record


def _scenario_sharded(rank, world, device, kind):
    mine = list(range(rank, len(SHAPES), world))  # ZeRO-style: rank r owns every world-th tensor
    scaler = FusedGradScaler(device.type, init_scale=INIT_SCALE, process_group=dist.group.WORLD)
    return _train_shard(mine, device, kind, scaler, overflow_here=rank == 1)


def _scenario_group_of_one(rank, world, device, kind):
    groups = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    mine = list(range(rank, len(SHAPES), world))
    scaler = FusedGradScaler(device.type, init_scale=INIT_SCALE, process_group=groups[rank])
    grouped = _train_shard(mine, device, kind, scaler, overflow_here=rank == 1)
    alone = _train_shard(mine, device, kind, FusedGradScaler(device.type, init_scale=INIT_SCALE), rank == 1)
    return {"grouped": grouped, "alone": alone}


def _scenario_ddp(rank, world, device, kind):
    """DDP, unchanged: gradients are all-reduced before the scaler sees them, so no process_group is needed."""
    results = {}
    for name, make_scaler in (
        ("fused", lambda: FusedGradScaler(device.type, init_scale=INIT_SCALE)),
        ("stock", lambda: torch.amp.GradScaler(device.type, init_scale=INIT_SCALE)),
    ):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(device)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        scaler = make_scaler()
        gen = torch.Generator().manual_seed(rank)
        scales = []
        for step in range(STEPS):
            x = torch.randn(8, 16, generator=gen).to(device)
            loss = ddp(x).square().mean()
            if step == OVERFLOW_STEP and rank == 0:
                loss = loss * math.inf  # an overflow on one rank reaches every rank through the all-reduce
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), MAX_NORM)
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        results[name] = {"scale": scales, "params": [p.detach().cpu().clone() for p in model.parameters()]}
    return results


def _scenario_fsdp2(rank, world, device, kind):
    """FSDP2 (fully_shard): DTensor gradients, each rank holding a shard; an inf lands in rank 1's shard only."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(device)
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    opt = _make_optimizer(kind, model.parameters())
    scaler = FusedGradScaler(device.type, init_scale=INIT_SCALE, process_group=mesh.get_group())
    gen = torch.Generator().manual_seed(rank)
    record = {"norm": [], "full_norm": [], "scale": [], "skipped": []}
    for step in range(STEPS):
        x = torch.randn(8, 16, generator=gen).to(device)
        opt.zero_grad()
        scaler.scale(model(x).square().mean()).backward()
        if step == OVERFLOW_STEP and rank == 1:
            model[2].weight.grad.to_local()[0, 0] = math.inf
        full = [p.grad.full_tensor().double() / scaler.get_scale() for p in model.parameters()]
        before = [p.detach().to_local().clone() for p in model.parameters()]
        norm = scaler.clip_grad_norm_(opt, MAX_NORM)
        scaler.step(opt)
        scaler.update()
        record["norm"].append(float(norm))
        record["full_norm"].append(float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in full]))))
        record["scale"].append(scaler.get_scale())
        after = [p.detach().to_local() for p in model.parameters()]
        record["skipped"].append(all(torch.equal(a, b) for a, b in zip(before, after)))
    return record


def _scenario_fsdp2_without_group(rank, world, device, kind):
    """FSDP2 gradients and a scaler without process_group: each rank would skip and clip on its own shard alone."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(device)
    fully_shard(model, mesh=mesh)
    opt = _make_optimizer(kind, model.parameters())
    scaler = FusedGradScaler(device.type, init_scale=INIT_SCALE)
    scaler.scale(model(torch.randn(8, 16, device=device)).square().mean()).backward()
    before = [p.grad.to_local().clone() for p in model.parameters()]
    try:
        scaler.unscale_(opt)
    except ValueError as exc:
        message = str(exc)
    else:
        message = None
    return {
        "message": message,
        "untouched": all(torch.equal(p.grad.to_local(), b) for p, b in zip(model.parameters(), before)),
    }


SCENARIOS = {
    "sharded": _scenario_sharded,
    "fsdp2": _scenario_fsdp2,
    "fsdp2_without_group": _scenario_fsdp2_without_group,
    "group_of_one": _scenario_group_of_one,
    "ddp": _scenario_ddp,
}


def _run(tmp_path, scenario, backend="gloo", kind="sgd"):
    return run_ranks(tmp_path, SCENARIOS[scenario], kind, world=WORLD, backend=backend)


def _single_process_reference(kind):
    """Every tensor in one process and one optimizer: the global norm and skip decision the ranks must agree on."""
    scaler = FusedGradScaler("cpu", init_scale=INIT_SCALE)
    return _train_shard(list(range(len(SHAPES))), torch.device("cpu"), kind, scaler, overflow_here=False)


def _check_sharded(ranks, kind):
    # The single-process run has no overflow; the distributed one skips OVERFLOW_STEP on every rank, so compare
    # norms of the steps before it and the skip/scale behaviour exactly.
    reference = _single_process_reference(kind)
    for r, rec in enumerate(ranks):
        assert rec["skipped"] == [step == OVERFLOW_STEP for step in range(STEPS)], f"rank {r}"
        assert rec["scale"] == ranks[0]["scale"], "ranks disagree about the scale"
        assert rec["scale"][OVERFLOW_STEP] == rec["scale"][OVERFLOW_STEP - 1] / 2
        assert math.isinf(rec["norm"][OVERFLOW_STEP]) or math.isnan(rec["norm"][OVERFLOW_STEP])
        for step in range(OVERFLOW_STEP):  # the global norm, not this rank's share of it
            assert rec["norm"][step] == pytest.approx(reference["norm"][step], rel=1e-6), f"rank {r} step {step}"
            mine = list(range(r, len(SHAPES), WORLD))
            for p, i in zip(rec["params"][step], mine):
                torch.testing.assert_close(p, reference["params"][step][i], rtol=1e-6, atol=1e-7)
    assert ranks[0]["norm"][0] > MAX_NORM  # the clip is active, so a per-rank norm would give other parameters


@pytest.mark.parametrize("kind", ["sgd", "adamw_fused"])
def test_sharded_gradients_global_norm_and_skip(tmp_path, kind):
    _check_sharded(_run(tmp_path, "sharded", kind=kind), kind)


def test_fsdp2_dtensor_gradients(tmp_path):
    ranks = _run(tmp_path, "fsdp2")
    for r, rec in enumerate(ranks):
        assert rec["skipped"] == [step == OVERFLOW_STEP for step in range(STEPS)], f"rank {r}"
        assert rec["scale"] == ranks[0]["scale"] and rec["norm"] == ranks[0]["norm"]
        finite = [step for step in range(STEPS) if step != OVERFLOW_STEP]
        assert [rec["norm"][s] for s in finite] == pytest.approx([rec["full_norm"][s] for s in finite], rel=1e-5)


def test_fsdp2_gradients_without_process_group_are_refused_before_any_write(tmp_path):
    for rank, rec in enumerate(_run(tmp_path, "fsdp2_without_group")):
        assert rec["message"] is not None and "argument 'process_group'" in rec["message"], f"rank {rank}"
        assert rec["untouched"], f"rank {rank}: gradients written before the error"


def test_process_group_of_one_communicates_nothing(tmp_path):
    for rec in _run(tmp_path, "group_of_one"):
        grouped, alone = rec["grouped"], rec["alone"]
        assert grouped["norm"] == alone["norm"] and grouped["scale"] == alone["scale"]
        for a, b in zip(grouped["params"], alone["params"]):
            assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_ddp_unchanged_matches_stock(tmp_path):
    ranks = _run(tmp_path, "ddp")
    for rec in ranks:
        assert rec["fused"]["scale"] == rec["stock"]["scale"]
        assert rec["fused"]["scale"][OVERFLOW_STEP] == rec["fused"]["scale"][OVERFLOW_STEP - 1] / 2
        assert all(torch.equal(a, b) for a, b in zip(rec["fused"]["params"], rec["stock"]["params"]))
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["fused"]["params"], ranks[1]["fused"]["params"]))


def test_process_group_needs_initialized_distributed():
    if dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    with pytest.raises(RuntimeError, match="process_group was given but torch.distributed is not initialized"):
        FusedGradScaler("cpu", process_group=object())


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("kind", ["sgd", "adamw_fused"])
def test_sharded_gradients_nccl(tmp_path, kind):
    _check_sharded(_run(tmp_path, "sharded", backend="nccl", kind=kind), kind)
