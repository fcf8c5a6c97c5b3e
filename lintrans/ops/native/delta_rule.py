"""ctypes bindings of delta_rule.cpp: the fused CPU chunked delta rule behind ``delta_rule``."""
from __future__ import annotations

import ctypes

import torch

from . import binding, eager_only
from .binding import I3, P, blas_rows, call, empty, last_contiguous, ptr, require, strides, takes


class DeltaArgs(ctypes.Structure):
    _fields_ = [(n, P) for n in ("q", "k", "v", "beta", "ld", "S0", "o", "u", "states", "S_end", "dout", "dS_end",
                                  "dq", "dk", "dv", "dbeta", "dld", "dS0")] + \
               [(n, ctypes.c_int64) for n in ("B", "T", "H", "Dk", "Dv")] + \
               [(n, I3) for n in ("sq", "sk", "sv", "sbeta", "sld", "sdo")] + \
               [(n, ctypes.c_int64) for n in ("chunk", "l2", "threads")] + [("scale", ctypes.c_double)]


def supports(q, k, v, beta, ld) -> bool:
    """Whether the fused kernel can run this call (else the PyTorch form does); builds it on first use."""
    return takes(q, k, v, beta, *([] if ld is None else [ld]))


def _strides3(x: torch.Tensor):
    """Strides of a [B|1, T, H] tensor's dimensions, 0 for a batch of one shared by every batch entry."""
    s = x.stride()
    return I3(0 if x.shape[0] == 1 else s[0], s[1], s[2])


def _args(q, k, v, beta, ld, chunk: int, l2: bool, scale: float) -> DeltaArgs:
    require(q.dim() == 4 and k.shape == q.shape, f"q and k must be [B, T, H, Dk] alike, got {tuple(q.shape)}, {tuple(k.shape)}")
    require(v.dim() == 4 and v.shape[:3] == q.shape[:3], f"v must be [B, T, H, Dv] with q's B, T, H, got {tuple(v.shape)}")
    B, T, H, Dk = q.shape
    require(beta.shape == (B, T, H), f"beta must be [B, T, H], got {tuple(beta.shape)}")
    require(ld is None or (ld.dim() == 3 and ld.shape[0] in (1, B) and ld.shape[1:] == (T, H)),
            "log_decay must be [B or 1, T, H]")
    require(all(x.dtype == q.dtype for x in (k, v, beta, *([] if ld is None else [ld])))
            and q.dtype in (torch.float32, torch.float64), "q, k, v, beta, log_decay must share float32 or float64")
    require(isinstance(chunk, int) and chunk >= 1, f"chunk must be an int >= 1, got {chunk!r}")
    a = DeltaArgs()
    a.q, a.k, a.v, a.beta, a.ld = ptr(q), ptr(k), ptr(v), ptr(beta), ptr(ld)
    a.B, a.T, a.H, a.Dk, a.Dv = B, T, H, Dk, v.shape[-1]
    a.sq, a.sk, a.sv, a.sbeta = strides(q), strides(k), strides(v), _strides3(beta)
    if ld is not None:
        a.sld = _strides3(ld)
    a.chunk, a.l2, a.scale, a.threads = chunk, int(l2), float(scale), torch.get_num_threads()
    return a


