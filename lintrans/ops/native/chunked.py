"""ctypes bindings of chunked.cpp: the fused CPU chunked form behind ``ChunkedAttention`` (ops/linear/chunked.py)."""
from __future__ import annotations

import ctypes

import torch

from . import binding, eager_only
from .binding import I3, P, call, empty, last_contiguous, ptr, require, strides, takes

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


def _check(q, k, v, ld, chunk, phi) -> None:
    """What the kernel takes for granted (callers validate user input; these guard memory)."""
    require(q.dim() == 4 and k.shape == q.shape, f"q and k must be [B, T, H, F] alike, got {tuple(q.shape)} and {tuple(k.shape)}")
    require(v.dim() == 4 and v.shape[:3] == q.shape[:3], f"v must be [B, T, H, Dv] with q's B, T, H, got {tuple(v.shape)}")
    require(q.dtype == k.dtype == v.dtype and q.dtype in (torch.float32, torch.float64),
            f"q, k, v must share one dtype, float32 or float64, got {q.dtype}, {k.dtype}, {v.dtype}")
    require(ld is None or (ld.dim() == 3 and ld.shape[0] in (1, q.shape[0]) and ld.shape[1:] == q.shape[1:3]
                           and ld.dtype == q.dtype), "log_decay must be [B or 1, T, H] in q's dtype")
    require(isinstance(chunk, int) and chunk >= 1, f"chunk must be an int >= 1, got {chunk!r}")
    require(phi in PHI_CODES, f"feature map {phi!r} has no kernel code; allowed: {sorted(map(str, PHI_CODES))}")


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
@eager_only
def forward(q, k, v, ld, S0, chunk: int, phi, normalize: bool, scale: float, eps: float):
    """(o [B, T, H, Dv], den [B, T, H] or None, states [B, H, ncp, F, E], S_end [B, H, F, E])."""
    _check(q, k, v, ld, chunk, phi)
    q, k, v = map(last_contiguous, (q, k, v))
    B, T, H, F = q.shape
    Dv = v.shape[-1]
    nck = -(-T // chunk)
    o = empty((B, T, H, Dv), q)
    den = empty((B, T, H), q) if normalize else None
    states = empty((B, H, -(-nck // CHECKPOINT_CHUNKS), F, Dv + 1), q)
    S0 = S0.contiguous()
    require(S0.shape == (B, H, F, Dv + 1) and S0.dtype == q.dtype, f"S0 must be [B, H, F, Dv + 1], got {tuple(S0.shape)}")
    S_end = torch.empty_like(S0)
    a = _args(q, k, v, ld, chunk, phi, normalize, scale, eps)
    a.S0, a.o, a.den, a.states, a.S_end = ptr(S0), ptr(o), ptr(den), ptr(states), ptr(S_end)
    call("lt_chunked_forward", q.dtype, a)
    return o, den, states, S_end


@eager_only
def backward(q, k, v, ld, o, den, states, do, dS_end, chunk: int, phi, normalize: bool, scale: float, eps: float,
             need_dld: bool):
    """(dq, dk, dv, dld or None, dS0), dld [B|1, T, H] as ld."""
    _check(q, k, v, ld, chunk, phi)
    q, k, v, do = map(last_contiguous, (q, k, v, do.to(q.dtype)))
    B, T, H, F = q.shape
    dq, dk, dv = empty(q.shape, q), empty(k.shape, q), empty(v.shape, q)
    dld = empty((B, T, H), q) if need_dld else None
    Dv, nck = v.shape[-1], -(-T // chunk)
    require(do.shape == (B, T, H, Dv), f"do must be [B, T, H, Dv], got {tuple(do.shape)}")
    require(o.shape == (B, T, H, Dv) and o.is_contiguous() and o.dtype == q.dtype, "o must be forward's output")
    require(states.shape == (B, H, -(-nck // CHECKPOINT_CHUNKS), F, Dv + 1) and states.is_contiguous()
            and states.dtype == q.dtype, "states must be forward's, for the same chunk size")
    require(not normalize or (den is not None and den.shape == (B, T, H) and den.is_contiguous()
                              and den.dtype == q.dtype),
            "den must be forward's [B, T, H] when normalize")
    require(not need_dld or ld is not None, "need_dld without a log_decay")
    dS_end = dS_end.contiguous()
    require(dS_end.shape == (B, H, F, Dv + 1) and dS_end.dtype == q.dtype, "dS_end must be [B, H, F, Dv + 1]")
    dS0 = torch.empty_like(dS_end)
    a = _args(q, k, v, ld, chunk, phi, normalize, scale, eps)
    a.o, a.den, a.states, a.dout, a.dS_end = ptr(o), ptr(den), ptr(states), ptr(do), ptr(dS_end)
    a.sdo = strides(do)
    a.dq, a.dk, a.dv, a.dld, a.dS0, a.need_dld = ptr(dq), ptr(dk), ptr(dv), ptr(dld), ptr(dS0), int(need_dld)
    call("lt_chunked_backward", q.dtype, a)
    if dld is not None and ld.shape[0] == 1 and B > 1:
        dld = dld.sum(0, keepdim=True)
    return dq, dk, dv, dld, dS0


class StepArgs(ctypes.Structure):
    _fields_ = [(n, P) for n in ("q", "k", "v", "ld", "S", "z", "o", "S_out", "z_out")] + \
               [(n, ctypes.c_int64) for n in ("B", "H", "F", "Dv", "ld_batch", "phi", "normalize", "threads")] + \
               [("scale", ctypes.c_double), ("eps", ctypes.c_double)]


def step_supports(q, k, v, ld, S, z, feature_map) -> bool:
    """Whether ``step`` can run this decoding step: a named map with a kernel code, CPU tensors of one
    dtype (float32 or float64, the state's too) and nothing for autograd to record."""
    named = (feature_map is None or isinstance(feature_map, str)) and feature_map in PHI_CODES
    return binding.step_supports((q, k, v, S, z) if ld is None else (q, k, v, S, z, ld), named)


@eager_only
def step(q, k, v, ld, S, z, phi, normalize: bool, scale: float, eps: float):
    """One token of the recurrence: (o [B, H, Dv], S_out [B, H, F, Dv], z_out [B, H, F]); S and z are read only."""
    B, H, F = q.shape
    Dv = v.shape[-1]
    require(k.shape == q.shape and v.shape == (B, H, Dv) and S.shape == (B, H, F, Dv) and z.shape == (B, H, F),
            f"q, k [B, H, F], v [B, H, Dv], S [B, H, F, Dv], z [B, H, F] expected, got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}, {tuple(S.shape)}, {tuple(z.shape)}")
    (q, k, v, S, z), ld, ld_batch = binding.step_operands(dict(q=q, k=k, v=v, S=S, z=z), ld, B, H)
    o = empty((B, H, Dv), q)  # on the CPU whatever torch.set_default_device says: the kernel writes through it
    S_out, z_out = empty(S.shape, S), empty(z.shape, z)
    a = StepArgs(ptr(q), ptr(k), ptr(v), ptr(ld), ptr(S), ptr(z), ptr(o), ptr(S_out), ptr(z_out), B, H, F, Dv,
                 ld_batch, PHI_CODES[phi], int(normalize), torch.get_num_threads(), float(scale), float(eps))
    call("lt_linear_step", q.dtype, a)
    return o, S_out, z_out
