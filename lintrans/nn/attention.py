"""Softmax and linear attention layers for the GPT, registered as ``softmax`` and ``linear``
(and ``none``, the no-mixing baseline).

Both share nanoGPT's parameters (``c_attn`` producing q, k, v in one matmul, ``c_proj``), so a
pretrained softmax model can be switched to linear attention without touching its weights.
With ``n_kv_head < n_head`` (grouped-query) ``c_attn`` is narrower: n_head query heads and
n_kv_head key/value heads, each key/value head shared by n_head // n_kv_head query heads.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import warnings
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from lintrans.checks import check_choice, check_known_keys
from lintrans.config import set_key
from lintrans.ops.feature_maps import FEATURE_MAPS
from lintrans.ops.context_parallel import context_parallel_linear_attention
from lintrans.ops.linear import FORMS, linear_attention, linear_attention_step
from lintrans.ops.validation import gates_from_layer

from .feature_maps import Hedgehog, Performer, ReBased
from .registry import register_attention
from .rotary import apply_rope


@dataclass
class NoOptions:
    """The options of a mechanism that takes none."""


class QKVAttention(nn.Module):
    """The projections every q/k/v mechanism shares: x [B,T,C] -> q [B,T,H,Dk], k [B,T,Hkv,Dk], v [B,T,Hkv,D]
    (Dk = ``qk_dim``, the head size D unless a linear layer's ``qk_dim`` option narrows it).

    ``Options``: the dataclass of the mechanism's ``attention_options`` (typed keys and defaults,
    checked by ``check_options``); each registered layer sets its own.
    """

    Options: type = NoOptions
    # the longest sequence the layer's parameters cover (AFT's pairwise bias, cosFormer's M); None: any.
    # The GPT refuses longer inputs and generation crops to it, as for learned positions
    max_positions: Optional[int] = None

    def __init__(self, config, qk_dim: Optional[int] = None):
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = config.kv_heads
        self.head_dim = config.n_embd // config.n_head
        self.qk_dim = qk_dim or self.head_dim  # queries' and keys' width per head; values keep head_dim
        qkv_width = (self.n_head + self.n_kv_head) * self.qk_dim + self.n_kv_head * self.head_dim
        self.c_attn = nn.Linear(config.n_embd, qkv_width, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def qkv(self, x: torch.Tensor):
        B, T, _ = x.shape
        D, Dk = self.head_dim, self.qk_dim
        q, k, v = self.c_attn(x).split(
            [self.n_head * Dk, self.n_kv_head * Dk, self.n_kv_head * D], dim=2
        )
        return (
            q.view(B, T, self.n_head, Dk),
            k.view(B, T, self.n_kv_head, Dk),
            v.view(B, T, self.n_kv_head, D),
        )

    def out(self, o: torch.Tensor) -> torch.Tensor:
        return self.resid_dropout(self.c_proj(o.flatten(2)))  # [B,T,C] (flatten: B = 0 works too)

    def repeat_kv(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        groups = self.n_head // self.n_kv_head
        return x if groups == 1 else x.repeat_interleave(groups, dim=dim)

    # -- the cost model (lintrans.bench.cost) asks each mechanism for its own numbers ----------
    # ``shape`` has n_head, head_dim, kv_heads, F (feature dim), form, chunk_size, attention_options.

    @classmethod
    def qkv_width(cls, shape) -> int:
        """Output width of ``c_attn``: n_head query heads and kv_heads key and value heads."""
        return (shape.n_head + 2 * shape.kv_heads) * shape.head_dim

    @classmethod
    def core_flops(cls, shape, T: int, B: int = 1) -> float:
        """Forward FLOPs of the mechanism in one layer, projections excluded (matmuls: 2 per MAC)."""
        raise NotImplementedError(f"the cost model has no FLOP count for {cls.__name__}")

    @classmethod
    def cache_bytes(cls, shape, T: int, B: int = 1, dtype_bytes: int = 4) -> int:
        """Bytes one layer keeps to continue decoding after T tokens."""
        raise NotImplementedError(f"the cost model has no cache size for {cls.__name__}")

    @classmethod
    def option(cls, shape, name: str):
        return {**dataclasses.asdict(cls.Options()), **(getattr(shape, "attention_options", None) or {})}.get(name)


def check_options(name: str, options: dict, schema: type) -> dict:
    """Every option of mechanism ``name``: ``options`` checked against its options dataclass
    ``schema`` (unknown keys: ValueError naming the allowed ones; a value of the wrong type or out of
    range: TypeError/ValueError naming the key), with the defaults filled in."""
    if not isinstance(options, dict):
        raise TypeError(f"attention_options for {name!r} must be a mapping, got {options!r}")
    check_known_keys("attention_options", options, [f.name for f in dataclasses.fields(schema)], where=repr(name))
    typed = schema()
    for key, value in options.items():
        set_key(typed, key, value, label=lambda k: f"attention_options[{k!r}]")
    return dataclasses.asdict(typed)


@contextlib.contextmanager
def options_checked_by_op(name: str):
    """Around an op's own check of a layer's options: its ValueError/TypeError names the option bare
    (``block_size must be ...``, which reads like GPTConfig.block_size); say it is one of
    ``attention_options`` of ``name``."""
    try:
        yield
    except (ValueError, TypeError) as e:
        raise type(e)(f"attention_options of {name!r}: {e}") from None


class KVCache:
    """Keys and values seen so far, [B, Hkv, L, D], in buffers that grow by doubling.

    Appending writes in place (amortised O(1) per token instead of a full copy per token), so a
    cache must not be shared between two continuations. Where autograd records the keys or values
    (decoding with gradients), it appends by concatenation instead: an in-place write would change
    tensors that earlier steps saved for backward.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self._k, self._v, self.length = k, v, k.shape[2]

    def check(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """ValueError unless k, v [B, Hkv, t, D] continue this cache (same B, heads and D)."""
        ck, cv = self._k.shape, self._v.shape
        if (k.dim() != 4 or v.dim() != 4 or k.shape[:2] != ck[:2] or v.shape[:2] != cv[:2] or k.shape[3] != ck[3]
                or v.shape[3] != cv[3] or k.shape[2] != v.shape[2]):
            raise ValueError(
                f"cache: it holds keys {list(self.k.shape)} and values {list(self.v.shape)} [B, Hkv, L, D]; "
                f"keys {list(k.shape)} and values {list(v.shape)} do not continue it (the same B, heads and D are "
                "needed: a batch of another size needs its own cache)")

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.check(k, v)
        t = k.shape[2]
        need = self.length + t
        if torch.is_grad_enabled() and any(x.requires_grad for x in (k, v, self._k, self._v)):
            self._k, self._v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
            self.length = need
            return
        if need > self._k.shape[2]:
            cap = max(need, 2 * self._k.shape[2])
            self._k, self._v = self._grow(self._k, cap), self._grow(self._v, cap)
        self._k[:, :, self.length : need] = k
        self._v[:, :, self.length : need] = v
        self.length = need

    def _grow(self, buf: torch.Tensor, cap: int) -> torch.Tensor:
        new = buf.new_empty(*buf.shape[:2], cap, buf.shape[3])  # [B,Hkv,cap,D]
        new[:, :, : self.length] = buf[:, :, : self.length]
        return new

    @property
    def k(self) -> torch.Tensor:
        return self._k[:, :, : self.length]

    @property
    def v(self) -> torch.Tensor:
        return self._v[:, :, : self.length]

    def nbytes(self) -> int:
        """Bytes held by the keys and values actually stored (not the spare capacity)."""
        return (self.k.numel() + self.v.numel()) * self._k.element_size()


@register_attention("softmax")
class SoftmaxAttention(QKVAttention):
    """Causal scaled dot-product attention (PyTorch SDPA) with a KV cache for decoding.

    With ``rope`` (the cos/sin tables of x's absolute positions, ``lintrans.nn.rotary``) queries and
    keys are rotated before the cache, so cached keys keep the rotation of their own positions.
    """

    ROPE = True  # GPTConfig.pos_embedding="rope" works with it

    @classmethod
    def core_flops(cls, shape, T: int, B: int = 1) -> float:
        return 4.0 * B * shape.n_head * T * T * shape.head_dim  # QK^T and AV, dense

    @classmethod
    def cache_bytes(cls, shape, T: int, B: int = 1, dtype_bytes: int = 4) -> int:
        return 2 * B * shape.kv_heads * shape.head_dim * T * dtype_bytes  # the KV cache

    def __init__(self, config):
        super().__init__(config)
        check_options("softmax", config.attention_options, self.Options)

    def forward(self, x: torch.Tensor, cache: Optional[KVCache] = None, use_cache: bool = False, rope=None):
        q, k, v = self.qkv(x)  # [B,T,H,D], [B,T,Hkv,D]
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B,H(kv),T,D]
        T = q.shape[2]
        past = 0 if cache is None else cache.length
        if cache is not None:
            if use_cache:
                cache.append(k, v)
                k, v = cache.k, cache.v
            else:
                k, v = torch.cat([cache.k, k], dim=2), torch.cat([cache.v, v], dim=2)
        elif use_cache:
            cache = KVCache(k.contiguous(), v.contiguous())
        # keys [0, past + T); query i (global past + i) sees keys <= past + i
        mask, causal = None, past == 0 and T > 1
        if past > 0 and T > 1:
            mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(past)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal,
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.n_kv_head != self.n_head,
        )  # [B,H,T,D]
        return self.out(o.transpose(1, 2)), (cache if use_cache else None)