def _states_shape(q, v, chunk):
    B, T, H, Dk = q.shape
    return (B, H, -(-T // chunk), Dk, v.shape[-1])


# torch.compile cannot trace a ctypes call: it runs these eagerly (a clean graph break)
@eager_only
def forward(q, k, v, beta, ld, S0, chunk: int, l2: bool, scale: float):
    """q, k [B, T, H, Dk] (L2-normalised here with ``l2``; q then times ``scale``), v [B, T, H, Dv], beta [B, T, H], ld
    [B|1, T, H] or None, S0 [B, H, Dk, Dv] -> (o [B, T, H, Dv], u (the values written, for backward; a head's rows
    contiguous) [B, H, T, Dv], states [B, H, nck, Dk, Dv], S_end)."""
    q, k, v = map(last_contiguous, (q, k, v))
    a = _args(q, k, v, beta, ld, chunk, l2, scale)
    B, T, H, Dk = q.shape
    S0 = S0.contiguous()
    require(S0.shape == (B, H, Dk, v.shape[-1]) and S0.dtype == q.dtype, f"S0 must be [B, H, Dk, Dv], got {tuple(S0.shape)}")
    o, u = empty((B, T, H, v.shape[-1]), q), empty((B, H, T, v.shape[-1]), q)
    states = empty(_states_shape(q, v, chunk), q)
    S_end = torch.empty_like(S0)
    a.S0, a.o, a.u, a.states, a.S_end = ptr(S0), ptr(o), ptr(u), ptr(states), ptr(S_end)
    call("lt_delta_forward", q.dtype, a)
    return o, u, states, S_end


@eager_only
def backward(q, k, v, beta, ld, u, states, do, dS_end, chunk: int, l2: bool, scale: float):
    """(dq, dk, dv, dbeta, dld or None, dS0), dld [B|1, T, H] as ld."""
    # the kernel gathers q, k, v row by row but hands do to BLAS in place
    q, k, v = map(last_contiguous, (q, k, v))
    do = blas_rows(do.to(q.dtype))
    a = _args(q, k, v, beta, ld, chunk, l2, scale)
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    require(do.shape == (B, T, H, Dv), f"do must be [B, T, H, Dv], got {tuple(do.shape)}")
    require(states.shape == _states_shape(q, v, chunk) and states.is_contiguous() and states.dtype == q.dtype,
            "states must be forward's")
    require(u.shape == (B, H, T, Dv) and u.is_contiguous() and u.dtype == q.dtype, "u must be forward's")
    dS_end = dS_end.to(q.dtype).contiguous()
    require(dS_end.shape == (B, H, Dk, Dv), "dS_end must be [B, H, Dk, Dv]")
    dq, dk, dv = empty(q.shape, q), empty(k.shape, q), empty(v.shape, q)
    dbeta = empty((B, T, H), q)
    dld = None if ld is None else empty((B, T, H), q)
    dS0 = torch.empty_like(dS_end)
    a.u, a.states, a.dout, a.dS_end, a.sdo = ptr(u), ptr(states), ptr(do), ptr(dS_end), strides(do)
    a.dq, a.dk, a.dv, a.dbeta, a.dld, a.dS0 = ptr(dq), ptr(dk), ptr(dv), ptr(dbeta), ptr(dld), ptr(dS0)
    call("lt_delta_backward", q.dtype, a)
    if dld is not None and ld.shape[0] == 1 and B > 1:
        dld = dld.sum(0, keepdim=True)
    return dq, dk, dv, dbeta, dld, dS0


class DeltaStepArgs(ctypes.Structure):
    _fields_ = [(n, P) for n in ("q", "k", "v", "beta", "ld", "S", "o", "S_out")] + \
               [(n, ctypes.c_int64) for n in ("B", "H", "Dk", "Dv", "ld_batch", "l2", "threads")] + \
               [("scale", ctypes.c_double)]


def step_supports(q, k, v, beta, ld, S) -> bool:
    """Whether ``step`` can run this decoding step: CPU tensors of one dtype (float32 or float64, the
    state's too) and nothing for autograd to record."""
    return binding.step_supports((q, k, v, beta, S) if ld is None else (q, k, v, beta, S, ld))


@eager_only
def step(q, k, v, beta, ld, S, l2: bool, scale: float):
    """One token of the delta rule: (o [B, H, Dv], S_out [B, H, Dk, Dv]); S is read only."""
    B, H, Dk = q.shape
    Dv = v.shape[-1]
    require(k.shape == q.shape and v.shape == (B, H, Dv) and beta.shape == (B, H) and S.shape == (B, H, Dk, Dv),
            f"q, k [B, H, Dk], v [B, H, Dv], beta [B, H], S [B, H, Dk, Dv] expected, got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}, {tuple(beta.shape)}, {tuple(S.shape)}")
    (q, k, v, beta, S), ld, ld_batch = binding.step_operands(dict(q=q, k=k, v=v, beta=beta, S=S), ld, B, H)
    o = empty((B, H, Dv), q)  # on the CPU whatever torch.set_default_device says: the kernel writes through it
    S_out = empty(S.shape, S)
    a = DeltaStepArgs(ptr(q), ptr(k), ptr(v), ptr(beta), ptr(ld), ptr(S), ptr(o), ptr(S_out), B, H, Dk, Dv,
                      ld_batch, int(l2), torch.get_num_threads(), float(scale))
    call("lt_delta_step", q.dtype, a)
    return o, S_out
