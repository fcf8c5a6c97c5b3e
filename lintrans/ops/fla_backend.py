"""``linear_attention(..., backend="fla")``: the chunked form by flash-linear-attention's Triton kernels.

flash-linear-attention (``pip install flash-linear-attention``, imported as ``fla``) computes gated
linear attention without a normaliser, ``S_t = exp(g_t) S_{t-1} + k_t v_t^T``, ``o_t = scale q_t S_t``
(``fla.ops.simple_gla.chunk_simple_gla``; ``g`` = None: no decay). Everything else of ours maps
onto that one call:

- the feature map is applied here, in torch (fla takes q and k as its features);
- the normaliser and the state's z come from a column of ones appended to v, as in our own forms:
  its output column is sum_j s_ij (decays and the initial z included), its state column is z;
- a fixed decay [H] that needs no gradient is fla's ``g_gamma`` [H]; one that does is the per-token
  decay repeated, ``g`` [B, T, H] (fla returns no gradient for ``g_gamma``). Where Triton
  miscompiles fla's gated backward (below), ``g`` is used whenever a backward may follow: fla then
  runs it in TileLang, or refuses it, while its ``g_gamma`` backward has the pattern its issue #640
  names as miscompiled there with neither a guard nor a TileLang version (fla 0.6.0).

Inputs are turned into the state dtype (float32) first, so the state is float32 as with the torch
backend. ``chunk_size`` is not used (fla picks its own chunk). Checked against the torch backend on
an H100 (docs/results/gpu-fla, docs/results/gpu-tilelang): forward and backward at T = 1, 100, 256,
with and without a decay (inference with ``g_gamma`` too). On Hopper GPUs with Triton >= 3.4 and
< 3.7.1 (fla's issue #640) fla 0.6.0 runs every decayed backward pass (``g``) in TileLang where
``tilelang`` is installed, and refuses it with its own RuntimeError where it is not.
"""
from __future__ import annotations

import torch

from .validation import autocast_off

DEVICES = frozenset({"cuda"})  # device types fla's kernels run on


def _fla_function(module: str, name: str):
    """fla's ``module.name``, or a ValueError saying why it cannot be used here."""
    try:
        return getattr(__import__(module, fromlist=[name]), name)
    except Exception as e:  # ImportError, or fla failing to import without triton/CUDA
        raise ValueError(
            "backend='fla' needs flash-linear-attention (pip install flash-linear-attention), which cannot be "
            f"imported here ({type(e).__name__}: {e}); use backend='torch'"
        ) from None


def fla_chunk_function():
    """fla's ``chunk_simple_gla``, or a ValueError saying why it cannot be used here."""
    return _fla_function("fla.ops.simple_gla", "chunk_simple_gla")


def check_fla_form(form: str) -> None:
    """ValueError unless ``form`` is the chunked form, the only one fla computes."""
    if form != "chunked":
        raise ValueError(f"backend='fla' computes the chunked form only; form must be 'chunked', got {form!r}")


def check_fla_case(q: torch.Tensor, form: str) -> None:
    """ValueError for what fla does not cover: another form, a device other than CUDA, float64."""
    check_fla_form(form)
    if q.device.type not in DEVICES:
        raise ValueError(f"backend='fla' runs on CUDA tensors only, got q on {q.device}; use backend='torch'")
    if q.dtype == torch.float64:
        raise ValueError("backend='fla' does not take float64 (its kernels compute in float32 at most); "
                         "use backend='torch'")


def _triton_miscompiles_gated_backward() -> bool:
    """True on Hopper with 3.4 <= Triton < 3.7.1 (fla's own test, its issue #640). There fla runs a gated
    (``g``) backward in TileLang where that is installed and refuses it otherwise; its ``g_gamma``
    backward has no TileLang version and no guard, so a fixed decay must go as ``g``."""
    try:
        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    except ImportError:  # another fla version: no such miscompilation known
        return False
    return bool(IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1)


def fla_linear_attention(q, k, v, fq, fk, S0, log_decay, *, normalize: bool, scale: float, eps: float,
                         output_final_state: bool):
    """fq, fk [B, T, H, F] features in the state dtype, S0 None or [B, H, F, Dv + 1] (z as the last
    column), log_decay None, [B, T, H] or [H] -> (o [B, T, H, Dv] in q's dtype, (S, z) or None)."""
    chunk_simple_gla = fla_chunk_function()
    B, T, H, _ = fq.shape
    Dv = v.shape[-1]
    ones = normalize or output_final_state or S0 is not None
    vs = v.to(fq.dtype)
    if ones:  # the normaliser column: output sum_j s_ij, state z
        vs = torch.cat([vs, torch.ones(B, T, H, 1, dtype=fq.dtype, device=fq.device)], dim=-1)
    g = g_gamma = None
    if log_decay is not None:
        g = log_decay.to(fq.dtype)
        backward = torch.is_grad_enabled() and any(
            t.requires_grad for t in (fq, fk, vs, g) + (() if S0 is None else (S0,)))
        if g.dim() == 1 and not (backward and (g.requires_grad or _triton_miscompiles_gated_backward())):
            g, g_gamma = None, g
        elif g.dim() == 1:
            g = g.expand(B, T, H).contiguous()
    with autocast_off(fq.device):
        y, S_end = chunk_simple_gla(fq.contiguous(), fk.contiguous(), vs.contiguous(), g, g_gamma=g_gamma,
                                    scale=scale, initial_state=S0, output_final_state=output_final_state)
        o = y[..., :Dv] / (y[..., Dv:] + eps) if normalize else y[..., :Dv]
    state = (S_end[..., :Dv], S_end[..., Dv]) if output_final_state else None
    return o.to(q.dtype), state


def fla_delta_rule(q, k, v, beta, log_decay, S0, *, scale: float, l2_normalize: bool, output_final_state: bool):
    """``delta_rule(..., backend="fla")`` by fla's ``chunk_gated_delta_rule``: q, k [B, T, H, Dk], v [B, T, H, Dv],
    beta [B, T, H], log_decay None, [B, T, H] or [H], S0 None or [B, H, Dk, Dv] -> (o [B, T, H, Dv] in q's
    dtype, S [B, H, Dk, Dv] float32 or None). Inputs go to fla in float32, so the state is float32 as with
    the torch backend. Without a decay the gate is zeros: fla's ungated ``chunk_delta_rule`` takes 16-bit
    inputs only (fla 0.6.0), and a zero gate is the same recurrence. Checked with fla 0.6.0; older fla
    versions' ``chunk_gated_delta_rule`` refused float32 inputs (an AssertionError of theirs)."""
    chunk_gated_delta_rule = _fla_function("fla.ops.gated_delta_rule", "chunk_gated_delta_rule")
    B, T, H, _ = q.shape
    f32 = torch.float32
    if log_decay is None:
        g = torch.zeros(B, T, H, dtype=f32, device=q.device)
    else:
        g = log_decay.to(f32)
        g = g.expand(B, T, H).contiguous() if g.dim() == 1 else g.contiguous()
    with autocast_off(q.device):
        o, S = chunk_gated_delta_rule(*(x.to(f32).contiguous() for x in (q, k, v)), g, beta.to(f32).contiguous(),
                                      scale=scale, initial_state=None if S0 is None else S0.to(f32).contiguous(),
                                      output_final_state=output_final_state, use_qk_l2norm_in_kernel=l2_normalize)
    return o.to(q.dtype), (S if output_final_state else None)
