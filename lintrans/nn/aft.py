"""Attention Free Transformer layers for the GPT: ``aft-full``, ``aft-simple``, ``aft-local``, ``aft-conv``.

q, k, v come from the shared ``c_attn`` projection as [B, T, H, D]; AFT mixes them per channel
(heads only matter for per-head biases). Always causal. Position biases start at zero, so every
variant starts out as AFT-simple and learns its bias from there.

Generation: ``aft-simple`` carries a constant-size state (num, den, running max); ``aft-local`` and
``aft-conv`` add a ring of the last ``window``/``kernel`` keys (constant size too). ``aft-full`` keeps
every key and value (a growing cache, like softmax attention): its bias row for a new token spans
every earlier position.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn

from lintrans.ops.aft import (
    aft,
    aft_last_row,
    aft_simple_state,
    aft_simple_step,
    aft_window_state,
    aft_window_step,
    uses_band,
)

from .attention import KVCache, QKVAttention, check_options
from .registry import register_attention

PER_HEAD = {"help": "a position bias per head (else one shared by the heads)"}


@dataclass
class AFTFullOptions:
    per_head: bool = field(default=False, metadata=PER_HEAD)


@dataclass
class AFTLocalOptions:
    per_head: bool = field(default=False, metadata=PER_HEAD)
    window: int = field(default=32, metadata={"low": 1, "help": "keys back that get the learned bias"})


@dataclass
class AFTConvOptions:
    kernel: int = field(default=32, metadata={"low": 1, "help": "positions of the relative bias"})


class _AFT(QKVAttention):
    """Shared by the four variants; subclasses set NAME, VARIANT, Options and make the bias."""

    NAME = VARIANT = ""

    @classmethod
    def _band(cls, shape) -> tuple[int, int]:
        """local/conv: (keys the bias reaches, bias rows: heads or 1)."""
        if cls.VARIANT == "conv":
            return cls.option(shape, "kernel"), shape.n_head
        return cls.option(shape, "window"), shape.n_head if cls.option(shape, "per_head") else 1

    @classmethod
    def core_flops(cls, shape, T: int, B: int = 1) -> float:
        D = shape.n_head * shape.head_dim
        if cls.VARIANT == "simple":  # running sums
            return 4.0 * B * T * D
        if cls.VARIANT in ("local", "conv"):
            W, Hw = cls._band(shape)
            if uses_band(T, Hw, B, shape.n_head, W, shape.head_dim):
                return 4.0 * B * T * W * D
        # weighted sums of exp(K) V and exp(K) over every earlier key (T^2 D each)
        return 4.0 * B * T * T * D

    @classmethod
    def cache_bytes(cls, shape, T: int, B: int = 1, dtype_bytes: int = 4) -> int:
        D = shape.n_head * shape.head_dim
        if cls.VARIANT == "simple":
            return 3 * B * D * 4  # running sums and maximum, float32
        if cls.VARIANT in ("local", "conv"):
            W, _ = cls._band(shape)
            return 3 * B * D * 4 + 2 * B * D * W * dtype_bytes  # unbiased sums and maximum + a ring of W keys
        return 2 * B * D * T * dtype_bytes  # full: every key and value

    @classmethod
    def extra_parameters(cls, shape) -> int:
        if cls.VARIANT == "full":
            return (shape.n_head if cls.option(shape, "per_head") else 1) * shape.block_size**2
        if cls.VARIANT in ("local", "conv"):
            W, Hw = cls._band(shape)
            return Hw * (W if cls.VARIANT == "conv" else shape.block_size**2)
        return 0

    def __init__(self, config):
        super().__init__(config)
        self.opts = check_options(self.NAME, config.attention_options, self.Options)
        self.block_size = config.block_size
        self.pos_bias: Optional[nn.Parameter] = None
        self.window: Optional[int] = None

    def _per_head_bias(self, config) -> nn.Parameter:
        T = config.block_size
        return nn.Parameter(torch.zeros(config.n_head, T, T) if self.opts["per_head"] else torch.zeros(T, T))

    def forward(self, x: torch.Tensor, cache=None, use_cache: bool = False):
        q, k, v = self.qkv(x)
        k, v = self.repeat_kv(k, 2), self.repeat_kv(v, 2)  # [B,T,H,D]
        kw = dict(variant=self.VARIANT, pos_bias=self.pos_bias, window=self.window)
        if cache is None:
            o = aft(q, k, v, causal=True, **kw)
            return self.out(o), (self._new_cache(k, v) if use_cache else None)
        if not use_cache and isinstance(cache, KVCache):  # appends go to a copy: the caller's cache stays
            cache = KVCache(cache.k, cache.v)
        outs = []
        for t in range(x.shape[1]):  # decoding: one token at a time against the cache
            # a windowed state's ring is written in place once it is this call's own, or the caller hands
            # the cache on (use_cache): as KVCache, a cache serves one continuation
            o, cache = self._step(q[:, t], k[:, t], v[:, t], cache, inplace=use_cache or t > 0)
            outs.append(o)
        return self.out(torch.stack(outs, dim=1)), (cache if use_cache else None)

    def _new_cache(self, k, v):
        return KVCache(k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous())  # [B,H,T,D]

    def _step(self, q, k, v, cache: KVCache, inplace: bool):  # appends are in place already (see forward)
        cache.append(k[:, :, None], v[:, :, None])
        kw = dict(variant=self.VARIANT, pos_bias=self.pos_bias, window=self.window)
        return aft_last_row(q, cache.k.transpose(1, 2), cache.v.transpose(1, 2), **kw), cache


class _WindowedAFT(_AFT):
    """local/conv: a constant-size decoding state (unbiased sums + a ring of the window's keys)."""

    def _new_cache(self, k, v):
        return aft_window_state(k, v, variant=self.VARIANT, pos_bias=self.pos_bias, window=self.window)

    def _step(self, q, k, v, cache, inplace: bool):
        return aft_window_step(q, k, v, cache, variant=self.VARIANT, pos_bias=self.pos_bias, window=self.window,
                               inplace=inplace)


@register_attention("aft-full")
class AFTFull(_AFT):
    """AFT-full: a learned bias for every (query, key) pair of positions, [block_size, block_size]
    (or [n_head, block_size, block_size] with ``per_head``)."""

    NAME, VARIANT = "aft-full", "full"
    Options = AFTFullOptions

    def __init__(self, config):
        super().__init__(config)
        self.pos_bias = self._per_head_bias(config)
        self.max_positions = config.block_size  # the bias has a row and a column per position


@register_attention("aft-local")
class AFTLocal(_WindowedAFT):
    """AFT-local: the pairwise bias only for keys less than ``window`` positions back; others count unbiased."""

    NAME, VARIANT = "aft-local", "local"
    Options = AFTLocalOptions

    def __init__(self, config):
        super().__init__(config)
        self.window = self.opts["window"]
        self.pos_bias = self._per_head_bias(config)
        self.max_positions = config.block_size


@register_attention("aft-conv")
class AFTConv(_WindowedAFT):
    """AFT-conv: a per-head relative bias over the last ``kernel`` positions, [n_head, kernel]."""

    NAME, VARIANT = "aft-conv", "conv"
    Options = AFTConvOptions

    def __init__(self, config):
        super().__init__(config)
        self.pos_bias = nn.Parameter(torch.zeros(config.n_head, self.opts["kernel"]))


@register_attention("aft-simple")
class AFTSimple(_AFT):
    """AFT-simple: no position bias; O(T*D) and a constant-size decoding state."""

    NAME, VARIANT = "aft-simple", "simple"

    def _new_cache(self, k, v):
        return aft_simple_state(k, v)

    def _step(self, q, k, v, cache, inplace: bool):  # nothing to write in place: new sums each step
        return aft_simple_step(q, k, v, cache)
