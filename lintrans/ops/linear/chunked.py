"""The chunked form, block by block, with a hand-derived backward (``ChunkedAttention``); on a CPU
with a named feature map it runs the fused kernel of ``lintrans/ops/native/chunked.cpp``."""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional

import torch
from torch.autograd.function import once_differentiable

from ..native import chunked as native_chunked
from ..validation import autocast_off

class Chunked(NamedTuple):
    """How ``ChunkedAttention`` runs (see there)."""

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


def chunks_per_block(device: torch.device, heads: int, chunk: int, n: int) -> int:
    """About ``BLOCK_TOKEN_HEADS`` tokens x heads per block on a CPU; one block elsewhere (an
    accelerator's caching allocator reuses memory, and it wants few, large kernels)."""
    if device.type != "cpu":
        return max(n, 1)
    return max(1, BLOCK_TOKEN_HEADS // max(1, heads * chunk))  # heads = 0: an empty batch


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


def _block_inputs(q, k, v, ld, t0: int, nb: int, c: int, cfg: Chunked, grad: bool = False):
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
    with torch.inference_mode(False):  # cached: an inference tensor could not be saved for backward later
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


def without_autocast(fn):
    """Run an autograd Function's forward/backward with autocast off for the device of its first
    tensor argument: the op chooses its own dtypes (float32 accumulation), and autocast would turn
    its matmuls to 16 bits and break its in-place accumulations."""

    @functools.wraps(fn)
    def wrapper(ctx, x, *args):
        with autocast_off(x.device):
            return fn(ctx, x, *args)

    return wrapper


class ChunkedAttention(torch.autograd.Function):
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
    @without_autocast
    def forward(ctx, q, k, v, ld, S0, cfg: Chunked):
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
    @without_autocast
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


def chunked_form(fq, fk, v, S0, chunk, ld=None):
    """LT_chunked as a form: features [B, H, T, F], v with its normaliser column [B, H, T, E]. (The
    op itself calls ``ChunkedAttention`` on q, k, v directly, with the feature map inside.)"""
    B, H, T, _ = fq.shape
    chunk = min(chunk, T)
    cfg = Chunked(None, None, 1.0, chunk, chunks_per_block(fq.device, B * H, chunk, T // chunk), None, 0.0,
                   fq.dtype, fq.dtype)
    ld = None if ld is None else ld.transpose(1, 2)
    y, S = ChunkedAttention.apply(fq.transpose(1, 2), fk.transpose(1, 2), v.transpose(1, 2), ld, S0, cfg)
    return y.transpose(1, 2), S

