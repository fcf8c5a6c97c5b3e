"""BigBird block-sparse attention (Zaheer et al. 2020).

The sequence is cut into blocks of ``block_size`` tokens. A query block attends to

* its window: ``window_blocks`` blocks around it (causal: itself and the ``window_blocks - 1``
  blocks before it; otherwise ``window_blocks // 2`` on each side),
* the global blocks: the first ``global_blocks`` blocks, which in turn attend to every block,
* ``random_blocks`` more blocks drawn without replacement from the rest (causal: from earlier
  blocks only), reproducibly from ``seed`` and the query block's index alone, so the pattern of
  a block does not change when the sequence grows (what decoding needs).

Causal attention also masks later tokens inside a block. ``bigbird_mask`` returns the exact
[T, T] pattern the op computes; the op itself gathers, per query block, only its key blocks:
work and memory O(T * block_size * (window + global + random)), plus the global rows' O(T * G).
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F

from .validation import autocast_off, check_bool, check_number, check_qkv, compute_dtype


def _check(block_size, window_blocks, global_blocks, random_blocks, seed, causal) -> None:
    check_number("block_size", block_size, integer=True, low=1)
    check_number("window_blocks", window_blocks, integer=True, low=1)
    check_number("global_blocks", global_blocks, integer=True, low=0)
    check_number("random_blocks", random_blocks, integer=True, low=0)
    check_number("seed", seed, integer=True, low=0, high=2**40)  # seed * 1_000_003 + block must fit 64 bits
    check_bool("causal", causal)


def _block_keys(b: int, n_blocks: int, window_blocks: int, global_blocks: int, random_blocks: int, seed: int,
                causal: bool) -> list[int]:
    """The sorted key blocks of query block b (a row of ``block_pattern``)."""
    if causal:
        window = set(range(max(0, b - window_blocks + 1), b + 1))
    else:
        half = window_blocks // 2
        window = set(range(max(0, b - half), min(n_blocks, b + half + 1)))
    glob = {g for g in range(min(global_blocks, n_blocks)) if not causal or g <= b}
    chosen = window | glob
    candidates = [c for c in range(b if causal else n_blocks) if c not in chosen]
    if random_blocks and candidates:
        # drawn from the seed and this block's index only: the pattern of block b never depends on T
        g = torch.Generator().manual_seed(seed * 1_000_003 + b)
        order = torch.randperm(len(candidates), generator=g)[:random_blocks].tolist()
        chosen |= {candidates[i] for i in order}
    return sorted(chosen)


def block_pattern(n_blocks: int, *, window_blocks: int = 3, global_blocks: int = 1, random_blocks: int = 2,
                  seed: int = 0, causal: bool = True) -> list[list[int]]:
    """For each query block, the sorted key blocks it attends to (global rows excluded: a global
    query block attends to every allowed block)."""
    return [_block_keys(b, n_blocks, window_blocks, global_blocks, random_blocks, seed, causal)
            for b in range(n_blocks)]


def bigbird_mask(T: int, *, block_size: int = 64, window_blocks: int = 3, global_blocks: int = 1,
                 random_blocks: int = 2, seed: int = 0, causal: bool = True, start: int = 0) -> torch.Tensor:
    """The boolean pattern (True: query i may attend to key j) that ``bigbird_attention`` computes:
    [T, T], or with ``start`` the rows of queries start..T-1 only, [T - start, T] (decoding)."""
    check_number("T", T, integer=True, low=1)
    check_number("start", start, integer=True, low=0, high=T - 1)
    _check(block_size, window_blocks, global_blocks, random_blocks, seed, causal)
    block_size = min(block_size, T)  # one block either way; a longer one would only be padding
    n = math.ceil(T / block_size)
    pattern = block_pattern(n, window_blocks=window_blocks, global_blocks=global_blocks,
                            random_blocks=random_blocks, seed=seed, causal=causal)
    blocks = torch.zeros(n, n, dtype=torch.bool)
    for b, keys in enumerate(pattern):
        blocks[b, keys] = True
    blocks[: min(global_blocks, n)] = True  # global rows
    rows = torch.arange(start, T)
    mask = blocks[rows // block_size].repeat_interleave(block_size, 1)[:, :T]  # [T-start,T]
    if causal:
        mask &= torch.arange(T)[None, :] <= rows[:, None]
    return mask


def bigbird_blocked_row(T: int, *, block_size: int = 64, window_blocks: int = 3, global_blocks: int = 1,
                        random_blocks: int = 2, seed: int = 0, device: Optional[torch.device] = None) -> torch.Tensor:
    """Causal decoding's row: [T], True where query T-1 may NOT attend to key j (``~bigbird_mask(T,
    start=T-1, causal=True)[0]``, ready for masked_fill). Sliced from its block's row, built once:
    decoding asks for it every token and layer, and the whole pattern costs a randperm per block."""
    check_number("T", T, integer=True, low=1)
    block_size = min(block_size, T)  # as bigbird_mask: one block either way
    # a causal row depends on its block alone, not on T
    return _blocked_row(device, (T - 1) // block_size, block_size, window_blocks, global_blocks, random_blocks,
                        seed)[:T]


@functools.lru_cache(maxsize=256)
def _blocked_row(device: Optional[torch.device], b: int, block_size: int, window_blocks: int, global_blocks: int,
                 random_blocks: int, seed: int) -> torch.Tensor:
    """Causal: True where query block b may not attend, over keys 0..(b + 1) * block_size - 1, on
    ``device``; the options are checked here, once per block."""
    _check(block_size, window_blocks, global_blocks, random_blocks, seed, True)
    keys = _block_keys(b, b + 1, window_blocks, global_blocks, random_blocks, seed, True)  # global b: all of 0..b
    with torch.inference_mode(False):  # cached: an inference tensor could not be saved for backward later
        blocked = torch.ones(b + 1, dtype=torch.bool)
        blocked[keys] = False
        return blocked.repeat_interleave(block_size).to(device)


@functools.lru_cache(maxsize=64)
def _pattern_on(device: torch.device, n: int, window_blocks: int, global_blocks: int, random_blocks: int,
                seed: int, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The key blocks of each query block, [n, K] (padded by repeats), and which slots are real,
    [n, K], made on the host and copied to ``device`` once: a copy per call would make CUDA wait."""
    pattern = block_pattern(n, window_blocks=window_blocks, global_blocks=global_blocks,
                            random_blocks=random_blocks, seed=seed, causal=causal)
    K = max(len(p) for p in pattern)
    with torch.inference_mode(False):  # a cached tensor made under inference_mode could not be saved for backward
        idx = torch.tensor([p + [p[-1]] * (K - len(p)) for p in pattern])
        slot_ok = torch.tensor([[s < len(p) for s in range(K)] for p in pattern])
        return idx.to(device), slot_ok.to(device)


