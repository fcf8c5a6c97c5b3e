"""Gated linear attention for the GPT: the recurrent state decays at every token.

``retention`` (RetNet, Sun et al. 2023): a fixed decay per head, ``gamma_h = 1 - 2^(-5 - h)``, so
head h forgets with a time constant of about 2^(5 + h) tokens; identity feature map with q scaled by
1/sqrt(qk_dim) (the head size unless ``qk_dim`` is set), no normaliser, and each head's output layer-normalised (RetNet's group norm, here
without affine parameters since ``c_proj`` follows). RetNet's swish output gate is not included.

``gated-linear`` (simple GLA / Mamba-2 style): a data-dependent scalar gate per token and head,
``log_decay = -softplus(x W_g + b_g) / tau``. The bias starts by default at RetNet's schedule (gates near 1,
different time constants per head) and ``W_g`` at zero-mean N(0, 0.02^2), so training starts from
retention and learns when to forget. Same feature map, scaling and output norm as ``retention``.

Both accept every option of ``linear`` (feature map, form, chunk size, normalize, scale, eps, qk_dim), with
these defaults changed, plus ``group_norm`` (bool) and for ``gated-linear`` ``tau`` (> 0) and ``decay_init``
(``retnet``, or ``mamba2``: faster starting decays, drawn as flash-linear-attention starts Gated DeltaNet's
Mamba-2 decay).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from lintrans.checks import check_number

from . import delta
from .attention import FEATURE_MAP, LinearAttention, LinearOptions
from .registry import register_attention


@dataclass
class RetentionOptions(LinearOptions):
    """``linear``'s options with RetNet's defaults, plus ``group_norm``."""

    feature_map: str = field(default="identity", metadata=FEATURE_MAP)
    normalize: bool = False
    scale: Optional[float] = field(default=None, metadata={"help": "None: 1 / sqrt(qk_dim)"})
    group_norm: bool = field(default=True, metadata={"help": "layer-normalise each head's output"})


@dataclass
class GatedLinearOptions(RetentionOptions):
    tau: float = field(default=16.0, metadata={"help": "gate temperature (> 0)"})
    decay_init: str = field(default="retnet", metadata={
        "choices": ("retnet", "mamba2"),
        "help": "the decays the gate starts at: retnet (RetNet's multi-scale ones, slow: half-lives 22-177 tokens "
                "for 4 heads) or mamba2 (per head as flash-linear-attention starts Gated DeltaNet's Mamba-2 "
                "decay, fast: half-lives of about 10 tokens typically; docs/experiments.md)"})


def retnet_log_decays(n_head: int, device=None) -> torch.Tensor:
    """log(1 - 2^(-5 - h)) for h = 0 .. n_head - 1: RetNet's fixed multi-scale decays, [H] float64."""
    return torch.log1p(-(2.0 ** (-5.0 - torch.arange(n_head, dtype=torch.float64, device=device))))


class _GatedAttention(LinearAttention):
    def __init__(self, config):
        super().__init__(config)
        self.group_norm = self.options["group_norm"]

    def finish(self, o: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(o, (o.shape[-1],)) if self.group_norm else o  # per head: [B,T,H,D] over D


@register_attention("retention")
class Retention(_GatedAttention):
    """RetNet's retention: linear attention with a fixed decay per head (see the module docstring)."""

    NAME = "retention"
    Options = RetentionOptions

    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        # H constants kept in a plain attribute, not a buffer (which .half() would round), made once per
        # device rather than every call (a decoding step's cost is its count of small ops)
        cached = self.__dict__.get("_log_decays")
        if cached is None or cached.device != x.device:
            with torch.inference_mode(False):  # a cached inference tensor could not be saved for backward
                cached = self.__dict__["_log_decays"] = retnet_log_decays(self.n_head, x.device)  # [H]
        return cached


class DecayGate(nn.Module):
    """x [B, T, C] -> log_decay [B, T, H] = -softplus(x W + b) / tau, in (-inf, 0). The bias starts the
    decays at ``start`` ([H] log-decays < 0, float64; default RetNet's)."""

    def __init__(self, n_embd: int, n_head: int, tau: float, start: Optional[torch.Tensor] = None):
        super().__init__()
        self.tau = tau
        self.weight = nn.Parameter(torch.randn(n_head, n_embd) * 0.02)  # [H,C]
        # softplus(b_h) / tau = -start_h: the decays at the start (W x is small then)
        target = -(retnet_log_decays(n_head) if start is None else start).double() * tau
        self.bias = nn.Parameter((target + torch.log(-torch.expm1(-target))).float())  # softplus^-1, [H]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return -F.softplus(F.linear(x, self.weight, self.bias)) / self.tau  # [B,T,H]

    def extra_repr(self) -> str:
        return f"n_embd={self.weight.shape[1]}, n_head={self.weight.shape[0]}, tau={self.tau}"


@register_attention("gated-linear")
class GatedLinearAttention(_GatedAttention):
    """Linear attention with a learned gate per token and head (see the module docstring)."""

    NAME = "gated-linear"
    Options = GatedLinearOptions

    @classmethod
    def extra_parameters(cls, shape) -> int:
        return shape.n_head * (shape.n_embd + 1)  # the gate's weight [H, C] and bias [H]

    @classmethod
    def core_flops(cls, shape, T: int, B: int = 1) -> float:
        return super().core_flops(shape, T, B) + 2.0 * B * T * shape.n_embd * shape.n_head  # the gate's x W_g

    def __init__(self, config):
        super().__init__(config)
        tau = self.options["tau"]
        check_number("attention_options['tau']", tau, low=0, low_open=True)
        start = None
        if self.options["decay_init"] == "mamba2":
            A_log, dt_bias = delta.mamba2_decay_init(self.n_head)
            start = delta.mamba2_log_decay(A_log.double(), dt_bias.double())
        self.gate = DecayGate(config.n_embd, self.n_head, float(tau), start)

    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x)
