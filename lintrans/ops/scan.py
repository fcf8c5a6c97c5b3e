"""A linear recurrence with decays <= 1, for all steps at once."""
from __future__ import annotations

import torch


def decayed_scan(g: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
    """X_t = g_t X_{t-1} + P_t with X_{-1} = 0, along dim 2, for all t at once (Hillis-Steele:
    log2(T) rounds, each combining every element with the one 2^r before it). g in (0, 1] with P's
    T along dim 2 (broadcastable against P [B, H, T, ...] in the other dims). Only products of gates
    (<= 1) are formed, so nothing overflows."""
    T = P.shape[2]
    if g.dim() < 3 or g.shape[2] != T:
        raise ValueError(f"g must have P's length {T} along dim 2, got shape {tuple(g.shape)}")
    d = 1
    while d < T:
        P = torch.cat([P[:, :, :d], P[:, :, d:] + g[:, :, d:] * P[:, :, :-d]], dim=2)
        g = torch.cat([g[:, :, :d], g[:, :, d:] * g[:, :, :-d]], dim=2)
        d *= 2
    return P
