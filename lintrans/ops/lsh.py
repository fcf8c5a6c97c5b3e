"""Reformer's LSH attention (Kitaev et al. 2020): shared query-key attention restricted to tokens
that an angular locality-sensitive hash puts in the same bucket.

Per hash round r, a random rotation R_r [D, n_buckets / 2] (drawn from ``seed``, per head) hashes
token i to ``argmax([x_i R_r; -x_i R_r])``. The tokens are sorted by (bucket, position) and the
sorted order is cut into chunks of ``chunk_size``. Query i may attend to key j in round r when

* j is in i's bucket in round r, and
* ``lookback="chunk"`` (the paper): j is in i's chunk or the chunk before it in the sorted order;
  ``lookback="window"``: j is at most ``chunk_size`` places from i in the sorted order (that is,
  among i's ``chunk_size`` nearest bucket-mates on each side; only earlier ones when causal),
* causal: j <= i.

Causal ``"chunk"`` is not causal in the strict sense: a later token's bucket moves the chunk
boundaries and so changes which earlier keys an earlier query sees (``tests/ops/test_lsh.py``
shows it). Causal ``"window"`` depends only on tokens up to i, which is what a language model and
exact decoding need (the GPT choice ``reformer`` uses it). Both cost the same.

Scores: keys are the unit-normalised shared projection k_j = qk_j / ||qk_j||,
s_ij = scale * qk_i . k_j (scale 1/sqrt(D)), and s_ii is replaced by ``SELF_SCORE`` = -1e5, so a
token attends to itself only when nothing else is allowed. Rounds are combined as in the paper
(each round's output weighted by exp(its logsumexp - the logsumexp over rounds), a key found in
N_ij rounds scored s_ij - log N_ij in each): the result is exactly softmax over the union of the
rounds' allowed keys, each key counted once. ``lsh_attention_reference`` computes that dense, in
float64, from ``lsh_mask``. Work and memory O(T * chunk_size * n_hashes); never T x T.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F

from .native import eager_only
from .validation import (autocast_off, check_bool, check_choice, check_head_dims, check_number, check_tensor, compute_dtype,
                         warn_if_head_first)

SELF_SCORE = -1e5  # a token's score with itself (the paper's 10^5 penalty)
LOOKBACKS = ("chunk", "window")


def check_lsh_options(n_buckets, n_hashes, chunk_size, seed, causal, lookback) -> None:
    check_number("n_buckets", n_buckets, integer=True, low=1)
    if n_buckets > 1 and n_buckets % 2:
        raise ValueError(f"n_buckets must be 1 or an even int >= 2 (the hash is an argmax over "
                         f"n_buckets / 2 rotations and their negatives), got {n_buckets!r}")
    check_number("n_hashes", n_hashes, integer=True, low=1)
    check_number("chunk_size", chunk_size, integer=True, low=1)
    check_number("seed", seed, integer=True, low=0, high=2**63 - 1)  # what torch.manual_seed takes
    check_bool("causal", causal)
    check_choice("lookback", lookback, LOOKBACKS)


def _check_inputs(qk, v) -> tuple[int, int, int, int, int]:
    check_tensor("qk", qk, 4, "[B, T, H, D]")
    check_tensor("v", v, 4, "[B, T, H, Dv]")
    if v.shape[:-1] != qk.shape[:-1]:
        raise ValueError(f"v must match qk in every dimension but the last ([B, T, H, D]), "
                         f"got qk {tuple(qk.shape)} and v {tuple(v.shape)}")
    if qk.dtype != v.dtype:
        raise TypeError(f"qk and v must share one dtype, got {qk.dtype} and {v.dtype}")
    if qk.device != v.device:
        raise ValueError(f"qk and v must be on one device, got {qk.device} and {v.device}")
    B, T, H, D = qk.shape
    if T < 1:
        raise ValueError("sequence length T must be at least 1")
    check_head_dims("[B, T, H, D]", qk=qk, v=v)
    warn_if_head_first("qk", qk)
    return B, T, H, D, v.shape[-1]


@functools.lru_cache(maxsize=64)
def lsh_rotations(H: int, D: int, n_buckets: int, n_hashes: int, seed: int) -> torch.Tensor:
    """The random rotations [H, n_hashes, D, n_buckets // 2] (float64, CPU), from ``seed`` alone.
    Drawn round by round, so more hashes only add rounds: the first rounds stay the same."""
    g = torch.Generator().manual_seed(seed)
    with torch.inference_mode(False):  # cached: an inference tensor could not be saved for backward later
        return torch.randn(n_hashes, H, D, n_buckets // 2, generator=g, dtype=torch.float64).transpose(0, 1)


@eager_only  # a cached constant: torch.compile would trace the seeded draw and warn of the cache
@functools.lru_cache(maxsize=64)
def _rotations_on(device: torch.device, *key) -> torch.Tensor:
    """``lsh_rotations(*key)`` on ``device``, copied there once: a copy per call would be a
    host-to-device transfer (and on CUDA a wait for the device) in every forward."""
    with torch.inference_mode(False):  # cached, as lsh_rotations
        return lsh_rotations(*key).to(device)


def lsh_buckets(qk: torch.Tensor, *, n_buckets: int, n_hashes: int = 2, seed: int = 0) -> torch.Tensor:
    """qk [B, T, H, D] -> bucket of every token in every round, [B, H, n_hashes, T] (int64).

    Hashed in float64 whatever qk's dtype, so that a token gets the same bucket whether it is
    hashed alone (decoding) or with the whole sequence (a rounding tie would otherwise differ)."""
    check_tensor("qk", qk, 4, "[B, T, H, D]")
    check_lsh_options(n_buckets, n_hashes, 1, seed, True, "chunk")
    B, T, H, D = qk.shape
    if n_buckets == 1:
        return torch.zeros(B, H, n_hashes, T, dtype=torch.long, device=qk.device)
    rot = _rotations_on(qk.device, H, D, n_buckets, n_hashes, seed)
    proj = torch.einsum("bthd,hrdk->bhrtk", qk.detach().to(torch.float64), rot)  # [B,H,R,T,nb/2]
    return torch.cat([proj, -proj], dim=-1).argmax(dim=-1)


def _ranks(buckets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """buckets [..., T] -> (order, rank): the positions sorted by (bucket, position), and each
    position's place in that order."""
    T = buckets.shape[-1]
    pos = torch.arange(T, device=buckets.device)
    order = torch.argsort(buckets * T + pos, dim=-1)
    rank = torch.empty_like(order).scatter_(-1, order, pos.expand_as(order))
    return order, rank


def _near(rq: torch.Tensor, rk: torch.Tensor, chunk_size: int, lookback: str) -> torch.Tensor:
    """Whether sorted places rk are close enough to rq (before the bucket and causal checks)."""
    if lookback == "chunk":  # the key's chunk is the query's or the one before
        d = torch.div(rq, chunk_size, rounding_mode="floor") - torch.div(rk, chunk_size, rounding_mode="floor")
        return (d == 0) | (d == 1)
    return (rq - rk).abs() <= chunk_size


def lsh_mask(buckets: torch.Tensor, *, chunk_size: int, causal: bool = True, lookback: str = "chunk",
             start: int = 0) -> torch.Tensor:
    """buckets [B, H, n_hashes, T] -> [B, H, T - start, T]: True where query i (rows start..T-1)
    may attend to key j in some round: the exact pattern ``lsh_attention`` computes (the self pair
    included, always allowed)."""
    if not isinstance(buckets, torch.Tensor) or buckets.dim() != 4 or buckets.dtype != torch.long:
        raise TypeError("buckets must be an int64 tensor [B, H, n_hashes, T] (from lsh_buckets)")
    T = buckets.shape[-1]
    check_number("start", start, integer=True, low=0, high=T - 1)
    check_lsh_options(2, 1, chunk_size, 0, causal, lookback)
    same = buckets[..., start:, None] == buckets[..., None, :]  # [B,H,R,T-start,T]
    if causal and lookback == "window":
        # Sorted by (bucket, position), an earlier bucket-mate j lies (the number of mates at
        # positions j+1..i) places before i: counted from a cumulative sum, with no sort of every
        # position per round (decoding asks for one row per token and layer)
        mates = same.cumsum(-1, dtype=torch.int32)  # [B,H,R,T-start,T]: i's mates at positions <= j
        between = mates.diagonal(offset=start, dim1=-2, dim2=-1)[..., None] - mates  # mates in j+1..i
        m = (same & (between <= chunk_size)).any(dim=2)
    else:
        _, rank = _ranks(buckets)  # [B,H,R,T]
        m = (same & _near(rank[..., start:, None], rank[..., None, :], chunk_size, lookback)).any(dim=2)
    if causal and start < T - 1:  # (the last row has no later keys)
        pos = torch.arange(T, device=buckets.device)
        m &= pos[None, :] <= pos[start:, None]
    return m


def _gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, H, L, E], idx [B, H, ...] of positions < L -> [B, H, ..., E]."""
    B, H, _, E = x.shape
    flat = idx.flatten(2)  # not reshape(B, H, -1): B or H may be 0
    return x.gather(2, flat[..., None].expand(-1, -1, -1, E)).reshape(*idx.shape, E)


def _take(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """table [B, H, L], idx [B, H, ...] -> table values at idx, [B, H, ...]."""
    return table.gather(2, idx.flatten(2)).reshape(idx.shape)


def lsh_attention(
    qk: torch.Tensor,
    v: torch.Tensor,
    *,
    n_buckets: int,
    n_hashes: int = 2,
    chunk_size: int = 64,
    causal: bool = True,
    seed: int = 0,
    scale: Optional[float] = None,
    lookback: str = "chunk",
    output_buckets: bool = False,
):
    """qk [B, T, H, D], v [B, T, H, Dv] -> (o [B, T, H, Dv], buckets [B, H, n_hashes, T] or None).

    LSH attention as in the module docstring: per round, each chunk of the sorted order attends to
    itself and its neighbour chunk(s) only. Computed in float32 (float64 for float64 inputs),
    returned in qk's dtype; the buckets are returned with ``output_buckets=True``."""
    B, T, H, D, Dv = _check_inputs(qk, v)
    check_lsh_options(n_buckets, n_hashes, chunk_size, seed, causal, lookback)
    check_number("scale", scale, allow_none=True)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    dtype = compute_dtype(qk.dtype)
    with autocast_off(qk.device):  # scores in dtype under mixed precision too (SELF_SCORE is beyond fp16)
        R, c = n_hashes, min(chunk_size, T)  # a chunk longer than T allows what a chunk of T does
        n = math.ceil(T / c)

        buckets = lsh_buckets(qk, n_buckets=n_buckets, n_hashes=R, seed=seed)  # [B,H,R,T]
        order, rank = _ranks(buckets)
        # every position is padded with one row, index T, standing for "no token"
        x = F.pad(qk.transpose(1, 2).to(dtype), (0, 0, 0, 1))  # [B,H,T+1,D]
        vals = F.pad(v.transpose(1, 2).to(dtype), (0, 0, 0, 1))  # [B,H,T+1,Dv]
        keys = F.normalize(x, dim=-1)
        q_pos = F.pad(order, (0, n * c - T), value=T).reshape(B, H, R, n, c)  # the token in each sorted slot
        none = torch.full_like(q_pos[..., :1, :], T)
        shifted = {-1: torch.cat([none, q_pos[..., :-1, :]], dim=-2), 0: q_pos,
                   1: torch.cat([q_pos[..., 1:, :], none], dim=-2)}
        reach = (0,) if n == 1 else (-1, 0, 1) if lookback == "window" and not causal else (-1, 0)
        k_pos = torch.cat([shifted[s] for s in reach], dim=-1)  # [B,H,R,n,Kc]: keys of each query chunk

        # Per round one integer per token such that a pair is allowed in that round iff the key's lies
        # in [query's - lo, query's + hi]: same bucket and near in the sorted order (window: places
        # at most c apart, only earlier ones when causal; chunk: the same chunk or the one before).
        # Buckets are spaced wider than any such range; the "no token" row is far from every token.
        if lookback == "window":
            packed, lo, hi = buckets * (2 * T + 4 * c) + rank, c, 0 if causal else c
        else:
            packed, lo, hi = buckets * (2 * n + 4) + torch.div(rank, c, rounding_mode="floor"), 1, 0
        small = n_buckets * (2 * T + 4 * c) < 2**30
        packed = F.pad(packed.to(torch.int32 if small else torch.int64), (0, 1), value=-(2**30 if small else 2**40))
        causal_pairs = k_pos[..., None, :] <= q_pos[..., :, None] if causal and lookback == "chunk" else None
        # every round's verdict on each pair: its own round's is the mask; N_ij, the number of rounds
        # that allow a pair, counts its duplicates
        count, own = None, []
        for r in range(R):
            kq, kk = _take(packed[:, :, r], q_pos)[..., :, None], _take(packed[:, :, r], k_pos)[..., None, :]
            ok = (kk >= kq - lo) & (kk <= kq + hi)  # [B,H,R,n,c,Kc]
            if causal_pairs is not None:
                ok &= causal_pairs
            own.append(ok[:, :, r])
            if R > 1:
                count = ok.to(dtype) if count is None else count.add_(ok)
        allowed = torch.stack(own, dim=2)  # [B,H,R,n,c,Kc]

        s = (_gather(x, q_pos) * scale) @ _gather(keys, k_pos).transpose(-1, -2)  # [B,H,R,n,c,Kc]
        if R > 1:  # each key counted once over the rounds: log N_ij off its score wherever it is allowed
            s = s - torch.where(allowed, count.log_(), math.inf)
        else:
            s = s.masked_fill(~allowed, float("-inf"))
        # the self pair: query slot t of a chunk is key slot t of the same chunk; every row keeps this
        # finite entry (padded slots included), so no row is all -inf. Every round holds it: log R off,
        # as for any pair that R rounds allow, so that it counts once
        # built without writing into a view: torch.compile's functionalisation refuses that
        col = torch.arange(len(reach) * c, device=qk.device)  # [Kc]
        self_pair = col[None, :] == torch.arange(c, device=qk.device)[:, None] + reach.index(0) * c  # [c, Kc]
        s = s.masked_fill(self_pair, SELF_SCORE - math.log(R))
        p = s.softmax(dim=-1)
        o = p @ _gather(vals, k_pos)  # [B,H,R,n,c,Dv]
        o = o.reshape(B, H, R, n * c, Dv).gather(3, rank[..., None].expand(-1, -1, -1, -1, Dv))  # [B,H,R,T,Dv]
        if R > 1:
            # each round weighted by exp(its logsumexp - the one over rounds); lse = s_a - log p_a at
            # a row's largest score a, one gather instead of a second pass of exp
            a = s.argmax(dim=-1, keepdim=True)
            lse = (s.gather(-1, a) - p.gather(-1, a).log()).reshape(B, H, R, n * c).gather(3, rank)  # [B,H,R,T]
            o = (lse.softmax(dim=2)[..., None] * o).sum(dim=2)  # [B,H,T,Dv]
        else:
            o = o[:, :, 0]
        return o.transpose(1, 2).to(qk.dtype), (buckets if output_buckets else None)


