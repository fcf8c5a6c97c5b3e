"""The delta rule token by token: the float64 reference and the ``recurrent`` form.

Per head, with S [Dk, Dv] the state, a_t = exp(log_decay_t) and beta_t the write strength:

    S_t = a_t S_{t-1} + k_t (beta_t (v_t - a_t S_{t-1}^T k_t))^T        o_t = scale * S_t^T q_t

i.e. the state first decays, then reads what it holds for k_t and moves that value a step beta_t
towards v_t: ``S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``. Without a decay this is
DeltaNet; with one, Gated DeltaNet.
"""
from __future__ import annotations

from typing import Optional

import torch


def l2_normalized(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(x.x + 1e-6) over the last dimension (flash-linear-attention's and transformers' eps)."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6)


def step(S: torch.Tensor, q, k, v, beta, g: Optional[torch.Tensor]):
    """One token for every (batch, head): S [B, H, Dk, Dv], q, k [B, H, Dk], v [B, H, Dv], beta [B, H],
    g (the decay, not its log) [B, H] or None; q already scaled. Returns (o [B, H, Dv], S)."""
    if g is not None:
        S = S * g[..., None, None]
    read = (k[..., None, :] @ S).squeeze(-2)  # S^T k: [B,H,Dv]
    S = S + k[..., :, None] * (beta[..., None] * (v - read))[..., None, :]
    return (q[..., None, :] @ S).squeeze(-2), S


def token_loop(q, k, v, beta, log_decay, S0):
    """The recurrence over [B, H, T, *] head-first tensors (q scaled), in their dtype, differentiable by
    autograd. log_decay: [B|1, H, T] or None. Returns (o [B, H, T, Dv], S [B, H, Dk, Dv])."""
    S = S0
    outs = []
    for t in range(q.shape[2]):
        g = None if log_decay is None else log_decay[:, :, t].exp().expand(q.shape[0], -1)
        o, S = step(S, q[:, :, t], k[:, :, t], v[:, :, t], beta[:, :, t], g)
        outs.append(o)
    return torch.stack(outs, dim=2), S


def delta_rule_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    log_decay: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    l2_normalize: bool = True,
    initial_state: Optional[torch.Tensor] = None,
):
    """The definition in float64, one token at a time: q, k [B, T, H, Dk], v [B, T, H, Dv], beta [B, T, H],
    log_decay [B, T, H] or [H] or None, initial_state [B, H, Dk, Dv] or None -> (o [B, T, H, Dv] float64,
    S [B, H, Dk, Dv] float64). No checks: the tests' yardstick, not an entry point."""
    q, k, v, beta = (x.double() for x in (q, k, v, beta))
    B, T, H, Dk = q.shape
    if l2_normalize:
        q, k = l2_normalized(q), l2_normalized(k)
    q = q * (Dk**-0.5 if scale is None else scale)
    ld = None
    if log_decay is not None:
        ld = log_decay.double()
        ld = ld[None, :, None].expand(1, H, T) if ld.dim() == 1 else ld.transpose(1, 2)
    S0 = torch.zeros(B, H, Dk, v.shape[-1], dtype=torch.float64, device=q.device) if initial_state is None else initial_state.double()
    o, S = token_loop(*(x.transpose(1, 2) for x in (q, k, v)), beta.transpose(1, 2), ld, S0)
    return o.transpose(1, 2), S
