"""cosFormer attention layer for the GPT, registered as ``cosformer`` (op: ``lintrans.ops.cosformer``).

Options: ``max_len`` (M of the cosine re-weighting; default the model's block size, so that every
position of a sequence shares one M and decoding keeps a constant-size state), ``eps``,
``chunk_size``. Generation keeps the state of the doubled features, S [B, H, 2D, D] and z.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from lintrans.checks import check_number
from lintrans.ops.cosformer import CosformerState, cosformer_attention, cosformer_step

from .attention import LinearAttention, QKVAttention, check_options
from .registry import register_attention


@dataclass
class CosformerOptions:
    max_len: Optional[int] = field(default=None, metadata={"help": "M of the re-weighting (None: block_size)"})
    eps: float = 1e-6
    chunk_size: int = 64


@register_attention("cosformer")
class CosformerAttention(QKVAttention):
    Options = CosformerOptions

    def __init__(self, config):
        super().__init__(config)
        opts = check_options("cosformer", config.attention_options, self.Options)
        self.max_len = config.block_size if opts["max_len"] is None else opts["max_len"]
        check_number("attention_options['max_len']", self.max_len, integer=True, low=config.block_size)
        check_number("attention_options['eps']", opts["eps"], low=0)
        check_number("attention_options['chunk_size']", opts["chunk_size"], integer=True, low=1)
        self.eps, self.chunk_size = opts["eps"], opts["chunk_size"]
        self.max_positions = self.max_len  # the re-weighting's angle reaches pi / 2 at position M

    def forward(self, x, cache: Optional[CosformerState] = None, use_cache: bool = False):
        q, k, v = self.qkv(x)
        k, v = self.repeat_kv(k, 2), self.repeat_kv(v, 2)  # [B,T,H,D]
        if cache is not None and x.shape[1] == 1:
            o, state = cosformer_step(q[:, 0], k[:, 0], v[:, 0], cache, max_len=self.max_len, eps=self.eps)
            o = o[:, None]  # [B,1,H,D]
        else:
            o, state = cosformer_attention(q, k, v, max_len=self.max_len, eps=self.eps, chunk_size=self.chunk_size,
                                           initial_state=cache, output_final_state=use_cache)
        return self.out(o), (state if use_cache else None)

    # the cost model: linear attention with doubled (2D) features
    @classmethod
    def core_flops(cls, shape, T: int, B: int = 1) -> float:
        from dataclasses import replace

        return LinearAttention.core_flops(replace(shape, feature_dim=2 * shape.head_dim, form="chunked"), T, B)

    @classmethod
    def cache_bytes(cls, shape, T: int, B: int = 1, dtype_bytes: int = 4) -> int:
        return B * shape.n_head * 2 * shape.head_dim * (shape.head_dim + 1) * 4
