"""Causal linear attention in the six forms of "Linear Transformers Are Faster After All".

Every form computes, for each position i and with phi the feature map,

    o_i = sum_{j<=i} s_ij v_j / (sum_{j<=i} s_ij + eps)     s_ij = scale * phi(q_i) . phi(k_j)

(without the division when ``normalize=False``), continuing from a recurrent state
``(S, z) = (sum_j phi(k_j) v_j^T, sum_j phi(k_j))`` handed in by a previous call.

Implementation note: the normaliser is computed by every form for free by appending a column of
ones to v, so each form only has to implement ``y = causal(phi(q), phi(k), v) + phi(q) @ S0`` and
return the final state; numerator, denominator and (S, z) are then the columns of one result.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from ._validate import check_positive_int, check_qkv, compute_dtype
from .feature_maps import resolve_feature_map

State = Tuple[torch.Tensor, torch.Tensor]

# Each form: (fq [B,H,T,F], fk [B,H,T,F], v [B,H,T,E], S0 [B,H,F,E], chunk) -> (y [B,H,T,E], S [B,H,F,E])


def _attention_loop(fq, fk, v, S0, chunk):
    """LT_attention: one query at a time against every earlier key. O(T^2 D) in a Python loop."""
    T = fq.shape[2]
    ys = []
    for i in range(T):
        a = torch.einsum("bhf,bhjf->bhj", fq[:, :, i], fk[:, :, : i + 1])  # [B,H,i+1]
        ys.append(torch.einsum("bhj,bhje->bhe", a, v[:, :, : i + 1]))
    y = torch.stack(ys, dim=2) + fq @ S0
    return y, S0 + fk.transpose(-1, -2) @ v


def _state_loop(fq, fk, v, S0, chunk):
    """LT_state: the RNN, S_i = S_{i-1} + phi(k_i) v_i^T, y_i = phi(q_i) S_i. O(T D^2) in a loop."""
    S = S0
    ys = []
    for i in range(fq.shape[2]):
        S = S + fk[:, :, i, :, None] * v[:, :, i, None, :]  # [B,H,F,E]
        ys.append(torch.einsum("bhf,bhfe->bhe", fq[:, :, i], S))
    return torch.stack(ys, dim=2), S


def _causal_mask(n: int, m: int, offset: int, device) -> torch.Tensor:
    """mask[i, j] = key j (global index) <= query i + offset (global index)."""
    return torch.ones(n, m, dtype=torch.bool, device=device).tril(offset)


def _attention(fq, fk, v, S0, chunk):
    """LT_attention_parallel_no_flash: the whole masked T x T matrix in one matmul."""
    T = fq.shape[2]
    A = (fq @ fk.transpose(-1, -2)).masked_fill(~_causal_mask(T, T, 0, fq.device), 0.0)  # [B,H,T,T]
    return A @ v + fq @ S0, S0 + fk.transpose(-1, -2) @ v


def _attention_blocked(fq, fk, v, S0, chunk):
    """LT_attention_parallel: query blocks of `chunk` rows against the keys up to them.

    Only a [chunk, i*chunk] strip of the attention matrix exists at a time, never T x T.
    """
    T = fq.shape[2]
    ys = []
    for start in range(0, T, chunk):
        end = min(start + chunk, T)
        A = fq[:, :, start:end] @ fk[:, :, :end].transpose(-1, -2)  # [B,H,c,end]
        A = A.masked_fill(~_causal_mask(end - start, end, start, fq.device), 0.0)
        ys.append(A @ v[:, :, :end])
    y = torch.cat(ys, dim=2) + fq @ S0
    return y, S0 + fk.transpose(-1, -2) @ v


def _state_parallel(fq, fk, v, S0, chunk):
    """LT_state_parallel: every state at once as a cumulative sum of outer products. O(T F E) memory."""
    P = fk[..., :, None] * v[..., None, :]  # [B,H,T,F,E]
    S = torch.cumsum(P, dim=2) + S0[:, :, None]  # [B,H,T,F,E]
    y = torch.einsum("bhtf,bhtfe->bhte", fq, S)
    return y, S[:, :, -1]


def _chunked(fq, fk, v, S0, chunk):
    """LT_chunked: states only at chunk boundaries, attention inside each chunk. Any T."""
    B, H, T, Fd = fq.shape
    E = v.shape[-1]
    chunk = min(chunk, T)  # a chunk longer than the sequence would only add padding
    pad = (-T) % chunk
    if pad:  # zero keys and values add nothing to the state; padded outputs are dropped
        fq, fk, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (fq, fk, v))
    n = (T + pad) // chunk
    qc = fq.reshape(B, H, n, chunk, Fd)
    kc = fk.reshape(B, H, n, chunk, Fd)
    vc = v.reshape(B, H, n, chunk, E)
    P = kc.transpose(-1, -2) @ vc  # [B,H,n,F,E] each chunk's contribution
    # exclusive prefix sum: the state before each chunk (cat + cumsum avoids cumsum(P) - P cancellation)
    S_before = torch.cumsum(torch.cat([S0[:, :, None], P[:, :, :-1]], dim=2), dim=2)  # [B,H,n,F,E]
    # in place is safe: matmul's backward needs its inputs, not its output
    A = (qc @ kc.transpose(-1, -2)).tril_()  # [B,H,n,c,c] causal within the chunk
    y = torch.matmul(qc, S_before).add_(A @ vc)  # [B,H,n,c,E]
    S = S_before[:, :, -1] + P[:, :, -1]
    return y.reshape(B, H, n * chunk, E)[:, :, :T], S


FORMS: dict[str, Callable] = {
    "attention_loop": _attention_loop,
    "state_loop": _state_loop,
    "attention": _attention,
    "attention_blocked": _attention_blocked,
    "state_parallel": _state_parallel,
    "chunked": _chunked,
}


def _check_state(
    initial_state, B: int, H: int, Fd: int, Dv: int, dtype: torch.dtype, device, arg: str = "initial_state"
) -> State:
    if not (isinstance(initial_state, (tuple, list)) and len(initial_state) == 2):
        raise TypeError(f"{arg} must be a pair (S [B, H, F, Dv], z [B, H, F]) or None")
    S, z = initial_state
    for name, x, shape in ((f"{arg} S", S, (B, H, Fd, Dv)), (f"{arg} z", z, (B, H, Fd))):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)} [B, H, F(, Dv)], got {list(x.shape)}")
        if x.dtype != dtype:
            raise TypeError(
                f"{name} must be {dtype} (states accumulate in float32, or float64 for float64 inputs), got {x.dtype}"
            )
        if x.device != device:
            raise ValueError(f"{name} must be on {device}, got {x.device}")
    return S, z


def _featurize(q, k, feature_map, scale):
    phi_q, phi_k = resolve_feature_map(feature_map)
    fq, fk = phi_q(q), phi_k(k)
    if fq.shape != fk.shape or fq.shape[:-1] != q.shape[:-1]:
        raise ValueError(
            f"feature_map must map q and k to one shape [..., F], got {tuple(fq.shape)} and {tuple(fk.shape)}"
        )
    dtype = compute_dtype(q.dtype)
    fq = fq.to(dtype)
    if scale != 1.0:
        fq = fq * scale
    return fq, fk.to(dtype)


def _check_scalars(normalize, scale, eps):
    if not isinstance(normalize, bool):
        raise TypeError(f"normalize must be a bool, got {normalize!r}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a number, got {scale!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"eps must be a number >= 0, got {eps!r}")


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    form: str = "chunked",
    feature_map="elu",
    chunk_size: int = 64,
    normalize: bool = True,
    scale: float = 1.0,
    eps: float = 1e-6,
    initial_state: Optional[State] = None,
    output_final_state: bool = False,
) -> Tuple[torch.Tensor, Optional[State]]:
    """Causal linear attention. q, k: [B, T, H, Dk], v: [B, T, H, Dv] -> (o [B, T, H, Dv], state).

    form: one of ``attention_loop``, ``state_loop``, ``attention``, ``attention_blocked``,
    ``state_parallel``, ``chunked`` (all equal; ``chunked`` is the fast one for long T).
    feature_map: a name (``identity``, ``elu``, ``relu``, ``softplus``, ``based``), a callable
    ``[..., D] -> [..., F]`` (e.g. a module from ``lintrans.nn.feature_maps``) or a pair of callables
    (phi_q, phi_k). chunk_size: the chunk of ``chunked`` and the block of ``attention_blocked``, or
    ``"auto"``: the fastest measured on this machine (``lintrans.bench.tune``, cached on disk).
    state: ``(S [B, H, F, Dv], z [B, H, F])`` in float32 (float64 for float64 inputs), returned when
    ``output_final_state``; pass it back as ``initial_state`` to continue the sequence.
    """
    B, T, H, Dk, Dv = check_qkv(q, k, v)
    if not isinstance(form, str) or form not in FORMS:
        raise ValueError(f"form must be one of {list(FORMS)}, got {form!r}")
    if isinstance(chunk_size, str) and chunk_size != "auto" or not isinstance(chunk_size, (int, str)):
        raise TypeError(f"chunk_size must be a positive int or 'auto', got {chunk_size!r}")
    if chunk_size != "auto":
        check_positive_int("chunk_size", chunk_size)
    _check_scalars(normalize, scale, eps)
    out_dtype = q.dtype
    if isinstance(feature_map, str):  # named maps act on each vector alone: apply them head-first
        fq, fk = _featurize(q.transpose(1, 2), k.transpose(1, 2), feature_map, scale)  # [B,H,T,F]
    else:  # modules may hold per-head parameters and expect [B,T,H,D]
        fq, fk = (x.transpose(1, 2) for x in _featurize(q, k, feature_map, scale))  # [B,H,T,F]
    dtype = fq.dtype
    Fd = fq.shape[-1]
    if chunk_size == "auto":  # measured once per shape class, then read from the on-disk cache
        from lintrans.bench.tune import auto_chunk_size

        chunk_size = auto_chunk_size(T, Dv, Fd, dtype, q.device)
    if initial_state is None:
        S0 = torch.zeros(B, H, Fd, Dv + 1, dtype=dtype, device=q.device)
    else:
        S, z = _check_state(initial_state, B, H, Fd, Dv, dtype, q.device)
        S0 = torch.cat([S, z[..., None]], dim=-1)
    # the extra column of ones carries the normaliser: y[..., -1] = sum_j s_ij, S0[..., -1] = z
    # built directly in the [B,H,T,Dv+1] layout the forms use: one copy of v instead of two
    ones = torch.ones(B, H, T, 1, dtype=dtype, device=v.device)
    v1 = torch.cat([v.transpose(1, 2).to(dtype), ones], dim=-1)  # [B,H,T,Dv+1]
    # one copy into [B,H,T,F] up front (none for elu, which writes that layout): the forms' batched
    # matmuls would otherwise copy these strided views for every product, forward and backward
    fq, fk = fq.contiguous(), fk.contiguous()  # [B,H,T,F]
    y, S_end = FORMS[form](fq, fk, v1, S0, chunk_size)  # y: [B,H,T,Dv+1]
    y = y.transpose(1, 2)  # [B,T,H,Dv+1]
    o = y[..., :Dv] / (y[..., Dv:] + eps) if normalize else y[..., :Dv]
    state = (S_end[..., :Dv], S_end[..., Dv]) if output_final_state else None
    return o.to(out_dtype), state


def linear_attention_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: Optional[State] = None,
    *,
    feature_map="elu",
    normalize: bool = True,
    scale: float = 1.0,
    eps: float = 1e-6,
) -> Tuple[torch.Tensor, State]:
    """One token of the recurrence, for generation: q, k [B, H, Dk], v [B, H, Dv] -> (o [B, H, Dv], state).

    Cost and memory are constant in the number of tokens seen so far.
    """
    B, _, H, Dk, Dv = check_qkv(q, k, v, layout="[B, H, D]")
    _check_scalars(normalize, scale, eps)
    fq, fk = _featurize(q, k, feature_map, scale)  # [B,H,F]
    dtype = fq.dtype
    Fd = fq.shape[-1]
    if state is None:
        S = torch.zeros(B, H, Fd, Dv, dtype=dtype, device=q.device)
        z = torch.zeros(B, H, Fd, dtype=dtype, device=q.device)
    else:
        S, z = _check_state(state, B, H, Fd, Dv, dtype, q.device, arg="state")
    S = torch.addcmul(S, fk[..., :, None], v.to(dtype)[..., None, :])  # S + phi(k) v^T, one op
    z = z + fk
    num = (fq[..., None, :] @ S).squeeze(-2)  # [B,H,Dv]; a batched matmul costs less per token than einsum
    if normalize:
        num = num / ((fq * z).sum(-1, keepdim=True) + eps)
    return num.to(q.dtype), (S, z)


def linear_attention_reference(
    q, k, v, *, feature_map="elu", normalize=True, scale=1.0, eps=1e-6, initial_state=None
) -> Tuple[torch.Tensor, State]:
    """Plain float64 definition, term by term, for tests: (o, (S, z)). Slow; small inputs only."""
    phi_q, phi_k = resolve_feature_map(feature_map)
    fq = phi_q(q).double() * scale
    fk = phi_k(k).double()
    v = v.double()
    B, T, H, Fd = fq.shape
    Dv = v.shape[-1]
    if initial_state is None:
        S0 = torch.zeros(B, H, Fd, Dv, dtype=torch.float64)
        z0 = torch.zeros(B, H, Fd, dtype=torch.float64)
    else:
        S0, z0 = (x.double() for x in initial_state)
    o = torch.zeros(B, T, H, Dv, dtype=torch.float64)
    for i in range(T):
        num = torch.einsum("bhf,bhfe->bhe", fq[:, i], S0)
        den = torch.einsum("bhf,bhf->bh", fq[:, i], z0)
        for j in range(i + 1):
            s = (fq[:, i] * fk[:, j]).sum(-1)  # [B,H]
            num = num + s[..., None] * v[:, j]
            den = den + s
        o[:, i] = num / (den[..., None] + eps) if normalize else num
    S = S0 + torch.einsum("bthf,bthe->bhfe", fk, v)
    z = z0 + fk.sum(1)
    return o, (S, z)
