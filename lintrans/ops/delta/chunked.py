"""The chunked delta rule: the WY representation of a chunk's updates, by one unit-triangular solve.

Per chunk of c tokens with state S entering it, in-chunk cumulative log-decays b_i (Gamma_i =
exp(b_i), gamma = exp(b_c)) and E_ij = exp(b_i - b_j) for j <= i (every exponent <= 0):

    A  = strict_lower(diag(beta) K K^T * E)               L = I + A (unit lower triangular)
    W  = L^-1 (beta Gamma * K)      U~ = L^-1 (beta * V)    (the WY / UT transform)
    U  = U~ - W S                                          (the values the chunk actually writes)
    O  = (Gamma * Q) S + (lower(Q K^T) * E) U
    S' = gamma S + (K * exp(b_c - b))^T U

Only U and S' depend on the state, so the chunk-to-chunk loop is two small products per chunk; the
rest runs batched over all chunks. Backward walks the chunks in reverse carrying dS, the gradient
reaching the state after a chunk (``_Chunked.backward`` has the derivation's steps in order).
T that is not a multiple of c is padded with tokens that leave the state alone (k = v = beta = 0,
no decay) and whose outputs are dropped.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ..native import delta_rule as native_delta


def _pad(x: torch.Tensor, n: int) -> torch.Tensor:
    """Zero-pad dim 2 (T, head-first) by n."""
    if n == 0:
        return x
    pad = [0, 0] * (x.dim() - 3) + [0, n]
    return F.pad(x, pad)


def _decays(b: Optional[torch.Tensor], dtype):
    """From in-chunk cumulative log-decays b [B|1, H, N, c] (float64): E (lower, incl. diagonal) as
    [.., c, c], Gamma_i = exp(b_i), kappa_j = exp(b_c - b_j) and gamma = exp(b_c) in ``dtype``; all
    None without a decay. Differences are taken in float64: b can reach -1e4 within a chunk."""
    if b is None:
        return None, None, None, None
    c = b.shape[-1]
    diff = b[..., :, None] - b[..., None, :]
    mask = torch.ones(c, c, dtype=torch.bool, device=b.device).tril()
    E = diff.masked_fill(~mask, float("-inf")).exp().to(dtype)
    last = b[..., -1:]
    return E, b.exp().to(dtype), (last - b).exp().to(dtype), last.exp().to(dtype)[..., None]


def _mul(x, y):
    return x if y is None else x * y


class _Chunked(torch.autograd.Function):
    """q (scaled), k [B, H, N, c, Dk], v [B, H, N, c, Dv], beta [B, H, N, c], b [B|1, H, N, c] float64
    cumulative log-decays or None, S0 [B, H, Dk, Dv] -> (o [B, H, N, c, Dv], S [B, H, Dk, Dv])."""

    @staticmethod
    def forward(ctx, q, k, v, beta, b, S0):
        E, Gam, kap, gam = _decays(b, q.dtype)
        c = q.shape[-2]
        strict = torch.ones(c, c, dtype=torch.bool, device=q.device).tril(-1)
        Kk = k @ k.transpose(-1, -2)  # [B,H,N,c,c]
        L = (beta[..., :, None] * _mul(Kk, E)).masked_fill(~strict, 0.0)
        L.diagonal(dim1=-2, dim2=-1).fill_(1.0)
        bk = beta[..., None] * k
        R = torch.cat([_mul(bk, None if Gam is None else Gam[..., None]), beta[..., None] * v], dim=-1)
        X = torch.linalg.solve_triangular(L, R, upper=False, unitriangular=True)
        Dk = k.shape[-1]
        W, Ut = X[..., :Dk], X[..., Dk:]
        kh = _mul(k, None if kap is None else kap[..., None])  # keys decayed to the chunk's end
        N = q.shape[2]
        states = q.new_empty(*S0.shape[:2], N, *S0.shape[2:])  # the state entering each chunk
        U = torch.empty_like(Ut)
        S = S0
        for n in range(N):
            states[:, :, n] = S
            U[:, :, n] = Ut[:, :, n] - W[:, :, n] @ S
            S = torch.baddbmm(_mul(S, None if gam is None else gam[:, :, n]).flatten(0, 1),
                              kh[:, :, n].transpose(-1, -2).flatten(0, 1), U[:, :, n].flatten(0, 1)).view_as(S)
        P = _mul((q @ k.transpose(-1, -2)).tril(), E)  # [B,H,N,c,c]
        o = P @ U + _mul(q, None if Gam is None else Gam[..., None]) @ states
        ctx.save_for_backward(q, k, v, beta, b, L, W, Ut, U, states)
        return o, S

    @staticmethod
    @once_differentiable
    def backward(ctx, do, dS_end):
        q, k, v, beta, b, L, W, Ut, U, states = ctx.saved_tensors
        E, Gam, kap, gam = _decays(b, q.dtype)
        c, N, Dk = q.shape[-2], q.shape[2], k.shape[-1]
        strict = torch.ones(c, c, dtype=torch.bool, device=q.device).tril(-1)
        P = _mul((q @ k.transpose(-1, -2)).tril(), E)
        qG = _mul(q, None if Gam is None else Gam[..., None])
        kh = _mul(k, None if kap is None else kap[..., None])
        # 1. the reverse loop: dU_n = P^T do + kh dS, dS <- (Gamma q)^T do + gamma dS - W^T dU_n
        dU = P.transpose(-1, -2) @ do
        dS_in = qG.transpose(-1, -2) @ do  # [B,H,N,Dk,Dv]
        dS_after = torch.empty_like(states)  # the gradient reaching the state after each chunk
        dS = torch.zeros_like(states[:, :, 0]) if dS_end is None else dS_end
        for n in range(N - 1, -1, -1):
            dS_after[:, :, n] = dS
            dU[:, :, n] += kh[:, :, n] @ dS
            dS = dS_in[:, :, n] + _mul(dS, None if gam is None else gam[:, :, n]) - W[:, :, n].transpose(-1, -2) @ dU[:, :, n]
        dS0 = dS
        # 2. the output's products
        dP = (do @ U.transpose(-1, -2)).tril()
        dQK = _mul(dP, E)
        dq_inter = do @ states.transpose(-1, -2)  # d(Gamma q): [B,H,N,c,Dk]
        dq = dQK @ k + _mul(dq_inter, None if Gam is None else Gam[..., None])
        dk = dQK.transpose(-1, -2) @ q
        # 3. U = U~ - W S and the solve L [W, U~] = [beta Gamma k, beta v]
        dW = -(dU @ states.transpose(-1, -2))
        dR = torch.linalg.solve_triangular(L.transpose(-1, -2), torch.cat([dW, dU], dim=-1), upper=True,
                                           unitriangular=True)
        dRw, dRu = dR[..., :Dk], dR[..., Dk:]
        dA = -(dRw @ W.transpose(-1, -2) + dRu @ Ut.transpose(-1, -2)).masked_fill(~strict, 0.0)
        Kk = k @ k.transpose(-1, -2)
        rw = (dRw * k).sum(-1)  # [B,H,N,c]
        dk = dk + _mul(beta[..., None] * dRw, None if Gam is None else Gam[..., None])
        dv = beta[..., None] * dRu
        dbeta = _mul(rw, Gam) + (dRu * v).sum(-1)
        dAE = _mul(dA, E)
        dbeta = dbeta + (dAE * Kk).sum(-1)
        dKk = beta[..., :, None] * dAE
        dk = dk + (dKk + dKk.transpose(-1, -2)) @ k
        # 4. the state's update S' = gamma S + kh^T U
        dkh = U @ dS_after.transpose(-1, -2)  # [B,H,N,c,Dk]
        dk = dk + _mul(dkh, None if kap is None else kap[..., None])
        db = None
        if b is not None:
            Z = dAE * (beta[..., :, None] * Kk) + dP * P  # d/d(b_i - b_j) of every E_ij term
            db = Z.sum(-1) - Z.sum(-2) + (dq_inter * qG).sum(-1) + beta * Gam * rw
            y = (dkh * kh).sum(-1)  # d/d(b_c - b_j)
            db = db - y
            db[..., -1] += y.sum(-1) + (gam[..., 0, 0] * (states * dS_after).sum((-1, -2)))
            if b.shape[0] != q.shape[0]:  # a fixed decay, broadcast over the batch
                db = db.sum(0, keepdim=True)
            db = db.to(b.dtype)
        return dq, dk, dv, dbeta, db, dS0


def chunked(q, k, v, beta, log_decay, S0, chunk: int):
    """The chunked form on head-first tensors in the compute dtype: q (l2-normalised and scaled), k
    [B, H, T, Dk], v [B, H, T, Dv], beta [B, H, T], log_decay [B|1, H, T] or None, S0 [B, H, Dk, Dv] ->
    (o [B, H, T, Dv], S [B, H, Dk, Dv])."""
    B, H, T, Dk = q.shape
    c = min(chunk, T)
    N = -(-T // c)
    pad = N * c - T
    shaped = [_pad(x, pad).unflatten(2, (N, c)) for x in (q, k, v)]
    beta = _pad(beta[..., None], pad)[..., 0].unflatten(2, (N, c))
    b = None
    if log_decay is not None:
        b = _pad(log_decay.double()[..., None], pad)[..., 0].unflatten(2, (N, c)).cumsum(-1)
    o, S = _Chunked.apply(*shaped, beta, b, S0)
    return o.flatten(2, 3)[:, :, :T], S


class _Native(torch.autograd.Function):
    """The same chunked form by the fused CPU kernel (lintrans/ops/native/delta_rule.cpp), on [B, T, H, *]
    tensors as they come: q, k (L2-normalised by the kernel with ``l2``, q then scaled), v, beta [B, T, H],
    ld [B|1, T, H] or None, S0."""

    @staticmethod
    def forward(ctx, q, k, v, beta, ld, S0, chunk, l2, scale):
        o, u, states, S = native_delta.forward(q, k, v, beta, ld, S0, chunk, l2, scale)
        ctx.save_for_backward(q, k, v, beta, ld, u, states)
        ctx.args = chunk, l2, scale
        return o, S

    @staticmethod
    @once_differentiable
    def backward(ctx, do, dS_end):
        q, k, v, beta, ld, u, states = ctx.saved_tensors
        if dS_end is None:
            dS_end = q.new_zeros(states.shape[0], states.shape[1], *states.shape[3:])
        dq, dk, dv, dbeta, dld, dS0 = native_delta.backward(q, k, v, beta, ld, u, states, do, dS_end, *ctx.args)
        return dq, dk, dv, dbeta, dld, dS0, None, None, None


def native_chunked(q, k, v, beta, log_decay, S0, chunk: int, l2: bool, scale: float):
    """The fused kernel on [B, T, H, *] tensors in float32/float64 (see ``_Native``); log_decay
    [B, T, H], [H] or None. Returns (o [B, T, H, Dv], S [B, H, Dk, Dv])."""
    B, T, H, _ = q.shape
    ld = log_decay
    if ld is not None and ld.dim() == 1:
        ld = ld[None, None, :].expand(1, T, H)
    return _Native.apply(q, k, v, beta, ld, S0, min(chunk, T), l2, scale)
