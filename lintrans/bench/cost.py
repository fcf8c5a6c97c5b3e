"""A cost model of the GPT: parameters, FLOPs, cache bytes and arithmetic intensity per component.

The JAX scaling book's accounting (a matmul [N, P] x [P, M] costs 2NPM FLOPs forward and 4NPM backward, so a
training step is 3x the forward) extended to linear attention. Notation: B batch, T context, L
layers, D model width, N query heads, K key/value heads, h head dim, V vocabulary, F feature
dimension of the linear map, c chunk size. Per layer, forward:

    q, k, v projections   2 B T D (N + 2K) h          output projection   2 B T D^2
    MLP (GELU, 4D)        16 B T D^2                  (SwiGLU: 6 B T D Fh with Fh ~ 8D/3)
    softmax attention     4 B N T^2 h                 (QK^T and AV, dense, as FLOP counters count it)
    linear, chunked       4 B N T F E + 2 B N (n c^2 + r^2) (F + E)      T = n c + r
    linear, attention     2 B N T^2 (F + E) + 4 B N T F E
and once: the LM head 2 B T D V. E = h + 1: the implementation carries the normaliser as an extra
value column. Element-wise work (softmax, feature maps, layer norms, cumulative sums) is left out,
as in the JAX scaling book's transformer accounting; it is small beside the matmuls but not free on a CPU.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from lintrans.models.config import HeadGeometry

DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2, "int8": 1}


@dataclass
class ModelShape(HeadGeometry):
    """What the cost depends on; ``from_config`` reads a ``GPTConfig``."""

    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    vocab_size: int = 50257
    block_size: int = 1024
    n_kv_head: Optional[int] = None
    bias: bool = True
    mlp: str = "gelu"
    attention: str = "softmax"  # any registered mechanism that reports its cost (see core_flops)
    form: str = "chunked"
    chunk_size: int = 64
    feature_dim: Optional[int] = None  # None: the head dim (elu, relu, softplus, identity)
    attention_options: dict = field(default_factory=dict)  # the mechanism's options (e.g. window)

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        opts = dict(getattr(config, "attention_options", {}) or {})
        hd = config.n_embd // config.n_head
        fdim = None
        from lintrans.ops.feature_maps import FEATURE_MAPS

        from .sizes import is_linear

        fm = opts.get("feature_map", "elu")  # every linear-family layer's default
        if is_linear(config.attention) and isinstance(fm, str) and fm in FEATURE_MAPS:  # module maps: not modelled
            from .sizes import feature_dim_of

            fdim = feature_dim_of(fm, opts.get("qk_dim") or hd)
        chunk = opts.get("chunk_size", 64)
        return cls(
            n_layer=config.n_layer, n_head=config.n_head, n_embd=config.n_embd, vocab_size=config.vocab_size,
            block_size=config.block_size, n_kv_head=config.n_kv_head, bias=config.bias, mlp=config.mlp,
            attention=config.attention, form=opts.get("form", "chunked"),
            chunk_size=chunk if isinstance(chunk, int) else 64, feature_dim=fdim, attention_options=opts,
        )

    @property
    def F(self) -> int:
        return self.feature_dim or (self.attention_options or {}).get("qk_dim") or self.head_dim

    @property
    def mlp_hidden(self) -> int:
        from lintrans.models.gpt import swiglu_hidden

        return 4 * self.n_embd if self.mlp == "gelu" else swiglu_hidden(self.n_embd)


def parameters(m: ModelShape, learned_positions: bool = True) -> dict[str, int]:
    """Parameter count per component (tied embedding counted once, as ``embedding``)."""
    D, b = m.n_embd, int(m.bias)
    ln = (1 + b) * D
    qkv = _mechanism(m).qkv_width(m)
    attn = D * qkv + b * qkv + D * D + b * D
    attn += getattr(_mechanism(m), "extra_parameters", lambda shape: 0)(m)  # e.g. a convolution, norms
    n_in = 1 if m.mlp == "gelu" else 2
    mlp = n_in * D * m.mlp_hidden + b * n_in * m.mlp_hidden + m.mlp_hidden * D + b * D
    out = {
        "embedding": m.vocab_size * D,
        "positions": m.block_size * D if learned_positions else 0,
        "attention projections": m.n_layer * attn,
        "mlp": m.n_layer * mlp,
        "layer norms": (2 * m.n_layer + 1) * ln,
    }
    out["total"] = sum(out.values())
    return out


def _mechanism(m: ModelShape):
    from lintrans.nn.registry import get_attention

    return get_attention(m.attention)


def attention_core_flops(m: ModelShape, T: int, B: int = 1) -> float:
    """Forward FLOPs of the attention mechanism itself (all layers), without its projections: each
    registered mechanism reports its own (``core_flops`` of its layer class)."""
    try:
        return float(m.n_layer * _mechanism(m).core_flops(m, T, B))
    except NotImplementedError as e:
        raise ValueError(f"attention {m.attention!r}: {e}") from None


def forward_flops(m: ModelShape, T: int, B: int = 1) -> dict[str, float]:
    """Forward FLOPs per component for B sequences of T tokens."""
    D = m.n_embd
    n_in = 1 if m.mlp == "gelu" else 2
    out = {
        "qkv projections": m.n_layer * 2.0 * B * T * D * _mechanism(m).qkv_width(m),
        "output projection": m.n_layer * 2.0 * B * T * D * D,
        "mlp": m.n_layer * 2.0 * B * T * D * m.mlp_hidden * (n_in + 1),
        "attention": attention_core_flops(m, T, B),
        "lm head": 2.0 * B * T * D * m.vocab_size,
    }
    out["total"] = sum(out.values())
    return out


def training_flops(m: ModelShape, T: int, B: int = 1) -> dict[str, float]:
    """Forward + backward: 3x the forward for every matmul (the JAX scaling book)."""
    return {k: 3 * v for k, v in forward_flops(m, T, B).items()}


def speedup_bounds(soft: ModelShape, lin: ModelShape, T: int, B: int = 1) -> dict[str, float]:
    """Training-FLOP ratios that bound the measured softmax / linear speed-up at context T.

    ``dense``: softmax attention counted as the full T x T (what FLOP counters report);
    ``causal``: half of it, what a causal flash kernel such as SDPA's actually computes;
    ``no_mixing``: softmax (causal) over the same model with no attention at all, Amdahl's bound
    for *any* mechanism, since everything else (projections, MLP, LM head) stays.
    """
    fs, fl = training_flops(soft, T, B), training_flops(lin, T, B)
    causal = fs["total"] - fs["attention"] / 2
    rest = fs["total"] - fs["attention"]
    return {"dense": fs["total"] / fl["total"], "causal": causal / fl["total"], "no_mixing": causal / rest}


def attention_crossover(m: ModelShape, T_max: int = 1 << 24) -> Optional[int]:
    """Smallest T at which attention FLOPs exceed all the other FLOPs, None if not below ``T_max``."""
    def attn_wins(T):
        f = forward_flops(m, T)
        return f["attention"] > f["total"] - f["attention"]

    if not attn_wins(T_max):
        return None
    lo, hi = 1, T_max
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if attn_wins(mid) else (mid + 1, hi)
    return lo


def cache_bytes(m: ModelShape, T: int, B: int = 1, dtype: str = "float32") -> int:
    """What generation keeps per batch after T tokens, all layers: the KV cache of softmax grows
    with T, a linear state does not (each mechanism reports its own, ``cache_bytes`` of its layer)."""
    try:
        return m.n_layer * _mechanism(m).cache_bytes(m, T, B, DTYPE_BYTES[dtype])
    except NotImplementedError as e:
        raise ValueError(f"attention {m.attention!r}: {e}") from None


def arithmetic_intensity(m: ModelShape, T: int, B: int = 1, dtype: str = "float32") -> dict[str, float]:
    """FLOPs per byte of the minimum memory traffic (inputs + weights + outputs), forward, per layer."""
    b = DTYPE_BYTES[dtype]
    D, h, N, K = m.n_embd, m.head_dim, m.n_head, m.kv_heads
    BT = B * T

    def matmul(rows, inner, cols):
        return 2 * rows * inner * cols / ((rows * inner + inner * cols + rows * cols) * b)

    qkvo = 2 * B * T * (N + K) * h * b  # read q, k, v, write o: k and v at the K key/value heads (GQA)
    softmax = 4 * B * N * T * T * h / qkvo
    one_layer = ModelShape(**{**m.__dict__, "n_layer": 1, "attention": "linear", "form": "chunked"})
    qk = _mechanism(one_layer).option(one_layer, "qk_dim") or h  # q, k may have their own width
    n_chunks = math.ceil(T / m.chunk_size)
    chunk_state_io = 2 * B * N * n_chunks * m.F * (h + 1) * 4
    linear = attention_core_flops(one_layer, T, B) / (B * T * (N + K) * (qk + h) * b + chunk_state_io)
    # one decode step: the KV cache is read whole for 4 N T h FLOPs; the state is read and written
    kv_decode = 4 * B * N * T * h / (2 * B * K * T * h * b)
    state_decode = 4 * B * N * m.F * (h + 1) / (2 * B * N * m.F * (h + 1) * 4)
    return {
        "qkv projection": matmul(BT, D, _mechanism(one_layer).qkv_width(one_layer)),
        "mlp up": matmul(BT, D, m.mlp_hidden),
        "lm head": matmul(BT, D, m.vocab_size),
        "softmax attention (flash)": softmax,
        "linear attention (chunked)": linear,
        "decode: softmax over KV cache": kv_decode,
        "decode: linear state": state_decode,
        "decode: weights (any layer)": 2 / b,
    }


def op_training_flops(m: ModelShape, T: int, B: int = 1) -> float:
    """Forward + backward FLOPs of one layer's attention op on [B, T, N, h] (3x its forward, as for
    the whole step): what a measured op time (``bench ops``, ``lintrans cost --op-time``) divides."""
    return 3 * attention_core_flops(ModelShape(**{**m.__dict__, "n_layer": 1}), T, B)


def mfu(flops: float, step_time_s: float, peak_flops: float) -> float:
    """Model FLOP utilisation: achieved FLOP/s over the machine's measured peak."""
    if step_time_s <= 0 or peak_flops <= 0:
        raise ValueError("step_time_s and peak_flops must be positive")
    return flops / step_time_s / peak_flops
