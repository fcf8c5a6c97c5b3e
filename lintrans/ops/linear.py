"""Causal linear attention in the six forms of "Linear Transformers Are Faster After All".

Every form computes, for each position i and with phi the feature map,

    o_i = sum_{j<=i} s_ij v_j / (sum_{j<=i} s_ij + eps)     s_ij = scale * phi(q_i) . phi(k_j)

(without the division when ``normalize=False``), continuing from a recurrent state
``(S, z) = (sum_j phi(k_j) v_j^T, sum_j phi(k_j))`` handed in by a previous call.

Gated (decayed-state) attention: with ``log_decay`` (a_t <= 0, g_t = exp(a_t)) the state decays
before each token is added, ``S_t = g_t S_{t-1} + phi(k_t) v_t^T`` and ``z_t = g_t z_{t-1} + phi(k_t)``,
so the score of key j at query i is multiplied by ``exp(a_{j+1} + ... + a_i)``. Every form computes
that decay from differences of cumulative log-decays that are <= 0, so no ``exp`` of a positive
number is ever formed: gates that shut (a = -50) and long sequences of gates near 1 stay finite.

Implementation note: the normaliser is computed by every form for free by appending a column of
ones to v, so each form only has to implement ``y = causal(phi(q), phi(k), v) + phi(q) @ S0`` and
return the final state; numerator, denominator and (S, z) are then the columns of one result.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from .validation import check_number, check_positive_int, check_qkv, compute_dtype
from .feature_maps import resolve_feature_map

State = Tuple[torch.Tensor, torch.Tensor]

# Each form: (fq [B,H,T,F], fk [B,H,T,F], v [B,H,T,E], S0 [B,H,F,E], chunk, ld) -> (y [B,H,T,E], S [B,H,F,E])
# ld: None (no decay) or the log-decays [B or 1, H, T], <= 0, in the compute dtype.


def _causal_mask(n: int, m: int, offset: int, device) -> torch.Tensor:
    """mask[i, j] = key j (global index) <= query i + offset (global index)."""
    return torch.ones(n, m, dtype=torch.bool, device=device).tril(offset)


def _cumulative(ld: torch.Tensor) -> torch.Tensor:
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
    L = None if ld is None else _cumulative(ld)
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
    L = None if ld is None else _cumulative(ld)
    A = _scores(fq, fk, 0, L)  # [B,H,T,T]
    return A @ v + _from_state(fq, S0, L), _final_state(fk, v, S0, L)


def _attention_blocked(fq, fk, v, S0, chunk, ld=None):
    """LT_attention_parallel: query blocks of `chunk` rows against the keys up to them.

    Only a [chunk, i*chunk] strip of the attention matrix exists at a time, never T x T.
    """
    T = fq.shape[2]
    L = None if ld is None else _cumulative(ld)
    ys = []
    for start in range(0, T, chunk):
        end = min(start + chunk, T)
        ys.append(_scores(fq[:, :, start:end], fk[:, :, :end], start, L) @ v[:, :, :end])  # [B,H,c,E]
    y = torch.cat(ys, dim=2) + _from_state(fq, S0, L)
    return y, _final_state(fk, v, S0, L)


def _decayed_scan(g: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
    """X_t = g_t X_{t-1} + P_t with X_{-1} = 0, along dim 2, for all t at once (Hillis-Steele:
    log2(T) rounds, each combining every element with the one 2^r before it). g [B|1,H,T] in
    (0, 1], P [B,H,T,...]. Only products of gates (<= 1) are formed, so nothing overflows."""
    T = P.shape[2]
    extra = (None,) * (P.dim() - 3)
    d = 1
    while d < T:
        P = torch.cat([P[:, :, :d], P[:, :, d:] + g[:, :, d:][(...,) + extra] * P[:, :, :-d]], dim=2)
        g = torch.cat([g[:, :, :d], g[:, :, d:] * g[:, :, :-d]], dim=2)
        d *= 2
    return P


def _state_parallel(fq, fk, v, S0, chunk, ld=None):
    """LT_state_parallel: every state at once as a cumulative sum of outer products. O(T F E) memory.

    With a decay the cumulative sum becomes a parallel scan (``_decayed_scan``), O(T log T F E) work.
    """
    P = fk[..., :, None] * v[..., None, :]  # [B,H,T,F,E]
    if ld is None:
        S = torch.cumsum(P, dim=2) + S0[:, :, None]  # [B,H,T,F,E]
    else:
        L = _cumulative(ld)
        S = _decayed_scan(ld.exp(), P) + L.exp().to(P.dtype)[..., None, None] * S0[:, :, None]
    y = torch.einsum("bhtf,bhtfe->bhte", fq, S)
    return y, S[:, :, -1]


class _ChunkStates(torch.autograd.Function):
    """The state before each chunk and after the last, [B,H,n+1,F,E], from S0 [B,H,F,E], each chunk's
    own contribution P [B,H,n,F,E] and its total decay g [B|1,H,n]: X_0 = S0, X_{m+1} = g_m X_m + P_m.

    One fused multiply-add per chunk, written into one buffer: the chunks are few (T / c). Written
    as a Function because autograd through a loop of slices would zero-fill a full-size gradient
    for every slice (quadratic in the number of chunks); here the backward is the same loop reversed.
    """

    @staticmethod
    def forward(ctx, S0, P, g):
        B, H, n = P.shape[:3]
        X = P.new_empty(B, H, n + 1, *P.shape[3:])
        X[:, :, 0] = S0
        for m in range(n):
            torch.addcmul(P[:, :, m], g[:, :, m, None, None], X[:, :, m], out=X[:, :, m + 1])
        ctx.save_for_backward(X, g)
        return X

    @staticmethod
    def backward(ctx, dX):
        X, g = ctx.saved_tensors
        n = g.shape[2]
        dP = torch.empty_like(dX[:, :, 1:])  # dP_m is the whole gradient reaching X_{m+1}
        carry = dX[:, :, n]
        for m in range(n - 1, -1, -1):
            dP[:, :, m] = carry
            carry = torch.addcmul(dX[:, :, m], g[:, :, m, None, None], carry)
        dg = (dP * X[:, :, :-1]).sum((-1, -2))  # [B,H,n]
        if g.shape[0] != dg.shape[0]:  # a decay shared by the batch
            dg = dg.sum(0, keepdim=True)
        return carry, dP, dg


class _DecayedChunkAttention(torch.autograd.Function):
    """Attention inside each chunk with the decay between query i and key j: y = ((Q K^T) * D) V,
    D_ij = exp(b_i - b_j) for j <= i, else 0, from the in-chunk cumulative log-decays b [B|1,H,n,c].

    By hand rather than by autograd to pass over the [c, c] blocks fewer times and keep two of
    them for backward instead of three: the block's gradient dA gives the gradient of every
    exponent b_i - b_j as dA * A (A the decayed scores), and then, scaled by D in place, those of q and k.
    """

    @staticmethod
    def forward(ctx, qc, kc, vc, b):
        c = qc.shape[-2]
        mask = _causal_mask(c, c, 0, qc.device)
        D = (b[..., :, None] - b[..., None, :]).masked_fill_(~mask, float("-inf")).exp_()  # [B|1,H,n,c,c]
        A = torch.matmul(qc, kc.transpose(-1, -2)).mul_(D)  # [B,H,n,c,c]
        ctx.save_for_backward(qc, kc, vc, A, D)
        ctx.b_shape = b.shape
        return A @ vc

    @staticmethod
    def backward(ctx, dy):
        qc, kc, vc, A, D = ctx.saved_tensors
        dA = dy @ vc.transpose(-1, -2)  # [B,H,n,c,c]
        dv = A.transpose(-1, -2) @ dy
        db = None
        if ctx.needs_input_grad[3]:
            G = dA * A  # gradient of each exponent b_i - b_j
            db = G.sum(-1) - G.sum(-2)  # [B,H,n,c]
            if ctx.b_shape[0] != db.shape[0]:  # a decay shared by the batch
                db = db.sum(0, keepdim=True)
        dS = dA.mul_(D)  # gradient of the undecayed scores Q K^T
        return dS @ kc, dS.transpose(-1, -2) @ qc, dv, db


def _chunked(fq, fk, v, S0, chunk, ld=None):
    """LT_chunked: states only at chunk boundaries, attention inside each chunk. Any T."""
    B, H, T, Fd = fq.shape
    E = v.shape[-1]
    chunk = min(chunk, T)  # a chunk longer than the sequence would only add padding
    pad = (-T) % chunk
    if pad:  # zero keys and values add nothing to the state; padded outputs are dropped
        fq, fk, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (fq, fk, v))
        if ld is not None:  # and padded steps must not decay the final state
            ld = torch.nn.functional.pad(ld, (0, pad))
    n = (T + pad) // chunk
    qc = fq.reshape(B, H, n, chunk, Fd)
    kc = fk.reshape(B, H, n, chunk, Fd)
    vc = v.reshape(B, H, n, chunk, E)
    if ld is None:
        P = kc.transpose(-1, -2) @ vc  # [B,H,n,F,E] each chunk's contribution
        # exclusive prefix sum: the state before each chunk (cat + cumsum avoids cumsum(P) - P cancellation)
        S_before = torch.cumsum(torch.cat([S0[:, :, None], P[:, :, :-1]], dim=2), dim=2)  # [B,H,n,F,E]
        # in place is safe: matmul's backward needs its inputs, not its output
        A = (qc @ kc.transpose(-1, -2)).tril_()  # [B,H,n,c,c] causal within the chunk
        y = torch.matmul(qc, S_before).add_(A @ vc)  # [B,H,n,c,E]
        S = S_before[:, :, -1] + P[:, :, -1]
        return y.reshape(B, H, n * chunk, E)[:, :, :T], S
    # b: cumulative log-decay from the chunk's start, [B|1,H,n,c]; every exponent below is a
    # difference b_i - b_j (j <= i), b_i or b_last - b_j, all <= 0
    b = ld.reshape(ld.shape[0], H, n, chunk).cumsum(-1)
    last = b[..., -1:]  # [B|1,H,n,1]
    P = (kc * (last - b).exp()[..., None]).transpose(-1, -2) @ vc  # [B,H,n,F,E] decayed to the chunk's end
    states = _ChunkStates.apply(S0, P, last[..., 0].exp())  # [B,H,n+1,F,E]
    y = torch.matmul(qc * b.exp()[..., None], states[:, :, :-1])  # [B,H,n,c,E] from the earlier chunks
    y = y.add_(_DecayedChunkAttention.apply(qc, kc, vc, b))
    return y.reshape(B, H, n * chunk, E)[:, :, :T], states[:, :, -1]


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
    check_number("scale", scale)
    check_number("eps", eps, low=0)


def _check_log_decay(log_decay, B: int, T: Optional[int], H: int, device) -> None:
    """Shapes always; values (finite, <= 0) only on the CPU, where checking them costs no device sync."""
    layout = "[B, T, H] or [H]" if T is not None else "[B, H] or [H]"
    if not isinstance(log_decay, torch.Tensor):
        raise TypeError(f"log_decay must be None or a torch.Tensor {layout}, got {type(log_decay).__name__}")
    if not log_decay.is_floating_point():
        raise TypeError(f"log_decay must be a floating tensor, got {log_decay.dtype}")
    full = (B, T, H) if T is not None else (B, H)
    if tuple(log_decay.shape) not in (full, (H,)):
        raise ValueError(f"log_decay must have shape {list(full)} or [{H}] ({layout}), got {list(log_decay.shape)}")
    if log_decay.device != device:
        raise ValueError(f"log_decay must be on {device} like q, got {log_decay.device}")
    if log_decay.device.type == "cpu":
        bad = ~(log_decay <= 0) | torch.isinf(log_decay)  # NaN fails <= 0
        if bad.any():
            x = log_decay[bad][0].item()
            raise ValueError(f"log_decay must be finite and <= 0 (decays in (0, 1]), got {x}")


def _log_decay_head_first(log_decay, B: int, T: int, H: int, dtype) -> torch.Tensor:
    """[B, T, H] -> [B, H, T]; a fixed [H] -> [1, H, T] (broadcast over the batch)."""
    if log_decay.dim() == 1:
        return log_decay.to(dtype)[None, :, None].expand(1, H, T)
    return log_decay.to(dtype).transpose(1, 2)


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
    log_decay: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[State]]:
    """Causal linear attention. q, k: [B, T, H, Dk], v: [B, T, H, Dv] -> (o [B, T, H, Dv], state).

    form: one of ``attention_loop``, ``state_loop``, ``attention``, ``attention_blocked``,
    ``state_parallel``, ``chunked`` (all equal; ``chunked`` is the fast one for long T).
    feature_map: a name (``identity``, ``elu``, ``relu``, ``softplus``, ``based``), a callable
    ``[..., D] -> [..., F]`` (e.g. a module from ``lintrans.nn.feature_maps``) or a pair of callables
    (phi_q, phi_k). chunk_size: the chunk of ``chunked`` and the block of ``attention_blocked``, or
    ``"auto"``: the fastest measured on this machine (``lintrans.ops.chunk_tuning``, cached on disk).
    state: ``(S [B, H, F, Dv], z [B, H, F])`` in float32 (float64 for float64 inputs), returned when
    ``output_final_state``; pass it back as ``initial_state`` to continue the sequence.
    log_decay: None, or the log of the state's decay, ``[B, T, H]`` (a gate per token and head) or
    ``[H]`` (a fixed decay per head): ``S_t = exp(log_decay_t) S_{t-1} + phi(k_t) v_t^T`` and likewise
    z. Finite and <= 0 (checked on CPU tensors; on an accelerator the check would wait for the
    device, so only its shape is checked there); any float dtype, applied in the state's dtype;
    gradients flow to it.
    """
    B, T, H, Dk, Dv = check_qkv(q, k, v)
    if log_decay is not None:
        _check_log_decay(log_decay, B, T, H, q.device)
    if not isinstance(form, str) or form not in FORMS:
        raise ValueError(f"form must be one of {list(FORMS)}, got {form!r}")
    if isinstance(chunk_size, str) and chunk_size != "auto" or not isinstance(chunk_size, (int, str)):
        raise TypeError(f"chunk_size must be an int >= 1 or 'auto', got {chunk_size!r}")
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
        from .chunk_tuning import auto_chunk_size

        chunk_size = auto_chunk_size(T, Dv, Fd, dtype, q.device, gated=log_decay is not None)
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
    ld = None if log_decay is None else _log_decay_head_first(log_decay, B, T, H, dtype)  # [B|1,H,T]
    y, S_end = FORMS[form](fq, fk, v1, S0, chunk_size, ld)  # y: [B,H,T,Dv+1]
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
    log_decay: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, State]:
    """One token of the recurrence, for generation: q, k [B, H, Dk], v [B, H, Dv] -> (o [B, H, Dv], state).

    Cost and memory are constant in the number of tokens seen so far. ``log_decay`` [B, H] or [H]:
    the state is multiplied by ``exp(log_decay)`` before this token is added (see ``linear_attention``).
    """
    B, _, H, Dk, Dv = check_qkv(q, k, v, layout="[B, H, D]")
    _check_scalars(normalize, scale, eps)
    if log_decay is not None:
        _check_log_decay(log_decay, B, None, H, q.device)
    fq, fk = _featurize(q, k, feature_map, scale)  # [B,H,F]
    dtype = fq.dtype
    Fd = fq.shape[-1]
    if state is None:
        S = torch.zeros(B, H, Fd, Dv, dtype=dtype, device=q.device)
        z = torch.zeros(B, H, Fd, dtype=dtype, device=q.device)
    else:
        S, z = _check_state(state, B, H, Fd, Dv, dtype, q.device, arg="state")
    if log_decay is not None:
        g = log_decay.to(dtype).exp().expand(B, H)  # [B,H]
        S, z = S * g[..., None, None], z * g[..., None]
    S = torch.addcmul(S, fk[..., :, None], v.to(dtype)[..., None, :])  # S + phi(k) v^T, one op
    z = z + fk
    num = (fq[..., None, :] @ S).squeeze(-2)  # [B,H,Dv]; a batched matmul costs less per token than einsum
    if normalize:
        num = num / ((fq * z).sum(-1, keepdim=True) + eps)
    return num.to(q.dtype), (S, z)


def linear_attention_reference(
    q, k, v, *, feature_map="elu", normalize=True, scale=1.0, eps=1e-6, initial_state=None, log_decay=None
) -> Tuple[torch.Tensor, State]:
    """Plain float64 definition, term by term, for tests: (o, (S, z)). Slow; small inputs only.

    With ``log_decay`` ([B, T, H] or [H]) key j's score at query i is multiplied by the product of
    the gates g_{j+1} .. g_i, and the initial state by g_1 .. g_i.
    """
    phi_q, phi_k = resolve_feature_map(feature_map)
    fq = phi_q(q).double() * scale
    fk = phi_k(k).double()
    v = v.double()
    B, T, H, Fd = fq.shape
    Dv = v.shape[-1]
    g = torch.ones(B, T, H, dtype=torch.float64)
    if log_decay is not None:
        g = g * log_decay.double().exp()  # [B,T,H]; an [H] decay broadcasts
    if initial_state is None:
        S0 = torch.zeros(B, H, Fd, Dv, dtype=torch.float64)
        z0 = torch.zeros(B, H, Fd, dtype=torch.float64)
    else:
        S0, z0 = (x.double() for x in initial_state)
    o = torch.zeros(B, T, H, Dv, dtype=torch.float64)
    for i in range(T):
        gate = torch.ones(B, H, dtype=torch.float64)  # prod_{t=j+1..i} g_t, built as j goes down
        num = torch.zeros(B, H, Dv, dtype=torch.float64)
        den = torch.zeros(B, H, dtype=torch.float64)
        for j in range(i, -1, -1):
            s = (fq[:, i] * fk[:, j]).sum(-1) * gate  # [B,H]
            num = num + s[..., None] * v[:, j]
            den = den + s
            gate = gate * g[:, j]
        num = num + gate[..., None] * torch.einsum("bhf,bhfe->bhe", fq[:, i], S0)  # gate = prod_{t<=i} g_t
        den = den + gate * torch.einsum("bhf,bhf->bh", fq[:, i], z0)
        o[:, i] = num / (den[..., None] + eps) if normalize else num
    S, z = S0, z0
    for t in range(T):
        S = g[:, t, :, None, None] * S + torch.einsum("bhf,bhe->bhfe", fk[:, t], v[:, t])
        z = g[:, t, :, None] * z + fk[:, t]
    return o, (S, z)
