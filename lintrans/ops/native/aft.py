"""ctypes bindings of aft.cpp: the fused CPU causal AFT-simple behind ``aft(variant="simple")``."""
from __future__ import annotations

import ctypes

import torch

from . import eager_only
from .binding import I3, P, call, empty, last_contiguous, ptr, require, takes

# steps between the carried sums forward saves for backward, which recomputes the steps between
# into buffers that stay in cache (STEPS x a thread's channels x 3 doubles)
CHECKPOINT_STEPS = 64

class AftArgs(ctypes.Structure):
    _fields_ = [(n, P) for n in ("q", "k", "v", "o", "ckpt", "dout", "dq", "dk", "dv")] + \
               [(n, ctypes.c_int64) for n in ("B", "T", "H", "D")] + \
               [(n, I3) for n in ("sq", "sk", "sv", "sdo")] + \
               [(n, ctypes.c_int64) for n in ("every", "threads")]


def supports(q, k, v) -> bool:
    """Whether the fused kernel can run this call (else the PyTorch paths do); builds it on first use."""
    return takes(q, k, v)


def _args(*xs: torch.Tensor) -> AftArgs:
    """Shapes and strides of the inputs xs [B, T, H, D]; when every one has its heads side by side
    (stride of H = D), H * D counts as one row of channels (longer vector loops, fewer tiles)."""
    B, T, H, D = xs[0].shape
    for x in xs:
        require(x.shape == xs[0].shape and x.dtype == xs[0].dtype and x.dtype in (torch.float32, torch.float64),
                f"q, k, v (and do) must be [B, T, H, D] alike in float32 or float64, got {tuple(x.shape)} {x.dtype}")
    a = AftArgs()
    merge = all(x.stride(2) == D or H == 1 for x in xs)
    a.B, a.T, a.H, a.D = (B, T, 1, H * D) if merge else (B, T, H, D)
    strides = [I3(x.stride(0), x.stride(1), 0 if merge else x.stride(2)) for x in xs]
    a.sq, a.sk, a.sv = strides[:3]
    if len(xs) > 3:
        a.sdo = strides[3]
    a.every, a.threads = CHECKPOINT_STEPS, torch.get_num_threads()
    return a


# torch.compile cannot trace a ctypes call: it runs these eagerly (a clean graph break), as chunked.py's
@eager_only
def forward(q, k, v, save: bool):
    """(o [B, T, H, D] contiguous, ckpt): ckpt, for backward (None unless ``save``), holds the carried
    sums every CHECKPOINT_STEPS steps, float64 [ncp, 3, B * H * D] (the kernel carries them in double)."""
    q, k, v = map(last_contiguous, (q, k, v))
    B, T, H, D = q.shape
    o = empty(q.shape, q)
    ckpt = empty((-(-T // CHECKPOINT_STEPS), 3, B * H * D), q, torch.float64) if save else None
    a = _args(q, k, v)
    a.q, a.k, a.v, a.o, a.ckpt = ptr(q), ptr(k), ptr(v), ptr(o), ptr(ckpt)
    call("lt_aft_simple_forward", q.dtype, a)
    return o, ckpt


@eager_only
def backward(q, k, v, ckpt, do):
    """(dq, dk, dv), each [B, T, H, D] contiguous; ckpt from forward (with the same CHECKPOINT_STEPS)."""
    q, k, v, do = map(last_contiguous, (q, k, v, do.to(q.dtype)))
    dq, dk, dv = (empty(q.shape, q) for _ in range(3))
    a = _args(q, k, v, do)
    require(ckpt is not None and ckpt.dtype == torch.float64 and ckpt.is_contiguous()
            and ckpt.shape == (-(-q.shape[1] // a.every), 3, q.numel() // q.shape[1]),
            "ckpt must be forward's checkpoints (forward(..., save=True)) for these inputs")
    a.q, a.k, a.v, a.ckpt, a.dout = ptr(q), ptr(k), ptr(v), ptr(ckpt), ptr(do)
    a.dq, a.dk, a.dv = ptr(dq), ptr(dk), ptr(dv)
    call("lt_aft_simple_backward", q.dtype, a)
    return dq, dk, dv
