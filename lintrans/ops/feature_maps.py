"""Parameter-free feature maps phi, by name.

Each map takes ``[..., D]`` and returns ``[..., F]``; the similarity of a query and a key is
``phi(q) . phi(k)``. Learnable or random maps (ReBased, Hedgehog, Performer) live in
``lintrans.nn.feature_maps`` as modules and are passed to the ops as callables.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from .validation import check_choice, check_positive_int

FeatureMap = Callable[[torch.Tensor], torch.Tensor]


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _elu_plus_one_values(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return torch.clamp(x, max=0, out=y).exp_().add_(torch.relu(x))


class _EluPlusOne(torch.autograd.Function):
    """elu(x) + 1 = exp(min(x, 0)) + max(x, 0), whose derivative is min(y, 1) of the output y.

    Faster on CPU than ``F.elu(x) + 1`` (torch's elu goes through expm1; docs/feature-maps.md),
    keeps one tensor (y) for backward instead of x, and writes y contiguous
    whatever x's strides, so a transposed view goes in and the [B, H, T, F] layout the linear
    attention forms use comes out with no extra copy.
    """

    @staticmethod
    def forward(ctx, x):
        y = _elu_plus_one_values(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        # y < 1 exactly where x < 0, and there dy/dx = exp(x) = y; differentiable again through y
        return grad * y.clamp(max=1.0)


def elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    """elu(x) + 1 (Katharopoulos et al. 2020): positive, smooth. Output contiguous."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _EluPlusOne.apply(x)
    return _elu_plus_one_values(x)  # decoding: the same values without an autograd call's overhead


def relu(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """softplus(x): puts queries and keys in the positive quadrant (the normaliser of "Linear Transformers Are Faster After All")."""
    return F.softplus(x)


def squared_features(x: torch.Tensor, *, symmetric: bool = True) -> torch.Tensor:
    """Features psi with psi(x) . psi(y) = (x . y)^2: [..., d] -> [..., d(d+1)/2] (or [..., d^2]).

    symmetric=True keeps the d(d+1)/2 distinct products x_a x_b (a <= b) with the off-diagonal ones
    scaled by sqrt(2): the same inner product as all d^2 products with half the feature dimension.
    """
    d = x.shape[-1]
    if not symmetric:
        return (x[..., :, None] * x[..., None, :]).flatten(-2)  # [..., d*d]
    # Row a of the upper triangle is [x_a^2, sqrt(2) x_a x_{a+1}, ..., sqrt(2) x_a x_{d-1}]; slices
    # and one cat run faster (forward and backward) than gathering with triu_indices.
    scaled = x * math.sqrt(2.0)  # [..., d]
    rows = []
    for a in range(d):
        x_a = x[..., a : a + 1]
        rows.append(x_a * x_a)
        if a + 1 < d:
            rows.append(scaled[..., a + 1 :] * x_a)
    return torch.cat(rows, dim=-1)  # [..., d(d+1)/2], row-major upper triangle


def squared_feature_dim(d: int, *, symmetric: bool = True) -> int:
    return d * (d + 1) // 2 if symmetric else d * d


def based(x: torch.Tensor) -> torch.Tensor:
    """Second-order Taylor map (Based): phi(q) . phi(k) = 1 + s + s^2 / 2 with s = q . k / sqrt(d).

    Features [1, x / d^(1/4), psi(x) / sqrt(2d)] with psi the symmetric squared features:
    F = 1 + d + d(d+1)/2 instead of 1 + d + d^2.
    """
    d = x.shape[-1]
    ones = torch.ones_like(x[..., :1])
    first = x / d**0.25  # first . first = q.k / sqrt(d) = s
    second = squared_features(x) / math.sqrt(2.0 * d)  # second . second = (q.k)^2 / (2d) = s^2 / 2
    return torch.cat([ones, first, second], dim=-1)


def based_feature_dim(d: int) -> int:
    return 1 + d + squared_feature_dim(d)


def named_feature_dim(name: str, d: int) -> int:
    """F of the named map ``name`` on vectors of dimension d."""
    return based_feature_dim(d) if name == "based" else d


_EXPANDED_DIM = {
    "based": based_feature_dim,
    "rebased": squared_feature_dim,
    "rebased_full": lambda p: squared_feature_dim(p, symmetric=False),
}


def feature_dim_for(kind: str, head_dim: int, n_head: int = 1) -> int:
    """The q/k projection width (all heads together) that keeps each head's expanded feature
    dimension closest to ``head_dim`` (the d-hat of the ReBased paper, Aksenov et al. 2024).

    Per head it is the p >= 1 minimising |F(p) - head_dim|, ties to the smaller p, with F(p) =
    1 + p + p(p+1)/2 for ``based``, p(p+1)/2 for ``rebased`` (symmetric products, as ``ReBased``
    by default) and p^2 for ``rebased_full``; the result is ``n_head * p``.
    Example: head_dim=64 -> based 10 (F=66), rebased 11 (F=66), rebased_full 8 (F=64).
    """
    check_choice("kind", kind, sorted(_EXPANDED_DIM))
    check_positive_int("head_dim", head_dim)
    check_positive_int("n_head", n_head)
    expanded = _EXPANDED_DIM[kind]
    p = 1
    while expanded(p + 1) <= head_dim:  # F grows with p: the best p is the last below or the first above
        p += 1
    if abs(expanded(p + 1) - head_dim) < abs(expanded(p) - head_dim):
        p += 1
    return n_head * p


FEATURE_MAPS: dict[str, FeatureMap] = {
    "identity": identity,
    "elu": elu_plus_one,
    "relu": relu,
    "softplus": softplus,
    "based": based,
}


# d phi / dx as a function of phi's output y, for the element-wise named maps: the chunked op applies
# them block by block and gets their gradient from the features it recomputes anyway, without
# recording a graph (maps not listed get theirs by autograd)
OUTPUT_DERIVATIVES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "elu": lambda y: y.clamp(max=1.0),  # exp(x) = y where x < 0, else 1
    "relu": lambda y: (y > 0).to(y.dtype),
    "softplus": lambda y: -torch.expm1(-y),  # sigmoid(x) = 1 - exp(-softplus(x))
}


def resolve_feature_map(feature_map) -> tuple[FeatureMap, FeatureMap]:
    """Return (phi_q, phi_k) from a name, a callable, or a (phi_q, phi_k) pair."""
    if isinstance(feature_map, str):
        if feature_map not in FEATURE_MAPS:
            raise ValueError(
                f"feature_map must be one of {sorted(FEATURE_MAPS)} or a callable, got {feature_map!r}"
            )
        fn = FEATURE_MAPS[feature_map]
        return fn, fn
    if feature_map is None:
        return identity, identity
    if isinstance(feature_map, tuple) and len(feature_map) == 2 and all(callable(f) for f in feature_map):
        fq, fk = feature_map
        shared = [f for f in feature_map if getattr(f, "shared_by_q_and_k", False)]
        if fq is not fk and shared:  # e.g. two Performers: two random projections estimate no kernel at all
            raise ValueError(f"feature_map: {type(shared[0]).__name__} must serve queries and keys as one module; "
                             "pass it alone, not in a (phi_q, phi_k) pair")
        return fq, fk
    if callable(feature_map):
        return feature_map, feature_map
    raise TypeError(
        "feature_map must be a name "
        f"{sorted(FEATURE_MAPS)}, a callable, or a (phi_q, phi_k) pair of callables; got {type(feature_map).__name__}"
    )
