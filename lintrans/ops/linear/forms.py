"""The six forms of causal linear attention (see the package's docstring), on features.

Five are plain PyTorch, kept for what they show and to check one another; the sixth, ``chunked``,
is the fast one (``chunked.py``).
"""
from __future__ import annotations

from typing import Callable

import torch

from ..scan import decayed_scan
from .chunked import chunked_form

# Each form: (fq [B,H,T,F], fk [B,H,T,F], v [B,H,T,E], S0 [B,H,F,E], chunk, ld) -> (y [B,H,T,E], S [B,H,F,E])
# ld: None (no decay) or the log-decays [B or 1, H, T], <= 0, in the compute dtype.


def _causal_mask(n: int, m: int, offset: int, device) -> torch.Tensor:
    """mask[i, j] = key j (global index) <= query i + offset (global index)."""
    return torch.ones(n, m, dtype=torch.bool, device=device).tril(offset)


def cumulative(ld: torch.Tensor) -> torch.Tensor:
    """L_t = a_1 + ... + a_t in float64: the quadratic forms take differences L_i - L_j of sums that
    can reach -1e6, which float32 would round by far more than the difference itself."""
    return ld.double().cumsum(-1)


def _scores(fq_rows, fk_cols, row0: int, L) -> torch.Tensor:
    """Causal (decayed) scores of queries row0.. against keys 0..m-1: [.., n, F] x [.., m, F] -> [.., n, m]."""
    n, m = fq_rows.shape[-2], fk_cols.shape[-2]
    A = fq_rows @ fk_cols.transpose(-1, -2)  # [B,H,n,m]
    mask = _causal_mask(n, m, row0, fq_rows.device)
    if L is None:
        return A.masked_fill(~mask, 0.0)
    diff = L[..., row0 : row0 + n, None] - L[..., None, :m]  # [B|1,H,n,m], <= 0 where unmasked
    return A * diff.masked_fill(~mask, float("-inf")).exp().to(A.dtype)


def _from_state(fq, S0, L) -> torch.Tensor:
    """What the state before the sequence contributes: phi(q_i) (prod_{t<=i} g_t) S0."""
    if L is None:
        return fq @ S0
    return (fq * L.exp().to(fq.dtype)[..., None]) @ S0


def _final_state(fk, v, S0, L) -> torch.Tensor:
    if L is None:
        return S0 + fk.transpose(-1, -2) @ v
    last = L[..., -1:]  # [B|1,H,1]
    keep = (last - L).exp().to(fk.dtype)[..., None]  # decay from each key to the end, <= 1
    return last.exp().to(fk.dtype)[..., None] * S0 + (fk * keep).transpose(-1, -2) @ v


def _attention_loop(fq, fk, v, S0, chunk, ld=None):
    """LT_attention: one query at a time against every earlier key. O(T^2 D) in a Python loop."""
    T = fq.shape[2]
    L = None if ld is None else cumulative(ld)
    ys = [_scores(fq[:, :, i : i + 1], fk[:, :, : i + 1], i, L) @ v[:, :, : i + 1] for i in range(T)]  # [B,H,1,E]
    y = torch.cat(ys, dim=2) + _from_state(fq, S0, L)
    return y, _final_state(fk, v, S0, L)


def _state_loop(fq, fk, v, S0, chunk, ld=None):
    """LT_state: the RNN, S_i = g_i S_{i-1} + phi(k_i) v_i^T, y_i = phi(q_i) S_i. O(T D^2) in a loop."""
    S = S0
    g = None if ld is None else ld.exp()[..., None, None]  # [B|1,H,T,1,1]
    ys = []
    for i in range(fq.shape[2]):
        if g is not None:
            S = g[:, :, i] * S
        S = S + fk[:, :, i, :, None] * v[:, :, i, None, :]  # [B,H,F,E]
        ys.append(torch.einsum("bhf,bhfe->bhe", fq[:, :, i], S))
    return torch.stack(ys, dim=2), S


def _attention(fq, fk, v, S0, chunk, ld=None):
    """LT_attention_parallel_no_flash: the whole masked T x T matrix in one matmul."""
    L = None if ld is None else cumulative(ld)
    A = _scores(fq, fk, 0, L)  # [B,H,T,T]
    return A @ v + _from_state(fq, S0, L), _final_state(fk, v, S0, L)


def _attention_blocked(fq, fk, v, S0, chunk, ld=None):
    """LT_attention_parallel: query blocks of `chunk` rows against the keys up to them.

    Only a [chunk, i*chunk] strip of the attention matrix exists at a time, never T x T.
    """
    T = fq.shape[2]
    L = None if ld is None else cumulative(ld)
    ys = []
    for start in range(0, T, chunk):
        end = min(start + chunk, T)
        ys.append(_scores(fq[:, :, start:end], fk[:, :, :end], start, L) @ v[:, :, :end])  # [B,H,c,E]
    y = torch.cat(ys, dim=2) + _from_state(fq, S0, L)
    return y, _final_state(fk, v, S0, L)


def _state_parallel(fq, fk, v, S0, chunk, ld=None):
    """LT_state_parallel: every state at once as a cumulative sum of outer products. O(T F E) memory.

    With a decay the cumulative sum becomes a parallel scan (``decayed_scan``), O(T log T F E) work.
    """
    P = fk[..., :, None] * v[..., None, :]  # [B,H,T,F,E]
    if ld is None:
        S = torch.cumsum(P, dim=2) + S0[:, :, None]  # [B,H,T,F,E]
    else:
        L = cumulative(ld)
        S = decayed_scan(ld.exp()[..., None, None], P) + L.exp().to(P.dtype)[..., None, None] * S0[:, :, None]
    y = torch.einsum("bhtf,bhtfe->bhte", fq, S)
    return y, S[:, :, -1]


FORMS: dict[str, Callable] = {
    "attention_loop": _attention_loop,
    "state_loop": _state_loop,
    "attention": _attention,
    "attention_blocked": _attention_blocked,
    "state_parallel": _state_parallel,
    "chunked": chunked_form,
}

