"""What the kernels' ctypes bindings (chunked.py, aft.py, sliding_window.py) share."""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from . import enabled, library

P = ctypes.c_void_p  # a tensor's data, or null
I3 = ctypes.c_int64 * 3  # the strides of a [B, T, H, D] tensor's B, T, H dimensions (D's is 1)


def takes(*xs: torch.Tensor) -> bool:
    """Whether a kernel can take these inputs: CPU tensors of one dtype, float32 or float64, with
    the kernels on and built (built here on first use)."""
    return (xs[0].device.type == "cpu" and xs[0].dtype in (torch.float32, torch.float64)
            and all(x.dtype == xs[0].dtype for x in xs) and enabled() and library() is not None)


def ptr(x: Optional[torch.Tensor]):
    return None if x is None else x.data_ptr()


def strides(x: torch.Tensor):
    return I3(*x.stride()[:3])


def last_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def call(name: str, dtype: torch.dtype, args: ctypes.Structure) -> None:
    """Run the kernel ``name`` (e.g. "lt_aft_simple_forward") for ``dtype`` on ``args``."""
    suffix = "f32" if dtype == torch.float32 else "f64"
    getattr(library(), f"{name}_{suffix}")(ctypes.byref(args))
