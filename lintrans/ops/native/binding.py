"""What the kernels' ctypes bindings (chunked.py, aft.py, sliding_window.py) share."""
from __future__ import annotations

import ctypes
import functools
import os
import sys
from typing import Optional

import torch

from . import LayoutError, active, library

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
    # on the CPU whatever torch.set_default_device says: the kernel writes through a host pointer
    t = torch.empty(shape, dtype=like.dtype if dtype is None else dtype, device="cpu")
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


INT_MAX = 2**31 - 1


def blas_rows(x: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D], or a contiguous copy where BLAS cannot read one head's [T, D] rows in place:
    it needs unit stride along D and rows at least D apart (a gradient broadcast along T has stride 0
    there, and BLAS rejects such a leading dimension, skipping the product). A copy, not
    ``contiguous()``: torch calls a tensor contiguous whatever the strides of its size-1 dimensions, so
    at T = 1 that could hand back the same bad T-stride."""
    ok = x.stride(-1) == 1 and x.shape[-1] <= x.stride(1) <= INT_MAX  # BLAS takes an int leading dimension
    return x if ok else x.clone(memory_format=torch.contiguous_format)


def step_operands(tensors: dict, ld: Optional[torch.Tensor], B: int, H: int):
    """The one-token kernels' operands (``tensors``, by name, q first), checked and contiguous, and the
    decay: (contiguous tensors in order, ld or None, ld_batch: 1 where ld is [B, H], 0 for [H])."""
    names, xs = list(tensors), list(tensors.values())
    require(ld is None or tuple(ld.shape) in ((B, H), (H,)), "log_decay must be [B, H] or [H]")
    require(xs[0].dtype in (torch.float32, torch.float64)
            and all(x.dtype == xs[0].dtype for x in xs[1:] + ([] if ld is None else [ld])),
            f"{', '.join(names)} and log_decay must share one dtype, float32 or float64")
    return ([x.contiguous() for x in xs], None if ld is None else ld.contiguous(),
            int(ld is not None and ld.dim() == 2))


def step_supports(xs, extra: bool = True) -> bool:
    """Whether a one-token kernel can run on ``xs`` (``extra``: the op's own conditions): CPU tensors of
    one dtype, float32 or float64, nothing for autograd to record, and not while torch.compile traces
    (a compiled step fuses the small ops itself, in one graph)."""
    if torch.compiler.is_compiling():
        return False
    return extra and takes(*xs) and not (torch.is_grad_enabled() and any(x.requires_grad for x in xs))


def require(ok: bool, message: str) -> None:
    """A binding's precondition: what the kernel would otherwise read or write out of bounds. An
    explicit raise, not ``assert``, which ``python -O`` strips."""
    if not ok:
        raise ValueError(message)


# the status codes of cpu_kernels.h's Status
OK, OUT_OF_MEMORY = 0, 1

_checked: dict = {}  # (library handle, struct) -> True once its layout matched


def check_layout(lib: ctypes.CDLL, struct: type) -> None:
    """Raise LayoutError unless ``struct`` (a ctypes.Structure) has the size the library's
    ``lt_sizeof_<name>`` reports for the C struct of the same name (cpu_kernels.h's conventions)."""
    key = (lib._handle, struct)
    if key in _checked:
        return
    name = struct.__name__
    try:
        fn = getattr(lib, f"lt_sizeof_{name}")
    except AttributeError:
        raise LayoutError(f"lintrans native kernels: the library exports no lt_sizeof_{name}, so the layout of "
                          f"{name} cannot be checked") from None
    fn.restype, fn.argtypes = ctypes.c_int64, ()
    c_size, py_size = fn(), ctypes.sizeof(struct)
    if c_size != py_size:
        raise LayoutError(f"lintrans native kernels: struct {name} is {c_size} bytes in the C++ source but "
                          f"{py_size} in its ctypes binding: the two have gone out of step")
    _checked[key] = True


def call(name: str, dtype: torch.dtype, args: ctypes.Structure) -> None:
    """Run the kernel ``name`` (e.g. "lt_aft_simple_forward") for ``dtype`` on ``args``: its struct's
    layout checked against the library's on first use; a failed allocation inside raises MemoryError."""
    lib = library()
    if lib is None:
        raise RuntimeError("lintrans native kernels are not available (LINTRANS_NATIVE=0 or no build)")
    check_layout(lib, type(args))
    suffix = "f32" if dtype == torch.float32 else "f64"
    fn = getattr(lib, f"{name}_{suffix}")
    fn.restype = ctypes.c_int
    status = fn(ctypes.byref(args))
    if status == OUT_OF_MEMORY:
        raise MemoryError(f"lintrans native kernel {name}_{suffix}: out of memory for its buffers")
    if status != OK:
        raise RuntimeError(f"lintrans native kernel {name}_{suffix} failed (status {status})")
