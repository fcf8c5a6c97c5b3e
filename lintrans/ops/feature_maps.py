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

FeatureMap = Callable[[torch.Tensor], torch.Tensor]


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


def elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    """elu(x) + 1 (Katharopoulos et al. 2020): positive, smooth."""
    return F.elu(x) + 1.0


def relu(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """softplus(x): puts queries and keys in the positive quadrant (seed 000's normaliser)."""
    return F.softplus(x)


def based(x: torch.Tensor) -> torch.Tensor:
    """Second-order Taylor map (Based): phi(q) . phi(k) = 1 + s + s^2 / 2 with s = q . k / sqrt(d).

    Uses the d(d+1)/2 distinct products x_a x_b (a <= b), off-diagonal ones scaled by sqrt(2),
    instead of all d^2: the same inner product with half the feature dimension.
    """
    d = x.shape[-1]
    iu, ju = torch.triu_indices(d, d, device=x.device)
    weight = torch.where(iu == ju, 1.0, math.sqrt(2.0)).to(x.dtype)
    # (q.k)^2 / (2d) = sum_{a<=b} w_ab^2 q_a q_b k_a k_b / (2d)
    second = x[..., iu] * x[..., ju] * (weight / math.sqrt(2.0 * d))
    first = x / d ** 0.25
    ones = torch.ones_like(x[..., :1])
    return torch.cat([ones, first, second], dim=-1)


def based_feature_dim(d: int) -> int:
    return 1 + d + d * (d + 1) // 2


FEATURE_MAPS: dict[str, FeatureMap] = {
    "identity": identity,
    "elu": elu_plus_one,
    "relu": relu,
    "softplus": softplus,
    "based": based,
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
        return feature_map[0], feature_map[1]
    if callable(feature_map):
        return feature_map, feature_map
    raise TypeError(
        "feature_map must be a name "
        f"{sorted(FEATURE_MAPS)}, a callable, or a (phi_q, phi_k) pair of callables; got {type(feature_map).__name__}"
    )