@register_attention("none")
class NoMixingAttention(QKVAttention):
    """No token mixing: each position gets only its own value (softmax with only the diagonal).

    A baseline, not a model to train for quality: it has the same parameters and projections as
    every other mechanism here, so a GPT with it costs exactly everything but the mixing. The
    training benchmark uses it as the floor no attention mechanism can go below.
    """

    CONTEXT_PARALLEL = True  # nothing crosses positions, so a split sequence needs nothing exchanged

    @classmethod
    def core_flops(cls, shape, T: int, B: int = 1) -> float:
        return 0.0

    @classmethod
    def cache_bytes(cls, shape, T: int, B: int = 1, dtype_bytes: int = 4) -> int:
        return 0

    def __init__(self, config):
        super().__init__(config)
        check_options("none", config.attention_options, self.Options)

    def forward(self, x: torch.Tensor, cache=None, use_cache: bool = False):
        _, _, v = self.qkv(x)  # [B,T,Hkv,D]; q and k are computed and dropped, as their cost is real
        return self.out(self.repeat_kv(v, dim=2)), None


# ---------------------------------------------------------------------------------------------
# feature maps by name: parameter-free ones go straight to the op as a name; learnable or random
# ones are modules from lintrans.nn.feature_maps.

# name -> module class (``shared_by_q_and_k`` on the class: queries and keys must share one module)
MODULE_FEATURE_MAPS = {"rebased": ReBased, "hedgehog": Hedgehog, "performer": Performer}