def unit_keys(x: torch.Tensor) -> torch.Tensor:
    """The keys of shared-QK attention, qk_j / ||qk_j||, in the compute dtype (float32, float64 for
    float64 inputs): normalised over the last dimension."""
    return F.normalize(x.to(compute_dtype(x.dtype)), dim=-1)


def shared_qk_rows(q: torch.Tensor, keys: torch.Tensor, v: torch.Tensor, *, scale: float,
                   mask: Optional[torch.Tensor] = None, causal: bool = True) -> torch.Tensor:
    """The last rows of dense shared-QK attention from keys already normalised: q [B, H, t, D]
    (the shared projections of tokens L-t..L-1), keys [B, H, L, D] (``unit_keys`` of all L
    tokens), v [B, H, L, Dv], in one dtype; mask [B, H, t, L] or None -> [B, H, t, Dv]. The core
    of ``shared_qk_attention``; a decoding cache keeps the unit keys, so that a step normalises
    only its own."""
    with autocast_off(q.device):  # in q's dtype under mixed precision too (SELF_SCORE is beyond fp16)
        return _shared_qk_rows(q, keys, v, scale, mask, causal)


def _shared_qk_rows(q, keys, v, scale, mask, causal):
    t, L = q.shape[2], keys.shape[2]
    s = (q @ keys.transpose(-1, -2)) * scale  # [B,H,t,L]
    # s_ii written in place (a decoding step's cost is mostly such small ops): s is a new tensor
    # whose producer saved nothing, and this dense path is not one torch.compile traces in training
    s[..., L - t :].diagonal(dim1=-2, dim2=-1).fill_(SELF_SCORE)
    allowed = mask
    if causal:
        rows, cols = torch.arange(L - t, L, device=q.device)[:, None], torch.arange(L, device=q.device)[None, :]
        allowed = cols <= rows if mask is None else mask & (cols <= rows)
    if allowed is not None:
        s = torch.where(allowed, s, float("-inf"))
    return s.softmax(-1) @ v


