"""Device names (auto, cpu, cuda, cuda:N, mps) as usable torch devices, checked before any work;
shared by sampling, training, benchmarks and studies."""
from __future__ import annotations


def resolve_device(name: str, local_rank: int = 0, what: str = "train.device"):
    """``name`` (auto, cpu, cuda, cuda:N, mps) as a usable ``torch.device``; ValueError naming ``what`` if not."""
    import torch

    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank)
        return torch.device("cpu")
    allowed = f"{what} must be auto, cpu, cuda, cuda:N or mps, got {name!r}"
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(allowed) from None
    if device.type not in ("cpu", "cuda", "mps") or (device.type != "cuda" and device.index not in (None, 0)):
        raise ValueError(allowed)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{what} is {name!r} but no CUDA device is available")
        if device.index is None:
            device = torch.device("cuda", local_rank)
        if device.index >= torch.cuda.device_count():
            raise ValueError(f"{what} is {name!r} but this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{what} is 'mps' but MPS is not available")
    return device
