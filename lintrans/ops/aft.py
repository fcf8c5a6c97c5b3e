"""Attention Free Transformer (Zhai et al. 2021): a per-channel weighted mean instead of dot products.

For every position t and channel d, with w the log position bias of the variant,

    o_td = sigmoid(q_td) * sum_j exp(k_jd + w_tj) v_jd / sum_j exp(k_jd + w_tj)

over j <= t when causal, every j otherwise. The variants differ only in w:

- ``full``:   w = pos_bias[:T, :T], a learned pairwise bias, pos_bias [T_max, T_max] or [H, T_max, T_max].
- ``simple``: w = 0 (no bias): a softmax over keys per channel, O(T*D).
- ``local``:  w = pos_bias inside the window (|t - j| < window; 0 <= t - j < window when causal) and
              0 outside it; 0, not -inf: tokens outside the window still count, just without a bias.
- ``conv``:   w_tj = pos_bias[h, t - j] (causal: taps are offsets 0..kernel-1) or
              pos_bias[h, t - j + kernel // 2] (non-causal, odd kernel), 0 outside the kernel:
              a per-head relative bias, AFT-local with a convolution kernel. pos_bias [H, kernel].

Never builds a [T, T, D] tensor. Paths:

- full (and local/conv on short sequences): exp(w - rowmax w) [Hw, T, T] times exp(k - max k) * v, one
  matmul; both max shifts cancel in the ratio. When causal and a huge key comes late (a row's largest
  term would sit more than UNDERFLOW_GAP below the shared reference), query chunks with per-row
  references (the running max of k) instead. A row whose largest key and largest bias belong to
  different keys far apart can still underflow whole; on the CPU such rows are computed again against
  their own reference, [CHUNK, T, D] per (batch, head) at a time (``_divide_or_redo``); on an
  accelerator (no host read) they stay NaN.
- simple, causal, on the CPU (float32/float64): one fused pass along T with a running max per channel
  (ops/native/aft.cpp), exact for any keys. Where that kernel is unavailable (or off), and on
  accelerators, the PyTorch paths:
- simple: two cumulative sums against the largest key, O(T*D), while no row can underflow; otherwise
  chunks with a per-chunk reference carried by a scan over chunks, and log-cumsum-exp scans over T
  only when a key jumps far above the running max inside a chunk. Those choices read the keys on
  the host, so on an accelerator (``validation.reads_values``) causal simple always takes the
  log-cumsum-exp scans, which need no host sync; they run in float64 (not on MPS), so that a key's
  size does not eat the value's digits (float32 keys as large as 1e7 keep the output to 1e-6).
- local/conv on long sequences: the biased band [B, H, T, W, D] plus unbiased prefix/suffix sums from
  the same scans, O(T*W*D), no [T, T] matrix.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
from torch.autograd.function import once_differentiable
import torch.nn.functional as F

from .native import aft as native_aft
from .scan import decayed_scan
from .validation import autocast_off, can_write_in_place, check_bool, check_choice, check_positive_int, check_qkv, check_tensor, compute_dtype, reads_values

VARIANTS = ("full", "simple", "local", "conv")
# state of the causal simple recurrence: (num [B,H,D], den [B,H,D], running max m [B,H,D])
AFTState = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]
# query rows per step of the causal chunked path; its in-chunk weights are [B, H, CHUNK, CHUNK, D]
CHUNK = 32
# how far (in log space) below a row's largest term the shared reference may sit before the causal
# path switches from one matmul to per-row references: exp(-60) is far from float32 underflow (1e-38)
UNDERFLOW_GAP = {torch.float32: 60.0, torch.float64: 600.0}
# tokens per chunk of causal AFT-simple (its in-chunk sums are cumulative sums; chunks are carried by a scan)
SIMPLE_CHUNK = 64
# elements (tokens x heads x channels) per block of the two-cumsum path of causal AFT-simple: a block's
# temporaries stay in cache and are reused, so no T-sized temporary is ever allocated
SIMPLE_BLOCK_ELEMENTS = 65536
# local/conv take the O(T*W*D) banded path once the [Hw, T, T] bias matrix is larger than this times
# the band [B, H, T, W, D]: band work is elementwise, slower per entry than the T x T matmul (on a CPU
# core the two cross near ratio 0.3-0.75 for W = D = 64; 1.0 also keeps the band's memory below the matrix)
BANDED_RATIO = 1.0


def _check_variant_args(variant, pos_bias, window, T: int, H: int) -> None:
    check_choice("variant", variant, VARIANTS)
    if variant == "simple":
        if pos_bias is not None:
            raise ValueError("pos_bias must be None for variant 'simple' (it has no position bias)")
    else:
        if pos_bias is None:
            raise ValueError(f"variant {variant!r} needs pos_bias")
        if variant == "conv":
            check_tensor("pos_bias", pos_bias, 2, "[H, kernel]")
            if pos_bias.shape[0] != H or pos_bias.shape[1] < 1:
                raise ValueError(f"pos_bias for variant 'conv' must have shape [H, kernel] with H={H} and kernel >= 1, "
                                 f"got {tuple(pos_bias.shape)}")
        else:
            if not isinstance(pos_bias, torch.Tensor) or pos_bias.dim() not in (2, 3):
                raise ValueError(
                    f"pos_bias for variant {variant!r} must be a tensor [T_max, T_max] or [H, T_max, T_max], "
                    f"got {getattr(pos_bias, 'shape', type(pos_bias).__name__)}"
                )
            check_tensor("pos_bias", pos_bias, pos_bias.dim(), "[T_max, T_max] or [H, T_max, T_max]")
            Tr, Tc = pos_bias.shape[-2:]
            if Tr != Tc or Tr < T or (pos_bias.dim() == 3 and pos_bias.shape[0] != H):
                raise ValueError(
                    f"pos_bias for variant {variant!r} must have shape [T_max, T_max] or [H={H}, T_max, T_max] "
                    f"with T_max >= T={T}, got {tuple(pos_bias.shape)}"
                )
    if variant == "local":
        check_positive_int("window", window)
    elif window is not None:
        raise ValueError(
            f"window is only used by variant 'local' (conv takes its width from pos_bias), got window={window!r}"
        )


def position_bias(variant: str, pos_bias, window, T: int, causal: bool, *, rows: Optional[slice] = None):
    """The log weights w [Hw, T, T] (Hw = 1 or H) the variant adds to the keys, or None for simple.

    ``rows`` selects query positions (e.g. the last row for decoding); columns are always 0..T-1.
    Entries above the diagonal are left in place; causal masking is the caller's job.
    """
    if variant == "simple":
        return None
    rows = rows if rows is not None else slice(0, T)
    t = torch.arange(T, device=pos_bias.device)[rows, None]
    j = torch.arange(T, device=pos_bias.device)[None, :]
    rel = t - j  # [R, T] query minus key position
    if variant == "conv":
        # Toeplitz matrix w[t, j] = bias at offset t - j, from a [H, 2T-1] vector of offsets
        # -(T-1)..(T-1) (an unfold, whose backward is cheap, unlike indexing by offset)
        kernel = pos_bias.shape[-1]
        left = T - 1 - (0 if causal else kernel // 2)  # where tap 0 sits; F.pad crops when negative
        offsets = F.pad(pos_bias, (left, 2 * T - 1 - left - kernel))  # [H, 2T-1] bias at offset i-(T-1)
        if rows != slice(0, T):  # a few rows (decoding): index, no T x T matrix
            return offsets[:, rel + T - 1]  # [H, R, T]
        return offsets.unfold(-1, T, 1).flip(-1)  # [H, T, T]: w[t, j] = offsets[t - j + T - 1]
    w = pos_bias[..., rows, :T]
    w = w if w.dim() == 3 else w[None]  # [Hw, R, T]
    if variant == "local":
        inside = (rel >= 0) & (rel < window) if causal else rel.abs() < window
        w = torch.where(inside, w, 0.0)  # not w * inside: a -inf bias outside the window would give NaN
    return w


def _aft_dense(k, v, logw):
    """Weighted mean, one matmul (causal where logw holds -inf above the diagonal). k, v: [B,H,T,D];
    logw: [Hw,T,T] -> [B,H,T,D]. Keys and biases take separate references (their maxima); a row whose
    every term fell below the range of floats that way (a large key under a very negative bias, beside
    large biases on small keys) is computed again with its own reference (``_divide_or_redo``)."""
    ek = torch.exp(k - k.amax(dim=2, keepdim=True).detach())  # [B,H,T,D] max term is exactly 1
    E = torch.exp(logw - logw.amax(dim=-1, keepdim=True).detach())  # [Hw,T,T]
    nd = E @ torch.cat([ek * v, ek], dim=-1)  # [B,H,T,2D]
    D = v.shape[-1]
    return _divide_or_redo(nd[..., :D], nd[..., D:], k, v, logw)


def _divide_or_redo(num, den, k, v, logw):
    """num / den [B,H,T,D], with the rows whose den fell under sqrt(tiny) (their terms, taken against
    shared references, underflowed: 0/0, or too few digits) computed again by ``_exact_rows`` for the
    (batch, head) pairs they occur in. One host read where values are read (the CPU); on an accelerator
    the division alone, and such rows stay NaN there."""
    if not reads_values(k.device) or den.numel() == 0:
        return num / den
    small = den.detach() < torch.finfo(den.dtype).tiny ** 0.5  # [B,H,T,D]
    bad = small.any(-1)  # [B,H,T]
    pairs = bad.any(-1).nonzero()  # [P, 2] (batch, head)
    if pairs.shape[0] == 0:
        return num / den
    rows = bad[pairs[:, 0], pairs[:, 1]].any(0).nonzero().squeeze(1)  # [R] query positions
    # those rows' quotients replaced: a den of 1 there keeps their (unused) gradient finite, not 0 * inf
    out = num / den.masked_fill(small, 1.0)
    b, h = pairs[:, 0, None], pairs[:, 1, None]  # [P,1]
    w = logw[h[:, 0] if logw.shape[0] > 1 else torch.zeros_like(h[:, 0])]  # [P,T,T]
    return out.index_put((b, h, rows[None]), _exact_rows(k[b[:, 0], h[:, 0]], v[b[:, 0], h[:, 0]], w, rows))


def _exact_rows(k, v, logw, rows):
    """Rows ``rows`` [R] of the weighted mean of P (batch, head) pairs, each row against its own reference
    max_j (w_tj + k_j) per channel: exact for any keys and biases. Rows go in chunks of CHUNK, each
    recomputed in backward (checkpointed), so memory stays O(P CHUNK T D) however many rows there are.
    k, v [P,T,D]; logw [P,T,T], -inf where a key is masked (causal) -> [P,R,D]."""
    from torch.utils.checkpoint import checkpoint

    def rows_of(w_rows, k, v):
        s = w_rows[..., None] + k[:, None]  # [P,C,T,D]
        e = torch.exp(s - _finite(s.detach().amax(2, keepdim=True)))
        return (e * v[:, None]).sum(2) / e.sum(2)

    records = torch.is_grad_enabled() and any(x.requires_grad for x in (k, v, logw))
    out = []
    for part in rows.split(CHUNK):
        w_rows = logw[:, part]  # [P,C,T]
        out.append(checkpoint(rows_of, w_rows, k, v, use_reentrant=False) if records else rows_of(w_rows, k, v))
    return torch.cat(out, dim=1)


def _aft_causal(k, v, logw):
    """Causal weighted mean. k, v: [B,H,T,D]; logw: [Hw,T,T] -> [B,H,T,D].

    With one global per-channel max M as reference, row t's largest term is at least
    exp(-(M - m_t) - range of w in row t), m_t = max_{j<=t} k_j. While that exponent stays above
    -UNDERFLOW_GAP (keys of ordinary size), one masked matmul is exact; otherwise (a huge key late
    in the sequence) the chunked path with per-row references. Choosing reads one number back from
    the device: on an accelerator, one host sync per call (the chunked path, always taken instead,
    would keep [B, H, CHUNK, CHUNK, D] weights per chunk for backward).
    """
    causal = torch.ones(logw.shape[-1], logw.shape[-1], dtype=torch.bool, device=k.device).tril()
    lw = logw.detach().masked_fill(~causal, float("-inf"))
    w_range = lw.amax(-1) - lw.masked_fill(~causal, float("inf")).amin(-1)  # [Hw,T]
    kd = k.detach()
    gap = kd.amax(dim=2, keepdim=True) - torch.cummax(kd, dim=2).values  # [B,H,T,D]
    if k.numel() == 0 or k.device.type == "meta" or float((gap.amax(-1) + w_range).max()) < UNDERFLOW_GAP[k.dtype]:
        return _aft_dense(k, v, logw.masked_fill(~causal, float("-inf")))
    return _aft_causal_chunked(k, v, logw)


def _aft_causal_chunked(k, v, logw):
    """Causal weighted mean in query chunks. k, v: [B,H,T,D]; logw: [Hw,T,T] -> [B,H,T,D].

    Row t uses m_t = max_{j<=t} k_j as reference: keys before the chunk enter through one matmul with
    the reference at the chunk start (rescaled per row by exp(m_start - m_t) <= 1), keys inside the
    chunk through an exact [C, C, D] block. Every exponent is <= 0; the largest key and the largest
    bias of a row need not be one term's, so a row can still underflow whole: ``_divide_or_redo``.
    """
    B, H, T, D = k.shape
    causal = torch.ones(T, T, dtype=torch.bool, device=k.device).tril()
    mw = logw.masked_fill(~causal, float("-inf")).amax(dim=-1, keepdim=True).detach()
    E = torch.exp((logw - mw).masked_fill(~causal, float("-inf")))  # [Hw,T,T], 0 above the diagonal
    m = torch.cummax(k.detach(), dim=2).values  # [B,H,T,D] prefix max
    nums, dens = [], []
    # split once: slicing E per chunk would make autograd build a full [Hw,T,T] gradient per chunk
    for E_rows, s in zip(E.split(CHUNK, dim=1), range(0, T, CHUNK)):  # E_rows: [Hw,C,T]
        e = min(s + CHUNK, T)
        c = e - s
        inner = torch.ones(c, c, dtype=torch.bool, device=k.device).tril()
        x = (k[:, :, None, s:e] - m[:, :, s:e, None]).masked_fill(~inner[:, :, None], float("-inf"))
        W = E_rows[None, :, :, s:e, None] * torch.exp(x)  # [1,Hw,C,C,1] * [B,H,C,C,D]
        num = (W * v[:, :, None, s:e]).sum(3)  # [B,H,C,D]
        den = W.sum(3)
        if s > 0:
            ref = m[:, :, s - 1 : s]  # [B,H,1,D] max over keys before the chunk
            ek = torch.exp(k[:, :, :s] - ref)  # [B,H,s,D]
            nd = E_rows[:, :, :s] @ torch.cat([ek * v[:, :, :s], ek], dim=-1)  # [B,H,C,2D]
            rescale = torch.exp(ref - m[:, :, s:e])  # [B,H,C,D] <= 1
            num = num + rescale * nd[..., :D]
            den = den + rescale * nd[..., D:]
        nums.append(num)
        dens.append(den)
    return _divide_or_redo(torch.cat(nums, dim=2), torch.cat(dens, dim=2), k, v,
                           logw.masked_fill(~causal, float("-inf")))


def _finite(ref):
    """A reference to subtract from logits, 0 where it is -inf (only -inf keys: any finite one does).
    nan_to_num, not where(isfinite(ref), ref, 0): the same values and gradient, one kernel instead of two."""
    return torch.nan_to_num(ref, nan=0.0, posinf=0.0, neginf=0.0)


def _wide(x):
    """x in float64 where the device has it: k + log(a) keeps log(a)'s digits only while ulp(k) is
    small, about 1e-3 at |k| = 1e4 in float32 against 2e-12 in float64."""
    return x if x.dtype == torch.float64 or x.device.type == "mps" else x.double()


def _log_sums(k, v, reverse: bool = False):
    """log sum_{j<=t} exp(k_j) * (a_j, b_j, 1) with v = a - b, a = relu(v) + 1, b = relu(-v) + 1.

    Three log-cumsum-exp scans over T (from the end when ``reverse``): O(T*D), stable for any k, in
    float64 (``_wide``; the results are float64). a, b >= 1 keep the log domain safe, and each
    weighted mean lies in [1, 1 + |v|]: no bad cancellation.
    """
    k, v = _wide(k), _wide(v)

    def scan(x):
        return torch.logcumsumexp(x.flip(2), dim=2).flip(2) if reverse else torch.logcumsumexp(x, dim=2)

    return scan(k + torch.log(F.relu(v) + 1)), scan(k + torch.log(F.relu(-v) + 1)), scan(k)


def _shift(x, by: int):
    """x [B,H,T,D] moved `by` positions later in time (earlier when negative), -inf where nothing comes in."""
    T = x.shape[2]
    if by >= 0:
        return F.pad(x, (0, 0, by, 0), value=float("-inf"))[:, :, :T]
    return F.pad(x, (0, 0, 0, -by), value=float("-inf"))[:, :, -by:]


def _aft_banded(k, v, band_w, back: int, fwd: int, causal: bool):
    """AFT-local/conv in O(T * band * D): biased keys in the band t-back..t+fwd, unbiased ones outside.

    k, v: [B,H,T,D]; band_w: [Hw, T or 1, back+fwd+1], the bias of key t - back + l at index l.
    Keys outside the band enter as simple-AFT prefix (and, non-causal, suffix) sums in log space.
    Every term is scaled by exp(-R), R the largest log-term of the row and channel: nothing overflows.
    """
    width = back + fwd + 1
    kb = F.pad(k, (0, 0, back, fwd), value=float("-inf")).unfold(2, width, 1).transpose(-1, -2)  # [B,H,T,W,D]
    vb = F.pad(v, (0, 0, back, fwd)).unfold(2, width, 1).transpose(-1, -2)  # [B,H,T,W,D]
    # each row's logits relative to its band's largest key r, so
    # that k - r is formed before the bias is added: at |k| = 1e4, k + w in float32 loses w's digits
    r = _finite(kb.detach().amax(3))  # [B,H,T,D]
    logits = (kb - r[:, :, :, None]) + band_w[None, :, :, :, None]  # [B,H,T,W,D]; -inf outside 0..T-1
    outside = [tuple(_shift(x, back + 1) for x in _log_sums(k, v))]  # keys j < t - back
    if not causal:
        outside.append(tuple(_shift(x, -(fwd + 1)) for x in _log_sums(k, v, reverse=True)))  # keys j > t + fwd
    rw = _wide(r)
    R = logits.detach().amax(3)  # [B,H,T,D], relative to r
    for la, lb, _ in outside:
        R = torch.maximum(R, (torch.maximum(la, lb).detach() - rw).to(R.dtype))
    e = torch.exp(logits - R[:, :, :, None])  # [B,H,T,W,D]
    num, den = (e * vb).sum(3), e.sum(3)
    Rw = _wide(R) + rw  # the same reference, absolute: the outside sums' differences taken in float64
    for la, lb, l1 in outside:
        num = num + (torch.exp(la - Rw) - torch.exp(lb - Rw)).to(num.dtype)
        den = den + torch.exp(l1 - Rw).to(den.dtype)
    return num / den


def band_bias(variant: str, pos_bias, window, T: int, causal: bool):
    """(band_w [Hw, T or 1, back+fwd+1], back, fwd) for local/conv: the bias of key t - back + l at l."""
    if variant == "conv":
        kernel = pos_bias.shape[-1]
        back, fwd = (kernel - 1, 0) if causal else (kernel // 2, kernel // 2)
        return pos_bias.flip(-1)[:, None, :], back, fwd  # offset back - l is tap kernel - 1 - l
    back, fwd = (window - 1, 0) if causal else (window - 1, window - 1)
    bias = pos_bias if pos_bias.dim() == 3 else pos_bias[None]  # [Hw,T_max,T_max]
    t = torch.arange(T, device=pos_bias.device)[:, None]
    j = (t - back + torch.arange(back + fwd + 1, device=pos_bias.device)[None, :]).clamp(0, T - 1)  # [T,W]
    return bias[:, t, j], back, fwd  # out-of-range j hold a key of -inf, so their bias is never used


def _aft_simple_causal(k, v):
    """Causal softmax-over-prefix per channel in O(T*D), in chunks of SIMPLE_CHUNK tokens (the
    flash-attention trick along time). Each chunk takes the running max of k at its end as its
    reference R: inside the chunk, cumulative sums of exp(k - R) (v, 1); from the chunks before, their
    totals carried by a scan over chunks that rescales by exp(R_prev - R) <= 1. Every exponent is
    <= 0; a row's largest term is exp(m_t - R), m_t its running max, which stays far from underflow
    while m_t is within UNDERFLOW_GAP of R. When a key jumps further above the running max inside a
    chunk (rare: keys of that size), the three log-cumsum-exp scans over T instead (_log_sums)."""
    B, H, T, D = k.shape
    c = min(SIMPLE_CHUNK, T)
    n, pad = -(-T // c), -T % c
    m = torch.cummax(k.detach(), dim=2).values  # [B,H,T,D] running max; the reference cancels: no gradient
    if pad:
        m = torch.cat([m, m[:, :, -1:].expand(B, H, pad, D)], dim=2)
    m = m.view(B, H, n, c, D)
    ref = m[:, :, :, -1:]  # [B,H,n,1,D]
    if float((ref - m[:, :, :, :1]).max()) >= UNDERFLOW_GAP[k.dtype]:
        return _aft_simple_causal_log(k, v)
    if pad:  # padded keys weigh exp(-inf) = 0
        k = F.pad(k, (0, 0, 0, pad), value=float("-inf"))
        v = F.pad(v, (0, 0, 0, pad))
    w = torch.exp(k.reshape(B, H, n, c, D) - ref)  # <= 1
    num = torch.cumsum(w * v.reshape(B, H, n, c, D), dim=3)  # [B,H,n,c,D] relative to the chunk's R
    den = torch.cumsum(w, dim=3)
    R = ref[:, :, :, 0]  # [B,H,n,D]
    g = torch.exp(torch.cat([R[:, :, :1], R[:, :, :-1]], dim=2) - R)  # exp(R_prev - R) <= 1
    # Z_m = g_m Z_{m-1} + total of chunk m: every chunk up to m, relative to R_m
    Z = decayed_scan(g[..., None, :], torch.stack([num[:, :, :, -1], den[:, :, :, -1]], dim=3))  # [B,H,n,2,D]
    carry = g[..., None, :] * torch.cat([torch.zeros_like(Z[:, :, :1]), Z[:, :, :-1]], dim=2)  # before chunk m
    mean = (num + carry[:, :, :, None, 0]) / (den + carry[:, :, :, None, 1])
    return mean.view(B, H, n * c, D)[:, :, :T]


def _aft_simple_causal_log(k, v):
    """The same as ``_aft_simple_causal`` from the three log-space scans (``_log_sums``): exact for
    any keys, with no choice of path made from their values. k, v: [B,H,T,D]."""
    la, lb, l1 = _log_sums(k, v)
    return (torch.exp(la - l1) - torch.exp(lb - l1)).to(v.dtype)


def _reverse_cumsum(x):
    """sum over t >= j along dim 1, summed from the end: a total minus a prefix would cancel
    catastrophically (the early terms a_t = G_t / den_t can be far larger than the late ones)."""
    return torch.cumsum(x.flip(1), 1).flip(1)


class _SimpleCausal(torch.autograd.Function):
    """Causal AFT-simple by two plain cumulative sums against one reference per channel, the largest
    key M: o_t = sigmoid(q_t) * sum_{j<=t} e_j v_j / sum_{j<=t} e_j with e_j = exp(k_j - M) <= 1.
    Row t's largest term is at least exp(k_0 - M) (its prefix holds key 0), so while
    M - k_0 < UNDERFLOW_GAP no row loses its leading terms; the caller checks that and passes M
    (``_simple_reference``).

    q, k, v [B, T, H, D] in the compute dtype. The sums run block by block along T, their totals
    carried, so every temporary is a block's worth; backward recomputes a block from the carried
    totals and takes the reverse cumulative sums of a_t = G_t / den_t and a_t * mean_t:
    dv_j = e_j A_j and dk_j = e_j (v_j A_j - C_j). M gets no gradient: it cancels in the ratio.
    """

    @staticmethod
    def forward(ctx, q, k, v, M):
        B, T, H, D = k.shape
        block = max(1, SIMPLE_BLOCK_ELEMENTS // max(1, B * H * D))  # an empty batch: any block
        o = torch.empty_like(v)
        totals = k.new_zeros(-(-T // block) + 1, 2, B, 1, H, D)  # (num, den) before each block
        for i, t0 in enumerate(range(0, T, block)):
            t1 = min(t0 + block, T)
            e = torch.exp(k[:, t0:t1] - M)
            num = torch.cumsum(e * v[:, t0:t1], 1).add_(totals[i, 0])
            den = torch.cumsum(e, 1).add_(totals[i, 1])
            totals[i + 1, 0], totals[i + 1, 1] = num[:, -1:], den[:, -1:]
            torch.mul(torch.sigmoid(q[:, t0:t1]), num.div_(den), out=o[:, t0:t1])
        ctx.save_for_backward(q, k, v, M, totals)
        ctx.block = block
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx, go):
        q, k, v, M, totals = ctx.saved_tensors
        T, block = k.shape[1], ctx.block
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        A_after = C_after = 0.0  # the reverse sums from the blocks after the one at hand
        starts = range(0, T, block)
        for i in range(len(starts) - 1, -1, -1):
            t0 = starts[i]
            t1 = min(t0 + block, T)
            vb, gb = v[:, t0:t1], go[:, t0:t1]
            e = torch.exp(k[:, t0:t1] - M)
            den = torch.cumsum(e, 1).add_(totals[i, 1])
            mean = torch.cumsum(e * vb, 1).add_(totals[i, 0]).div_(den)
            s = torch.sigmoid(q[:, t0:t1])
            a = (gb * s).div_(den)  # the gradient reaching num_t; -a_t mean_t reaches den_t
            A = _reverse_cumsum(a).add_(A_after)
            C = _reverse_cumsum(a.mul_(mean)).add_(C_after)
            A_after, C_after = A[:, :1], C[:, :1]
            torch.mul(e, A, out=dv[:, t0:t1])
            torch.mul(vb, A, out=dk[:, t0:t1]).sub_(C).mul_(e)
            torch.mul(gb * mean, s * (1 - s), out=dq[:, t0:t1])
        return dq, dk, dv, None


class _NativeSimpleCausal(torch.autograd.Function):
    """Causal AFT-simple by the fused CPU kernel (ops/native/aft.cpp): q, k, v [B, T, H, D] in the
    compute dtype. Forward saves its carried sums every few steps; backward recomputes the steps
    between, a stretch at a time, and walks them in reverse (the derivation is at the top of aft.cpp)."""

    @staticmethod
    def forward(ctx, q, k, v):
        o, ckpt = native_aft.forward(q, k, v, save=True)
        ctx.save_for_backward(q, k, v, ckpt)
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx, go):
        return native_aft.backward(*ctx.saved_tensors, go)


def _simple_reference(k) -> Optional[torch.Tensor]:
    """The cumsum path's reference M [B,1,H,D] (the largest key of each channel) for keys k
    [B,T,H,D], or None where that path is not exact: the largest gap M - k_0 (see above)."""
    kd = k.detach()
    M = kd.amax(dim=1, keepdim=True)
    return M if kd.numel() == 0 or float((M[:, 0] - kd[:, 0]).max()) < UNDERFLOW_GAP[k.dtype] else None


def uses_band(T: int, Hw: int, B: int, H: int, W: int, D: int) -> bool:
    """AFT-local/conv's choice: the band [B, H, T, W, D] when it is smaller than the bias matrix
    [Hw, T, T] (the cost model follows the same choice)."""
    return T * Hw > BANDED_RATIO * B * H * W * D


def _check_one_d(Dk: int, Dv: int) -> None:
    """AFT mixes values per channel: k and v share D. (Beside check_qkv, not around it: its head-first
    warning counts the frames to the user's call.)"""
    if Dk != Dv:
        raise ValueError(f"AFT mixes values per channel: v must have the same last dimension as k, got {Dk} and {Dv}")


def aft(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    variant: str,
    pos_bias: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
    causal: bool = True,
) -> torch.Tensor:
    """AFT. q, k, v: [B, T, H, D] (one D: AFT mixes per channel) -> o [B, T, H, D].

    variant ``full``/``local``: pos_bias [T_max, T_max] shared by all heads or [H, T_max, T_max],
    T_max >= T (the top-left [T, T] block is used); ``local`` also needs ``window``. ``conv``: pos_bias
    [H, kernel] (odd kernel when not causal). ``simple``: no pos_bias. Memory O(T*D) for simple,
    O(T*T + T*D) for full, the smaller of O(T*T) and O(T*window*D) for local/conv.
    """
    B, T, H, Dk, Dv = check_qkv(q, k, v)
    _check_one_d(Dk, Dv)
    check_bool("causal", causal)
    _check_variant_args(variant, pos_bias, window, T, H)
    if variant == "conv" and not causal and pos_bias.shape[-1] % 2 == 0:
        raise ValueError(f"a non-causal conv kernel must have odd width, got pos_bias {tuple(pos_bias.shape)}")
    dtype = compute_dtype(q.dtype)
    # in that dtype under mixed precision too: autocast would run the weights' matmuls in 16 bits, where the
    # terms exp(k - max k) below 6e-8 vanish (rows of 0 / 0) and the rest keep 3 digits
    with autocast_off(q.device):
        if variant == "simple" and causal:
            q32, k32, v32 = q.to(dtype), k.to(dtype), v.to(dtype)  # [B,T,H,D]: the sums run along T, H*D contiguous
            if native_aft.supports(q32, k32, v32):  # the CPU: one fused pass, exact for any keys
                if torch.is_grad_enabled() and any(x.requires_grad for x in (q32, k32, v32)):
                    return _NativeSimpleCausal.apply(q32, k32, v32).to(q.dtype)
                return native_aft.forward(q32, k32, v32, save=False)[0].to(q.dtype)
            if not reads_values(k.device):  # an accelerator: no path chosen from values (a host sync)
                mean = _aft_simple_causal_log(k32.transpose(1, 2), v32.transpose(1, 2)).transpose(1, 2)
            elif (M := _simple_reference(k32)) is not None:  # keys of ordinary size: two cumsums
                return _SimpleCausal.apply(q32, k32, v32, M).to(q.dtype)
            else:  # a huge key late in the sequence: chunks with their own references
                mean = _aft_simple_causal(k32.transpose(1, 2), v32.transpose(1, 2)).transpose(1, 2)
            return (torch.sigmoid(q32) * mean).to(q.dtype)
        kh, vh = (x.transpose(1, 2).to(dtype) for x in (k, v))  # [B,H,T,D]
        if variant == "simple":  # not causal: one softmax over all keys
            mean = (torch.softmax(kh, dim=2) * vh).sum(2, keepdim=True).expand_as(vh)
        elif variant == "full":
            logw = position_bias(variant, pos_bias.to(dtype), window, T, causal)  # [Hw,T,T]
            mean = _aft_causal(kh, vh, logw) if causal else _aft_dense(kh, vh, logw)
        else:  # local, conv: whichever of the band [B,H,T,W,D] and the bias matrix [Hw,T,T] is smaller
            band_w, back, fwd = band_bias(variant, pos_bias.to(dtype), window, T, causal)
            Hw = pos_bias.shape[0] if pos_bias.dim() == 3 or variant == "conv" else 1
            if uses_band(T, Hw, B, H, back + fwd + 1, Dk):
                mean = _aft_banded(kh, vh, band_w, back, fwd, causal)
            else:
                logw = position_bias(variant, pos_bias.to(dtype), window, T, causal)  # [Hw,T,T]
                mean = _aft_causal(kh, vh, logw) if causal else _aft_dense(kh, vh, logw)
        o = torch.sigmoid(q.to(dtype)) * mean.transpose(1, 2)  # [B,T,H,D]
        return o.to(q.dtype)


def aft_simple_state(k: torch.Tensor, v: torch.Tensor) -> AFTState:
    """The causal simple state after the tokens k, v [B, T, H, D] (e.g. a prompt), for aft_simple_step."""
    _check_one_d(*check_qkv(k, k, v)[3:])
    dtype = compute_dtype(k.dtype)
    k, v = k.to(dtype), v.to(dtype)
    m = k.amax(dim=1)  # [B,H,D]
    ek = torch.exp(k - m[:, None])  # [B,T,H,D]
    return (ek * v).sum(1), ek.sum(1), m


def aft_simple_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: Optional[AFTState] = None
) -> Tuple[torch.Tensor, AFTState]:
    """One token of causal AFT-simple: q, k, v [B, H, D] -> (o [B, H, D], state).

    state = (num, den, m), each [B, H, D] in float32 (float64 for float64 inputs): the running sums of
    exp(k - m) v and exp(k - m), m the running max of k. Constant size whatever the length.
    """
    B, _, H, Dk, Dv = check_qkv(q, k, v, layout="[B, H, D]")
    _check_one_d(Dk, Dv)
    dtype = compute_dtype(q.dtype)
    kd, vd = k.to(dtype), v.to(dtype)
    if state is None:
        num = torch.zeros(B, H, Dk, dtype=dtype, device=q.device)
        den = torch.zeros_like(num)
        m = torch.full_like(num, float("-inf"))
    else:
        if not (isinstance(state, (tuple, list)) and len(state) == 3):
            raise TypeError("state must be a triple (num, den, m) of [B, H, D] tensors or None")
        for name, x in zip(("num", "den", "m"), state):
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != (B, H, Dk) or x.dtype != dtype:
                raise ValueError(
                    f"state {name} must be a {dtype} tensor of shape {[B, H, Dk]}, "
                    f"got {getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}"
                )
        num, den, m = state
    m_new = torch.maximum(m, kd)
    decay = torch.exp(m - m_new)  # rescales the old sums to the new max; exp(-inf) = 0 at the start
    ek = torch.exp(kd - m_new)
    num = num * decay + ek * vd
    den = den * decay + ek
    o = torch.sigmoid(q.to(dtype)) * num / den
    return o.to(q.dtype), (num, den, m_new)