def feature_map_names() -> list[str]:
    return sorted(set(FEATURE_MAPS) | set(MODULE_FEATURE_MAPS))


def build_feature_maps(name, options: dict, head_dim: int, n_head: int, per_head: bool, shared_qk):
    """A name for the op, or (phi_q, phi_k) modules (phi_k None when q and k share phi_q)."""
    if not isinstance(name, str):
        raise TypeError(f"attention_options['feature_map'] must be a name, got {name!r}")
    if name in FEATURE_MAPS:
        if options:
            raise ValueError(f"feature map {name!r} takes no feature_map_options, got {sorted(options)}")
        return name
    check_choice("attention_options['feature_map']", name, feature_map_names())
    cls = MODULE_FEATURE_MAPS[name]
    must_share = getattr(cls, "shared_by_q_and_k", False)
    if shared_qk is None:
        shared_qk = must_share
    if must_share and not shared_qk:
        raise ValueError(f"feature map {name!r} needs queries and keys to share it: shared_qk must be True")
    kwargs = dict(options)
    # num_heads is the layer's to set (from per_head and n_head), not an option
    accepted = set(inspect.signature(cls).parameters) - {"head_dim", "self", "num_heads"}
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise ValueError(f"attention_options['feature_map_options'] for {name!r} has unknown keys {unknown}; "
                         f"allowed: {sorted(accepted)}")
    if per_head and "num_heads" in inspect.signature(cls).parameters:
        kwargs.setdefault("num_heads", n_head)
    missing = sorted(p.name for p in inspect.signature(cls).parameters.values()
                     if p.default is inspect.Parameter.empty and p.name not in ("head_dim", "self")
                     and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in kwargs)
    if missing:
        raise ValueError(f"attention_options['feature_map_options'] for {name!r} needs {missing}, e.g. "
                         f"feature_map_options={{{', '.join(repr(m) + ': ...' for m in missing)}}}")
    phi_q = cls(head_dim, **kwargs)
    return (phi_q, None) if shared_qk else (phi_q, cls(head_dim, **kwargs))


