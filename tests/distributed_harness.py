"""Runs one function on every rank of a freshly spawned process group: gloo on the CPU, or NCCL with one GPU per rank.

Shared by the multi-process tests (``test_distributed.py``, ``test_float8_fsdp.py``, ``test_lowbit_fsdp.py``,
``test_float8_linear.py``): ``run_ranks(tmp_path, fn, *args)`` calls ``fn(rank, world, device, *args)`` in each
process and returns what each rank returned, in rank order. ``fn`` must be a module-level function (the spawned
processes import it by name) and return something ``torch.save`` takes. ``save_checkpoint`` / ``load_checkpoint``
take a sharded model and its optimizer through torch.distributed.checkpoint (or rank 0's consolidated state dicts).
"""

from __future__ import annotations

import copy
import faulthandler
import os
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"
)


def run_ranks(tmp_path, fn: Callable[..., Any], *args: Any, world: int = 2, backend: str = "gloo") -> list[Any]:
    """``fn(rank, world, device, *args)`` on ranks 0..world-1 (``backend`` "gloo": CPU devices; "nccl": cuda:rank);
    the ranks' results, loaded back in this process."""
    out_dir = str(tmp_path)
    mp.spawn(_rank_main, args=(world, backend, out_dir, fn, args), nprocs=world, join=True)
    return [torch.load(os.path.join(out_dir, f"rank{rank}.pt")) for rank in range(world)]


def _rank_main(rank: int, world: int, backend: str, out_dir: str, fn: Callable[..., Any], args: tuple) -> None:
    faulthandler.enable()  # an abort prints every thread's Python stack into the test's captured stderr
    init_file = os.path.join(out_dir, "store")
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        torch.set_num_threads(1)  # two ranks on a 2-core runner
        result = fn(rank, world, device, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # every rank past its last collective before any tears its connections down
    finally:
        dist.destroy_process_group()
    # Leave without interpreter finalization. The group outlives destroy_process_group
    # (torch.distributed.nn.functional, imported lazily after init, keeps group.WORLD in its default arguments), so
    # its gloo threads, and the autograd device threads FSDP2 starts, are still running at exit; a C++ thread that
    # touches a Python object during finalization aborts with "terminate called without an active exception"
    # (pytorch/pytorch#190489), intermittently (it segfaulted on the H200 machine's Python). faulthandler above
    # records the stacks should one happen earlier.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def save_checkpoint(model, optimizer, out_dir: str, full: bool) -> dict[str, Any]:
    """The model's and optimizer's state dicts: saved with torch.distributed.checkpoint under ``out_dir/ckpt`` (each
    rank its shards), or, ``full``, the consolidated ones rank 0 gets (``full_state_dict``, ``cpu_offload``; copied,
    since cpu_offload hands CPU tensors over as they are: the live step counts). Returned in both cases."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True) if full else None
    saved = {
        "model": get_model_state_dict(model, options=options),
        "optim": get_optimizer_state_dict(model, optimizer, options=options),
    }
    if full:
        return copy.deepcopy(saved)
    dcp.save(saved, checkpoint_id=os.path.join(out_dir, "ckpt"))
    return saved


def load_checkpoint(model, optimizer, saved: dict[str, Any], out_dir: str, full: bool) -> None:
    """Loads what :func:`save_checkpoint` saved into a fresh ``model`` and ``optimizer``: from the files, or, ``full``,
    from rank 0's consolidated dicts (``broadcast_from_rank0``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if full:
        state, options = saved, StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    else:
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=os.path.join(out_dir, "ckpt"))
        options = None
    set_model_state_dict(model, state["model"], options=options)
    set_optimizer_state_dict(model, optimizer, state["optim"], options=options)
