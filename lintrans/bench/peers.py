"""Other implementations of the same causal linear attention, timed beside ours when installed.

Optional extra ``peers``: fast-transformers' causal-product kernel (Katharopoulos et al.; the sdist
builds on CPU torch with ``pip install --no-build-isolation`` and nvcc hidden from PATH).
Manifest's ``retention`` package is not wired in: its ``__init__`` imports its Triton kernels, so
even the reference implementation needs Triton, and it computes symmetric power retention
(a different feature map and an output norm), not this op.
"""
from __future__ import annotations

from typing import Callable


def peer_ops(feature_map: str = "elu") -> dict[str, Callable]:
    """name -> fn(q, k, v) -> o on [B, T, H, D], computing what ``linear_attention`` computes."""
    out: dict[str, Callable] = {}
    try:
        from fast_transformers.causal_product import causal_dot_product
    except ImportError:
        return out
    from lintrans.ops import resolve_feature_map

    phi_q, phi_k = resolve_feature_map(feature_map)

    def fast_transformers_causal(q, k, v, eps: float = 1e-6):
        fq, fk = phi_q(q), phi_k(k)  # [B,T,H,F]
        # normaliser as in fast_transformers.attention.CausalLinearAttention
        z = 1.0 / (torch.einsum("bthf,bthf->bth", fq, fk.cumsum(1)) + eps)  # [B,T,H]
        num = causal_dot_product(
            fq.permute(0, 2, 1, 3).contiguous(), fk.permute(0, 2, 1, 3).contiguous(),
            v.permute(0, 2, 1, 3).contiguous(),
        )  # [B,H,T,Dv]
        return num.permute(0, 2, 1, 3) * z[..., None]

    import torch

    out["fast-transformers causal_product"] = fast_transformers_causal
    return out
