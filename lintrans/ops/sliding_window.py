"""Longformer attention (Beltagy et al. 2020): softmax over a sliding band plus a few global tokens.

Query t sees the keys at offsets t - j in its band, every ``dilation``-th position:

- causal:     t - j in {0, d, 2d, ..., (window - 1) d}: itself and window - 1 earlier keys;
- non-causal: t - j in {-h d, ..., -d, 0, d, ..., h d} with h = window // 2 on each side.

Global tokens (a bool mask [T] or a list of positions): non-causal, a global token attends to every
position and every position attends to it; causal, it attends to every earlier position and every
later position attends to it (a visible prefix, like an attention sink). Memory O(T * (block + band))
for scores, never T x T: queries go in blocks against the slice of keys their bands cover. The
common case on a CPU (causal, dilation 1, no global tokens) runs block by block in
``_SlidingWindowCausal``, flash-style; every other case through torch's SDPA with the band as a mask.
"""
from __future__ import annotations

import functools
import math
import numbers
from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .linear.chunked import LOG2E, without_autocast
from .native import sliding_window as native_sw
from .validation import can_write_in_place, check_bool, check_number, check_positive_int, check_qkv, compute_dtype


class SlidingWindowCache(NamedTuple):
    """Decoding state. The ring holds the last (window - 1) * dilation + 1 keys (slot = position % size);
    the prefix holds every key up to the last global position (global rows see all earlier keys)."""

    ring_k: torch.Tensor  # [B, H, R, Dk]
    ring_v: torch.Tensor  # [B, H, R, Dv]
    prefix_k: torch.Tensor  # [B, H, P, Dk], P = min(pos, last global position + 1)
    prefix_v: torch.Tensor  # [B, H, P, Dv]
    pos: int  # tokens seen so far