def shared_qk_attention(qk: torch.Tensor, v: torch.Tensor, *, causal: bool = True, scale: Optional[float] = None,
                        mask: Optional[torch.Tensor] = None, start: int = 0) -> torch.Tensor:
    """Dense shared-QK softmax attention with the self rule (O(T^2)): rows start..T-1 of
    softmax_j(scale * qk_i . qk_j / ||qk_j||) v_j, s_ii = SELF_SCORE, restricted to ``mask``
    [B, H, T - start, T] (and j <= i when causal). Computed in float32 (float64 for float64
    inputs), returned in qk's dtype: [B, T - start, H, Dv]. What LSH attention approximates, and
    (with ``lsh_mask``) what it computes."""
    D = _check_inputs(qk, v)[3]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    dtype = compute_dtype(qk.dtype)
    keys = unit_keys(qk.transpose(1, 2))  # [B,H,T,D]
    o = shared_qk_rows(qk[:, start:].transpose(1, 2).to(dtype), keys, v.transpose(1, 2).to(dtype), scale=scale,
                       mask=mask, causal=causal)  # [B,H,T-start,Dv]
    return o.transpose(1, 2).to(qk.dtype)


def lsh_attention_reference(qk, v, *, n_buckets, n_hashes=2, chunk_size=64, causal=True, seed=0, scale=None,
                            lookback="chunk") -> torch.Tensor:
    """Dense float64 softmax over the union of the rounds' allowed keys (``lsh_mask`` of the
    same hashes), the self rule included: what ``lsh_attention`` computes, for tests."""
    buckets = lsh_buckets(qk, n_buckets=n_buckets, n_hashes=n_hashes, seed=seed)
    mask = lsh_mask(buckets, chunk_size=chunk_size, causal=causal, lookback=lookback)
    return shared_qk_attention(qk.double(), v.double(), causal=causal, scale=scale, mask=mask)
