"""Synthetic in-context learning tasks: data generators and the baselines they are judged against.

In-context linear regression (Garg et al. 2022): every sequence draws its own w ~ N(0, I_n) and
points x_i ~ N(0, I_n) with y_i = w . x_i; the model sees (x_1, y_1, ..., x_P) and predicts y_i at
every x_i from the i - 1 examples before it. Multi-query associative recall (MQAR, Arora et al.
2024): key-value token pairs, then some of the keys again; the model must name each one's value.
"""
from __future__ import annotations

from typing import Optional

import torch

from lintrans.ops.validation import check_positive_int


def regression_batch(
    batch: int, n_points: int, dim: int, generator: Optional[torch.Generator] = None, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> xs [B, P, n], ys [B, P] with ys = xs @ w exactly, w [B, n]; all float32."""
    for name, value in (("batch", batch), ("n_points", n_points), ("dim", dim)):
        check_positive_int(name, value)
    w = torch.randn(batch, dim, generator=generator).to(device)  # [B,n]
    xs = torch.randn(batch, n_points, dim, generator=generator).to(device)  # [B,P,n]
    ys = torch.einsum("bpn,bn->bp", xs, w)  # [B,P]
    return xs, ys, w


def regression_tokens(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    """Interleave x_1, y_1, ..., x_P as vectors [B, 2P - 1, n]; a y token is (y, 0, ..., 0) as in Garg et al.

    The last y is dropped: no prediction is read after it. Predictions are read at even positions.
    """
    B, P, n = xs.shape
    y_tok = torch.zeros_like(xs)  # [B,P,n]
    y_tok[..., 0] = ys
    seq = torch.stack([xs, y_tok], dim=2).reshape(B, 2 * P, n)  # [B,2P,n]
    return seq[:, :-1]


def least_squares_errors(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    """Squared error of the minimum-norm least-squares fit on the first k points at point k + 1,
    for k = 0 .. P - 1: [B, P] (k = 0 predicts 0). The optimal estimator for noiseless data once
    k >= n; below that the best any estimator can do is about (n - k) / n of E[y^2] on average."""
    xs64, ys64 = xs.double(), ys.double()
    B, P, n = xs.shape
    errors = torch.empty(B, P, dtype=torch.float64)
    errors[:, 0] = ys64[:, 0] ** 2
    for k in range(1, P):
        w_hat = torch.linalg.pinv(xs64[:, :k]) @ ys64[:, :k, None]  # [B,n,1]
        pred = (xs64[:, k, None] @ w_hat)[:, 0, 0]  # [B]
        errors[:, k] = (pred - ys64[:, k]) ** 2
    return errors


def recall_batch(
    batch: int, n_pairs: int, n_queries: int, n_keys: int, n_values: int,
    generator: Optional[torch.Generator] = None, device: str = "cpu", filler: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MQAR sequences: k_1 v_1 ... k_P v_P then q_1 a_1 ... q_Q a_Q, each query one of the P keys.

    Keys are ids 0..n_keys-1 (distinct within a sequence), values n_keys..n_keys+n_values-1.
    Returns idx [B, 2(P + Q)] int64 and targets of the same shape: at a query key the value paired
    with it, -1 (ignored) everywhere else. With ``filler`` (an id past the values) the token after
    each query is that filler, as in Zoology's MQAR, where the answers are never in the input. Without
    it the answers a_j are (teacher forcing): a causal model cannot see a_j when predicting it, but it
    sees the earlier answers, so it can rule out values already asked for without recalling anything
    (an accuracy of H_Q / Q at Q = P queries, 0.21 at 16 pairs, against 1 / P with a filler).
    """
    for name, value in (("batch", batch), ("n_pairs", n_pairs), ("n_queries", n_queries),
                        ("n_keys", n_keys), ("n_values", n_values)):
        check_positive_int(name, value)
    if filler is not None:
        check_positive_int("filler", filler)
        if filler < n_keys + n_values:
            raise ValueError(f"filler ({filler}) must be an id past the keys and values (>= {n_keys + n_values})")
    if n_pairs > n_keys:
        raise ValueError(f"n_pairs ({n_pairs}) must be <= n_keys ({n_keys}): keys in a sequence are distinct")
    if n_queries > n_pairs:
        raise ValueError(f"n_queries ({n_queries}) must be <= n_pairs ({n_pairs}): each pair is queried at most once")
    # the P largest of n_keys uniform draws: a uniform random subset in random order (topk, unlike a
    # full argsort, does not sort all n_keys)
    keys = torch.rand(batch, n_keys, generator=generator).topk(n_pairs, dim=1).indices  # [B,P]
    values = n_keys + torch.randint(n_values, (batch, n_pairs), generator=generator)  # [B,P]
    which = torch.rand(batch, n_pairs, generator=generator).argsort(dim=1)[:, :n_queries]  # [B,Q]
    q_keys, answers = keys.gather(1, which), values.gather(1, which)  # [B,Q]
    pairs = torch.stack([keys, values], dim=2).reshape(batch, 2 * n_pairs)
    after = answers if filler is None else torch.full_like(answers, filler)  # [B,Q]
    queries = torch.stack([q_keys, after], dim=2).reshape(batch, 2 * n_queries)
    idx = torch.cat([pairs, queries], dim=1)  # [B,T]
    targets = torch.full_like(idx, -1)
    targets[:, 2 * n_pairs::2] = answers
    return idx.to(device), targets.to(device)


def averaging_errors(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    """Squared error at point k + 1 of the averaging estimator w_hat = mean_{i<=k} y_i x_i (Garg et al.'s
    baseline: unbiased for x ~ N(0, I), but it never becomes exact): [B, P], k = 0 predicts 0."""
    xs64, ys64 = xs.double(), ys.double()
    sums = torch.cumsum(ys64[..., None] * xs64, dim=1)  # [B,P,n] sum over i <= k of y_i x_i
    counts = torch.arange(1, xs.shape[1] + 1, dtype=torch.float64)[None, :, None]
    w_hat = torch.cat([torch.zeros_like(sums[:, :1]), (sums / counts)[:, :-1]], dim=1)  # from points before k+1
    return ((w_hat * xs64).sum(-1) - ys64) ** 2


def nearest_neighbour_errors(xs: torch.Tensor, ys: torch.Tensor, k_nn: int = 3) -> torch.Tensor:
    """Squared error at point k + 1 of the mean y of its ``k_nn`` nearest earlier x (all of them while
    fewer exist): [B, P], k = 0 predicts 0."""
    check_positive_int("k_nn", k_nn)
    xs64, ys64 = xs.double(), ys.double()
    B, P, _ = xs.shape
    errors = torch.empty(B, P, dtype=torch.float64)
    errors[:, 0] = ys64[:, 0] ** 2
    for k in range(1, P):
        dist = (xs64[:, :k] - xs64[:, k, None]).norm(dim=-1)  # [B,k]
        near = dist.topk(min(k_nn, k), dim=1, largest=False).indices
        errors[:, k] = (ys64[:, :k].gather(1, near).mean(1) - ys64[:, k]) ** 2
    return errors
