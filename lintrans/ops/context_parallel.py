"""Context-parallel causal linear attention: one sequence split over the ranks of a process group.

Rank r of the group holds tokens ``[t_r, t_r + T_r)`` of the same sequences, in rank order
(normally ``T_r = T / R``). Linear attention only carries a fixed-size state from one token to the
next, so each rank needs nothing of the other ranks' keys and values, only the state they leave
behind (LASP-2, Sun et al. 2025):

1. each rank sums its own keys and values into a local state ``(S_r, z_r)`` as if it started from
   zero (``S_r = sum_j exp(L_r - L_j) phi(k_j) v_j^T``, L the local cumulative log-decay) and, gated,
   its total log-decay ``A_r``;
2. one all-gather of these fixed-size sums (``torch.distributed.all_gather``);
3. each rank combines them with ``initial_state`` into the state before its first token,
   ``X_r = exp(A_0 + .. + A_{r-1}) S0 + sum_{s<r} exp(A_{s+1} + .. + A_{r-1}) S_s`` (every exponent a
   sum of log-decays, <= 0), and runs ``linear_attention`` on its slice from that state.
   The whole sequence's final state is ``X_R``, formed the same way on every rank.

The backward of the all-gather is the matching reduce-scatter (summed over the ranks), so the
gradients are exact too: the gradient reaching rank s's local state is the sum over every rank of
how its outputs depend on it.

Communication per layer: forward one all-gather, backward one reduce-scatter, each of a payload of
``B * H * F * (Dv + 1)`` state numbers (+ ``B * H`` log-decays when gated; ``H`` for a fixed decay)
in the state dtype (float32, float64 for float64 inputs). With ring collectives a rank sends
``(R - 1) x payload`` bytes per direction, whatever T is: for B=1, H=8, F=Dv=32 in float32 that is
33.8 KB per peer, against 2.1 MB for the keys and values of 1024 tokens alone.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from .feature_maps import resolve_feature_map
from .linear import linear_attention
from .linear.checks import check_log_decay, check_state, log_decay_head_first
from .linear.forms import cumulative
from .validation import autocast_off, check_qkv, compute_dtype

State = Tuple[torch.Tensor, torch.Tensor]


class _AllGather(torch.autograd.Function):
    """x on every rank -> [R, *x.shape], rank order; backward: the reduce-scatter (sum) of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        out = torch.empty_like(grad[0])
        dist.reduce_scatter(out, list(grad.contiguous().unbind(0)), group=ctx.group)
        return out, None


def _group_rank(group, op: str = "context_parallel_linear_attention") -> tuple[object, int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{op} needs an initialised torch.distributed process group "
            "(torch.distributed.init_process_group, e.g. under torchrun); group=None means the default group"
        )
    if group is None:
        group = dist.group.WORLD
    elif not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of group: every rank of the group must call the op")
    return group, rank, dist.get_world_size(group)


def _local_state(k, v, phi_k, named, ld, dtype) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(S [B,H,F,Dv], z [B,H,F], total log-decay [B|1,H] or None) of this rank's tokens from a zero state.
    A named map (``named``) acts on k in the state dtype, as in ``linear_attention``; a module on k as given."""
    fk = phi_k(k.to(dtype) if named else k).to(dtype)  # [B,T,H,F]
    with autocast_off(k.device):  # summed in the state dtype under mixed precision too
        if ld is not None:
            L = cumulative(ld)  # [B|1,H,T] float64
            keep = (L[..., -1:] - L).exp().to(dtype)  # decay from each key to the slice's end, <= 1
            fk = fk * keep.transpose(1, 2)[..., None]
        S = torch.einsum("bthf,bthe->bhfe", fk, v.to(dtype))
        return S, fk.sum(1), None if ld is None else L[..., -1].to(dtype)


def _combine(S0, S_all, A_all, upto: int) -> torch.Tensor:
    """The state before rank ``upto``'s first token from S0 [B,H,F,E] and the ranks' local states
    S_all [R,B,H,F,E] (log-decays A_all [R,B|1,H] or None). Every rank's state takes part (with a
    zero weight from ``upto`` on), so the backward's reduce-scatter is reached on every rank."""
    with autocast_off(S_all.device):  # in the state dtype under mixed precision too
        R = S_all.shape[0]
        s = torch.arange(R, device=S_all.device)
        before = s < upto
        if A_all is None:
            w = before.to(S_all.dtype)[:, None, None]  # [R,1,1]
            w0 = torch.ones((), dtype=S_all.dtype, device=S_all.device)
        else:
            A = A_all.double()
            # exponent of state s: A_{s+1} + .. + A_{upto-1}, a masked sum (no differences of cumulative sums)
            between = (s[None, :] > s[:, None]) & (s[None, :] < upto)  # [s, t]
            e = torch.einsum("st,tbh->sbh", between.double(), A)
            w = e.masked_fill(~before[:, None, None], float("-inf")).exp().to(S_all.dtype)  # [R,B|1,H]
            w0 = A[:upto].sum(0).exp().to(S_all.dtype)[..., None, None]  # [B|1,H,1,1]
        X = (w[..., None, None] * S_all).sum(0)
        return X if S0 is None else X + w0 * S0


