"""Reformer LSH attention layer for the GPT, registered as ``reformer`` (op: ``lintrans.ops.lsh``).

One projection ``c_attn`` makes the shared query-key vector and the value ([C] -> [2C]; so no
grouped-query heads and no GPT-2 ``c_attn`` to load). Options: ``n_buckets`` (32, the paper's
2 T / chunk for T = 1024), ``n_hashes`` (2), ``chunk_size`` (64), ``seed`` (0: the rotations, the
same in every layer), ``scale``. Causal, with the strictly causal ``lookback="window"``: a token
attends to same-bucket tokens among the ``chunk_size`` before it in each round's sorted order,
which depends on earlier tokens only (the paper's chunks would let later tokens move the chunk
boundaries). Decoding keeps every unit key (normalised once, in the compute dtype), value and
bucket (a growing cache, like softmax's KV cache) and computes each new row densely under
``lsh_mask``, at O(T) per token: equal to the forward pass.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn

from lintrans.checks import check_number
from lintrans.ops.lsh import check_lsh_options, lsh_attention, lsh_buckets, lsh_mask, shared_qk_rows, unit_keys

from .attention import KVCache, QKVAttention, check_options, options_checked_by_op
from .registry import register_attention


class LSHCache(KVCache):
    """Unit keys and values [B, H, L, D] plus every token's buckets [B, H, L, n_hashes].

    The keys are ``unit_keys`` of the shared projection (in the compute dtype), not the projection:
    decoding uses them only normalised, so each is normalised once instead of every key per token."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, buckets: torch.Tensor):
        super().__init__(k, v)
        self._b = buckets

    def append(self, k: torch.Tensor, v: torch.Tensor, buckets: torch.Tensor) -> None:
        self.check(k, v)
        if buckets.shape[:3] != k.shape[:3] or buckets.shape[3] != self._b.shape[3]:
            raise ValueError(f"cache: buckets {list(buckets.shape)} do not continue {list(self.buckets.shape)}")
        need = self.length + k.shape[2]
        if need > self._b.shape[2]:
            self._b = self._grow(self._b, max(need, 2 * self._b.shape[2]))
        self._b[:, :, self.length : need] = buckets
        super().append(k, v)

    @property
    def buckets(self) -> torch.Tensor:
        return self._b[:, :, : self.length]

    def nbytes(self) -> int:  # the unit keys may be wider than the values (float32 keys of a bfloat16 model)
        return (self.k.numel() * self._k.element_size() + self.v.numel() * self._v.element_size()
                + self.buckets.numel() * self._b.element_size())


@dataclass
class ReformerOptions:
    n_buckets: int = 32
    n_hashes: int = field(default=2, metadata={"help": "hashing rounds"})
    chunk_size: int = 64
    seed: int = field(default=0, metadata={"help": "the rotations (the same in every layer)"})
    scale: Optional[float] = field(default=None, metadata={"help": "None: 1 / sqrt(head_dim)"})


@register_attention("reformer")
class ReformerAttention(QKVAttention):
    Options = ReformerOptions

    def __init__(self, config):
        super().__init__(config)
        if self.n_kv_head != self.n_head:
            raise ValueError(f"reformer shares one projection for queries and keys, so it has no grouped-query "
                             f"heads: n_kv_head must be None or n_head ({self.n_head}), got {config.n_kv_head}")
        self.c_attn = nn.Linear(config.n_embd, 2 * config.n_embd, bias=config.bias)  # qk and v
        opts = check_options("reformer", config.attention_options, self.Options)
        self.lsh = {k: opts[k] for k in ("n_buckets", "n_hashes", "chunk_size", "seed")}
        with options_checked_by_op("reformer"):
            check_lsh_options(causal=True, lookback="window", **self.lsh)
        check_number("attention_options['scale']", opts["scale"], allow_none=True)
        self.scale = 1.0 / math.sqrt(self.head_dim) if opts["scale"] is None else float(opts["scale"])

    def qkv(self, x: torch.Tensor):
        """x [B, T, C] -> the shared query-key [B, T, H, D] and the value [B, T, H, D]."""
        B, T, _ = x.shape
        qk, v = self.c_attn(x).view(B, T, 2, self.n_head, self.head_dim).unbind(2)
        return qk, v

    def forward(self, x: torch.Tensor, cache: Optional[LSHCache] = None, use_cache: bool = False):
        qk, v = self.qkv(x)
        if cache is None:
            o, buckets = lsh_attention(qk, v, causal=True, lookback="window", scale=self.scale,
                                       output_buckets=use_cache, **self.lsh)
            new = None
            if use_cache:
                new = LSHCache(unit_keys(qk.transpose(1, 2)).contiguous(), v.transpose(1, 2).contiguous(),
                               buckets.transpose(2, 3).contiguous())
            return self.out(o), new
        past = cache.length
        b = lsh_buckets(qk, n_buckets=self.lsh["n_buckets"], n_hashes=self.lsh["n_hashes"],
                        seed=self.lsh["seed"]).transpose(2, 3)  # [B,H,T,R]
        kh, vh = unit_keys(qk.transpose(1, 2)), v.transpose(1, 2)  # [B,H,T,D]
        if use_cache:
            cache.append(kh, vh, b)
            keys, values, buckets = cache.k, cache.v, cache.buckets
        else:
            keys, values = torch.cat([cache.k, kh], dim=2), torch.cat([cache.v, vh], dim=2)
            buckets = torch.cat([cache.buckets, b], dim=2)
        mask = lsh_mask(buckets.transpose(2, 3), chunk_size=self.lsh["chunk_size"], causal=True, lookback="window",
                        start=past)  # [B,H,T,past+T]
        q = qk.transpose(1, 2).to(keys.dtype)
        o = shared_qk_rows(q, keys, values.to(keys.dtype), scale=self.scale, mask=mask, causal=False)  # mask: causal
        return self.out(o.transpose(1, 2).to(qk.dtype)), (cache if use_cache else None)

    # the cost model: one shared projection; per round, each chunk against itself and the one before
    @classmethod
    def qkv_width(cls, shape) -> int:
        return 2 * shape.n_head * shape.head_dim

    @classmethod
    def core_flops(cls, shape, T: int, B: int = 1) -> float:
        R, nb = cls.option(shape, "n_hashes"), cls.option(shape, "n_buckets")
        c = min(cls.option(shape, "chunk_size"), T)
        n = math.ceil(T / c)
        keys = c if n == 1 else 2 * c
        hashing = T * shape.head_dim * nb if nb > 1 else 0  # x R_r, [D, nb/2] per round
        return float(B * shape.n_head * R * (4 * n * c * keys * shape.head_dim + hashing))

    @classmethod
    def cache_bytes(cls, shape, T: int, B: int = 1, dtype_bytes: int = 4) -> int:
        unit_key_bytes = max(dtype_bytes, 4)  # the compute dtype: float32, float64 for float64 models
        kv = B * shape.n_head * shape.head_dim * T * (unit_key_bytes + dtype_bytes)  # every unit key and value
        return kv + B * shape.n_head * T * cls.option(shape, "n_hashes") * 8  # and their buckets (int64)
