"""``linear_attention_step``: one token of the recurrence, for decoding."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..native import chunked as native_chunked
from ..validation import autocast_off, check_qkv, compute_dtype
from .checks import State, check_log_decay, check_scalars, check_state, featurize


def linear_attention_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: Optional[State] = None,
    *,
    feature_map="elu",
    normalize: bool = True,
    scale: float = 1.0,
    eps: float = 1e-6,
    log_decay: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, State]:
    """One token of the recurrence, for generation: q, k [B, H, Dk], v [B, H, Dv] -> (o [B, H, Dv], state).

    Cost and memory are constant in the number of tokens seen so far. ``log_decay`` [B, H] or [H]:
    the state is multiplied by ``exp(log_decay)`` before this token is added (see ``linear_attention``).
    """
    B, _, H, Dk, Dv = check_qkv(q, k, v, layout="[B, H, D]")
    check_scalars(normalize, scale, eps)
    if log_decay is not None:
        check_log_decay(log_decay, B, None, H, q.device)
    checked = None
    if (feature_map is None or isinstance(feature_map, str)) and feature_map in native_chunked.PHI_CODES \
            and state is not None:
        # a named element-wise map keeps q's width; then one fused call where nothing records gradients
        checked = S, z = check_state(state, B, H, Dk, Dv, compute_dtype(q.dtype), q.device, arg="state")
        if native_chunked.step_supports(q, k, v, log_decay, S, z, feature_map):
            o, S, z = native_chunked.step(q, k, v, log_decay, S, z, feature_map, normalize, scale, eps)
            return o, (S, z)
    fq, fk = featurize(q, k, feature_map, scale)  # [B,H,F]
    dtype = fq.dtype
    Fd = fq.shape[-1]
    if state is None:
        S = torch.zeros(B, H, Fd, Dv, dtype=dtype, device=q.device)
        z = torch.zeros(B, H, Fd, dtype=dtype, device=q.device)
    else:
        S, z = checked or check_state(state, B, H, Fd, Dv, dtype, q.device, arg="state")
    with autocast_off(q.device):  # the state and its readout in the state dtype under mixed precision too
        if log_decay is not None:
            g = log_decay.to(dtype).exp().expand(B, H)  # [B,H]
            S, z = S * g[..., None, None], z * g[..., None]
        S = torch.addcmul(S, fk[..., :, None], v.to(dtype)[..., None, :])  # S + phi(k) v^T, one op
        z = z + fk
        num = (fq[..., None, :] @ S).squeeze(-2)  # [B,H,Dv]; a batched matmul costs less per token than einsum
        if normalize:
            num = num / ((fq * z).sum(-1, keepdim=True) + eps)
    return num.to(q.dtype), (S, z)

