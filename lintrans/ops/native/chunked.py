"""ctypes bindings of chunked.cpp: the fused CPU chunked form behind ``_ChunkedAttention``."""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from . import enabled, library

# named feature maps the kernel applies itself (the codes of chunked.cpp's Phi)
PHI_CODES = {None: 0, "identity": 0, "elu": 1, "relu": 2, "softplus": 3}
# chunks between the states forward saves for backward (which recomputes the ones between)
CHECKPOINT_CHUNKS = 16

_p = ctypes.c_void_p
_i3 = ctypes.c_int64 * 3


class ChunkedArgs(ctypes.Structure):
    _fields_ = [(n, _p) for n in ("q", "k", "v", "ld", "S0", "o", "den", "states", "S_end", "dout", "dS_end",
                                  "dq", "dk", "dv", "dld", "dS0")] + \
               [(n, ctypes.c_int64) for n in ("B", "T", "H", "F", "Dv")] + \
               [(n, _i3) for n in ("sq", "sk", "sv", "sld", "sdo")] + \
               [(n, ctypes.c_int64) for n in ("chunk", "ckpt", "phi", "normalize", "need_dld", "threads")] + \
               [("scale", ctypes.c_double), ("eps", ctypes.c_double)]


def supports(q, k, v, ld, feature_map, normalize, dtype) -> bool:
    """Whether the fused kernel can run this call (else the PyTorch blocks do); builds it on first use."""
    return (q.device.type == "cpu" and dtype in (torch.float32, torch.float64)
            and q.dtype == k.dtype == v.dtype == dtype and (ld is None or ld.dtype == dtype)
            and isinstance(normalize, bool) and feature_map in PHI_CODES and enabled()
            and library() is not None)


def _ptr(x: Optional[torch.Tensor]):
    return None if x is None else x.data_ptr()


def _strides(x: torch.Tensor):
    return _i3(*x.stride()[:3])


def _last_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _args(q, k, v, ld, chunk, phi, normalize, scale, eps) -> ChunkedArgs:
    B, T, H, F = q.shape
    a = ChunkedArgs()
    a.q, a.k, a.v, a.ld = _ptr(q), _ptr(k), _ptr(v), _ptr(ld)
    a.B, a.T, a.H, a.F, a.Dv = B, T, H, F, v.shape[-1]
    a.sq, a.sk, a.sv = _strides(q), _strides(k), _strides(v)
    if ld is not None:
        s = ld.stride()
        a.sld = _i3(0 if ld.shape[0] == 1 else s[0], s[1], s[2])  # a decay shared by the batch
    a.chunk, a.ckpt, a.phi, a.normalize = chunk, CHECKPOINT_CHUNKS, PHI_CODES[phi], int(normalize)
    a.threads = torch.get_num_threads()
    a.scale, a.eps = float(scale), float(eps)
    return a


def _suffix(dtype) -> str:
    return "f32" if dtype == torch.float32 else "f64"


# torch.compile cannot trace a ctypes call: it runs these eagerly (a clean graph break)
@torch.compiler.disable
def forward(q, k, v, ld, S0, chunk: int, phi, normalize: bool, scale: float, eps: float):
    """(o [B, T, H, Dv], den [B, T, H] or None, states [B, H, ncp, F, E], S_end [B, H, F, E])."""
    q, k, v = map(_last_contiguous, (q, k, v))
    B, T, H, F = q.shape
    Dv = v.shape[-1]
    nck = -(-T // chunk)
    o = q.new_empty(B, T, H, Dv)
    den = q.new_empty(B, T, H) if normalize else None
    states = q.new_empty(B, H, -(-nck // CHECKPOINT_CHUNKS), F, Dv + 1)
    S0 = S0.contiguous()
    S_end = torch.empty_like(S0)
    a = _args(q, k, v, ld, chunk, phi, normalize, scale, eps)
    a.S0, a.o, a.den, a.states, a.S_end = _ptr(S0), _ptr(o), _ptr(den), _ptr(states), _ptr(S_end)
    getattr(library(), f"lt_chunked_forward_{_suffix(q.dtype)}")(ctypes.byref(a))
    return o, den, states, S_end


@torch.compiler.disable
def backward(q, k, v, ld, o, den, states, do, dS_end, chunk: int, phi, normalize: bool, scale: float, eps: float,
             need_dld: bool):
    """(dq, dk, dv, dld or None, dS0), dld [B|1, T, H] as ld."""
    q, k, v, do = map(_last_contiguous, (q, k, v, do))
    B, T, H, F = q.shape
    dq, dk, dv = q.new_empty(q.shape), q.new_empty(k.shape), q.new_empty(v.shape)
    dld = q.new_empty(B, T, H) if need_dld else None
    dS_end = dS_end.contiguous()
    dS0 = torch.empty_like(dS_end)
    a = _args(q, k, v, ld, chunk, phi, normalize, scale, eps)
    a.o, a.den, a.states, a.dout, a.dS_end = _ptr(o), _ptr(den), _ptr(states), _ptr(do), _ptr(dS_end)
    a.sdo = _strides(do)
    a.dq, a.dk, a.dv, a.dld, a.dS0, a.need_dld = _ptr(dq), _ptr(dk), _ptr(dv), _ptr(dld), _ptr(dS0), int(need_dld)
    getattr(library(), f"lt_chunked_backward_{_suffix(q.dtype)}")(ctypes.byref(a))
    if dld is not None and ld.shape[0] == 1 and B > 1:
        dld = dld.sum(0, keepdim=True)
    return dq, dk, dv, dld, dS0