def _band_reach(window: int, dilation: int, causal: bool) -> Tuple[int, int]:
    """How far (in positions) the band reaches back and forward."""
    if causal:
        return (window - 1) * dilation, 0
    h = (window // 2) * dilation
    return h, h


def _in_band(offset: torch.Tensor, window: int, dilation: int, causal: bool) -> torch.Tensor:
    """offset = query position - key position -> bool, same shape."""
    back, fwd = _band_reach(window, dilation, causal)
    return (offset <= back) & (offset >= -fwd) & (offset % dilation == 0)


def global_positions(global_tokens, T: Optional[int], device=None) -> Optional[torch.Tensor]:
    """A bool mask [T] or a sequence/tensor of positions -> sorted unique int64 positions (or None).

    T is the sequence length to check against; None (decoding) allows any non-negative position.
    """
    if global_tokens is None:
        return None
    if isinstance(global_tokens, torch.Tensor) and global_tokens.dtype == torch.bool:
        if global_tokens.dim() != 1 or (T is not None and global_tokens.shape[0] != T):
            raise ValueError(
                f"global_tokens as a bool mask must have shape [T] = [{T}], got {tuple(global_tokens.shape)}"
            )
        idx = global_tokens.nonzero().flatten()
    else:
        try:
            # positions from a list live on the CPU, also under a `torch.device("meta")` context
            # (a config check builds layers there)
            idx = global_tokens if isinstance(global_tokens, torch.Tensor) else torch.as_tensor(global_tokens, device="cpu")
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(
                f"global_tokens must be a bool mask [T] or a list of int positions, got {type(global_tokens).__name__}"
            ) from None
        if idx.numel() and (idx.dtype.is_floating_point or idx.dtype == torch.bool or idx.dim() != 1):
            raise TypeError(
                f"global_tokens must be a bool mask [T] or a 1-d list of int positions, got {global_tokens!r}"
            )
        idx = idx.long().flatten()
        if idx.numel() and (idx.min() < 0 or (T is not None and idx.max() >= T)):
            where = f"lie in [0, {T})" if T is not None else "be >= 0"
            raise ValueError(f"global_tokens positions must {where}, got {idx.tolist()}")
    idx = torch.unique(idx)  # sorted
    return idx.to(device) if device is not None else idx


def _check_common(window, dilation, causal, scale):
    check_positive_int("window", window)
    check_positive_int("dilation", dilation)
    check_bool("causal", causal)
    check_number("scale", scale, allow_none=True)


# Query rows per block of the causal fast path, and tokens x heads per group of blocks: a group's
# scores and buffers (a few MB) stay in cache and are reused
SW_BLOCK = 64
SW_GROUP_TOKEN_HEADS = 8192


class _Plan(NamedTuple):
    """How ``_SlidingWindowCausal`` runs (see there)."""

    window: int
    scale: float
    C: int  # query rows per block
    m: int  # key blocks before a query block that its band may reach
    G: int  # query blocks per group (>= m)
    dtype: torch.dtype  # compute dtype


def _plan(B: int, T: int, H: int, window: int, scale: float, dtype: torch.dtype) -> _Plan:
    C = min(SW_BLOCK, T)
    n = -(-T // C)
    m = min(-(-(window - 1) // C), n - 1)
    G = max(m, 1, min(n, SW_GROUP_TOKEN_HEADS // max(1, B * H * C)))  # B * H = 0: an empty batch
    return _Plan(window, scale, C, m, G, dtype)


@functools.lru_cache(maxsize=16)
def _edge_masks(p: _Plan, device: torch.device):
    """The band inside a block's key window [C, L = (m + 1) C] (column l is key position
    (b - m) C + l for query row i at b C + i) is 0 <= m C + i - l < window: only the first columns
    (the far edge) and the last key block (the diagonal) hold cut-off entries. Returns (far, last):
    far, none or one (width, bias [C, width]) for the columns :width, and last, the bias [C, C] of
    the last C columns; 0 in the band, -inf outside it."""
    C, m = p.C, p.m
    L = (m + 1) * C
    d = m * C + torch.arange(C, device=device)[:, None] - torch.arange(L, device=device)[None, :]
    bias = torch.zeros(C, L, dtype=p.dtype, device=device).masked_fill_((d < 0) | (d >= p.window), float("-inf"))
    far = max(0, min(L - C, C - 1 + m * C - p.window + 1))  # columns before the last block with a cut
    return ((far, bias[:, :far]),) if far else (), bias[:, L - C :]


def _load(buf: torch.Tensor, x: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    """Rows r0 .. r1 of x [B, T, H, D] (zeros outside 0 .. T) into buf [B, H, r1 - r0, D], head-first."""
    T = x.shape[1]
    a, b = max(r0, 0), min(r1, T)
    if a > r0:
        buf[:, :, : a - r0].zero_()
    if b < r1:
        buf[:, :, b - r0 :].zero_()
    buf[:, :, a - r0 : b - r0] = x[:, a:b].transpose(1, 2)
    return buf


def _rows(buf: torch.Tensor, x: torch.Tensor, r0: int, r1: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows r0 .. r1 of x [B, T, H, D] as [B, H, r1 - r0, D]: a view of x where they all lie in it
    and x is in ``dtype`` with unit stride along D (the matmuls read it in place), else a copy
    into buf, zeros outside 0 .. T."""
    if 0 <= r0 and r1 <= x.shape[1] and x.dtype == dtype and x.stride(-1) == 1:
        return x[:, r0:r1].transpose(1, 2)
    return _load(buf[:, :, : r1 - r0], x, r0, r1)


def _windows(x: torch.Tensor, g: int, C: int, L: int) -> torch.Tensor:
    """One head's key windows [g, L, D] of its rows x [rows, D]: block j's window starts at row j C
    (overlapping views, nothing copied)."""
    D = x.shape[-1]
    return x.as_strided((g, L, D), (C * x.stride(0), x.stride(0), x.stride(1)), x.storage_offset())


def _scores(s, qh, kh, p: _Plan, g: int, b0: int) -> torch.Tensor:
    """One head's base-2 scores s [g, C, L] (exp2 is a much cheaper kernel than exp on a CPU): its
    query blocks qh [g C, Dk] from block b0 (scaled by ``scale * LOG2E`` already) against their key
    windows in kh [(g + m) C, Dk], -inf outside the band and before position 0."""
    C, m = p.C, p.m
    L = (m + 1) * C
    torch.bmm(qh.view(g, C, -1), _windows(kh, g, C, L).transpose(1, 2), out=s)
    far, last = _edge_masks(p, s.device)
    for width, bias in far:
        s[..., :width].add_(bias)
    s[..., L - C :].add_(last)
    for j in range(min(m - b0, g)):  # the first blocks' windows start before position 0
        s[j, :, : (m - b0 - j) * C] = float("-inf")
    return s


class _SlidingWindowCausal(torch.autograd.Function):
    """Causal sliding-window softmax (dilation 1, no global tokens), flash-style, block by block.

    Queries go in blocks of C rows; block b's band lies in the m key blocks before it and its own,
    L = (m + 1) C keys, a strided window of a group's key buffer (no gathered copies). Blocks are
    taken G at a time (about ``SW_GROUP_TOKEN_HEADS`` tokens x heads) and a group's heads one by
    one, so that every temporary is a group's or a head's worth, stays in cache and is reused.
    Forward keeps only the output and each row's logsumexp; backward recomputes the probabilities
    from them and runs over the groups in reverse, carrying the key and value gradients of the m
    blocks a group shares with the one before it. Where the fused kernel (ops/native/sliding_window.cpp)
    can run (float32/float64 on the CPU), it does the same, one parallel region per call.
    """

    @staticmethod
    @without_autocast
    def forward(ctx, q, k, v, p: _Plan):
        ctx.p = p
        ctx.native = native_sw.supports(q, k, v)
        if ctx.native:
            o, lse = native_sw.forward(q, k, v, p.window, p.scale)
            ctx.save_for_backward(q, k, v, o, lse)
            return o
        B, T, H, Dk = q.shape
        Dv = v.shape[-1]
        C, m, G, dt = p.C, p.m, p.G, p.dtype
        n = -(-T // C)
        L, BH = (m + 1) * C, B * H
        o = torch.empty(B, T, H, Dv, dtype=dt, device=q.device)
        lse = torch.empty(BH, n, C, 1, dtype=dt, device=q.device)  # base 2
        qb = q.new_empty(B, H, G * C, Dk, dtype=dt)
        kb = q.new_empty(B, H, (G + m) * C, Dk, dtype=dt)
        vb = q.new_empty(B, H, (G + m) * C, Dv, dtype=dt)
        ob = q.new_empty(B, H, G * C, Dv, dtype=dt)
        S = q.new_empty(G, C, L, dtype=dt)
        o3 = ob.view(BH, G, C, Dv)
        for b0 in range(0, n, G):
            g = min(G, n - b0)
            t0, t1 = b0 * C, (b0 + g) * C
            _load(qb[:, :, : g * C], q, t0, t1).mul_(p.scale * LOG2E)  # C x D, not C x L, multiplies
            kg, vg = _rows(kb, k, t0 - m * C, t1, dt), _rows(vb, v, t0 - m * C, t1, dt)
            for bh in range(BH):
                b, h = divmod(bh, H)
                s = _scores(S[:g], qb[b, h, : g * C], kg[b, h], p, g, b0)
                mx = s.amax(-1, keepdim=True)
                den = s.sub_(mx).exp2_().sum(-1, keepdim=True)
                torch.bmm(s, _windows(vg[b, h], g, C, L), out=o3[bh, :g]).div_(den)
                torch.add(mx, den.log2_(), out=lse[bh, b0 : b0 + g])
            e = min(t1, T)
            o[:, t0:e] = ob[:, :, : e - t0].transpose(1, 2)
        ctx.save_for_backward(q, k, v, o, lse)
        return o.to(v.dtype)

    @staticmethod
    @once_differentiable
    @without_autocast
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        p = ctx.p
        if ctx.native:
            return (*native_sw.backward(q, k, v, o, lse, do, p.window, p.scale), None)
        B, T, H, Dk = q.shape
        Dv = v.shape[-1]
        C, m, G, dt = p.C, p.m, p.G, p.dtype
        n = -(-T // C)
        L, BH = (m + 1) * C, B * H
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        qb = q.new_empty(B, H, G * C, Dk, dtype=dt)
        kb = q.new_empty(B, H, (G + m) * C, Dk, dtype=dt)
        vb = q.new_empty(B, H, (G + m) * C, Dv, dtype=dt)
        dob = q.new_empty(B, H, G * C, Dv, dtype=dt)
        dqb = q.new_empty(B, H, G * C, Dk, dtype=dt)
        delta = q.new_empty(B, H, G * C, dtype=dt)  # rowsum(dO * O), zero on padding rows
        # key/value gradients of the group's key rows: the m blocks before its own G blocks (they
        # carry over to the group before, processed next), then its own
        dkb = q.new_zeros(BH, G + m, C, Dk, dtype=dt)
        dvb = q.new_zeros(BH, G + m, C, Dv, dtype=dt)
        P = q.new_empty(G, C, L, dtype=dt)
        dP = q.new_empty(G, C, L, dtype=dt)
        dq3 = dqb.view(BH, G, C, Dk)
        starts = list(range(0, n, G))
        for i, b0 in enumerate(reversed(starts)):
            g = min(G, n - b0)
            t0, t1 = b0 * C, (b0 + g) * C
            e = min(t1, T)
            _load(qb[:, :, : g * C], q, t0, t1).mul_(p.scale * LOG2E)
            kg, vg = _rows(kb, k, t0 - m * C, t1, dt), _rows(vb, v, t0 - m * C, t1, dt)
            dog = _rows(dob, do, t0, t1, dt)
            delta[:, :, e - t0 :].zero_()
            delta[:, :, : e - t0] = torch.linalg.vecdot(do[:, t0:e].to(dt), o[:, t0:e]).transpose(1, 2)
            for bh in range(BH):
                b, h = divmod(bh, H)
                qh, doh = qb[b, h, : g * C].view(g, C, Dk), dog[b, h].view(g, C, Dv)
                s = _scores(P[:g], qh, kg[b, h], p, g, b0)
                s.sub_(lse[bh, b0 : b0 + g]).exp2_()  # the probabilities again
                ds = torch.bmm(doh, _windows(vg[b, h], g, C, L).transpose(1, 2), out=dP[:g])
                # dS = P (dP - rowsum(dO O)); the scale goes on dQ, and dK's q is scaled
                ds.sub_(delta[b, h, : g * C].view(g, C, 1)).mul_(s)
                torch.bmm(ds, _windows(kg[b, h], g, C, L), out=dq3[bh, :g])
                for j in range(m + 1):  # window block j of query block b is block b + j of the buffer
                    dvb[bh, j : j + g].baddbmm_(s[..., j * C : (j + 1) * C].transpose(1, 2), doh)
                    dkb[bh, j : j + g].baddbmm_(ds[..., j * C : (j + 1) * C].transpose(1, 2), qh)
            # the group's own key blocks are complete: the later groups' windows were added before
            r0, r1 = m * C, m * C + e - t0
            dq[:, t0:e] = dqb[:, :, : e - t0].transpose(1, 2).mul_(p.scale)
            dk[:, t0:e] = dkb.view(B, H, (G + m) * C, Dk)[:, :, r0:r1].transpose(1, 2).mul_(1 / LOG2E)
            dv[:, t0:e] = dvb.view(B, H, (G + m) * C, Dv)[:, :, r0:r1].transpose(1, 2)
            if i + 1 < len(starts):  # the earlier group's last m blocks are this one's first m
                carry_k, carry_v = dkb[:, :m].clone(), dvb[:, :m].clone()
                dkb.zero_()
                dvb.zero_()
                dkb[:, G : G + m] = carry_k
                dvb[:, G : G + m] = carry_v
        return dq, dk, dv, None


def sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int,
    dilation: int = 1,
    causal: bool = True,
    global_tokens=None,
    scale: Optional[float] = None,
    global_rows: bool = True,
) -> torch.Tensor:
    """Banded softmax attention. q, k: [B, T, H, Dk], v: [B, T, H, Dv] -> o [B, T, H, Dv].

    scale defaults to 1/sqrt(Dk). global_tokens: None, a bool mask [T] or a list of positions.
    global_rows=False leaves the global positions' own rows like any other row (their band plus the
    global columns), for a caller that computes those rows itself (Longformer's separate global
    projections) and would otherwise pay for them twice.
    """
    B, T, H, Dk, Dv = check_qkv(q, k, v)
    _check_common(window, dilation, causal, scale)
    check_bool("global_rows", global_rows)
    # every window past 2T + 1 covers every key (either way, any dilation): a huge one would overflow the
    # PyTorch path's int64 masks (NaN at 2^63, OverflowError beyond), as the kernel's clamp to T avoids
    window = min(window, 2 * T + 1)
    gidx = global_positions(global_tokens, T, q.device)
    scale = 1.0 / math.sqrt(Dk) if scale is None else float(scale)
    dtype = compute_dtype(q.dtype)
    if causal and dilation == 1 and (gidx is None or gidx.numel() == 0) and q.device.type == "cpu":
        # the common case, block by block; an accelerator keeps SDPA's fused kernels (this path's
        # many small per-head kernels suit a CPU's caches, not a GPU's launch costs). 16-bit inputs
        # reach the fused kernel as float32 copies, made once: the float32 the blocks compute in anyway
        out_dtype, up = v.dtype, [x.to(dtype) for x in (q, k, v)]
        if native_sw.supports(*up):
            q, k, v = up
        return _SlidingWindowCausal.apply(q, k, v, _plan(B, T, H, window, scale, dtype)).to(out_dtype)
    qh, kh, vh = (x.transpose(1, 2).to(dtype) for x in (q, k, v))  # [B,H,T,D]
    back, fwd = (min(r, T - 1) for r in _band_reach(window, dilation, causal))  # no key lies further
    # query blocks of C rows, each against the L = C + back + fwd keys its bands cover (plus the
    # global keys), through torch's fused SDPA: no [T, L] scores or probabilities are kept
    C = min(T, 64)
    n = -(-T // C)
    L = C + back + fwd
    kp = F.pad(kh, (0, 0, back, n * C - T + fwd))  # [B,H,back+nC+fwd,Dk]
    vp = F.pad(vh, (0, 0, back, n * C - T + fwd))
    kb = kp.unfold(2, L, C).transpose(-1, -2)  # [B,H,n,L,Dk] key slice of each query block
    vb = vp.unfold(2, L, C).transpose(-1, -2)  # [B,H,n,L,Dv]
    qb = F.pad(qh, (0, 0, 0, n * C - T)).reshape(B, H, n, C, Dk)
    # query t = b*C + i, key j = b*C + l - back: allowed in the band with 0 <= j < T; a padding row
    # (t >= T) sees its own padding key, so that no row is empty (an empty row's softmax is NaN)
    i = torch.arange(C, device=q.device)[:, None]  # [C,1]
    l = torch.arange(L, device=q.device)[None, :]  # [1,L]
    t = torch.arange(n, device=q.device)[:, None, None] * C + i  # [n,C,1]
    j = t - i + l - back  # [n,C,L] key position
    allowed = (_in_band(i + back - l, window, dilation, causal) & (j >= 0) & (j < T)) | ((t >= T) & (j == t))
    if gidx is not None and gidx.numel():
        # extra columns: every query against the global keys not already in its band (no double count)
        off = t - gidx  # [n,C,G]
        extra = ~_in_band(off, window, dilation, causal) & (t < T)
        if causal:
            extra &= off > 0
        kb = torch.cat([kb, kh[:, :, None, gidx].expand(B, H, n, -1, Dk)], dim=3)  # [B,H,n,L+G,Dk]
        vb = torch.cat([vb, vh[:, :, None, gidx].expand(B, H, n, -1, Dv)], dim=3)
        allowed = torch.cat([allowed.expand(n, C, L), extra], dim=-1)  # [n,C,L+G]
    o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=allowed, scale=scale)  # [B,H,n,C,Dv]
    o = o.reshape(B, H, n * C, Dv)[:, :, :T]  # [B,H,T,Dv]
    if gidx is not None and gidx.numel() and global_rows:
        # global rows: dense softmax over every key (every earlier key when causal); [G,T] scores only
        sgl = (qh[:, :, gidx] * scale) @ kh.transpose(-1, -2)  # [B,H,G,T]
        if causal:
            sgl = sgl.masked_fill(torch.arange(T, device=q.device)[None, :] > gidx[:, None], float("-inf"))
        o = o.index_copy(2, gidx, sgl.softmax(-1) @ vh)
    return o.transpose(1, 2).to(q.dtype)  # [B,T,H,Dv]


def sliding_window_cache(
    k: torch.Tensor, v: torch.Tensor, *, window: int, dilation: int = 1, global_tokens=None
) -> SlidingWindowCache:
    """The causal decoding cache after the tokens k [B, T, H, Dk], v [B, T, H, Dv] (e.g. a prompt)."""
    B, T, H, Dk, Dv = check_qkv(k, k, v)
    _check_common(window, dilation, True, None)
    R = (window - 1) * dilation + 1
    dtype = compute_dtype(k.dtype)
    kh, vh = (x.transpose(1, 2).to(dtype) for x in (k, v))  # [B,H,T,D]
    ring_k = kh.new_zeros(B, H, R, Dk)
    ring_v = vh.new_zeros(B, H, R, Dv)
    last = torch.arange(max(0, T - R), T, device=k.device)
    ring_k[:, :, last % R] = kh[:, :, last]
    ring_v[:, :, last % R] = vh[:, :, last]
    gidx = global_positions(global_tokens, None)
    P = 0 if gidx is None or gidx.numel() == 0 else min(T, int(gidx.max()) + 1)
    return SlidingWindowCache(ring_k, ring_v, kh[:, :, :P], vh[:, :, :P], T)


def sliding_window_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: Optional[SlidingWindowCache] = None,
    *,
    window: int,
    dilation: int = 1,
    global_tokens=None,
    scale: Optional[float] = None,
    inplace: bool = False,
) -> Tuple[torch.Tensor, SlidingWindowCache]:
    """One causal token: q, k [B, H, Dk], v [B, H, Dv] -> (o [B, H, Dv], cache).

    Memory is constant in the generated length: (window - 1) * dilation + 1 ring entries plus the
    keys up to the last global position. global_tokens: positions (absolute, from 0) or a bool mask.
    inplace: write the new key and value into ``cache``'s rings instead of copies of them, for a
    decoding loop that owns its cache (the cache passed in is then spent: it shares the returned
    one's rings). Ignored where autograd records the rings or the new key or value.
    """
    B, _, H, Dk, Dv = check_qkv(q, k, v, layout="[B, H, D]")
    _check_common(window, dilation, True, scale)
    gl = _global_list(global_tokens)
    scale = 1.0 / math.sqrt(Dk) if scale is None else float(scale)
    dtype = compute_dtype(q.dtype)
    R = (window - 1) * dilation + 1
    if cache is None:
        cache = SlidingWindowCache(
            q.new_zeros(B, H, R, Dk, dtype=dtype), q.new_zeros(B, H, R, Dv, dtype=dtype),
            q.new_zeros(B, H, 0, Dk, dtype=dtype), q.new_zeros(B, H, 0, Dv, dtype=dtype), 0,
        )
    elif (
        not isinstance(cache, SlidingWindowCache)
        or cache.ring_k.shape != (B, H, R, Dk)
        or cache.ring_v.shape != (B, H, R, Dv)
        or cache.ring_k.dtype != dtype
        or cache.ring_v.dtype != dtype
        or not (isinstance(cache.pos, numbers.Integral) and not isinstance(cache.pos, bool) and cache.pos >= 0)
    ):
        raise ValueError(
            f"cache must be a SlidingWindowCache with rings of shape {[B, H, R, Dk]} and {[B, H, R, Dv]} in {dtype} "
            "at a position >= 0 (same window, dilation and batch as the calls that built it), got "
            + (f"rings {list(cache.ring_k.shape)} and {list(cache.ring_v.shape)} in {cache.ring_k.dtype} and "
               f"{cache.ring_v.dtype} at position {cache.pos!r}"
               if isinstance(cache, SlidingWindowCache) else type(cache).__name__)
        )
    check_bool("inplace", inplace)
    p = int(cache.pos)
    # the prefix holds every token up to the last global one: a cache built for other global tokens would
    # have the step score the wrong rows, or none (silently)
    held = min(p, gl[-1] + 1) if gl else 0
    if cache.prefix_k.shape != (B, H, held, Dk) or cache.prefix_v.shape != (B, H, held, Dv):
        raise ValueError(f"cache holds a prefix of {cache.prefix_k.shape[2]} tokens at position {p}; global_tokens "
                         f"{gl} need {held}: the cache must come from calls with the same global_tokens")
    qd, kd, vd = q.to(dtype) * scale, k.to(dtype), v.to(dtype)
    ring_k, ring_v = cache.ring_k, cache.ring_v
    if not (inplace and can_write_in_place(ring_k, ring_v, q, k, v)):  # else copies: the caller keeps its rings
        ring_k, ring_v = ring_k.clone(), ring_v.clone()
    ring_k[:, :, p % R] = kd
    ring_v[:, :, p % R] = vd
    prefix_k, prefix_v = cache.prefix_k, cache.prefix_v
    if gl and p <= gl[-1]:
        prefix_k = torch.cat([prefix_k, kd[:, :, None]], dim=2)
        prefix_v = torch.cat([prefix_v, vd[:, :, None]], dim=2)
    new_cache = SlidingWindowCache(ring_k, ring_v, prefix_k, prefix_v, p + 1)
    qd = qd[:, :, None]  # [B,H,1,Dk]
    if torch.is_grad_enabled() and q.requires_grad and not (ring_k.requires_grad or ring_v.requires_grad):
        # the scores save the rings for backward, and the rings go on in the cache, where a later step
        # under no_grad may write in place (can_write_in_place refuses only rings that require grad):
        # score against copies
        ring_k, ring_v = ring_k.clone(), ring_v.clone()
    if p in gl:  # a global row: every key so far
        s = qd @ prefix_k.transpose(-1, -2)  # [B,H,1,P]
        return (s.softmax(-1) @ prefix_v)[:, :, 0].to(q.dtype), new_cache
    s = qd @ ring_k.transpose(-1, -2)  # [B,H,1,R]: the ring in slot order (softmax ignores the keys' order)
    if p < R - 1 or dilation > 1:  # else every slot holds a key of the band
        back = (p - torch.arange(R, device=q.device)) % R  # slot j holds the position `back` tokens before p
        s = s.masked_fill((back > p) | (back % dilation != 0), float("-inf"))
    g = [x for x in gl if x < p and not _in_band(p - x, window, dilation, True)]  # Python ints: one bool
    if not g:
        return (s.softmax(-1) @ ring_v)[:, :, 0].to(q.dtype), new_cache
    # global keys outside the band, scored beside the ring (not copied into it: that copies the ring)
    sel = slice(g[0], g[-1] + 1) if g[-1] - g[0] + 1 == len(g) else g  # a run of positions (a sink): a view
    gk, gv = prefix_k[:, :, sel], prefix_v[:, :, sel]  # [B,H,G,D]
    w = torch.cat([s, qd @ gk.transpose(-1, -2)], dim=-1).softmax(-1)  # [B,H,1,R+G]
    return (w[..., :R] @ ring_v + w[..., R:] @ gv)[:, :, 0].to(q.dtype), new_cache


def _global_list(global_tokens) -> list:
    """global_tokens -> sorted unique positions as Python ints (a step's few lookups; a list of
    non-negative ints, as the layer passes, without building a tensor)."""
    if isinstance(global_tokens, (list, tuple)) and all(type(x) is int and x >= 0 for x in global_tokens):
        return sorted(set(global_tokens))
    gidx = global_positions(global_tokens, None)
    return [] if gidx is None else gidx.tolist()


def sliding_window_attention_reference(
    q, k, v, *, window, dilation=1, causal=True, global_tokens=None, scale=None, global_rows=True
) -> torch.Tensor:
    """Plain float64 definition for tests: the T x T pattern entry by entry, then a masked softmax."""
    q, k, v = q.double(), k.double(), v.double()
    T, Dk = q.shape[1], q.shape[-1]
    scale = 1.0 / math.sqrt(Dk) if scale is None else scale
    if global_tokens is None:
        glob = set()
    elif isinstance(global_tokens, torch.Tensor) and global_tokens.dtype == torch.bool:
        glob = {i for i in range(T) if global_tokens[i]}
    else:
        glob = {int(i) for i in global_tokens}
    allowed = torch.zeros(T, T, dtype=torch.bool)
    for t in range(T):
        for j in range(T):
            if causal and j > t:
                continue
            d = t - j
            in_band = (d % dilation == 0) and (
                0 <= d <= (window - 1) * dilation if causal else abs(d) <= (window // 2) * dilation
            )
            allowed[t, j] = in_band or (global_rows and t in glob) or j in glob
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("bhij,bjhd->bihd", s.softmax(-1), v)
