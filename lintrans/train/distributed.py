"""Process group set-up for ``torchrun``: DDP over NCCL on GPUs, gloo on CPU; a no-op when run plainly."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(name: str, local_rank: int = 0, what: str = "train.device") -> torch.device:
    """``name`` (auto, cpu, cuda, cuda:N, mps) as a usable device; ValueError naming ``what`` if not."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank)
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"{what} must be auto, cpu, cuda, cuda:N or mps, got {name!r}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{what} is {name!r} but no CUDA device is available")
        if device.index is None:
            device = torch.device("cuda", local_rank)
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{what} is 'mps' but MPS is not available")
    return device


def init_distributed(device_name: str) -> DistInfo:
    """Join the process group when launched by torchrun (WORLD_SIZE > 1), else a single process."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistInfo(device=resolve_device(device_name))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_name, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return DistInfo(rank, world_size, local_rank, device)


def shutdown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
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