class AFTWindowState(NamedTuple):
    """Decoding state of causal AFT-local/conv: keys that left the window as an AFT-simple state,
    the last `window` keys and values in a ring (slot = position % window). Constant size."""

    num: torch.Tensor  # [B, H, D] sum of exp(k - m) v over keys before the window
    den: torch.Tensor  # [B, H, D]
    m: torch.Tensor  # [B, H, D] their running max (-inf while there are none)
    ring_k: torch.Tensor  # [B, H, W, D]
    ring_v: torch.Tensor  # [B, H, W, D]
    pos: int  # tokens seen so far


def _band_width(variant: str, pos_bias, window) -> int:
    if variant not in ("local", "conv"):
        raise ValueError(f"variant must be 'local' or 'conv' for a windowed AFT state, got {variant!r}")
    if variant == "conv" and not isinstance(pos_bias, torch.Tensor):
        raise ValueError(f"variant 'conv' needs pos_bias, a tensor [H, kernel], got {type(pos_bias).__name__}")
    return pos_bias.shape[-1] if variant == "conv" else window


def aft_window_state(k: torch.Tensor, v: torch.Tensor, *, variant: str, pos_bias, window=None) -> AFTWindowState:
    """The causal AFT-local/conv decoding state after the tokens k, v [B, T, H, D] (e.g. a prompt)."""
    B, T, H, D, Dv = check_qkv(k, k, v)
    _check_one_d(D, Dv)
    W = _band_width(variant, pos_bias, window)
    check_positive_int("window", W)
    dtype = compute_dtype(k.dtype)
    if T > W:
        num, den, m = aft_simple_state(k[:, : T - W], v[:, : T - W])
    else:
        num = torch.zeros(B, H, D, dtype=dtype, device=k.device)
        den, m = torch.zeros_like(num), torch.full_like(num, float("-inf"))
    ring_k = torch.zeros(B, H, W, D, dtype=dtype, device=k.device)
    ring_v = torch.zeros_like(ring_k)
    last = torch.arange(max(0, T - W), T, device=k.device)
    ring_k[:, :, last % W] = k[:, last].transpose(1, 2).to(dtype)
    ring_v[:, :, last % W] = v[:, last].transpose(1, 2).to(dtype)
    return AFTWindowState(num, den, m, ring_k, ring_v, T)


