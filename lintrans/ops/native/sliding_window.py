"""ctypes bindings of sliding_window.cpp: the fused CPU causal sliding window behind ``_SlidingWindowCausal``."""
from __future__ import annotations

import ctypes

import torch

from . import eager_only
from .binding import I3, P, blas_rows, call, empty, ptr, require, strides, takes

# query rows per block: a block's scores (BLOCK x (BLOCK + window - 1)) stay in cache
BLOCK = 64

class SlidingWindowArgs(ctypes.Structure):
    _fields_ = [(n, P) for n in ("q", "k", "v", "o", "lse", "dout", "dq", "dk", "dv")] + \
               [(n, ctypes.c_int64) for n in ("B", "T", "H", "Dk", "Dv")] + \
               [(n, I3) for n in ("sq", "sk", "sv", "sdo")] + \
               [(n, ctypes.c_int64) for n in ("block", "window", "threads")] + \
               [("scale", ctypes.c_double)]


def supports(q, k, v) -> bool:
    """Whether the fused kernel can run this call (else the PyTorch blocks do); builds it on first use."""
    return takes(q, k, v)


def _args(q, k, v, window: int, scale: float) -> SlidingWindowArgs:
    require(q.dim() == 4 and k.shape == q.shape, f"q and k must be [B, T, H, Dk] alike, got {tuple(q.shape)} and {tuple(k.shape)}")
    require(v.dim() == 4 and v.shape[:3] == q.shape[:3], f"v must be [B, T, H, Dv] with q's B, T, H, got {tuple(v.shape)}")
    require(q.dtype == k.dtype == v.dtype and q.dtype in (torch.float32, torch.float64),
            f"q, k, v must share one dtype, float32 or float64, got {q.dtype}, {k.dtype}, {v.dtype}")
    require(isinstance(window, int) and window >= 1, f"window must be an int >= 1, got {window!r}")
    B, T, H, Dk = q.shape
    a = SlidingWindowArgs()
    a.q, a.k, a.v = ptr(q), ptr(k), ptr(v)
    a.B, a.T, a.H, a.Dk, a.Dv = B, T, H, Dk, v.shape[-1]
    a.sq, a.sk, a.sv = map(strides, (q, k, v))
    # a window of T or more is full causal attention: the kernel sees at most T, so a huge int can
    # neither wrap in int64 nor overflow the kernel's index sums
    a.block, a.window, a.threads = BLOCK, max(1, min(window, T)), torch.get_num_threads()
    a.scale = float(scale)
    return a


# torch.compile cannot trace a ctypes call: it runs these eagerly (a clean graph break), as chunked.py's
@eager_only
def forward(q, k, v, window: int, scale: float):
    """(o [B, T, H, Dv] contiguous, lse [B, H, T], each row's base-2 logsumexp, for backward)."""
    q, k, v = map(blas_rows, (q, k, v))
    B, T, H, _ = q.shape
    o = empty((B, T, H, v.shape[-1]), q)
    lse = empty((B, H, T), q)
    a = _args(q, k, v, window, scale)
    a.o, a.lse = ptr(o), ptr(lse)
    call("lt_sliding_window_forward", q.dtype, a)
    return o, lse


@eager_only
def backward(q, k, v, o, lse, do, window: int, scale: float):
    """(dq, dk, dv), contiguous; o and lse from forward."""
    q, k, v, do = map(blas_rows, (q, k, v, do.to(q.dtype)))
    dq, dk, dv = empty(q.shape, q), empty(k.shape, q), empty(v.shape, q)
    a = _args(q, k, v, window, scale)
    B, T, H, _ = q.shape
    require(do.shape == (B, T, H, v.shape[-1]), f"do must be [B, T, H, Dv], got {tuple(do.shape)}")
    require(o.shape == do.shape and o.is_contiguous() and lse.shape == (B, H, T) and lse.is_contiguous()
            and o.dtype == lse.dtype == q.dtype, "o and lse must be forward's")
    a.o, a.lse, a.dout = ptr(o), ptr(lse), ptr(do)
    a.sdo = strides(do)
    a.dq, a.dk, a.dv = ptr(dq), ptr(dk), ptr(dv)
    call("lt_sliding_window_backward", q.dtype, a)
    return dq, dk, dv