def context_parallel_linear_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None, **kwargs
) -> Tuple[torch.Tensor, Optional[State]]:
    """Causal linear attention on a sequence split over the ranks of ``group`` (default: the world).

    Rank r passes its contiguous slice, q, k: [B, T_r, H, Dk], v: [B, T_r, H, Dv], the ranks in
    sequence order; every rank must call this with the same B, H, D and options (``T_r`` may differ,
    but is at least 1 on every rank: a rank with no tokens raises ValueError before the all-gather,
    and its peers then fail inside it).
    ``kwargs`` are those of ``linear_attention``: ``feature_map``, ``normalize``, ``scale``, ``eps``,
    ``form``, ``chunk_size``; ``log_decay`` for this rank's tokens ([B, T_r, H]) or fixed ([H]);
    ``initial_state`` the state before rank 0's first token (the same on every rank).

    Returns ``(o_local, state)``: ``o_local`` [B, T_r, H, Dv] equals this rank's slice of
    ``linear_attention`` on the whole sequence, and ``state`` (with ``output_final_state=True``)
    the whole sequence's final state, on every rank. Gradients are exact: those of q, k, v and a
    per-token ``log_decay`` are this rank's slices of the one-process gradients; tensors every rank
    holds whole (a fixed [H] ``log_decay``, ``initial_state``, a feature map's parameters) get on
    each rank the part from its slice, and their sum over the group is the one-process gradient
    (as DDP's gradient all-reduce forms it for parameters).

    One all-gather per call (a reduce-scatter in backward) of fixed-size state sums: see the module
    docstring for the bytes.
    """
    group, rank, R = _group_rank(group)
    B, T, H, Dk, Dv = check_qkv(q, k, v)
    feature_map = kwargs.pop("feature_map", "elu")
    initial_state = kwargs.pop("initial_state", None)
    output_final_state = kwargs.pop("output_final_state", False)
    log_decay = kwargs.pop("log_decay", None)
    if log_decay is not None:
        check_log_decay(log_decay, B, T, H, q.device)
    dtype = compute_dtype(q.dtype)
    ld = None if log_decay is None else log_decay_head_first(log_decay, B, T, H, dtype)  # [B|1,H,T]
    _, phi_k = resolve_feature_map(feature_map)
    # recomputed in backward instead of kept: its phi(k) and copies of v would be T-sized memory per
    # layer (0.6 GB at 16k tokens for 12L-256), the very thing context parallelism is for
    S, z, A = checkpoint(_local_state, k, v, phi_k, isinstance(feature_map, str), ld, dtype, use_reentrant=False)
    Fd = S.shape[2]
    S0 = None
    if initial_state is not None:
        S_init, z_init = check_state(initial_state, B, H, Fd, Dv, dtype, q.device)
        S0 = torch.cat([S_init, z_init[..., None]], dim=-1)  # [B,H,F,Dv+1]
    E = Dv + 1  # the normaliser z rides along as the last column of S
    payload = [torch.cat([S, z[..., None]], dim=-1).flatten()] + ([] if A is None else [A.flatten()])
    gathered = _AllGather.apply(torch.cat(payload), group)  # [R, P]: the one collective
    n = B * H * Fd * E
    S_all = gathered[:, :n].reshape(R, B, H, Fd, E)
    A_all = None if A is None else gathered[:, n:].reshape(R, *A.shape)
    X = _combine(S0, S_all, A_all, rank)
    o, _ = linear_attention(q, k, v, feature_map=feature_map, log_decay=log_decay,
                            initial_state=(X[..., :Dv], X[..., Dv]), **kwargs)
    state = None
    if output_final_state:
        X = _combine(S0, S_all, A_all, R)
        state = (X[..., :Dv], X[..., Dv])
    return o, state
