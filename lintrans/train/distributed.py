"""Process group set-up for ``torchrun``: DDP or FSDP over NCCL on GPUs, gloo on CPU, optionally with
each sequence split over a context-parallel group; a no-op when run plainly."""
from __future__ import annotations

import contextlib
import gc
import os
import resource
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from lintrans.device import resolve_device  # also importable from here, its old home


@dataclass
class DistInfo:
    """Ranks ``[d * cp_size, (d + 1) * cp_size)`` form context-parallel group d: they hold the same
    sequences, each a contiguous slice of every sequence in rank order; the groups split the batch
    (data parallelism over ``dp_size = world_size / cp_size`` groups)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    cp_size: int = 1
    cp_group: Optional[object] = None  # this rank's context-parallel ProcessGroup when cp_size > 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp_size

    @property
    def dp_size(self) -> int:
        return self.world_size // self.cp_size


def init_distributed(device_name: str, context_parallel: int = 1) -> DistInfo:
    """Join the process group when launched by torchrun (WORLD_SIZE > 1), else a single process;
    with ``context_parallel`` > 1 also the context-parallel group of this rank."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size % context_parallel:
        raise ValueError(
            f"train.context_parallel = {context_parallel} splits every sequence over {context_parallel} processes: "
            f"launch a multiple of {context_parallel} (torchrun --nproc_per_node {context_parallel}), got {world_size}"
        )
    if world_size <= 1:
        return DistInfo(device=resolve_device(device_name))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_name, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    info = DistInfo(rank, world_size, local_rank, device, cp_size=context_parallel)
    if context_parallel > 1:
        # a group of its own even when it spans the world: its collectives run inside the backward,
        # beside DDP's / FSDP's gradient collectives, and must not queue behind them
        for d in range(world_size // context_parallel):
            group = dist.new_group(list(range(d * context_parallel, (d + 1) * context_parallel)))
            if d == info.dp_rank:
                info.cp_group = group
    return info


def shutdown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        # free what still refers to the groups (a sharded model's device mesh sits in reference
        # cycles) while the interpreter is whole: gloo groups torn down during its exit can abort it
        gc.collect()
        dist.destroy_process_group()


def all_mean(info: DistInfo, value: float) -> float:
    """Mean of a float over all processes (the value itself when single-process)."""
    if not info.enabled:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=info.device)
    dist.all_reduce(t)
    return t.item() / info.world_size


def any_flag(info: DistInfo, flag: bool) -> bool:
    """True on every process if it is True on any (so all stop at the same step)."""
    if not info.enabled:
        return flag
    t = torch.tensor([int(flag)], device=info.device)
    dist.all_reduce(t)
    return bool(t.item())


def gather_objects(info: DistInfo, obj) -> list:
    if not info.enabled:
        return [obj]
    out = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


# -- data / context / fully-sharded parallelism of the model -----------------------------------


def parallelize(model: torch.nn.Module, info: DistInfo, parallel: str, compile: bool) -> torch.nn.Module:
    """The module the training step calls: ``model`` as it is, compiled, DDP-wrapped or (``fsdp``)
    sharded in place with FSDP2's ``fully_shard`` (each block, then the rest), whose parameters
    become DTensors: build the optimizer after this."""
    if info.cp_size > 1:
        model.set_context_parallel(info.cp_group)
    if parallel == "fsdp" and info.enabled:
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        return torch.compile(model) if compile else model
    forward = torch.compile(model) if compile else model
    if info.enabled:
        from torch.nn.parallel import DistributedDataParallel

        forward = DistributedDataParallel(forward, device_ids=[info.device.index] if info.device.type == "cuda" else None)
    return forward


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def no_gradient_sync(model: torch.nn.Module, forward: torch.nn.Module, skip: bool):
    """Gradient accumulation: no gradient all-reduce (DDP) / reduce-scatter (FSDP) while ``skip``."""
    if not skip:
        yield
    elif is_sharded(model):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    elif hasattr(forward, "no_sync"):
        with forward.no_sync():
            yield
    else:
        yield


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded (DTensor) parameter or gradient; a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def full_value(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a DTensor (a collective: every rank must call it); a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def full_state_dicts(model: torch.nn.Module, optimizer) -> tuple[Optional[dict], Optional[dict]]:
    """(model state dict, optimizer state dict) of a sharded model gathered whole on CPU on rank 0
    (``None`` elsewhere), the optimizer's in torch's own layout (parameters numbered in the order of
    its param groups), so the checkpoint is the one an unsharded run writes. Every rank must call it."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    optim_state = get_optimizer_state_dict(model, optimizer, options=options)
    if dist.get_rank() != 0:
        return None, None
    order = {name: i for i, name in enumerate(n for g in optim_state["param_groups"] for n in g["params"])}
    return model_state, {
        "state": {order[name]: value for name, value in optim_state["state"].items()},
        "param_groups": [{**g, "params": [order[n] for n in g["params"]]} for g in optim_state["param_groups"]],
    }


def load_sharded_optimizer(model: torch.nn.Module, optimizer, state: dict) -> None:
    """Load an optimizer state in torch's layout (as saved by an unsharded run or ``full_state_dicts``)
    into the optimizer of a sharded model: each rank keeps its shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    by_name = {
        "state": {order[int(i)]: value for i, value in state["state"].items()},
        "param_groups": [{**g, "params": [order[int(i)] for i in g["params"]]} for g in state["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory so far: the CUDA allocator's peak on a GPU, else the peak resident
    set (``ru_maxrss``: weights, optimizer state, activations, and the Python/torch runtime)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux
