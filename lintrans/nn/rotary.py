"""Rotary position embeddings (RoPE; Su et al., RoFormer) for the queries and keys of attention.

Channel pairs are half-split as in Hugging Face Llama and GPT-NeoX: channel i of a head pairs with
channel i + D/2, and the pair at absolute position p turns by p * base^(-2i/D). The dot product of
a rotated query at position m and a rotated key at position n then depends on the positions only
through m - n. Positions are absolute, so a KV cache stores keys already rotated and a decoding
step rotates its query and key at ``past``, the number of tokens the cache covers.
"""
from __future__ import annotations

import torch

ROPE_BASE = 10000.0


def rope_tables(positions: torch.Tensor, head_dim: int, base: float = ROPE_BASE,
                dtype: torch.dtype = torch.float32):
    """cos and sin [T, head_dim] for integer ``positions`` [T] (angles computed in float64)."""
    if head_dim % 2:
        raise ValueError(f"rotary position embeddings need an even head_dim, got {head_dim}")
    half = head_dim // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float64, device=positions.device) * 2 / head_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # [T, D/2]
    angles = torch.cat([angles, angles], dim=-1)  # channel i and i + D/2 share an angle
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D] rotated by the tables [T, D] of its positions."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)  # [T, 1, D]: broadcast over heads
    return x * c + rotated * s
