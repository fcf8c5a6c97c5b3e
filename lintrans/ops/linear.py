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

import functools
from typing import Callable, NamedTuple, Optional, Tuple

import torch
from torch.autograd.function import once_differentiable

from .validation import (
    autocast_off, check_choice, check_number, check_positive_int, check_qkv, compute_dtype, reads_values,
)
from .scan import decayed_scan
from .feature_maps import OUTPUT_DERIVATIVES, named_feature_dim, resolve_feature_map
from .native import chunked as native_chunked

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


def _state_parallel(fq, fk, v, S0, chunk, ld=None):
    """LT_state_parallel: every state at once as a cumulative sum of outer products. O(T F E) memory.

    With a decay the cumulative sum becomes a parallel scan (``decayed_scan``), O(T log T F E) work.
    """
    P = fk[..., :, None] * v[..., None, :]  # [B,H,T,F,E]
    if ld is None:
        S = torch.cumsum(P, dim=2) + S0[:, :, None]  # [B,H,T,F,E]
    else:
        L = _cumulative(ld)
        S = decayed_scan(ld.exp()[..., None, None], P) + L.exp().to(P.dtype)[..., None, None] * S0[:, :, None]
    y = torch.einsum("bhtf,bhtfe->bhte", fq, S)
    return y, S[:, :, -1]


class _Chunked(NamedTuple):
    """How ``_ChunkedAttention`` runs (see there)."""

    phi: Optional[Callable]  # the feature map, applied block by block; None: q and k are features already
    dphi: Optional[Callable]  # phi's derivative from its output (None: by autograd)
    scale: float
    chunk: int
    block: int  # chunks per block
    normalize: Optional[bool]  # None: v carries the normaliser column already; every column of y is returned
    eps: float
    dtype: torch.dtype  # the compute (state) dtype
    out_dtype: torch.dtype
    native: Optional[str] = None  # run the fused CPU kernel with this named map (ops/native), or not (None)


# Tokens x heads per block on a CPU: a block's temporaries (a few MB) stay in cache and are reused
# from the heap (docs/dev/chunked-kernel.md).
BLOCK_TOKEN_HEADS = 8192
# Calls of up to this many tokens x heads keep their blocks for backward instead of recomputing them
KEEP_TOKEN_HEADS = 8192


