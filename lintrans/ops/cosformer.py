"""cosFormer (Qin et al. 2022): ReLU features re-weighted by cos(pi/2 * (i - j) / M), in linear time.

    s_ij = relu(q_i) . relu(k_j) * cos(pi/2 * (i - j) / M)
    o_i  = sum_j s_ij v_j / (sum_j s_ij + eps)          (j <= i when causal)

With a_i = pi/2 * i / M, cos(a_i - a_j) = cos a_i cos a_j + sin a_i sin a_j, so s_ij is the inner
product of the doubled features [relu(x) cos a, relu(x) sin a]: cosFormer is linear attention with
2D features, computed by ``linear_attention`` (chunked, any form) when causal and by two
contractions when not. Every weight is >= 0 while |i - j| < M. M is ``max_len``, or the length of
the call when ``max_len`` is None (the paper's choice); decoding with a constant-size state needs a
fixed ``max_len``, since every weight depends on M.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import torch

from .linear import linear_attention, linear_attention_step
from .validation import autocast_off, check_bool, check_number, check_positive_int, check_qkv, compute_dtype


class CosformerState(NamedTuple):
    """S [B, H, 2Dk, Dv] and z [B, H, 2Dk] of the doubled features (float32, float64 for float64
    inputs), and ``offset``: the tokens seen, i.e. the position of the next one."""

    S: torch.Tensor
    z: torch.Tensor
    offset: int


def _features(x: torch.Tensor, positions: torch.Tensor, M: int, dtype: torch.dtype) -> torch.Tensor:
    """x [..., T, H, D] with positions [T] -> [relu(x) cos a, relu(x) sin a] [..., T, H, 2D]."""
    a = (math.pi / 2) * positions.to(dtype) / M  # [T]
    r = torch.relu(x.to(dtype))
    return torch.cat([r * a.cos()[:, None, None], r * a.sin()[:, None, None]], dim=-1)


def _check_max_len(max_len, needed: int, what: str) -> None:
    check_number("max_len", max_len, integer=True, low=1, allow_none=True)
    if max_len is not None and needed > max_len:
        raise ValueError(f"max_len ({max_len}) must cover every position: {what} reaches {needed} tokens "
                         "(past M the cosine weights turn negative)")


def _check_state(state, B: int, H: int, Dk: int, Dv: int, dtype, device, arg: str) -> CosformerState:
    if not (isinstance(state, tuple) and len(state) == 3):
        raise TypeError(f"{arg} must be a CosformerState (S [B, H, 2Dk, Dv], z [B, H, 2Dk], offset) or None")
    S, z, offset = state
    check_number(f"{arg} offset", offset, integer=True, low=0)
    for name, x, shape in ((f"{arg} S", S, (B, H, 2 * Dk, Dv)), (f"{arg} z", z, (B, H, 2 * Dk))):
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape:
            raise ValueError(f"{name} must be a tensor of shape {list(shape)}, got {tuple(getattr(x, 'shape', ()))}")
        if x.dtype != dtype or x.device != device:
            raise TypeError(f"{name} must be {dtype} on {device}, got {x.dtype} on {x.device}")
    return CosformerState(S, z, offset)


def cosformer_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    max_len: Optional[int] = None,
    eps: float = 1e-6,
    initial_state: Optional[CosformerState] = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> Tuple[torch.Tensor, Optional[CosformerState]]:
    """q, k: [B, T, H, Dk], v: [B, T, H, Dv] -> (o [B, T, H, Dv], state).

    max_len: M of the cosine, None for the length of this call (the paper's default); a fixed value
    (>= every position) is what makes a sequence splittable across calls and steps. The state
    (causal only) continues the sequence in a later call or in ``cosformer_step``. Computed in
    float32 (float64 for float64 inputs) and returned in q's dtype.
    """
    B, T, H, Dk, Dv = check_qkv(q, k, v)
    check_bool("causal", causal)
    check_bool("output_final_state", output_final_state)
    if chunk_size != "auto":  # as linear_attention takes it; checked where the call has no use for it too
        check_positive_int("chunk_size", chunk_size)
    check_number("eps", eps, low=0)
    dtype = compute_dtype(q.dtype)
    offset = 0
    if initial_state is not None or output_final_state:
        if not causal:
            raise ValueError("initial_state and output_final_state need causal=True (a non-causal call sees "
                             "the whole sequence)")
        if max_len is None:
            raise ValueError("initial_state and output_final_state need a fixed max_len: every weight depends "
                             "on M, so a sequence split across calls must share it")
    if initial_state is not None:
        S0, z0, offset = _check_state(initial_state, B, H, Dk, Dv, dtype, q.device, "initial_state")
    _check_max_len(max_len, offset + T, "this call")
    M = max_len if max_len is not None else T
    pos = torch.arange(offset, offset + T, device=q.device)
    fq, fk = _features(q, pos, M, dtype), _features(k, pos, M, dtype)  # [B,T,H,2Dk]
    if not causal:
        with autocast_off(q.device):  # in dtype under mixed precision too, as the causal form's op keeps it
            kv = torch.einsum("bthf,bthd->bhfd", fk, v.to(dtype))  # [B,H,2Dk,Dv]
            num = torch.einsum("bthf,bhfd->bthd", fq, kv)
            den = torch.einsum("bthf,bhf->bth", fq, fk.sum(1))  # [B,T,H]
        return (num / (den[..., None] + eps)).to(q.dtype), None
    o, state = linear_attention(fq, fk, v.to(dtype), feature_map="identity", normalize=True, eps=eps,
                                chunk_size=chunk_size, output_final_state=output_final_state,
                                initial_state=None if initial_state is None else (S0, z0))
    final = CosformerState(*state, offset + T) if output_final_state else None
    return o.to(q.dtype), final


def cosformer_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: Optional[CosformerState] = None,
    *,
    max_len: int,
    eps: float = 1e-6,
) -> Tuple[torch.Tensor, CosformerState]:
    """One token, for decoding: q, k [B, H, Dk], v [B, H, Dv] -> (o [B, H, Dv], state). Constant
    cost and memory; ``max_len`` fixed (and >= the positions decoded), as in the full call."""
    B, _, H, Dk, Dv = check_qkv(q, k, v, layout="[B, H, D]")
    check_number("eps", eps, low=0)
    dtype = compute_dtype(q.dtype)
    offset, inner = 0, None
    if state is not None:
        S, z, offset = _check_state(state, B, H, Dk, Dv, dtype, q.device, "state")
        inner = (S, z)
    if max_len is None:
        raise ValueError("cosformer_step needs a fixed max_len (the M the whole sequence uses)")
    _check_max_len(max_len, offset + 1, "decoding")
    # _features for one position, its angle a Python number: no tensor from a list, no cos/sin kernels,
    # q and k in one pass (a decoding step's cost is its count of small ops)
    a = (math.pi / 2) * offset / max_len
    r = torch.relu(torch.stack([q, k]).to(dtype))  # [2,B,H,Dk]
    fq, fk = torch.cat([r * math.cos(a), r * math.sin(a)], dim=-1).unbind(0)  # [B,H,2Dk] each
    o, (S, z) = linear_attention_step(fq, fk, v.to(dtype), inner, feature_map="identity", normalize=True, eps=eps)
    return o.to(q.dtype), CosformerState(S, z, offset + 1)


def cosformer_attention_reference(q, k, v, *, causal=True, max_len=None, eps=1e-6, offset=0) -> torch.Tensor:
    """The explicit O(T^2) double sum in float64, for tests: positions start at ``offset``."""
    q, k, v = q.double(), k.double(), v.double()
    T = q.shape[1]
    M = max_len if max_len is not None else T
    i = torch.arange(offset, offset + T, dtype=torch.float64)
    w = torch.cos((math.pi / 2) * (i[:, None] - i[None, :]) / M)  # [T,T]
    s = torch.einsum("bihd,bjhd->bhij", torch.relu(q), torch.relu(k)) * w
    if causal:
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), 0.0)
    return torch.einsum("bhij,bjhd->bihd", s, v) / (s.sum(-1).transpose(1, 2)[..., None] + eps)