def aft_window_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: AFTWindowState,
    *,
    variant: str,
    pos_bias,
    window=None,
    inplace: bool = False,
) -> Tuple[torch.Tensor, AFTWindowState]:
    """One token of causal AFT-local/conv: q, k, v [B, H, D] -> (o [B, H, D], state), constant memory.

    The key leaving the window joins the unbiased sum; the window's keys get their bias.
    inplace: write the new key and value into ``state``'s ring instead of a copy of it, for a decoding
    loop that owns its state (the state passed in is then spent: it shares the returned one's ring).
    Ignored where autograd records the ring or this step's inputs (the sliding window's rule).
    """
    B, _, H, D, Dv = check_qkv(q, k, v, layout="[B, H, D]")
    _check_one_d(D, Dv)
    W = _band_width(variant, pos_bias, window)
    if not isinstance(state, AFTWindowState) or state.ring_k.shape != (B, H, W, D):
        got = f"a ring {list(state.ring_k.shape)}" if isinstance(state, AFTWindowState) else type(state).__name__
        raise ValueError(f"state must be an AFTWindowState with a ring of shape {[B, H, W, D]} (from aft_window_state), "
                         f"got {got}")
    check_bool("inplace", inplace)
    p = state.pos
    _check_variant_args(variant, pos_bias, None if variant == "conv" else window, p + 1, H)
    num, den, m = state.num, state.den, state.m
    ring_k, ring_v = state.ring_k, state.ring_v
    inputs = (q, k, v, pos_bias, num, den, m)
    if not (inplace and can_write_in_place(ring_k, ring_v, *inputs)):  # else copies: the caller keeps its ring
        ring_k, ring_v = ring_k.clone(), ring_v.clone()
    records = torch.is_grad_enabled() and any(x.requires_grad for x in (ring_k, ring_v, *inputs))
    slot = p % W
    if p >= W:  # position p - W leaves the window: fold it into the unbiased sums
        k_old, v_old = ring_k[:, :, slot], ring_v[:, :, slot]
        if records:  # autograd saves them, and the slot is overwritten below
            k_old, v_old = k_old.clone(), v_old.clone()
        m_new = torch.maximum(m, k_old)
        decay, e = torch.exp(m - m_new), torch.exp(k_old - m_new)
        num, den, m = num * decay + e * v_old, den * decay + e, m_new
    ring_k[:, :, slot] = k.to(ring_k.dtype)
    ring_v[:, :, slot] = v.to(ring_v.dtype)
    # the window's keys in slot order (slot = position % W): views of the ring, not a gather; the
    # small bias is reordered to match instead
    n = min(p + 1, W)
    kw, vw = (ring_k, ring_v) if n == W else (ring_k[:, :, :n], ring_v[:, :, :n])  # [B,H,n,D]
    if records and not vw.requires_grad:  # saved for the bias's (or state's) gradient, where a later step
        vw = vw.clone()  # (under no_grad, say) could write the ring in place
    if variant == "conv":
        w = pos_bias[:, :n].flip(-1)  # [H, n]: taps n-1..0, the window's keys oldest first
    else:
        w = (pos_bias if pos_bias.dim() == 3 else pos_bias[None])[:, p, p + 1 - n : p + 1]  # [Hw, n] oldest first
    # the i-th oldest key (position p + 1 - n + i) sits in slot (p + 1 + i) % n
    w = w.to(ring_k.dtype).roll(p + 1, -1)
    r = _finite(torch.maximum(kw.amax(2), m))  # near the row's terms: k - r keeps w's digits in k + w
    logits = (kw - r[:, :, None]) + w[None, :, :, None]  # [B,H,n,D]
    R = torch.maximum(logits.amax(2), m - r)
    e = torch.exp(logits - R[:, :, None])
    scale = torch.exp(m - r - R)  # 0 while nothing has left the window
    num_o = num * scale + (e * vw).sum(2)
    den_o = den * scale + e.sum(2)
    o = torch.sigmoid(q.to(num.dtype)) * num_o / den_o
    return o.to(q.dtype), AFTWindowState(num, den, m, ring_k, ring_v, p + 1)