FEATURE_MAP = {"help": "feature map name (module maps take feature_map_options)",
               "choices": tuple(feature_map_names())}


@dataclass
class LinearOptions:
    feature_map: str = field(default="elu", metadata=FEATURE_MAP)
    feature_map_options: dict = field(default_factory=dict,
                                      metadata={"help": "constructor arguments of a module feature map"})
    per_head: bool = field(default=True, metadata={"help": "module feature maps: parameters per head"})
    shared_qk: Optional[bool] = field(default=None, metadata={
        "help": "module feature maps: one module for q and k (None: the map's default)"})
    form: str = field(default="chunked", metadata={"choices": tuple(FORMS)})
    chunk_size: Union[int, Literal["auto"]] = field(default=64, metadata={
        "low": 1, "help": "auto: the measured fastest (lintrans tune)"})
    normalize: bool = True
    scale: Optional[float] = field(default=1.0, metadata={"help": "None: 1 / sqrt(qk_dim)"})
    eps: float = field(default=1e-6, metadata={"low": 0, "help": "added to the normaliser"})
    qk_dim: Optional[int] = field(default=None, metadata={
        "low": 1, "help": "width of each head's queries and keys, projected from the input as Based does "
                          "(its feature dim 16); None: the head dim. Values keep the head dim"})


