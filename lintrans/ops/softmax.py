"""Softmax attention, the baseline every efficient mechanism is compared with."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from .validation import check_bool, check_number, check_qkv


def softmax_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, scale: Optional[float] = None
) -> torch.Tensor:
    """Scaled dot-product attention via PyTorch SDPA. q, k: [B, T, H, Dk], v: [B, T, H, Dv] -> o [B, T, H, Dv]."""
    check_qkv(q, k, v)
    check_bool("causal", causal)
    check_number("scale", scale, allow_none=True)  # a NaN or inf scale would give NaN outputs, silently
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, scale=scale
    )  # [B,H,T,Dv]
    return o.transpose(1, 2)


def softmax_attention_reference(q, k, v, *, causal: bool = True, scale: Optional[float] = None) -> torch.Tensor:
    """Plain float64 softmax attention for tests."""
    q, k, v = q.double(), k.double(), v.double()
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if causal:
        T = q.shape[1]
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("bhij,bjhd->bihd", s.softmax(-1), v)