def aft_last_row(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, variant: str, pos_bias=None, window=None
) -> torch.Tensor:
    """Causal AFT output of the newest token only, for decoding with a cache of every key and value.

    q [B, H, D] is the query at position L - 1; k, v [B, L, H, D] are all keys and values so far.
    O(L*D) per token (AFT-full's bias row depends on the position, so it needs the whole history).
    """
    B, L, H, Dk, Dv = check_qkv(k, k, v)
    _check_one_d(Dk, Dv)
    check_tensor("q", q, 3, "[B, H, D]")
    if q.shape != (B, H, Dk):
        raise ValueError(f"q must have shape [B, H, D] = {[B, H, Dk]}, got {tuple(q.shape)}")
    if q.dtype != k.dtype or q.device != k.device:
        raise TypeError(f"q must have k and v's dtype and device ({k.dtype}, {k.device}), got {q.dtype}, {q.device}")
    _check_variant_args(variant, pos_bias, window, L, H)
    dtype = compute_dtype(q.dtype)
    # [B,H,L,D]: a decoding cache's own layout (the layer passes it transposed), L contiguous to reduce over
    kh, vh = k.transpose(1, 2).to(dtype), v.transpose(1, 2).to(dtype)
    logits = kh - _finite(kh.detach().amax(2, keepdim=True))  # cancels in the softmax; keeps w's digits
    if variant == "full":  # the query's row of the pairwise bias, a view
        w = pos_bias[..., L - 1, :L].to(dtype)  # [L] or [H, L]
        logits = logits + w[..., None]
    elif variant != "simple":
        w = position_bias(variant, pos_bias.to(dtype), window, L, True, rows=slice(L - 1, L))  # [Hw,1,L]
        logits = logits + w[:, 0, :, None]
    mean = (torch.softmax(logits, dim=2) * vh).sum(2)  # [B,H,D]
    return (torch.sigmoid(q.to(dtype)) * mean).to(q.dtype)


