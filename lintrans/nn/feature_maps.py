"""Learnable and random feature maps for linear attention, as modules ``[..., D] -> [..., F]``.

Each module works wherever the ops take a ``feature_map``: pass one module when queries and keys
share the map (``feature_map=Performer(d, m)``, which they must for FAVOR+), or a pair
``(phi_q, phi_k)`` when they have their own (``feature_map=(ReBased(d), ReBased(d))``, as in the
ReBased and Hedgehog papers). Every map acts on each position alone, so it is causal-safe and
``linear_attention_step`` with the same module reproduces the full forward token by token.

With ``num_heads`` set, the parameters are per head and the input must be ``[..., H, D]``
(``[B, T, H, D]`` in the ops, ``[B, H, D]`` in the step).
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.validation import (FLOAT_DTYPES, autocast_off, check_bool, check_number, check_positive_int, check_tensor,
                              compute_dtype)
from ..ops.feature_maps import feature_dim_for, resolve_feature_map, squared_feature_dim, squared_features

__all__ = [
    "ReBased",
    "Hedgehog",
    "Performer",
    "feature_dim_for",
    "attention_weights",
    "softmax_attention_weights",
    "hedgehog_distillation_loss",
    "distill_feature_maps",
]


def _check_input(module: nn.Module, x) -> None:
    name = type(module).__name__
    if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{name} input must be a floating torch.Tensor, got {got}")
    if x.dim() < 1 or x.shape[-1] != module.head_dim:
        raise ValueError(f"{name} input must end in head_dim={module.head_dim}, got shape {tuple(x.shape)}")
    if module.num_heads is not None and (x.dim() < 2 or x.shape[-2] != module.num_heads):
        raise ValueError(
            f"{name} has per-head parameters: input must be [..., H={module.num_heads}, D], got shape {tuple(x.shape)}"
        )


def _param_shape(head_dim: int, num_heads: Optional[int], *rest: int) -> tuple[int, ...]:
    check_positive_int("head_dim", head_dim)
    check_positive_int("num_heads", num_heads, allow_none=True)
    return ((num_heads,) if num_heads is not None else ()) + tuple(rest)


class ReBased(nn.Module):
    """ReBased (Aksenov et al. 2024): y = gamma * norm(x) + beta, phi(x) = psi(y) / sqrt(d).

    norm is layer normalisation without affine parameters over the last dimension; gamma and beta
    are learnable per feature (and per head with ``num_heads``). psi keeps only the second-order
    terms y_a y_b, so phi(q) . phi(k) = (y_q . y_k)^2 / d: a parabola with its minimum, zero, at
    y_q . y_k = 0 (Based's 1 + s + s^2/2 bottoms out at 1/2 instead).
    F = d(d+1)/2 with ``symmetric=True`` (distinct products, off-diagonal ones scaled by sqrt(2)),
    d^2 otherwise; the same similarity either way.
    """

    no_weight_decay = ("gamma", "beta")  # a norm's gain and bias, 2-D when stacked per head

    def __init__(
        self, head_dim: int, *, num_heads: Optional[int] = None, symmetric: bool = True, eps: float = 1e-5
    ) -> None:
        super().__init__()
        check_bool("symmetric", symmetric)
        check_number("eps", eps, low=0, low_open=True)  # layer_norm of a constant row divides by sqrt(eps)
        shape = _param_shape(head_dim, num_heads, head_dim)
        self.head_dim, self.num_heads, self.symmetric, self.eps = head_dim, num_heads, symmetric, eps
        self.gamma = nn.Parameter(torch.ones(shape))
        self.beta = nn.Parameter(torch.zeros(shape))

    @property
    def feature_dim(self) -> int:
        return squared_feature_dim(self.head_dim, symmetric=self.symmetric)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(self, x)
        y = F.layer_norm(x, (self.head_dim,), eps=self.eps) * self.gamma + self.beta  # [..., d]
        return squared_features(y, symmetric=self.symmetric) / math.sqrt(self.head_dim)  # [..., F]

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, num_heads={self.num_heads}, symmetric={self.symmetric}"


class Hedgehog(nn.Module):
    """Hedgehog (Zhang et al. 2024): z = W x (+ b), phi(x) = softmax([z, -z]) over the 2 * feature_dim features.

    The softmax over features is a per-position normaliser, so the map stays causal-safe; the
    [z, -z] pair lets phi(q) . phi(k) grow with both large positive and large negative dot products
    of the projected vectors, like the exponential it is trained to mimic (see
    ``distill_feature_maps``). W starts as the identity (truncated or zero-padded when
    feature_dim != head_dim), as in the paper's code.
    """

    no_weight_decay = ("bias",)  # 2-D when stacked per head

    def __init__(
        self,
        head_dim: int,
        feature_dim: Optional[int] = None,
        *,
        num_heads: Optional[int] = None,
        bias: bool = False,
    ) -> None:
        super().__init__()
        feature_dim = head_dim if feature_dim is None else feature_dim
        check_positive_int("feature_dim", feature_dim)
        check_bool("bias", bias)
        shape = _param_shape(head_dim, num_heads, feature_dim, head_dim)
        self.head_dim, self.num_heads, self.projection_dim = head_dim, num_heads, feature_dim
        self.weight = nn.Parameter(torch.eye(feature_dim, head_dim).expand(shape).clone())  # [(H,) f, d]
        self.bias = nn.Parameter(torch.zeros(shape[:-1])) if bias else None  # [(H,) f]

    @property
    def feature_dim(self) -> int:
        return 2 * self.projection_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(self, x)
        dtype = torch.promote_types(x.dtype, self.weight.dtype)  # matmul needs one dtype
        x, weight = x.to(dtype), self.weight.to(dtype)
        if self.num_heads is None:
            z = x @ weight.transpose(-1, -2)  # [..., f]
        else:
            z = torch.einsum("...hd,hfd->...hf", x, weight)  # [..., H, f]
        if self.bias is not None:
            z = z + self.bias
        return torch.cat([z, -z], dim=-1).softmax(dim=-1)  # [..., 2f]

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, feature_dim={self.projection_dim}, num_heads={self.num_heads}, "
            f"bias={self.bias is not None}"
        )


def gaussian_orthogonal_matrix(
    rows: int, cols: int, *, orthogonal: bool = True, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """[rows, cols] whose rows are each distributed N(0, I_cols).

    orthogonal=True: blocks of ``cols`` rows are exactly orthogonal to each other within a block
    (Haar-random directions via QR, sign-corrected), each row rescaled by the norm of an
    independent Gaussian vector so its length is chi-distributed as for an i.i.d. row.
    """
    if not orthogonal:
        return torch.randn(rows, cols, generator=generator, dtype=torch.float64)
    n_blocks = -(-rows // cols)
    qmat, r = torch.linalg.qr(torch.randn(n_blocks, cols, cols, generator=generator, dtype=torch.float64))
    # sign correction makes the directions Haar-distributed; transposed: rows orthonormal within a block
    blocks = (qmat * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[:, None, :]).transpose(-1, -2)
    directions = blocks.reshape(n_blocks * cols, cols)[:rows]  # [rows, cols]
    lengths = torch.randn(rows, cols, generator=generator, dtype=torch.float64).norm(dim=1)  # [rows]
    return directions * lengths[:, None]


_SEED_STRIDE = 0x9E3779B97F4A7C15  # odd, 64-bit: spreads the seeds of successive draws (Weyl sequence)


class Performer(nn.Module):
    """Performer FAVOR+ (Choromanski et al. 2020): positive (orthogonal) random features.

    phi(x) = exp(W x' - |x'|^2 / 2) / sqrt(m) with x' = x / d^(1/4) and W the [m, d] random
    ``projection`` buffer (saved in state_dict), so E[phi(q) . phi(k)] = exp(q . k / sqrt(d)), the
    unnormalised softmax kernel. No stabiliser is subtracted: a per-position maximum would scale each
    key by a different constant and bias the estimate. The exponent is at most |w|^2/2 (w . x' - |x'|^2/2 =
    (|w|^2 - |x' - w|^2)/2), about d/2 and more for W's longest rows: float32 features stay finite up to about
    d = 128 (exp overflows past 88) but not beyond, and a product of two features (the op's normaliser) can
    overflow already at d = 64 for inputs aligned with a row of W. The exponent shrinks fast as |x| grows: the
    features scale like exp(-|x|^2 / (2 sqrt(d))).
    Once they fall near the op's ``eps`` (1e-6 by default) the normaliser is mostly eps and the output
    shrinks towards 0 without any error: at d = 64 with 256 features, inputs of entries with standard
    deviation 3 (|x| about 24) already give outputs near 0 instead of their softmax average. Rows far
    longer still (|x| near 50 at d = 64) underflow to all-zero features, and with ``eps=0`` to 0 / 0
    (nan). Keep queries and keys normalised (e.g. LayerNorm or L2 before the map) at such scales.
    Queries and keys must share one module (one W).

    seed: draw n (the first, n = 0, at construction; then one per ``redraw()``) comes from a generator
    seeded by (seed, n) alone, so equal seeds give equal features and a module reloaded from its state_dict
    (which counts the draws in the ``draws`` buffer) redraws as an uninterrupted one would; None uses
    torch's global generator. A seed in a GPT's ``feature_map_options`` gives every layer that seed, so
    every layer the same W (their estimates err alike); leave it None for independent draws per layer.
    ``redraw()`` replaces W in place; call it between optimiser steps, never inside a forward pass,
    where the queries and keys of one sequence would end up with different features.
    Features are computed in float32 (float64 for float64 inputs).
    """

    shared_by_q_and_k = True  # resolve_feature_map refuses it in a pair with another module
    optional_state_keys = ("draws",)  # absent from weights saved before it was counted

    def __init__(
        self, head_dim: int, num_features: int, *, seed: Optional[int] = None, orthogonal: bool = True
    ) -> None:
        super().__init__()
        check_positive_int("head_dim", head_dim)
        check_positive_int("num_features", num_features)
        check_number("seed", seed, integer=True, allow_none=True)
        check_bool("orthogonal", orthogonal)
        self.head_dim, self.num_features, self.orthogonal, self.num_heads = head_dim, num_features, orthogonal, None
        self.seed = seed
        self.register_buffer("projection", torch.empty(num_features, head_dim))  # [m, d]
        # the draws made so far, saved with the weights: a reloaded module's next redraw() is the one an
        # uninterrupted run would make
        self.register_buffer("draws", torch.zeros((), dtype=torch.int64))
        self.redraw()

    @property
    def feature_dim(self) -> int:
        return self.num_features

    @torch.no_grad()
    def redraw(self) -> None:
        if self.projection.is_meta:  # built to check a config (check_attention): no values to draw or count
            return
        generator = None
        if self.seed is not None:  # draw n from its own seed: (seed, n) alone decides it
            n = int(self.draws)
            generator = torch.Generator().manual_seed((self.seed + n * _SEED_STRIDE) % 2**64)
        w = gaussian_orthogonal_matrix(self.num_features, self.head_dim, orthogonal=self.orthogonal,
                                       generator=generator)
        self.projection.copy_(w)
        self.draws += 1

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # weights saved before the draws were counted hold the first draw (only where they hold this module's
        # projection: a partial load of other modules leaves the count alone)
        if prefix + "projection" in state_dict:
            state_dict.setdefault(prefix + "draws", torch.ones((), dtype=torch.int64))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(self, x)
        dtype = compute_dtype(x.dtype)
        with autocast_off(x.device):  # the exponent in dtype under mixed precision too: 16 bits would bias the estimate
            x = x.to(dtype) * self.head_dim**-0.25
            wx = x @ self.projection.to(dtype).T  # [..., m]
            return torch.exp(wx - 0.5 * (x * x).sum(-1, keepdim=True)) / math.sqrt(self.num_features)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, num_features={self.num_features}, orthogonal={self.orthogonal}"


# --- distillation: train a feature map to mimic softmax attention weights (Hedgehog) ---


def _causal_mask(T: int, device) -> torch.Tensor:
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()


def _check_qk(q, k, causal: bool) -> None:
    """q [B, Tq, H, D] and k [B, Tk, H, D] alike but for T (equal T when causal): the weights' einsums
    would broadcast a batch or head of one."""
    for name, x in (("q", q), ("k", k)):
        check_tensor(name, x, 4, "[B, T, H, D]")
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:] or (causal and q.shape[1] != k.shape[1]):
        raise ValueError(f"q and k must have the same shape [B, T, H, D]{'' if causal else ' but for T'}, got "
                         f"{list(q.shape)} and {list(k.shape)}")
    if q.dtype != k.dtype or q.device != k.device:
        raise TypeError(f"q and k must share one dtype and device, got {q.dtype} on {q.device} and {k.dtype} on "
                        f"{k.device}")


def attention_weights(q: torch.Tensor, k: torch.Tensor, feature_map, *, causal: bool = True) -> torch.Tensor:
    """The attention matrix of normalised linear attention: q, k [B, T, H, D] -> [B, H, T, T], rows sum to 1."""
    _check_qk(q, k, causal)
    phi_q, phi_k = resolve_feature_map(feature_map)
    a = torch.einsum("bihf,bjhf->bhij", phi_q(q), phi_k(k))  # [B,H,T,T]
    if causal:
        a = a.masked_fill(~_causal_mask(q.shape[1], q.device), 0.0)
    return a / a.sum(-1, keepdim=True)


def softmax_attention_weights(
    q: torch.Tensor, k: torch.Tensor, *, causal: bool = True, scale: Optional[float] = None
) -> torch.Tensor:
    """softmax(scale * q k^T) (scale defaults to 1/sqrt(D)): q, k [B, T, H, D] -> [B, H, T, T]."""
    _check_qk(q, k, causal)
    check_number("scale", scale, allow_none=True)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale  # [B,H,T,T]
    if causal:
        s = s.masked_fill(~_causal_mask(q.shape[1], q.device), float("-inf"))
    return s.softmax(-1)


def hedgehog_distillation_loss(
    attn_pred: torch.Tensor, attn_softmax: torch.Tensor, *, eps: float = 1e-12
) -> torch.Tensor:
    """Cross-entropy -sum_j a_ij log p_ij between attention rows, averaged over rows.

    attn_pred (p) and attn_softmax (a, the target) are [..., T, T] with rows summing to 1; masked
    entries are zero in both and contribute nothing. The minimum over p is the entropy of a.
    """
    if not isinstance(attn_pred, torch.Tensor) or not isinstance(attn_softmax, torch.Tensor):
        raise TypeError("attn_pred and attn_softmax must be torch.Tensors [..., T, T]")
    if attn_pred.shape != attn_softmax.shape or attn_pred.dim() < 2:
        raise ValueError(
            f"attn_pred and attn_softmax must share one shape [..., T, T], got {tuple(attn_pred.shape)} "
            f"and {tuple(attn_softmax.shape)}"
        )
    return -(attn_softmax * torch.log(attn_pred.clamp_min(eps))).sum(-1).mean()


def distill_feature_maps(
    feature_map,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    lr: float = 1e-2,
    causal: bool = True,
    scale: Optional[float] = None,
) -> list[float]:
    """Train the parameters of ``feature_map`` (a module or a (phi_q, phi_k) pair) so that its linear
    attention weights mimic softmax attention on each (q, k) of ``batches``, with Adam.

    Returns the loss of every step (measured before that step's update).
    """
    maps = feature_map if isinstance(feature_map, tuple) else (feature_map,)
    params = [p for m in maps if isinstance(m, nn.Module) for p in m.parameters()]
    params = list({id(p): p for p in params}.values())  # a module shared by q and k counts once
    if not params:
        raise ValueError("feature_map has no learnable parameters to distill")
    opt = torch.optim.Adam(params, lr=lr)
    losses = []
    for q, k in batches:
        with torch.no_grad():
            target = softmax_attention_weights(q, k, causal=causal, scale=scale)
        loss = hedgehog_distillation_loss(attention_weights(q, k, feature_map, causal=causal), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