def _chunks_per_block(device: torch.device, heads: int, chunk: int, n: int) -> int:
    """About ``BLOCK_TOKEN_HEADS`` tokens x heads per block on a CPU; one block elsewhere (an
    accelerator's caching allocator reuses memory, and it wants few, large kernels)."""
    if device.type != "cpu":
        return max(n, 1)
    return max(1, BLOCK_TOKEN_HEADS // (heads * chunk))


def _blocks(T: int, chunk: int, block: int) -> list:
    """(first token, chunks, chunk length) of each block: whole chunks, ``block`` at a time, then
    the last T mod chunk tokens as one shorter chunk (the chunked algebra holds for any length, so
    nothing is padded)."""
    n, r = divmod(T, chunk)
    blocks = [(m * chunk, min(block, n - m), chunk) for m in range(0, n, block)]
    return blocks + [(n * chunk, 1, r)] if r else blocks


def _block_view(x: torch.Tensor, t0: int, nb: int, c: int) -> torch.Tensor:
    """[B, T, H, *] -> its tokens t0 .. t0 + nb c as [nb, B, H, c, *], chunk-major (a view; one
    as_strided call instead of slice, unflatten and permute: short calls are bound by per-op cost)."""
    sB, sT, sH, *rest = x.stride()
    return x.as_strided((nb, x.shape[0], x.shape[2], c, *x.shape[3:]), (c * sT, sB, sH, sT, *rest),
                        x.storage_offset() + t0 * sT)


def _gather(x: torch.Tensor, dtype: torch.dtype, columns: Optional[int] = None) -> torch.Tensor:
    """A contiguous copy of a block view in ``dtype``, with ``columns`` >= its last dimension (the
    extra columns left for the caller to fill)."""
    out = torch.empty(*x.shape[:-1], columns or x.shape[-1], dtype=dtype, device=x.device)
    out[..., : x.shape[-1]] = x
    return out


def _block_inputs(q, k, v, ld, t0: int, nb: int, c: int, cfg: _Chunked, grad: bool = False):
    """A block's features [nb, B, H, c, F], values with the normaliser column [nb, B, H, c, E] and
    in-chunk cumulative log-decays b [nb|1, B|1, H, c] in base 2 (or None), and with ``grad`` the
    feature map's inputs (its graph recorded from them, for its gradient)."""
    qb, kb = _block_view(q, t0, nb, c), _block_view(k, t0, nb, c)
    if cfg.phi is None:
        fq, fk, xq, xk = _gather(qb, cfg.dtype), _gather(kb, cfg.dtype), None, None
    else:
        # named maps act on each vector alone, so a block of the map is the map of the block
        xq, xk = qb.to(cfg.dtype), kb.to(cfg.dtype)
        if grad:
            xq, xk = xq.detach().requires_grad_(), xk.detach().requires_grad_()
        fq, fk = cfg.phi(xq).contiguous(), cfg.phi(xk).contiguous()
    vb = _block_view(v, t0, nb, c)
    if cfg.normalize is None:
        vb = _gather(vb, cfg.dtype)
    else:
        vb = _gather(vb, cfg.dtype, vb.shape[-1] + 1)
        vb[..., -1] = 1.0  # the normaliser column: y[..., -1] = sum_j s_ij, and the state's z
    b = None
    if ld is not None:  # a fixed decay (stride 0 along T) is the same in every chunk: one chunk's worth
        b = _block_view(ld, t0, 1 if ld.stride(1) == 0 else nb, c).cumsum(-1).mul_(LOG2E)
    return fq, fk, vb, b, (xq, xk) if grad else None


# The in-chunk cumulative log-decays are kept in base 2 (b = log2 of the decay) and every decay is
# an exp2: the same numbers as exp of the natural logs, and exp2 is the cheaper kernel on a CPU
LOG2E = 1.4426950408889634


def _decays(b: torch.Tensor):
    """From in-chunk cumulative log2-decays b [nb|1, B|1, H, c]: 2^b_i (the state before the chunk,
    seen by query i), 2^(b_last - b_j) (key j to the chunk's end), 2^b_last (the whole chunk), as
    [..., c, 1], [..., c, 1], [..., 1, 1]; every exponent <= 0, all from one exp2."""
    c = b.shape[-1]
    e = torch.cat([b, b[..., -1:] - b], -1).exp2_()
    return e[..., :c, None], e[..., c:, None], e[..., c - 1 : c, None]


def _chunk_scores(fq3, fk3, b, shape):
    """Causal in-chunk scores A [nb B H, c, c]: phi(q_i) . phi(k_j) for j <= i, times
    D_ij = 2^(b_i - b_j) with a decay; returns (A, D), D [nb|1, B|1, H, c, c] or None."""
    A = torch.bmm(fq3, fk3.transpose(1, 2))
    if b is None:
        return A.tril_(), None
    c = b.shape[-1]
    # b falls along the chunk, so b_i - b_j <= 0 on and below the diagonal and >= 0 above it: clamped
    # to 0 there (exp2 of a finite number <= 0 is also much cheaper than of -inf), then cut off
    D = (b[..., :, None] - b[..., None, :]).clamp_max_(0.0).exp2_().tril_()
    return A.view(*shape[:3], c, c).mul_(D).view(-1, c, c), D


@functools.lru_cache(maxsize=16)
def _lower_ones(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.ones(n, n, dtype=dtype, device=device).tril_()


def _scan_(Y: torch.Tensor, g: Optional[torch.Tensor], reverse: bool = False) -> torch.Tensor:
    """The recurrence across a block's chunks, in place on Y [nb + 1, B, H, F, E]:
    Y[m + 1] += g_m Y[m] for m = 0 .. nb - 1 (the state after each chunk from the one before it
    and the chunk's sum), or with ``reverse`` Y[m] += g_m Y[m + 1] for m = nb - 1 .. 0 (its
    transpose, for the gradients). g [nb|1, B|1, H, 1, 1]: each chunk's total decay (<= 1), None
    for none. nb small in-place kernels: cheaper than a matmul by an [nb + 1, nb + 1] scan matrix,
    and only decays <= 1 are ever multiplied."""
    nb = Y.shape[0] - 1
    for m in range(nb - 1, -1, -1) if reverse else range(nb):
        dst, src = (Y[m], Y[m + 1]) if reverse else (Y[m + 1], Y[m])
        if g is None:
            dst.add_(src)
        else:
            dst.addcmul_(g[m if g.shape[0] > 1 else 0], src)
    return Y


def _chunk_states(fk, vb, b, S, dec):
    """X [nb + 1, B, H, F, E]: the state before each chunk of the block (X[0] = S) and after it."""
    nb, B, H, c, Fd = fk.shape
    E = vb.shape[-1]
    X = fk.new_empty(nb + 1, B, H, Fd, E)
    X[0] = S
    kd = fk if b is None else fk * dec[1]  # each key decayed to its chunk's end
    torch.bmm(kd.view(-1, c, Fd).transpose(1, 2), vb.view(-1, c, E), out=X[1:].view(-1, Fd, E))  # chunk sums
    return _scan_(X, None if b is None else dec[2]), kd  # X[m+1] = g_m X[m] + P_m


class _Block(NamedTuple):
    """What a block's forward computes and its backward needs."""

    fq: torch.Tensor  # [nb, B, H, c, F] features
    fk: torch.Tensor
    vb: torch.Tensor  # [nb, B, H, c, E] values and the normaliser column
    b: Optional[torch.Tensor]  # [nb|1, B|1, H, c] in-chunk cumulative log-decays, or None
    dec: Optional[tuple]  # _decays(b)
    X: torch.Tensor  # [nb + 1, B, H, F, E] the state before each chunk, and after the last
    kd: torch.Tensor  # fk decayed to its chunk's end, or fk itself
    A: torch.Tensor  # [nb B H, c, c] causal (decayed) scores
    D: Optional[torch.Tensor]  # [nb|1, B|1, H, c, c] the in-chunk decays, or None


def _block(fq, fk, vb, b, S) -> _Block:
    """A block's chunk states and scores from its inputs and the state S before it."""
    c, Fd = fq.shape[-2:]
    dec = None if b is None else _decays(b)
    X, kd = _chunk_states(fk, vb, b, S, dec)
    A, D = _chunk_scores(fq.view(-1, c, Fd), fk.view(-1, c, Fd), b, fq.shape)
    return _Block(fq, fk, vb, b, dec, X, kd, A, D)


def _block_output(blk: _Block) -> torch.Tensor:
    """y [nb, B, H, c, E]: what the earlier chunks' state gives, plus the chunk's own scores."""
    nb, B, H, c, Fd = blk.fq.shape
    E = blk.vb.shape[-1]
    y = torch.bmm(blk.fq.view(-1, c, Fd), blk.X[:-1].view(-1, Fd, E))
    if blk.b is not None:  # the state as query i sees it: decayed by 2^b_i (its rows, in place)
        y.view(nb, B, H, c, E).mul_(blk.dec[0])
    return y.baddbmm_(blk.A, blk.vb.view(-1, c, E)).view(nb, B, H, c, E)


def _block_backward(blk: _Block, dy, dS, need_db: bool):
    """Gradients of a block: (d fq, d fk, d vb, d ld) given dy (overwritten) and dS, the gradient
    reaching the state after the block; dS becomes (in place) the gradient reaching the state
    before it."""
    fq, fk, vb, b, dec, X, kd, A, D = blk
    nb, B, H, c, Fd = fq.shape
    E = vb.shape[-1]
    q3, k3, v3, dy3 = fq.view(-1, c, Fd), fk.view(-1, c, Fd), vb.view(-1, c, E), dy.view(-1, c, E)
    dA = torch.bmm(dy3, v3.transpose(1, 2))  # [nb B H, c, c]
    dv = torch.bmm(A.transpose(1, 2), dy3)
    if b is not None:  # from here on, the gradient of the state's part of y before its decay 2^b_i
        dy.mul_(dec[0])
    # G[m]: the gradient reaching X[m]; G[nb] = dS, G[m] = fq_m^T dy_m + g_m G[m+1]: the transposed scan
    G = fq.new_empty(nb + 1, B, H, Fd, E)
    G[nb] = dS
    torch.bmm(q3.transpose(1, 2), dy3, out=G[:-1].view(-1, Fd, E))
    G = _scan_(G, None if b is None else dec[2], reverse=True)
    dS.copy_(G[0])
    dP3 = G[1:].view(-1, Fd, E)  # the gradient of each chunk's sum
    dv.baddbmm_(kd.view(-1, c, Fd), dP3)
    dq = torch.bmm(dy3, X[:-1].view(-1, Fd, E).transpose(1, 2))
    dk = torch.bmm(v3, dP3.transpose(1, 2))  # d kd
    if b is None:
        dA.tril_()
    else:
        dA.view(nb, B, H, c, c).mul_(D)  # the gradient of the undecayed scores
        dk.view(fq.shape).mul_(dec[1])
    dq.baddbmm_(dA, k3)
    dk.baddbmm_(dA.transpose(1, 2), q3)
    dq, dk = dq.view(fq.shape), dk.view(fq.shape)
    db = None
    if need_db:
        # b_i (in nats here) enters only as phi(q_i) e^{b_i} and phi(k_i) e^{-b_i} (every exponent is
        # such a sum), and b_last besides as the factor e^{b_last} of the whole state after the chunk;
        # so b's gradient is <phi(q_i), d phi(q_i)> - <phi(k_i), d phi(k_i)>, plus <G[m+1], X[m+1]>
        # for b_last
        db = (fq * dq).addcmul_(fk, dk, value=-1).sum(-1)  # [nb, B, H, c]
        d_last = torch.linalg.vecdot(G[1:].flatten(-2), X[1:].flatten(-2))  # [nb, B, H]
        if b.shape[1] != B:  # a decay shared by the batch
            db, d_last = db.sum(1, keepdim=True), d_last.sum(1, keepdim=True)
        # ld_t's gradient: every db_i with i >= t (one matmul), and b_last's
        db = torch.matmul(db, _lower_ones(c, db.dtype, db.device)).add_(d_last[..., None])
    return dq, dk, dv.view(vb.shape), db


def _without_autocast(fn):
    """Run an autograd Function's forward/backward with autocast off for the device of its first
    tensor argument: the op chooses its own dtypes (float32 accumulation), and autocast would turn
    its matmuls to 16 bits and break its in-place accumulations."""

    @functools.wraps(fn)
    def wrapper(ctx, x, *args):
        with autocast_off(x.device):
            return fn(ctx, x, *args)

    return wrapper


class _ChunkedAttention(torch.autograd.Function):
    """LT_chunked, block by block: ``(o, S_end)`` from q, k [B, T, H, Dk] (their features when
    ``cfg.phi`` is None), v [B, T, H, Dv], log-decays ld [B|1, T, H] or None, and the state S0
    [B, H, F, E] (its last column the normaliser z).

    Inside a chunk of c tokens the (decayed) scores are a [c, c] matrix; across chunks a state
    carries what came before. Chunks are taken ``cfg.block`` at a time, every head of a block in
    one batched matmul, and the state is carried from block to block. Every temporary is a
    block's worth, never T-sized, so the speed does not depend on how the allocator treats large
    blocks (glibc maps and page-faults anything above 32 MiB afresh on every call). The feature
    map, the normaliser column of ones, the scale and the division happen per block too: the
    only T-sized tensors are the output and, in backward, the gradients.

    Backward is derived by hand and runs over the blocks in reverse, carrying the gradient of the
    state. It recomputes a block's features, chunk states and scores from the inputs and the
    state at the block's start; besides the inputs it keeps only those states, the output and
    the normaliser. Short calls (up to ``KEEP_TOKEN_HEADS`` tokens x heads) keep their blocks
    instead: a few MB, and backward then runs fewer, larger kernels.

    With a decay, b is the cumulative log-decay from each chunk's start (<= 0), and every exponent
    is a difference b_i - b_j (j <= i), b_i, b_last - b_j or b_last, all <= 0: nothing overflows.
    """

    @staticmethod
    @_without_autocast
    def forward(ctx, q, k, v, ld, S0, cfg: _Chunked):
        if cfg.native is not None:  # the same algebra, fused (lintrans/ops/native/chunked.cpp)
            o, den, states, S_end = native_chunked.forward(q, k, v, ld, S0, cfg.chunk, cfg.native, cfg.normalize,
                                                           cfg.scale, cfg.eps)
            ctx.save_for_backward(q, k, v, ld, states, den, o)
            ctx.cfg, ctx.kept = cfg, []
            return o.to(cfg.out_dtype), S_end
        B, T, H = q.shape[:3]
        Dv = v.shape[-1]
        o = torch.empty(B, T, H, Dv, dtype=cfg.dtype, device=q.device)
        den = torch.empty(B, T, H, dtype=cfg.dtype, device=q.device) if cfg.normalize else None
        blocks = _blocks(T, cfg.chunk, cfg.block)
        states = S0.new_empty(len(blocks) + 1, *S0.shape)  # the state before each block, and the last
        states[0] = S0
        # a short call keeps its blocks for backward (block-sized, and fewer, larger kernels than
        # recomputing them); a long one keeps only the states between blocks
        keep = q.shape[0] * T * q.shape[2] <= KEEP_TOKEN_HEADS and (cfg.phi is None or cfg.dphi is not None)
        kept = []
        for i, (t0, nb, c) in enumerate(blocks):
            blk = _block(*_block_inputs(q, k, v, ld, t0, nb, c, cfg)[:4], states[i])
            y = _block_output(blk)
            states[i + 1] = blk.X[nb]
            if keep:
                kept.append(blk)
            if cfg.scale != 1.0:
                y.mul_(cfg.scale)
            out = _block_view(o, t0, nb, c)
            if cfg.normalize:
                d = torch.add(y[..., Dv], cfg.eps, out=_block_view(den, t0, nb, c))
                torch.div(y[..., :Dv], d[..., None], out=out)
            else:
                out.copy_(y[..., :Dv])
        ctx.save_for_backward(q, k, v, ld, states, den, o)
        ctx.cfg, ctx.kept = cfg, kept
        return o.to(cfg.out_dtype), states[-1].clone()

    @staticmethod
    @once_differentiable  # the hand-derived backward is not itself differentiable: a clear error, not a wrong one
    @_without_autocast
    def backward(ctx, do, dS_end):
        q, k, v, ld, states, den, o = ctx.saved_tensors
        cfg = ctx.cfg
        Dv = v.shape[-1]
        need_db = ld is not None and ctx.needs_input_grad[3]
        if cfg.native is not None:
            dq, dk, dv, dld, dS = native_chunked.backward(q, k, v, ld, o, den, states, do, dS_end, cfg.chunk,
                                                          cfg.native, cfg.normalize, cfg.scale, cfg.eps, need_db)
            return dq, dk, dv, dld, dS, None
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dld = torch.empty(ld.shape, dtype=cfg.dtype, device=ld.device) if need_db else None
        dS = dS_end.clone()  # the gradient reaching the state after the block at hand
        blocks = _blocks(q.shape[1], cfg.chunk, cfg.block)
        by_autograd = cfg.phi is not None and cfg.dphi is None
        for i in range(len(blocks) - 1, -1, -1):
            t0, nb, c = blocks[i]
            if ctx.kept:
                blk = ctx.kept[i]
            else:
                with torch.set_grad_enabled(by_autograd):
                    fq, fk, vb, b, x = _block_inputs(q, k, v, ld, t0, nb, c, cfg, grad=by_autograd)
                blk = _block(fq.detach(), fk.detach(), vb, b, states[i])
            dy = torch.empty(blk.vb.shape, dtype=cfg.dtype, device=q.device)
            do_b = _block_view(do, t0, nb, c)
            if cfg.normalize:  # o = y / d: dy = do / d, d(d) = -sum(do o) / d
                torch.div(do_b, _block_view(den, t0, nb, c)[..., None], out=dy[..., :Dv])
                torch.sum(dy[..., :Dv] * _block_view(o, t0, nb, c), -1, out=dy[..., Dv]).neg_()
            else:
                dy[..., :Dv] = do_b
                dy[..., Dv:] = 0.0
            if cfg.scale != 1.0:
                dy.mul_(cfg.scale)
            dfq, dfk, dvb, db = _block_backward(blk, dy, dS, need_db)
            if cfg.dphi is not None:
                dfq, dfk = dfq.mul_(cfg.dphi(blk.fq)), dfk.mul_(cfg.dphi(blk.fk))
            elif by_autograd:
                dfq, dfk = torch.autograd.grad((fq, fk), x, (dfq, dfk))
            _block_view(dq, t0, nb, c).copy_(dfq)
            _block_view(dk, t0, nb, c).copy_(dfk)
            _block_view(dv, t0, nb, c).copy_(dvb[..., :Dv])
            if need_db:
                _block_view(dld, t0, nb, c).copy_(db)
        return dq, dk, dv, dld, dS, None


def _chunked(fq, fk, v, S0, chunk, ld=None):
    """LT_chunked as a form: features [B, H, T, F], v with its normaliser column [B, H, T, E]. (The
    op itself calls ``_ChunkedAttention`` on q, k, v directly, with the feature map inside.)"""
    B, H, T, _ = fq.shape
    chunk = min(chunk, T)
    cfg = _Chunked(None, None, 1.0, chunk, _chunks_per_block(fq.device, B * H, chunk, T // chunk), None, 0.0,
                   fq.dtype, fq.dtype)
    ld = None if ld is None else ld.transpose(1, 2)
    y, S = _ChunkedAttention.apply(fq.transpose(1, 2), fk.transpose(1, 2), v.transpose(1, 2), ld, S0, cfg)
    return y.transpose(1, 2), S


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
    """Shapes always; values (finite, <= 0) only on the CPU, where checking them costs no device sync
    (``reads_values``)."""
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
    if reads_values(log_decay.device):
        lo, hi = torch.aminmax(log_decay)  # one pass; a NaN makes both NaN
        if not (hi <= 0 and lo > float("-inf")):
            bad = ~(log_decay <= 0) | torch.isinf(log_decay)  # NaN fails <= 0
            raise ValueError(f"log_decay must be finite and <= 0 (decays in (0, 1]), got {log_decay[bad][0].item()}")


def _log_decay_head_first(log_decay, B: int, T: int, H: int, dtype) -> torch.Tensor:
    """[B, T, H] -> [B, H, T]; a fixed [H] -> [1, H, T] (broadcast over the batch)."""
    if log_decay.dim() == 1:
        return log_decay.to(dtype)[None, :, None].expand(1, H, T)
    return log_decay.to(dtype).transpose(1, 2)


def _resolve_chunk(chunk_size, T: int, Dv: int, Fd: int, dtype, device, gated: bool) -> int:
    if chunk_size == "auto":  # measured once per shape class, then read from the on-disk cache
        from .chunk_tuning import auto_chunk_size

        return auto_chunk_size(T, Dv, Fd, dtype, device, gated=gated)
    return chunk_size


def _state0(initial_state, B: int, H: int, Fd: int, Dv: int, dtype, device) -> torch.Tensor:
    """The state to start from, [B, H, F, Dv + 1]: S with z as its last column."""
    if initial_state is None:
        return torch.zeros(B, H, Fd, Dv + 1, dtype=dtype, device=device)
    S, z = _check_state(initial_state, B, H, Fd, Dv, dtype, device)
    return torch.cat([S, z[..., None]], dim=-1)


def _chunked_attention(q, k, v, feature_map, chunk_size, normalize, scale, eps, initial_state,
                       output_final_state, log_decay):
    """The chunked form on q, k, v [B, T, H, D] (``_ChunkedAttention``); a named feature map is
    applied inside it, block by block, so that no T-sized features are ever stored."""
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    dtype = compute_dtype(q.dtype)
    if isinstance(feature_map, str) and feature_map != "identity":
        phi, Fd = resolve_feature_map(feature_map)[0], named_feature_dim(feature_map, Dk)
    else:  # a module may hold (per-head) parameters: it is applied here, to [B, T, H, D]
        phi, (q, k) = None, _featurize(q, k, feature_map, 1.0)
        Fd = q.shape[-1]
    dphi = OUTPUT_DERIVATIVES.get(feature_map) if phi is not None else None
    chunk = min(_resolve_chunk(chunk_size, T, Dv, Fd, dtype, q.device, log_decay is not None), T)
    S0 = _state0(initial_state, B, H, Fd, Dv, dtype, q.device)
    ld = None
    if log_decay is not None:
        ld = log_decay.to(dtype)
        ld = ld.expand(1, T, H) if ld.dim() == 1 else ld  # a fixed [H] decay: the same for every token
    native = feature_map if phi is not None else "identity"
    if not native_chunked.supports(q, k, v, ld, native, normalize, dtype):
        native = None
    cfg = _Chunked(phi, dphi, scale, chunk, _chunks_per_block(q.device, B * H, chunk, T // chunk), normalize, eps,
                   dtype, v.dtype, native)
    o, S_end = _ChunkedAttention.apply(q, k, v, ld, S0, cfg)
    return o, ((S_end[..., :Dv], S_end[..., Dv]) if output_final_state else None)


def _fla_attention(q, k, v, form, feature_map, normalize, scale, eps, initial_state, output_final_state, log_decay):
    """backend="fla": our feature map and state layout around flash-linear-attention's chunked kernel."""
    from .fla_backend import check_fla_case, fla_linear_attention

    check_fla_case(q, form)
    B, _, H, _, Dv = check_qkv(q, k, v)
    fq, fk = _featurize(q, k, feature_map, 1.0)  # [B,T,H,F] in the state dtype
    S0 = None if initial_state is None else _state0(initial_state, B, H, fq.shape[-1], Dv, fq.dtype, q.device)
    return fla_linear_attention(q, k, v, fq, fk, S0, log_decay, normalize=normalize, scale=scale, eps=eps,
                                output_final_state=output_final_state)


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
    backend: str = "torch",
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
    backend: ``"torch"`` (ours, the default) or ``"fla"``: the chunked form by flash-linear-attention's
    kernels, on CUDA where ``fla`` is importable (``lintrans.ops.fla_backend``; a ValueError says why
    not otherwise). Unverified on hardware by this project (docs/gpu.md).
    """
    B, T, H, Dk, Dv = check_qkv(q, k, v)
    if log_decay is not None:
        _check_log_decay(log_decay, B, T, H, q.device)
    check_choice("form", form, FORMS)
    if isinstance(chunk_size, str) and chunk_size != "auto" or not isinstance(chunk_size, (int, str)):
        raise TypeError(f"chunk_size must be an int >= 1 or 'auto', got {chunk_size!r}")
    if chunk_size != "auto":
        check_positive_int("chunk_size", chunk_size)
    _check_scalars(normalize, scale, eps)
    if backend == "fla":
        return _fla_attention(q, k, v, form, feature_map, normalize, scale, eps, initial_state, output_final_state,
                              log_decay)
    if backend != "torch":
        raise ValueError(f"backend must be 'torch' or 'fla', got {backend!r}")
    if form == "chunked":
        return _chunked_attention(q, k, v, feature_map, chunk_size, normalize, scale, eps, initial_state,
                                  output_final_state, log_decay)
    out_dtype = q.dtype
    if isinstance(feature_map, str):  # named maps act on each vector alone: apply them head-first
        fq, fk = _featurize(q.transpose(1, 2), k.transpose(1, 2), feature_map, scale)  # [B,H,T,F]
    else:  # modules may hold per-head parameters and expect [B,T,H,D]
        fq, fk = (x.transpose(1, 2) for x in _featurize(q, k, feature_map, scale))  # [B,H,T,F]
    dtype = fq.dtype
    Fd = fq.shape[-1]
    chunk_size = _resolve_chunk(chunk_size, T, Dv, Fd, dtype, q.device, log_decay is not None)
    S0 = _state0(initial_state, B, H, Fd, Dv, dtype, q.device)
    # the extra column of ones carries the normaliser: y[..., -1] = sum_j s_ij, S0[..., -1] = z
    # built directly in the [B,H,T,Dv+1] layout the forms use: one copy of v instead of two
    ones = torch.ones(B, H, T, 1, dtype=dtype, device=v.device)
    v1 = torch.cat([v.transpose(1, 2).to(dtype), ones], dim=-1)  # [B,H,T,Dv+1]
    # one copy into [B,H,T,F] up front (none for elu, which writes that layout): the forms' batched
    # matmuls would otherwise copy these strided views for every product, forward and backward
    fq, fk = fq.contiguous(), fk.contiguous()  # [B,H,T,F]
    ld = None if log_decay is None else _log_decay_head_first(log_decay, B, T, H, dtype)  # [B|1,H,T]
    with autocast_off(q.device):  # the forms accumulate in the state dtype under mixed precision too
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
    with autocast_off(q.device):  # the state and its readout in the state dtype under mixed precision too
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