def bigbird_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    block_size: int = 64,
    window_blocks: int = 3,
    global_blocks: int = 1,
    random_blocks: int = 2,
    seed: int = 0,
    causal: bool = True,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """q, k: [B, T, H, Dk], v: [B, T, H, Dv] -> o [B, T, H, Dv]: softmax attention under
    ``bigbird_mask(T, ...)``, computed block by block (never a T x T matrix). scale defaults to
    1/sqrt(Dk). Computed in float32 (float64 for float64 inputs), returned in q's dtype."""
    B, T, H, Dk, Dv = check_qkv(q, k, v)
    _check(block_size, window_blocks, global_blocks, random_blocks, seed, causal)
    check_number("scale", scale, allow_none=True)
    scale = 1.0 / math.sqrt(Dk) if scale is None else float(scale)
    dtype = compute_dtype(q.dtype)
    with autocast_off(q.device):  # in dtype under mixed precision too, as documented
        c = min(block_size, T)  # one block either way; a longer one would only be padding
        n = math.ceil(T / c)
        pad = n * c - T
        qh, kh, vh = (F.pad(x.transpose(1, 2).to(dtype), (0, 0, 0, pad)) for x in (q, k, v))  # [B,H,nc,D]
        qb = qh.reshape(B, H, n, c, Dk) * scale
        kb, vb = kh.reshape(B, H, n, c, Dk), vh.reshape(B, H, n, c, Dv)

        idx, slot_ok = _pattern_on(q.device, n, window_blocks, global_blocks, random_blocks, seed, causal)
        K = idx.shape[1]
        keys = kb[:, :, idx].reshape(B, H, n, K * c, Dk)  # [B,H,n,K c,Dk]: only the attended blocks
        vals = vb[:, :, idx].reshape(B, H, n, K * c, Dv)
        scores = qb @ keys.transpose(-1, -2)  # [B,H,n,c,Kc]
        qpos = torch.arange(n * c, device=q.device).reshape(n, c)  # [n,c]
        kpos = (idx[:, :, None] * c + torch.arange(c, device=q.device)).reshape(n, K * c)  # [n,Kc]
        allowed = (slot_ok[:, :, None].expand(n, K, c).reshape(n, K * c) & (kpos < T))[:, None, :]  # [n,1,Kc]
        if causal:
            allowed = allowed & (kpos[:, None, :] <= qpos[:, :, None])  # [n,c,Kc]
        scores = scores.masked_fill(~allowed, float("-inf"))
        o = (scores.softmax(-1) @ vals).reshape(B, H, n * c, Dv)  # [B,H,nc,Dv]
        G = min(global_blocks, n) * c
        if G:  # global rows: every (earlier) key, O(T * G)
            sg = qh[:, :, :G] * scale @ kh[:, :, :T].transpose(-1, -2)  # [B,H,G,T]
            if causal:
                sg = sg.masked_fill(torch.arange(T, device=q.device)[None, :] > torch.arange(G, device=q.device)[:, None],
                                    float("-inf"))
            o = torch.cat([sg.softmax(-1) @ vh[:, :, :T], o[:, :, G:]], dim=2)
        return o[:, :, :T].transpose(1, 2).to(q.dtype)  # [B,T,H,Dv]


def bigbird_attention_reference(q, k, v, *, scale=None, **pattern) -> torch.Tensor:
    """Dense float64 softmax under ``bigbird_mask``, for tests."""
    q, k, v = q.double(), k.double(), v.double()
    T, Dk = q.shape[1], q.shape[-1]
    scale = 1.0 / math.sqrt(Dk) if scale is None else scale
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    s = s.masked_fill(~bigbird_mask(T, **pattern), float("-inf"))
    return torch.einsum("bhij,bjhd->bihd", s.softmax(-1), v)
