"""Delta-rule layers for the GPT, registered as ``deltanet`` and ``gated-deltanet``.

Built as DeltaNet (Yang et al. 2024) and Gated DeltaNet (Yang, Kautz, Hatamizadeh 2025) build them,
in flash-linear-attention's layout:

    q, k, v = SiLU(causal depthwise conv_4(x W_qkv))       (one short convolution over q, k, v channels;
                                                           qkv_activation="identity", an ablation: no SiLU)
    beta    = sigmoid(x W_beta)                           per head (2 sigmoid with allow_neg_eigval;
                                                           learned_beta=False, an ablation: 1)
    log a   = -exp(A_log) * softplus(x W_a + dt_bias)     per head, gated-deltanet only (Mamba-2's decay)
    o       = delta_rule(q, k, v, beta, log_decay=log a)  q, k L2-normalised inside the op (qk_norm="none",
                                                           an ablation with rule="linear" only: not)
              (rule="linear", an ablation: S_t = a_t S_{t-1} + beta_t k_t v_t^T, o_t = S_t^T q_t / sqrt(Dk))
    y       = (RMSNorm(o) * SiLU(x W_g)) W_o              RMSNorm per head, weight shared by the heads
                                                          (output_gate=False: RMSNorm(o) W_o;
                                                           output_norm=False, an ablation: no RMSNorm)

``A_log`` and ``dt_bias`` start as in flash-linear-attention's Gated DeltaNet (A ~ U(0, 16); Mamba-2 draws
A from U(1, 16)) and Mamba-2 (softplus(dt_bias) log-uniform in [1e-3, 0.1]). With ``n_kv_head < n_head`` the key and value heads are shared by groups
of query heads, so the state is still one Dk x Dv matrix per query head.

The decoding cache is (the convolution's last ``conv_size - 1`` inputs [B, K-1, W], S [B, H, Dk, Dv]):
its size does not depend on how many tokens it covers.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from lintrans.ops.delta import DELTA_FORMS, delta_rule, delta_rule_step
from lintrans.ops.delta.api import NATIVE_CHUNK
from lintrans.ops.delta.reference import l2_normalized
from lintrans.ops.fla_backend import check_fla_form
from lintrans.ops.linear import linear_attention, linear_attention_step
from lintrans.ops.validation import gates_from_layer

from .attention import LinearAttention, QKVAttention, check_options
from .registry import register_attention


ADDITIVE_CHUNK = 64  # rule="linear": linear_attention's default chunk
ADDITIVE_FORM = {"recurrent": "state_loop", "chunked": "chunked"}  # rule="linear": the layer's form -> the op's


@dataclass
class DeltaNetOptions:
    form: str = field(default="chunked", metadata={"choices": DELTA_FORMS})
    chunk_size: Optional[int] = field(default=None, metadata={
        "low": 1, "help": "chunk of the chunked form (default: the op's, the fastest measured for its path)"})
    conv_size: int = field(default=4, metadata={
        "low": 0, "help": "kernel of the causal depthwise convolution on q, k, v (0: none, SiLU only)"})
    conv_init: str = field(default="uniform", metadata={
        "choices": ("uniform", "identity"),
        "help": "the short convolution's initial taps: uniform (PyTorch's default, as flash-linear-attention) or "
                "identity (the current input's tap 1, earlier taps 0: q, k, v start as their own token's)"})
    qkv_activation: str = field(default="silu", metadata={
        "choices": ("silu", "identity"),
        "help": "the activation after the convolution on q, k, v (identity: none; an ablation)"})
    qk_norm: str = field(default="l2", metadata={
        "choices": ("l2", "none"),
        "help": "l2: q and k divided by their L2 norms (the delta rule's keys must be, for a bounded state); none: "
                "left as they are, with rule=linear only (an ablation)"})
    learned_beta: bool = field(default=True, metadata={
        "help": "beta = sigmoid(x W_beta) per token and head (false: beta = 1 for every token, no W_beta; an "
                "ablation)"})
    allow_neg_eigval: bool = field(default=False, metadata={
        "help": "beta = 2 sigmoid(x W_beta) in [0, 2]: negative eigenvalues of the state transition"})
    norm_eps: float = field(default=1e-5, metadata={"low": 0, "help": "epsilon of the output RMSNorm"})
    output_norm: bool = field(default=True, metadata={
        "help": "normalise each head's output by its RMS, with a learned weight (false: an ablation; the delta "
                "rule's state stays bounded without it, an additive one's does not)"})
    output_gate: bool = field(default=True, metadata={
        "help": "multiply the normalised output by SiLU(x W_g) (Gated DeltaNet's design; flash-linear-attention's "
                "DeltaNet leaves it out by default)"})
    backend: str = field(default="torch", metadata={
        "choices": ("torch", "fla"),
        "help": "the op's backend over a whole sequence: torch (ours) or fla (flash-linear-attention's chunked kernel "
                "on CUDA; form must be chunked; decoding steps stay ours)"})
    rule: str = field(default="delta", metadata={
        "choices": ("delta", "linear"),
        "help": "the state's update: delta (the layer's own) or linear, the additive S_t = a_t S_{t-1} + "
                "beta_t k_t v_t^T with everything else kept (an ablation: what the delta rule itself is worth)"})


@dataclass
class GatedDeltaNetOptions(DeltaNetOptions):
    a_init_max: float = field(default=16.0, metadata={
        "low": 0, "low_open": True,
        "help": "A starts uniform in (0, a_init_max) (flash-linear-attention's 16; the state's initial half-life "
                "ln 2 / (A dt) grows as it shrinks)"})
    decay_trainable: bool = field(default=True, metadata={
        "help": "false: the decay's parameters (A_log, dt_bias, W_a) keep their initial values (an ablation: "
                "does training the decay make it forget?)"})


def mamba2_decay_init(n_head: int, dt_min: float = 1e-3, dt_max: float = 0.1, dt_floor: float = 1e-4,
                      a_max: float = 16.0):
    """(A_log, dt_bias) [H] as flash-linear-attention's Gated DeltaNet initialises them (A ~ U(0, a_max) with
    a_max = 16, where Mamba-2 uses U(1, 16); dt as Mamba-2)."""
    A = torch.empty(n_head).uniform_(0, a_max).clamp_(min=min(1e-4, 1e-4 * a_max))  # never 0: log(0) = -inf cannot learn
    dt = torch.exp(torch.rand(n_head) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    dt = dt.clamp(min=dt_floor)
    return torch.log(A), dt + torch.log(-torch.expm1(-dt))  # softplus^-1(dt)


def mamba2_log_decay(A_log: torch.Tensor, dt_in: torch.Tensor) -> torch.Tensor:
    """Mamba-2's decay, log a = -exp(A_log) * softplus(dt_in), with dt_in = x W_a + dt_bias in the layer
    (dt_bias alone: the decays it starts at)."""
    return -A_log.exp() * F.softplus(dt_in)


def causal_conv(u: torch.Tensor, weight: torch.Tensor, prev: Optional[torch.Tensor]):
    """Depthwise causal convolution: u [B, T, W], weight [W, 1, K], prev [B, K-1, W] (the inputs before
    u; None: zeros) -> (y [B, T, W], the last K-1 inputs [B, K-1, W])."""
    B, T, W = u.shape
    K = weight.shape[-1]
    if prev is None:
        prev = u.new_zeros(B, K - 1, W)
    elif tuple(prev.shape) != (B, K - 1, W):
        raise ValueError(f"cache: the convolution's last inputs are {list(prev.shape)} [B, K-1, W]; this input "
                         f"needs {[B, K - 1, W]} (a batch of another size needs its own cache)")
    full = torch.cat([prev.to(u.dtype), u], dim=1)  # [B, K-1+T, W]
    if T == 1:  # a decoding step: one product and a sum over the K inputs, fewer ops than the loop below
        return (full * weight[:, 0, :].T.to(u.dtype)).sum(1, keepdim=True), full[:, 1:]
    # conv1d's cross-correlation y_t = sum_j w_j full_{t+j} as K shifted multiply-adds in [B, T, W]: conv1d
    # wants [B, W, T] and gave q, k, v a last-dimension stride of T, which the op's kernels then copied (3
    # tensors, forward and backward), and it is slower than these for a kernel of 4
    w = weight[:, 0, :].to(u.dtype)  # [W, K]
    y = full[:, :T] * w[:, 0]
    for j in range(1, K):
        y = torch.addcmul(y, full[:, j : j + T], w[:, j])
    return y, full[:, full.shape[1] - (K - 1):]


@register_attention("deltanet")
class DeltaNet(QKVAttention):
    """DeltaNet: the delta rule with a short convolution, beta gate and gated RMSNorm output (see the
    module docstring)."""

    NAME = "deltanet"
    GATED = False
    Options = DeltaNetOptions

    def __init__(self, config):
        super().__init__(config)
        opts = check_options(self.NAME, config.attention_options, self.Options)
        self.options = opts
        self.form, self.chunk_size = opts["form"], opts["chunk_size"]
        H, D, C = self.n_head, self.head_dim, config.n_embd
        width = self.c_attn.out_features
        self.conv_size = opts["conv_size"]
        # depthwise, no bias (fla's ShortConvolution); PyTorch's default init unless conv_init="identity"; GPT's
        # init leaves it alone
        self.conv = nn.Conv1d(width, width, self.conv_size, groups=width, bias=False) if self.conv_size else None
        if self.conv is not None and opts["conv_init"] == "identity":
            with torch.no_grad():
                self.conv.weight.zero_()[..., -1] = 1.0  # tap K-1 multiplies the current input
        if opts["allow_neg_eigval"] and not opts["learned_beta"]:
            raise ValueError(f"{self.NAME}: allow_neg_eigval scales a learned beta; it cannot go with "
                             "learned_beta=False (beta = 1)")
        if opts["qk_norm"] == "none" and opts["rule"] == "delta":
            raise ValueError(f"{self.NAME}: qk_norm='none' goes with rule='linear' only: the delta rule's update "
                             "I - beta k k^T expands the state once beta |k|^2 > 2")
        self.qk_norm = opts["qk_norm"]
        self.beta_proj = nn.Linear(C, H, bias=config.bias) if opts["learned_beta"] else None
        self.qkv_activation = opts["qkv_activation"]
        self.g_proj = nn.Linear(C, H * D, bias=config.bias) if opts["output_gate"] else None
        self.o_norm = nn.Parameter(torch.ones(D)) if opts["output_norm"] else None
        self.beta_max = 2.0 if opts["allow_neg_eigval"] else 1.0
        self.norm_eps = opts["norm_eps"]
        self.rule = opts["rule"]
        self.backend = opts["backend"]
        if self.backend == "fla":
            try:
                check_fla_form(self.form)
            except ValueError as e:
                raise ValueError(f"{self.NAME}: {e}") from None
        if self.GATED:
            self.a_proj = nn.Linear(C, H, bias=config.bias)
            A_log, dt_bias = mamba2_decay_init(H, a_max=opts["a_init_max"])
            self.A_log, self.dt_bias = nn.Parameter(A_log), nn.Parameter(dt_bias)
            if not opts["decay_trainable"]:
                for p in (self.A_log, self.dt_bias, *self.a_proj.parameters()):
                    p.requires_grad_(False)

    def log_decay(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """log a [B, T, H] (<= 0), None for deltanet."""
        if not self.GATED:
            return None
        return mamba2_log_decay(self.A_log, self.a_proj(x) + self.dt_bias)

    def forward(self, x: torch.Tensor, cache=None, use_cache: bool = False):
        B, T, _ = x.shape
        if T < 1:
            raise ValueError("sequence length T must be at least 1")
        conv_prev, S = (None, None) if cache is None else cache
        u = self.c_attn(x)  # [B,T,W]
        if self.conv is not None:
            u, conv_prev = causal_conv(u, self.conv.weight, conv_prev)
        q, k, v = self.qkv_split(F.silu(u) if self.qkv_activation == "silu" else u)
        k, v = self.repeat_kv(k, 2), self.repeat_kv(v, 2)  # [B,T,H,D]
        if self.beta_proj is not None:
            beta = torch.sigmoid(self.beta_proj(x)) * self.beta_max  # [B,T,H]
        else:
            beta = v.new_ones(B, T, self.n_head)  # v's dtype: under autocast q, k, v are 16-bit and x is not
        ld = self.log_decay(x)
        if self.rule == "linear":
            o, S = self.additive_rule(q, k, v, beta, ld, S, cache is not None and T == 1, use_cache)
        elif cache is not None and T == 1:
            with gates_from_layer():  # beta and the decay come from sigmoid and -softplus: in range
                o, S = delta_rule_step(q[:, 0], k[:, 0], v[:, 0], beta[:, 0], S,
                                       log_decay=None if ld is None else ld[:, 0])
            o = o[:, None]  # [B,1,H,D]
        else:
            o, S = delta_rule(q, k, v, beta, log_decay=ld, form=self.form, chunk_size=self.chunk_size,
                              initial_state=S, output_final_state=use_cache, backend=self.backend)
        if self.o_norm is not None:
            o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.norm_eps) * self.o_norm
        if self.g_proj is not None:
            o = o * F.silu(self.g_proj(x)).view(B, T, self.n_head, self.head_dim)
        return self.out(o), ((conv_prev, S) if use_cache else None)

    def additive_rule(self, q, k, v, beta, ld, state, step: bool, use_cache: bool):
        """rule="linear": the delta rule's inputs (q, k L2-normalised unless qk_norm="none", scale Dk^-1/2, beta,
        the decay) through plain linear attention, unnormalised: the state (S, z) only adds. q, k, v [B, T, H, D]."""
        if self.qk_norm == "l2":
            q, k = l2_normalized(q), l2_normalized(k)  # in the input dtype (the delta-rule op's in float32 at least)
        v = v * beta[..., None]  # beta_t k_t v_t^T
        opts = dict(feature_map="identity", normalize=False, scale=self.head_dim ** -0.5)
        if step:
            ld = None if ld is None else ld[:, 0]
            with gates_from_layer():
                o, state = linear_attention_step(q[:, 0], k[:, 0], v[:, 0], state, log_decay=ld, **opts)
            return o[:, None], state  # [B,1,H,D]
        return linear_attention(q, k, v, form=ADDITIVE_FORM[self.form], chunk_size=self.chunk_size or ADDITIVE_CHUNK,
                                log_decay=ld, initial_state=state, output_final_state=use_cache,
                                backend=self.backend, **opts)

    def qkv_split(self, u: torch.Tensor):
        B, T, _ = u.shape
        D = self.head_dim
        q, k, v = u.split([self.n_head * D, self.n_kv_head * D, self.n_kv_head * D], dim=2)
        return q.view(B, T, self.n_head, D), k.view(B, T, self.n_kv_head, D), v.view(B, T, self.n_kv_head, D)

    # -- the cost model (lintrans.bench.cost) --------------------------------------------------

    @classmethod
    def qkv_width(cls, shape) -> int:
        """Every input projection: q, k, v, the output gate (n_head * head_dim), beta and (gated) a."""
        N, h = shape.n_head, shape.head_dim
        gate = N * h if cls.option(shape, "output_gate") else 0
        scalars = (1 if cls.option(shape, "learned_beta") else 0) + (1 if cls.GATED else 0)
        return (N + 2 * shape.kv_heads) * h + gate + N * scalars

    @classmethod
    def extra_parameters(cls, shape) -> int:
        """Parameters outside the projections: the convolution, the RMSNorm weight, A_log and dt_bias."""
        conv = (shape.n_head + 2 * shape.kv_heads) * shape.head_dim * cls.option(shape, "conv_size")
        norm = shape.head_dim if cls.option(shape, "output_norm") else 0
        return conv + norm + (2 * shape.n_head if cls.GATED else 0)

    @classmethod
    def core_flops(cls, shape, T: int, B: int = 1) -> float:
        """The delta rule per head with Dk = Dv = h. Recurrent: S^T k, the rank-one update and S^T q, 6 h^2
        per token. Chunked (WY form), per chunk of L tokens: K K^T, W = T(beta K), U = T(beta V), Q K^T
        and P U' (2 L^2 (3 + 2) h), U - W S, Q S and the state update K^T U' (6 L h^2), and the
        unit-triangular inverse (2/3 L^3)."""
        N, h = shape.n_head, shape.head_dim
        if cls.option(shape, "rule") == "linear":
            return LinearAttention.core_flops(cls.additive_shape(shape), T, B)
        if cls.option(shape, "form") == "recurrent":
            return float(6 * B * N * T * h * h)
        c = min(cls.option(shape, "chunk_size") or NATIVE_CHUNK, T)
        n, r = divmod(T, c)
        per = sum(m * (10 * L * L * h + 6 * L * h * h + 2 * L ** 3 / 3) for m, L in ((n, c), (1 if r else 0, r)))
        return float(B * N * per)

    @classmethod
    def cache_bytes(cls, shape, T: int, B: int = 1, dtype_bytes: int = 4) -> int:
        """S per head (float32 whatever the model's dtype) and the convolution's last K-1 inputs."""
        conv = (shape.n_head + 2 * shape.kv_heads) * shape.head_dim * max(cls.option(shape, "conv_size") - 1, 0)
        if cls.option(shape, "rule") == "linear":  # linear attention's (S, z)
            return LinearAttention.cache_bytes(cls.additive_shape(shape), T, B) + B * conv * dtype_bytes
        return B * shape.n_head * shape.head_dim * shape.head_dim * 4 + B * conv * dtype_bytes

    @classmethod
    def additive_shape(cls, shape):
        """rule="linear": the shape LinearAttention's cost terms read for the op this layer then runs."""
        chunk = cls.option(shape, "chunk_size") or ADDITIVE_CHUNK
        return dataclasses.replace(shape, attention="linear", form=ADDITIVE_FORM[cls.option(shape, "form")],
                                   feature_dim=shape.head_dim, chunk_size=chunk, attention_options={})


@register_attention("gated-deltanet")
class GatedDeltaNet(DeltaNet):
    """Gated DeltaNet: DeltaNet with Mamba-2's data-dependent decay of the state (see the module docstring)."""

    NAME = "gated-deltanet"
    GATED = True
    Options = GatedDeltaNetOptions
