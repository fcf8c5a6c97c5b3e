"""Random q, k, v for the op tests ([B, T, H, Dk] and [B, T, H, Dv], float64 by default)."""
import torch


def random_qkv(B, T, H, Dk, Dv, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, Dk, generator=g, dtype=dtype) for _ in range(2))
    return q, k, torch.randn(B, T, H, Dv, generator=g, dtype=dtype)
