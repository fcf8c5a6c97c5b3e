"""Other implementations of causal linear attention, timed beside ours when installed.

Optional peers (docs/benchmarks.md says how to install each):

* fast-transformers' CPU causal-product kernel (Katharopoulos et al.), wrapped to compute exactly
  ``linear_attention`` with the same feature map.
* flash-linear-attention's Triton kernel ``chunk_simple_gla``, through ``linear_attention(...,
  backend="fla")`` (on CUDA only), ungated and with the gate of ``linear chunked gated``; and its
  ``chunk_gated_delta_rule`` with the gates of ``gated-delta``.
* Hugging Face transformers' pure-PyTorch Gated DeltaNet (Qwen3-Next's fallback).
* the reference implementation of Manifest's ``retention`` (``retention.reference``): symmetric power
  retention of degree 2 without gating, which is causal linear attention with the squared feature
  map ``(q . k / sqrt(d))^2``. Ours computes it with ``squared_features`` and the chunked form, and
  the benchmark times the pair side by side at the same chunk size.
"""
from __future__ import annotations

import math
from typing import Callable

# the chunk both retention series use; retention pads T up to a multiple of it
RETENTION_CHUNK = 128
RETENTION_SERIES = "retention reference (power 2)"
POWER2_SERIES = "linear chunked, power-2 features"
# series that exist to be read beside a peer: ``--ops`` selects them through the peer's name only,
# so that asking for "chunked" does not also run the (much slower) power-2 feature map
COMPANION_OF = {POWER2_SERIES: RETENTION_SERIES}


FLA_SERIES = "fla chunk_simple_gla (backend='fla')"
FLA_GATED_SERIES = "fla chunk_simple_gla gated (backend='fla')"
FLA_DELTA_SERIES = "fla chunk_gated_delta_rule"


def peer_ops(feature_map: str = "elu", device: str = "cpu") -> dict[str, Callable]:
    """name -> fn(q, k, v) -> o on [B, T, H, D], for every peer that imports here and runs on ``device``.

    The fast-transformers entry computes what ``linear_attention(feature_map=feature_map)`` does;
    the retention entry comes with the lintrans op that computes the same thing.
    """
    out: dict[str, Callable] = {}
    out.update(_fast_transformers(feature_map))
    out.update(_retention())
    out.update(_transformers_delta())
    if str(device).startswith("cuda"):
        out.update(_fla(feature_map))
        out.update(_fla_delta())
    return out


TRANSFORMERS_DELTA_SERIES = "transformers torch_chunk_gated_delta_rule"


def _transformers_delta() -> dict[str, Callable]:
    """Hugging Face transformers' pure-PyTorch Gated DeltaNet (its fallback where fla is missing, as on
    every CPU), with the gates of our ``gated-delta`` series (``lintrans.bench.ops.delta_gates``)."""
    try:
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
    except ImportError:
        return {}
    from .ops import delta_gates

    def fn(q, k, v):
        beta, log_decay = delta_gates(q)
        return torch_chunk_gated_delta_rule(q, k, v, log_decay, beta, use_qk_l2norm_in_kernel=True)[0]

    return {TRANSFORMERS_DELTA_SERIES: fn}


def _fla(feature_map: str) -> dict[str, Callable]:
    """Our dispatch to fla's kernel: the same feature map and normaliser as ``linear chunked``, and the
    same gate as ``linear chunked gated`` (``lintrans.bench.ops._gated`` serves both)."""
    try:
        import fla  # noqa: F401
    except ImportError:
        return {}
    from lintrans.ops import linear_attention

    from .ops import _gated

    return {FLA_SERIES: lambda q, k, v: linear_attention(q, k, v, feature_map=feature_map, backend="fla")[0],
            FLA_GATED_SERIES: _gated(64, feature_map, backend="fla")}  # fla picks its own chunk


def _fla_delta() -> dict[str, Callable]:
    """flash-linear-attention's Triton Gated DeltaNet, with the gates of our ``gated-delta`` series."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # not installed, or its import (Triton) fails here
        return {}
    from .ops import delta_gates

    def fn(q, k, v):
        beta, log_decay = delta_gates(q)
        return chunk_gated_delta_rule(q, k, v, log_decay, beta, use_qk_l2norm_in_kernel=True)[0]

    return {FLA_DELTA_SERIES: fn}


def _fast_transformers(feature_map: str) -> dict[str, Callable]:
    try:
        from fast_transformers.causal_product import causal_dot_product
    except ImportError:
        return {}
    import torch

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

    return {"fast-transformers causal_product": fast_transformers_causal}


def power2_feature_map(x):
    """phi(q) . phi(k) = (q . k / sqrt(d))^2: the feature map of degree-2 power retention."""
    from lintrans.ops.feature_maps import squared_features

    return squared_features(x * x.shape[-1] ** -0.25)  # [..., d(d+1)/2]


def power2_linear_attention(q, k, v, chunk_size: int = RETENTION_CHUNK):
    """Our chunked linear attention computing retention's degree-2 power retention (no gating).

    eps=0: retention adds its 1e-6 to a row sum scaled so that its largest term is 1, i.e. relative to
    the row, where our eps is absolute; with squared scores the first tokens' sums can be that small.
    """
    from lintrans.ops import linear_attention

    return linear_attention(q, k, v, feature_map=power2_feature_map, form="chunked", chunk_size=chunk_size,
                            eps=0.0)[0]


def _retention() -> dict[str, Callable]:
    try:
        from retention.reference import power_retention
    except Exception:  # not installed, or its package import (which loads Triton) fails here
        return {}

    def retention_reference(q, k, v):
        return power_retention(q, k, v, deg=2, scale=1.0 / math.sqrt(q.shape[-1]), chunk_size=RETENTION_CHUNK)

    return {RETENTION_SERIES: retention_reference, POWER2_SERIES: power2_linear_attention}
