"""Longformer attention layer for the GPT, registered as ``sliding-window``.

Causal banded softmax attention (options ``window``, ``dilation``, ``scale``) with optional global
tokens (``global_tokens``: absolute positions, e.g. [0] for an attention sink). As in the paper,
global tokens' own rows use separate projections ``q_global``, ``k_global``, ``v_global`` (they
attend to every earlier position); other rows see a global token through the ordinary k and v.

Generation keeps a ring buffer of the last (window - 1) * dilation + 1 keys and values plus the
keys up to the last global position: memory constant in the generated length. Decoding writes the
ring in place (a cache serves one continuation, as the softmax layer's KVCache), except where
autograd records it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch
import torch.nn as nn

from lintrans.ops.sliding_window import (
    SlidingWindowCache,
    global_positions,
    sliding_window_attention,
    sliding_window_cache,
    sliding_window_step,
)

from .attention import QKVAttention, check_options, options_checked_by_op
from .registry import register_attention


class LongformerCache(NamedTuple):
    window: SlidingWindowCache  # ordinary keys and values: the ring and the prefix up to the last global
    global_k: torch.Tensor  # [B, H, P, D] k_global of positions 0..P-1 (P <= last global position + 1)
    global_v: torch.Tensor  # [B, H, P, D]


@dataclass
class SlidingWindowOptions:
    window: int = field(default=128, metadata={"low": 1, "help": "keys per query"})
    dilation: int = field(default=1, metadata={"low": 1})
    global_tokens: Optional[list[int]] = field(default=None, metadata={"help": "absolute positions, e.g. [0]"})
    scale: Optional[float] = field(default=None, metadata={"help": "None: 1 / sqrt(head_dim)"})


@register_attention("sliding-window")
class SlidingWindowAttention(QKVAttention):
    Options = SlidingWindowOptions

    @classmethod
    def core_flops(cls, shape, T: int, B: int = 1) -> float:
        # keys per query (global tokens left out): the band's FLOPs; the blocked paths score more
        # (docs/benchmarks.md, "Where a kernel does more")
        w = min(cls.option(shape, "window"), T)
        return 4.0 * B * shape.n_head * T * w * shape.head_dim

    @classmethod
    def cache_bytes(cls, shape, T: int, B: int = 1, dtype_bytes: int = 4) -> int:
        ring = (cls.option(shape, "window") - 1) * cls.option(shape, "dilation") + 1
        width = B * shape.n_head * shape.head_dim  # keys and values are cached after repeat_kv
        out = 2 * width * ring * dtype_bytes  # the ring buffer, allocated whole
        g = cls.option(shape, "global_tokens")
        if g:  # the prefix up to the last global token: its keys and values, and their global projections
            out += 4 * width * min(T, max(g) + 1) * dtype_bytes
        return out

    @classmethod
    def extra_parameters(cls, shape) -> int:
        if not cls.option(shape, "global_tokens"):
            return 0
        D = shape.n_head * shape.head_dim
        return 3 * (shape.n_embd * D + int(shape.bias) * D)  # q_global, k_global, v_global

    def __init__(self, config):
        super().__init__(config)
        opts = check_options("sliding-window", config.attention_options, self.Options)
        self.window, self.dilation, self.scale = opts["window"], opts["dilation"], opts["scale"]
        with options_checked_by_op("sliding-window"):
            g = global_positions(opts["global_tokens"], None)
        self.global_tokens = None if g is None or g.numel() == 0 else g.tolist()
        if self.global_tokens is not None:
            width = config.n_head * self.head_dim
            self.q_global = nn.Linear(config.n_embd, width, bias=config.bias)
            self.k_global = nn.Linear(config.n_embd, width, bias=config.bias)
            self.v_global = nn.Linear(config.n_embd, width, bias=config.bias)

    def _kw(self):
        return dict(window=self.window, dilation=self.dilation, global_tokens=self.global_tokens)

    def _heads(self, y: torch.Tensor) -> torch.Tensor:
        return y.view(*y.shape[:-1], self.n_head, self.head_dim)

    def forward(self, x: torch.Tensor, cache: Optional[LongformerCache] = None, use_cache: bool = False):
        if cache is not None:
            outs = []
            for t in range(x.shape[1]):  # decoding: one token at a time
                # the rings are written in place once they are this call's own, or the caller hands the
                # cache on (use_cache): as KVCache, a cache serves one continuation
                o, cache = self._step(x[:, t : t + 1], cache, inplace=use_cache or t > 0)
                outs.append(o)
            return self.out(torch.cat(outs, dim=1)), (cache if use_cache else None)
        q, k, v = self.qkv(x)
        k, v = self.repeat_kv(k, 2), self.repeat_kv(v, 2)  # [B,T,H,D]
        T = x.shape[1]
        g = [p for p in self.global_tokens or [] if p < T]  # configured positions may lie beyond this T
        o = sliding_window_attention(
            q, k, v, window=self.window, dilation=self.dilation, causal=True, global_tokens=g or None, scale=self.scale,
            global_rows=False,  # the global rows come from the layer's own global projections below
        )  # [B,T,H,D]
        new_cache = None
        if self.global_tokens is not None:
            P = min(T, self.global_tokens[-1] + 1)
            gk, gv = self._heads(self.k_global(x[:, :P])), self._heads(self.v_global(x[:, :P]))  # [B,P,H,D]
            if g:
                gq = self._heads(self.q_global(x[:, g]))  # [B,G,H,D]
                s = torch.einsum("bghd,bjhd->bhgj", gq, gk) * self._scale()
                idx = torch.tensor(g, device=x.device)
                s = s.masked_fill(torch.arange(P, device=x.device)[None, :] > idx[:, None], float("-inf"))
                og = torch.einsum("bhgj,bjhd->bghd", s.softmax(-1), gv)
                o = o.index_copy(1, idx, og.to(o.dtype))
            if use_cache:
                new_cache = (gk.transpose(1, 2), gv.transpose(1, 2))
        if use_cache:
            win = sliding_window_cache(
                k, v, window=self.window, dilation=self.dilation, global_tokens=self.global_tokens
            )
            gk, gv = new_cache if new_cache is not None else (k.new_zeros(0), v.new_zeros(0))
            new_cache = LongformerCache(win, gk, gv)
        return self.out(o), new_cache

    def _scale(self) -> float:
        return self.head_dim**-0.5 if self.scale is None else float(self.scale)

    def _step(self, x: torch.Tensor, cache: LongformerCache, inplace: bool):
        q, k, v = self.qkv(x)
        k, v = self.repeat_kv(k, 2), self.repeat_kv(v, 2)  # [B,1,H,D]
        p = cache.window.pos
        o, win = sliding_window_step(q[:, 0], k[:, 0], v[:, 0], cache.window, scale=self.scale, inplace=inplace,
                                     **self._kw())
        gk, gv = cache.global_k, cache.global_v
        if self.global_tokens is not None and p <= self.global_tokens[-1]:
            gk = torch.cat([gk, self._heads(self.k_global(x)).transpose(1, 2)], dim=2)  # [B,H,P+1,D]
            gv = torch.cat([gv, self._heads(self.v_global(x)).transpose(1, 2)], dim=2)
            if p in self.global_tokens:  # a global row: its own projections, every key so far
                gq = self._heads(self.q_global(x))[:, 0]  # [B,H,D]
                s = torch.einsum("bhd,bhjd->bhj", gq, gk) * self._scale()
                o = torch.einsum("bhj,bhjd->bhd", s.softmax(-1), gv).to(o.dtype)
        return o[:, None], LongformerCache(win, gk, gv)
