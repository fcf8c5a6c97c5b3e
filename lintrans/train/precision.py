"""Mixed precision as training uses it, shared by the training loop and the training-step benchmark:
the forward under ``torch.autocast`` in bf16/fp16, weights and AdamW in float32, fp16 with a
GradScaler (CUDA only)."""
from __future__ import annotations

import contextlib

# torch is imported in the functions: lintrans.train.config takes PRECISIONS from here and loads without torch
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
AUTOCAST_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}  # torch dtype names


def resolve_precision(name: str, device: torch.device | str, *, what: str = "train.precision") -> str:
    """``auto`` becomes bf16 on CUDA devices that support it and fp32 elsewhere; fp16 needs CUDA
    (gradient scaling). ``what`` names the setting in errors."""
    import torch

    device = torch.device(device)
    if name not in PRECISIONS:
        raise ValueError(f"{what} must be one of {list(PRECISIONS)}, got {name!r}")
    if name == "auto":
        return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if name == "fp16" and device.type != "cuda":
        raise ValueError(f"{what} 'fp16' needs a CUDA device (gradient scaling); got {device}")
    return name


def autocast(precision: str, device: torch.device | str):
    """The forward's context: autocast for bf16/fp16, nothing for fp32."""
    import torch

    device = torch.device(device)
    if precision in AUTOCAST_DTYPES:
        return torch.autocast(device.type, dtype=getattr(torch, AUTOCAST_DTYPES[precision]))
    return contextlib.nullcontext()


def grad_scaler(precision: str) -> torch.amp.GradScaler:
    """A GradScaler that scales only for fp16 (a pass-through otherwise)."""
    import torch

    return torch.amp.GradScaler("cuda", enabled=precision == "fp16")
