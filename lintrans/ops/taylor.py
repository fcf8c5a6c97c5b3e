"""Taylor approximation of softmax attention, computed in attention form (the T x T matrix).

Order m replaces exp(s) by its Taylor polynomial sum_{n=0..m} s^n / n!. Order 2 is what the
``based`` feature map computes in linear time; higher orders approach softmax attention. This is a
quadratic-cost reference for tests and for studying the approximation, not a fast path.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .validation import autocast_off, check_bool, check_number, check_qkv, compute_dtype


def taylor_polynomial(s: torch.Tensor, order: int) -> torch.Tensor:
    """sum_{n=0..order} s^n / n!, by Horner's rule."""
    out = torch.ones_like(s)
    for n in range(order, 0, -1):
        out = 1.0 + out * s / n
    return out


def taylor_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    order: int = 2,
    causal: bool = True,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """q, k: [B, T, H, Dk], v: [B, T, H, Dv] -> o [B, T, H, Dv].

    o_i = sum_j p(s_ij) v_j / sum_j p(s_ij), s_ij = scale * q_i . k_j (scale defaults to 1/sqrt(Dk)),
    p the Taylor polynomial of exp of degree ``order``, j <= i when ``causal``. Even orders keep
    p > 0 everywhere; odd orders can make a row sum vanish (order 1 for s < -1) and give inf/nan.
    Computed in float32 (float64 for float64 inputs) and returned in q's dtype.
    """
    _, T, _, Dk, _ = check_qkv(q, k, v)
    check_number("order", order, integer=True, low=0)
    check_bool("causal", causal)
    check_number("scale", scale, allow_none=True)
    if scale is None:
        scale = 1.0 / math.sqrt(Dk)
    dtype = compute_dtype(q.dtype)
    with autocast_off(q.device):  # in that dtype under mixed precision too (autocast would make the products 16-bit)
        s = torch.einsum("bihd,bjhd->bhij", q.to(dtype), k.to(dtype)) * scale  # [B,H,T,T]
        sim = taylor_polynomial(s, order)
        if causal:
            sim = sim.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=q.device).tril(), 0.0)
        sim = sim / sim.sum(-1, keepdim=True)
        return torch.einsum("bhij,bjhd->bihd", sim, v.to(dtype)).to(q.dtype)