@register_attention("linear")
class LinearAttention(QKVAttention):
    """Causal linear attention: chunked (or any form) for the prompt, a fixed-size state per token after.

    The cache is the recurrent state (S [B, H, F, D], z [B, H, F]): its size does not depend on
    how many tokens it summarises. Subclasses (the gated mechanisms in ``lintrans.nn.gated``) add a
    decay of that state (``log_decay``) and a transform of the output (``finish``).
    """

    NAME = "linear"
    CONTEXT_PARALLEL = True  # GPT.set_context_parallel: the state crosses processes, not the keys
    context_parallel = None  # the ProcessGroup when set
    Options = LinearOptions

    @classmethod
    def core_flops(cls, shape, T: int, B: int = 1) -> float:
        N, F, E, c = shape.n_head, shape.F, shape.head_dim + 1, shape.chunk_size  # E: v plus the ones column
        state_terms = 4 * B * N * T * F * E  # phi(k)^T v into the state, phi(q) S out of it
        if shape.form == "chunked":  # n chunks of c tokens and one of r (the op pads nothing)
            c = min(c, T)
            n, r = divmod(T, c)
            return float(4 * B * N * T * F * E + 2 * B * N * (n * c * c + r * r) * (F + E))
        if shape.form == "attention":
            return float(2 * B * N * T * T * (F + E) + state_terms)
        if shape.form == "attention_blocked":
            inner = sum((min(s + c, T) - s) * min(s + c, T) for s in range(0, T, c))
            return float(2 * B * N * inner * (F + E) + state_terms)
        if shape.form == "attention_loop":
            return float(B * N * T * (T + 1) * (F + E) + state_terms)
        return float(2 * B * N * T * F * E)  # state_parallel, state_loop: one F x E contraction per token

    @classmethod
    def cache_bytes(cls, shape, T: int, B: int = 1, dtype_bytes: int = 4) -> int:
        # S and z: the op's state always carries z (F floats a head), normalised or not
        return B * shape.n_head * shape.F * (shape.head_dim + 1) * 4  # float32 whatever the model's dtype

    @classmethod
    def qkv_width(cls, shape) -> int:
        qk = cls.option(shape, "qk_dim") or shape.head_dim
        return (shape.n_head + shape.kv_heads) * qk + shape.kv_heads * shape.head_dim

    def __init__(self, config):
        opts = check_options(self.NAME, config.attention_options, self.Options)
        super().__init__(config, qk_dim=opts["qk_dim"])
        fm = build_feature_maps(
            opts["feature_map"], dict(opts["feature_map_options"]), self.qk_dim, self.n_head,
            opts["per_head"], opts["shared_qk"],
        )
        # modules become submodules, so their parameters train and are saved
        self.feature_map_name = fm if isinstance(fm, str) else None
        if self.feature_map_name is None:
            self.phi_q, self.phi_k = fm
        if opts["feature_map"] == "identity" and opts["normalize"]:
            # signed q and k: the normaliser phi(q) . sum phi(k) crosses zero and the output blows up. A warning,
            # not an error: models saved with it still load
            warnings.warn("attention_options: feature_map 'identity' with normalize=True: its features are "
                          "signed, so the normaliser can vanish and outputs blow up; choose a positive map such as "
                          "'elu' to normalise, or normalize=False", UserWarning, stacklevel=3)
        self.form, self.chunk_size = opts["form"], opts["chunk_size"]
        scale = self.qk_dim ** -0.5 if opts["scale"] is None else opts["scale"]
        self.kw = {"normalize": opts["normalize"], "scale": scale, "eps": opts["eps"]}
        self.options = opts

    def log_decay(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The state's log-decay for input x [B, T, C]: None, [B, T, H] or [H]."""
        return None

    def finish(self, o: torch.Tensor) -> torch.Tensor:
        """A transform of the attention output o [B, T, H, D] before the output projection."""
        return o

    def forward(self, x: torch.Tensor, cache=None, use_cache: bool = False):
        q, k, v = self.qkv(x)
        k, v = self.repeat_kv(k, 2), self.repeat_kv(v, 2)  # [B,T,H,D]
        phi = self.feature_map_name
        if phi is None:
            phi = self.phi_q if self.phi_k is None else (self.phi_q, self.phi_k)
        ld = self.log_decay(x)  # None, [B,T,H] or [H]
        if cache is not None and x.shape[1] == 1:
            step_ld = ld[:, 0] if ld is not None and ld.dim() == 3 else ld
            with gates_from_layer():  # the layer's decays (-softplus, RetNet's constants) are in range
                o, state = linear_attention_step(
                    q[:, 0], k[:, 0], v[:, 0], cache, feature_map=phi, log_decay=step_ld, **self.kw
                )
            o = o[:, None]  # [B,1,H,D]
        elif self.context_parallel is not None:  # this rank's slice of a sequence split over processes
            o, state = context_parallel_linear_attention(
                q, k, v, group=self.context_parallel, form=self.form, feature_map=phi, chunk_size=self.chunk_size,
                log_decay=ld, **self.kw,
            )
        else:
            o, state = linear_attention(
                q, k, v, form=self.form, feature_map=phi, chunk_size=self.chunk_size,
                initial_state=cache, output_final_state=use_cache, log_decay=ld, **self.kw,
            )
        return self.out(self.finish(o)), (state if use_cache else None)
