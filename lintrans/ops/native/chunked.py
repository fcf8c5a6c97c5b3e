"""ctypes bindings of chunked.cpp: the fused CPU chunked form behind ``_ChunkedAttention``."""
from __future__ import annotations

import ctypes

import torch

from .binding import I3, P, call, empty, last_contiguous, ptr, strides, takes

# named feature maps the kernel applies itself (the codes of chunked.cpp's Phi)
PHI_CODES = {None: 0, "identity": 0, "elu": 1, "relu": 2, "softplus": 3}
# chunks between the states forward saves for backward (which recomputes the ones between)
CHECKPOINT_CHUNKS = 4

class ChunkedArgs(ctypes.Structure):
    _fields_ = [(n, P) for n in ("q", "k", "v", "ld", "S0", "o", "den", "states", "S_end", "dout", "dS_end",
                                  "dq", "dk", "dv", "dld", "dS0")] + \
               [(n, ctypes.c_int64) for n in ("B", "T", "H", "F", "Dv")] + \
               [(n, I3) for n in ("sq", "sk", "sv", "sld", "sdo")] + \
               [(n, ctypes.c_int64) for n in ("chunk", "ckpt", "phi", "normalize", "need_dld", "threads")] + \
               [("scale", ctypes.c_double), ("eps", ctypes.c_double)]


def supports(q, k, v, ld, feature_map, normalize, dtype) -> bool:
    """Whether the fused kernel can run this call (else the PyTorch blocks do); builds it on first use."""
    return (q.dtype == dtype and isinstance(normalize, bool) and feature_map in PHI_CODES
            and takes(q, k, v, *([] if ld is None else [ld])))


def _args(q, k, v, ld, chunk, phi, normalize, scale, eps) -> ChunkedArgs:
    B, T, H, F = q.shape
    a = ChunkedArgs()
    a.q, a.k, a.v, a.ld = ptr(q), ptr(k), ptr(v), ptr(ld)
    a.B, a.T, a.H, a.F, a.Dv = B, T, H, F, v.shape[-1]
    a.sq, a.sk, a.sv = strides(q), strides(k), strides(v)
    if ld is not None:
        s = ld.stride()
        a.sld = I3(0 if ld.shape[0] == 1 else s[0], s[1], s[2])  # a decay shared by the batch
    a.chunk, a.ckpt, a.phi, a.normalize = chunk, CHECKPOINT_CHUNKS, PHI_CODES[phi], int(normalize)
    a.threads = torch.get_num_threads()
    a.scale, a.eps = float(scale), float(eps)
    return a


# torch.compile cannot trace a ctypes call: it runs these eagerly (a clean graph break)
@torch.compiler.disable
def forward(q, k, v, ld, S0, chunk: int, phi, normalize: bool, scale: float, eps: float):
    """(o [B, T, H, Dv], den [B, T, H] or None, states [B, H, ncp, F, E], S_end [B, H, F, E])."""
    q, k, v = map(last_contiguous, (q, k, v))
    B, T, H, F = q.shape
    Dv = v.shape[-1]
    nck = -(-T // chunk)
    o = empty((B, T, H, Dv), q)
    den = empty((B, T, H), q) if normalize else None
    states = empty((B, H, -(-nck // CHECKPOINT_CHUNKS), F, Dv + 1), q)
    S0 = S0.contiguous()
    S_end = torch.empty_like(S0)
    a = _args(q, k, v, ld, chunk, phi, normalize, scale, eps)
    a.S0, a.o, a.den, a.states, a.S_end = ptr(S0), ptr(o), ptr(den), ptr(states), ptr(S_end)
    call("lt_chunked_forward", q.dtype, a)
    return o, den, states, S_end


@torch.compiler.disable
def backward(q, k, v, ld, o, den, states, do, dS_end, chunk: int, phi, normalize: bool, scale: float, eps: float,
             need_dld: bool):
    """(dq, dk, dv, dld or None, dS0), dld [B|1, T, H] as ld."""
    q, k, v, do = map(last_contiguous, (q, k, v, do))
    B, T, H, F = q.shape
    dq, dk, dv = empty(q.shape, q), empty(k.shape, q), empty(v.shape, q)
    dld = empty((B, T, H), q) if need_dld else None
    dS_end = dS_end.contiguous()
    dS0 = torch.empty_like(dS_end)
    a = _args(q, k, v, ld, chunk, phi, normalize, scale, eps)
    a.o, a.den, a.states, a.dout, a.dS_end = ptr(o), ptr(den), ptr(states), ptr(do), ptr(dS_end)
    a.sdo = strides(do)
    a.dq, a.dk, a.dv, a.dld, a.dS0, a.need_dld = ptr(dq), ptr(dk), ptr(dv), ptr(dld), ptr(dS0), int(need_dld)
    call("lt_chunked_backward", q.dtype, a)
    if dld is not None and ld.shape[0] == 1 and B > 1:
        dld = dld.sum(0, keepdim=True)
    return dq, dk, dv, dld, dS0