def aft_reference(q, k, v, *, variant, pos_bias=None, window=None, causal=True) -> torch.Tensor:
    """Plain float64 AFT for tests: the bias built entry by entry, then one softmax over keys per row."""
    q, k, v = q.double(), k.double(), v.double()
    B, T, H, D = q.shape
    w = torch.zeros(H, T, T, dtype=torch.float64)
    for h in range(H):
        for t in range(T):
            for j in range(T):
                if variant in ("full", "local"):
                    b = pos_bias[h] if pos_bias.dim() == 3 else pos_bias
                    near = (0 <= t - j < window if causal else abs(t - j) < window) if variant == "local" else True
                    if near:
                        w[h, t, j] = b[t, j]
                elif variant == "conv":
                    kernel = pos_bias.shape[-1]
                    tap = t - j if causal else t - j + kernel // 2
                    if 0 <= tap < kernel:
                        w[h, t, j] = pos_bias[h, tap]
    o = torch.zeros(B, T, H, D, dtype=torch.float64)
    for t in range(T):
        n = t + 1 if causal else T
        logits = k[:, :n] + w[:, t, :n].T[None, :, :, None]  # [B,n,H,D]
        o[:, t] = torch.sigmoid(q[:, t]) * (torch.softmax(logits, dim=1) * v[:, :n]).sum(1)
    return o
