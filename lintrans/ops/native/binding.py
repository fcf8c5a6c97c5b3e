"""What the kernels' ctypes bindings (chunked.py, aft.py, sliding_window.py) share."""
from __future__ import annotations

import ctypes
import functools
import os
import sys
from typing import Optional

import torch

from . import active, library

P = ctypes.c_void_p  # a tensor's data, or null
I3 = ctypes.c_int64 * 3  # the strides of a [B, T, H, D] tensor's B, T, H dimensions (D's is 1)


def takes(*xs: torch.Tensor) -> bool:
    """Whether a kernel can take these inputs: CPU tensors of one dtype, float32 or float64, with
    the kernels on and built (built here on first use)."""
    return (xs[0].device.type == "cpu" and xs[0].dtype in (torch.float32, torch.float64)
            and all(x.dtype == xs[0].dtype for x in xs) and active())


HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h
# outputs at least this large get the advice: smaller ones hold at most three whole huge pages
ADVISE_FROM_BYTES = 4 * HUGE_PAGE


def empty(shape, like: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``torch.empty`` on the CPU for a kernel's output, large ones backed by huge pages where the
    system allows it (``advise_huge_pages``)."""
    t = torch.empty(shape, dtype=like.dtype if dtype is None else dtype)
    advise_huge_pages(t)
    return t


def advise_huge_pages(t: torch.Tensor) -> None:
    """Ask Linux to back the 2 MiB-aligned interior of a large new tensor with transparent huge pages
    (madvise(MADV_HUGEPAGE); honoured where /sys/kernel/mm/transparent_hugepage/enabled is
    ``madvise`` or ``always``). A fresh multi-MiB output otherwise costs a page fault per 4 KiB when
    the kernel first writes it, on every call: glibc maps such blocks anew each time and unmaps them
    when freed. The memory used is the same; only the page size changes. PyTorch does the same for
    every allocation under ``THP_MEM_ALLOC_ENABLE=1``; this applies it to the kernels' own outputs
    only. ``LINTRANS_HUGEPAGES=0`` turns it off."""
    if t.nbytes < ADVISE_FROM_BYTES or not _madvise_enabled():
        return
    start = t.data_ptr()
    lo = -(-start // HUGE_PAGE) * HUGE_PAGE
    hi = (start + t.nbytes) // HUGE_PAGE * HUGE_PAGE
    if hi > lo:
        _libc().madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_HUGEPAGE)  # advice: failure is harmless


def _madvise_enabled() -> bool:
    return sys.platform.startswith("linux") and os.environ.get("LINTRANS_HUGEPAGES", "1") != "0"


@functools.lru_cache(maxsize=1)
def _libc():
    libc = ctypes.CDLL(None)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise.restype = ctypes.c_int
    return libc


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
