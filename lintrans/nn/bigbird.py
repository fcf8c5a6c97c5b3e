"""BigBird block-sparse attention layer for the GPT, registered as ``bigbird`` (op: ``lintrans.ops.bigbird``).

Options: ``block_size`` (tokens per block, 64), ``window_blocks`` (3), ``global_blocks`` (1),
``random_blocks`` (2), ``seed`` (0: the random blocks, the same in every layer), ``scale``. Causal.
Decoding keeps every key and value (random blocks may lie anywhere earlier) and computes each new
row under the same mask as the forward pass, at O(T) per token like softmax's KV cache.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from lintrans.ops.bigbird import bigbird_attention, bigbird_blocked_row, bigbird_mask
from lintrans.ops.validation import autocast_off

from .attention import KVCache, QKVAttention, check_options, options_checked_by_op
from .registry import register_attention


@dataclass
class BigBirdOptions:
    block_size: int = field(default=64, metadata={"help": "tokens per block"})
    window_blocks: int = 3
    global_blocks: int = 1
    random_blocks: int = 2
    seed: int = field(default=0, metadata={"help": "the random blocks (the same in every layer)"})
    scale: Optional[float] = field(default=None, metadata={"help": "None: 1 / sqrt(head_dim)"})


@register_attention("bigbird")
class BigBirdAttention(QKVAttention):
    Options = BigBirdOptions

    def __init__(self, config):
        super().__init__(config)
        self.opts = check_options("bigbird", config.attention_options, self.Options)
        self.pattern = {k: self.opts[k] for k in ("block_size", "window_blocks", "global_blocks", "random_blocks", "seed")}
        with options_checked_by_op("bigbird"):
            bigbird_mask(1, **self.pattern)  # checks the options now, not at the first forward

    def forward(self, x: torch.Tensor, cache: Optional[KVCache] = None, use_cache: bool = False):
        q, k, v = self.qkv(x)
        k, v = self.repeat_kv(k, 2), self.repeat_kv(v, 2)  # [B,T,H,D]
        if cache is None:
            o = bigbird_attention(q, k, v, causal=True, scale=self.opts["scale"], **self.pattern)
            new = KVCache(k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()) if use_cache else None
            return self.out(o), new
        past, T = cache.length, x.shape[1]
        kh, vh = k.transpose(1, 2), v.transpose(1, 2)  # [B,H,T,D]
        if use_cache:
            cache.append(kh, vh)
            keys, values = cache.k, cache.v
        else:
            keys, values = torch.cat([cache.k, kh], dim=2), torch.cat([cache.v, vh], dim=2)
        if T == 1:  # a decoding step: its block's row, built once instead of the whole pattern per token
            blocked = bigbird_blocked_row(past + 1, device=x.device, **self.pattern)  # [past+1]
        else:
            blocked = ~bigbird_mask(past + T, start=past, causal=True, **self.pattern).to(x.device)  # [T,past+T]
        scale = 1.0 / math.sqrt(self.head_dim) if self.opts["scale"] is None else float(self.opts["scale"])
        acc = torch.promote_types(q.dtype, torch.float32)  # float32 at least, float64 for float64 models
        with autocast_off(x.device):  # in acc throughout, as the op computes the forward
            s = (q.transpose(1, 2).to(acc) @ keys.to(acc).transpose(-1, -2)) * scale  # [B,H,T,L]
            o = (s.masked_fill(blocked, float("-inf")).softmax(-1) @ values.to(acc)).to(values.dtype)  # [B,H,T,D]
        return self.out(o.transpose(1, 2)), (cache if use_cache else None)

    # the cost model: per query block, its window, global and random blocks
    @classmethod
    def core_flops(cls, shape, T: int, B: int = 1) -> float:
        c = min(cls.option(shape, "block_size"), T)
        blocks = cls.option(shape, "window_blocks") + cls.option(shape, "global_blocks") + cls.option(shape, "random_blocks")
        G = min(cls.option(shape, "global_blocks") * c, T)
        return 4.0 * B * shape.n_head * shape.head_dim * (T * min(blocks * c, T) + G * T)

    @classmethod
    def cache_bytes(cls, shape, T: int, B: int = 1, dtype_bytes: int = 4) -> int:
        return 2 * B * shape.n_head * shape.head_dim * T * dtype_bytes  # every key and value
