"""FusedGradScaler across processes: FSDP2's sharded (DTensor) parameters, the process group's checks, and the one
all-reduce that makes the non-finite flag and the gradient norm global."""

from __future__ import annotations

from typing import Any

import torch

from ampkernels._constants import NormKind


def is_dtensor(t: torch.Tensor) -> bool:
    # DTensor (FSDP2's sharded parameters and gradients) is a wrapper without storage; the kernels run on its
    # local shard. Checked by name so that torch builds without torch.distributed import fine.
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local")


def sharded_across_ranks(p: torch.Tensor) -> bool:
    """A DTensor split over more than one rank (FSDP2; HSDP's replicated mesh dimension does not count)."""
    if not is_dtensor(p):
        return False
    mesh = p.device_mesh
    return any(placement.is_shard() and mesh.size(dim) > 1 for dim, placement in enumerate(p.placements))


def check_process_group(group: Any) -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "FusedGradScaler: process_group was given but torch.distributed is not initialized; "
            "call torch.distributed.init_process_group() first"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"FusedGradScaler: process_group must be a torch.distributed.ProcessGroup, got {type(group).__name__}"
        )


def group_size(process_group: Any) -> int:
    """Ranks in ``process_group`` (1 without one)."""
    return 1 if process_group is None else torch.distributed.get_world_size(process_group)


def all_reduce(
    found_per_device: dict,
    device: torch.device,
    process_group: Any,
    norms: list | None = None,
    kind: NormKind = NormKind.L2,
):
    """Make ``found_per_device`` (in place) and the gradient norm global over the process group.

    One all-reduce of ``[non-finite flag, norm statistic]`` in float64: summed for the 2-norm (the statistic is
    the local sum of squares), max for the inf-norm (the statistic is the local max). Every rank must call it
    the same number of times, also a rank whose optimizer holds no gradient. Returns the global norm, a 0-d
    float32 tensor, when ``norms`` (this rank's per-device ``kind`` norms) is given.
    """
    import torch.distributed as dist

    local = [f.to(device, torch.float64, non_blocking=True) for f in found_per_device.values()]
    flag = torch.stack(local).sum() if local else torch.zeros((), dtype=torch.float64, device=device)
    if not norms:
        stat = torch.zeros((), dtype=torch.float64, device=device)
    else:
        each = torch.stack([n.to(device, torch.float64, non_blocking=True) for n in norms])
        stat = each.square().sum() if kind is NormKind.L2 else each.max()
    buf = torch.stack([flag, stat])
    op = dist.ReduceOp.SUM if kind is NormKind.L2 else dist.ReduceOp.MAX
    dist.all_reduce(buf, op=op, group=process_group)
    global_flag = buf[0].float()
    for found in found_per_device.values():
        found.copy_(global_flag, non_blocking=True)
    if not found_per_device:
        found_per_device[device] = global_flag  # the skip decision of the other ranks, recorded for update()
    if norms is None:
        return None
    return (buf[1].sqrt() if kind is NormKind.L2 else buf[1]).float()
