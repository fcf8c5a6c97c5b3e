"""``delta_rule`` and ``delta_rule_step``: argument checks, layout and dtypes around the forms."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..linear.checks import check_log_decay, log_decay_head_first
from ..validation import autocast_off, check_bool, check_number, check_positive_int, check_qkv, compute_dtype, reads_gate_values
from ..native import delta_rule as native_delta
from . import chunked as _chunked_form
from .reference import l2_normalized, step, token_loop

DELTA_FORMS = ("recurrent", "chunked")
# chunk_size=None picks these, the fastest measured for each path (docs/delta-rule.md, "Speed on a CPU")
NATIVE_CHUNK, TORCH_CHUNK = 32, 64
_native_enabled = True  # tests turn the fused kernel off to reach the PyTorch chunked form


def _check_beta(beta, shape: tuple, layout: str, device) -> None:
    if not isinstance(beta, torch.Tensor):
        raise TypeError(f"beta must be a torch.Tensor {layout}, got {type(beta).__name__}")
    if not beta.is_floating_point():
        raise TypeError(f"beta must be a floating tensor, got {beta.dtype}")
    if tuple(beta.shape) != shape:
        raise ValueError(f"beta must have shape {list(shape)} {layout}, got {list(beta.shape)}")
    if beta.device != device:
        raise ValueError(f"beta must be on {device} like q, got {beta.device}")
    if reads_gate_values(beta.device) and beta.numel():
        lo, hi = torch.aminmax(beta.detach())
        if not (lo >= 0 and hi <= 2):  # NaN fails both
            bad = ~((beta >= 0) & (beta <= 2))
            raise ValueError(f"beta must be finite and in [0, 2], got {beta[bad][0].item()}")


def _check_state(state, B: int, H: int, Dk: int, Dv: int, device, arg: str) -> None:
    if not isinstance(state, torch.Tensor):
        raise TypeError(f"{arg} must be None or a torch.Tensor [B, H, Dk, Dv], got {type(state).__name__}")
    if not state.is_floating_point():
        raise TypeError(f"{arg} must be a floating tensor, got {state.dtype}")
    if tuple(state.shape) != (B, H, Dk, Dv):
        raise ValueError(f"{arg} must have shape {[B, H, Dk, Dv]} [B, H, Dk, Dv], got {list(state.shape)}")
    if state.device != device:
        raise ValueError(f"{arg} must be on {device} like q, got {state.device}")


def _check_options(scale, l2_normalize) -> None:
    check_number("scale", scale, allow_none=True)
    check_bool("l2_normalize", l2_normalize)


def _prepare(q, k, scale, l2_normalize, dtype):
    q, k = q.to(dtype), k.to(dtype)
    if l2_normalize:
        q, k = l2_normalized(q), l2_normalized(k)
    return q * (q.shape[-1] ** -0.5 if scale is None else scale), k


def delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    log_decay: Optional[torch.Tensor] = None,
    form: str = "chunked",
    chunk_size: Optional[int] = None,
    scale: Optional[float] = None,
    l2_normalize: bool = True,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    backend: str = "torch",
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The (gated) delta rule: DeltaNet, and Gated DeltaNet with ``log_decay``.

    q, k: [B, T, H, Dk]; v: [B, T, H, Dv]; beta: [B, T, H] in [0, 2] (above 1 the update's
    eigenvalue ``1 - beta |k|^2`` goes negative). Per head, with a_t = exp(log_decay_t) (1 without):

        S_t = a_t S_{t-1} + k_t (beta_t (v_t - a_t S_{t-1}^T k_t))^T,    o_t = scale * S_t^T q_t

    l2_normalize: q and k become ``x / sqrt(x.x + 1e-6)`` first (as flash-linear-attention's
    ``use_qk_l2norm_in_kernel`` and transformers). scale: defaults to ``Dk ** -0.5``.
    log_decay: None, [B, T, H] or a fixed [H]; finite and <= 0.
    form: ``"chunked"`` (the WY representation, the fast one) or ``"recurrent"`` (the token loop).
    chunk_size: the chunk of the chunked form; None: 32 for the fused CPU kernel, 64 for the PyTorch
    form (the fastest measured for each; any size gives the same result up to rounding).
    initial_state: S [B, H, Dk, Dv] from an earlier call (any float dtype; used in the state dtype).
    Returns (o [B, T, H, Dv] in q's dtype, S [B, H, Dk, Dv] in float32, or float64 for float64
    inputs, when ``output_final_state``, else None). bf16/fp16 inputs are computed in float32.
    Gradients reach q, k, v, beta, log_decay and initial_state.
    backend: ``"torch"`` (ours, the default) or ``"fla"``: the chunked form by flash-linear-attention's
    ``chunk_gated_delta_rule`` on CUDA where ``fla`` is importable (in float32; ``chunk_size`` unused;
    a ValueError says why it cannot run otherwise; see ``lintrans.ops.fla_backend`` and docs/gpu.md).
    """
    B, T, H, Dk, Dv = check_qkv(q, k, v)
    _check_beta(beta, (B, T, H), "[B, T, H]", q.device)
    if log_decay is not None:
        check_log_decay(log_decay, B, T, H, q.device)
    if not isinstance(form, str) or form not in DELTA_FORMS:
        raise ValueError(f"form must be one of {list(DELTA_FORMS)}, got {form!r}")
    check_positive_int("chunk_size", chunk_size, allow_none=True)
    _check_options(scale, l2_normalize)
    check_bool("output_final_state", output_final_state)
    if initial_state is not None:
        _check_state(initial_state, B, H, Dk, Dv, q.device, "initial_state")
    if backend == "fla":
        from ..fla_backend import check_fla_case, fla_delta_rule

        check_fla_case(q, form)
        return fla_delta_rule(q, k, v, beta, log_decay, initial_state, scale=Dk**-0.5 if scale is None else scale,
                              l2_normalize=l2_normalize, output_final_state=output_final_state)
    if backend != "torch":
        raise ValueError(f"backend must be 'torch' or 'fla', got {backend!r}")
    dtype = compute_dtype(q.dtype)
    with autocast_off(q.device):
        S0 = (torch.zeros(B, H, Dk, Dv, dtype=dtype, device=q.device) if initial_state is None
              else initial_state.to(dtype))
        if form == "chunked" and _native_enabled and q.device.type == "cpu":
            qkvb = [x.to(dtype) for x in (q, k, v, beta)]  # bf16/fp16 inputs computed in float32: once
            if native_delta.supports(*qkvb, None):
                ld = None if log_decay is None else log_decay.to(dtype)
                o, S = _chunked_form.native_chunked(*qkvb, ld, S0, chunk_size or NATIVE_CHUNK, l2_normalize,
                                                    Dk**-0.5 if scale is None else scale)
                return o.to(q.dtype), (S if output_final_state else None)
        qs, ks = _prepare(q, k, scale, l2_normalize, dtype)
        qs, ks, vs = (x.transpose(1, 2) for x in (qs, ks, v.to(dtype)))  # [B,H,T,D]
        bs = beta.to(dtype).transpose(1, 2)
        ld = None if log_decay is None else log_decay_head_first(log_decay, B, T, H, dtype)
        if form == "recurrent":
            o, S = token_loop(qs, ks, vs, bs, ld, S0)
        else:
            o, S = _chunked_form.chunked(qs.contiguous(), ks.contiguous(), vs.contiguous(), bs.contiguous(),
                                         ld, S0.contiguous(), chunk_size or TORCH_CHUNK)
    return o.transpose(1, 2).to(q.dtype), (S if output_final_state else None)


def delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    state: Optional[torch.Tensor] = None,
    *,
    log_decay: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    l2_normalize: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One token of ``delta_rule``, for decoding: q, k [B, H, Dk], v [B, H, Dv], beta [B, H], state
    [B, H, Dk, Dv] or None, log_decay [B, H] or [H] -> (o [B, H, Dv], state). Constant cost per token."""
    B, _, H, Dk, Dv = check_qkv(q, k, v, layout="[B, H, D]")
    _check_beta(beta, (B, H), "[B, H]", q.device)
    if log_decay is not None:
        check_log_decay(log_decay, B, None, H, q.device)
    _check_options(scale, l2_normalize)
    if state is not None:
        _check_state(state, B, H, Dk, Dv, q.device, "state")
    dtype = compute_dtype(q.dtype)
    if state is not None and _native_enabled and native_delta.step_supports(q, k, v, beta, log_decay, state):
        # one fused call where nothing records gradients (the torch ops below cost more to dispatch than to run)
        return native_delta.step(q, k, v, beta, log_decay, state, l2_normalize,
                                 Dk ** -0.5 if scale is None else scale)
    with autocast_off(q.device):
        qs, ks = _prepare(q, k, scale, l2_normalize, dtype)
        S = torch.zeros(B, H, Dk, Dv, dtype=dtype, device=q.device) if state is None else state.to(dtype)
        g = None if log_decay is None else log_decay.to(dtype).exp().expand(B, H)
        o, S = step(S, qs, ks, v.to(dtype), beta.to(dtype), g)
    return o.to(q.dtype), S
