"""Context-parallel delta rule: one sequence split over the ranks of a process group.

Linear attention's states add (``context_parallel_linear_attention``); the delta rule's do not, since
each token also reads and overwrites what the state holds. What a rank's tokens do to the state is an
affine map instead, ``S_out = M_r S_in + D_r`` with ``M_r = prod_t a_t (I - beta_t k_t k_t^T)``
[Dk, Dk] (latest token leftmost) and ``D_r`` the state the slice leaves when it starts from zero. Both
come from one run of the op: values ``[v | 0]`` from the state ``[0 | I]`` end in ``[D_r | M_r]``.

1. each rank computes its ``(M_r, D_r)``;
2. one all-gather of these fixed-size maps (B H Dk (Dv + Dk) numbers per rank);
3. rank r composes the maps of ranks 0 .. r-1 onto ``initial_state``, a scan over ranks, for the state
   before its first token, and runs the op on its slice from there. Every rank composes all R maps
   for the final state.

The all-gather's backward is a reduce-scatter, so gradients are exact. Each rank runs the op twice on
its slice (the summary, then the outputs), against once for linear attention.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..context_parallel import _AllGather, _group_rank
from ..validation import check_qkv, compute_dtype
from .api import _check_state, delta_rule


def _compose(X: Optional[torch.Tensor], maps: torch.Tensor, upto: int, Dv: int) -> Optional[torch.Tensor]:
    """The state after ranks 0 .. upto-1 from X (None: zeros): X <- M_s X + D_s in rank order."""
    for s in range(upto):
        D, M = maps[s, ..., :Dv], maps[s, ..., Dv:]
        X = D if X is None else M @ X + D
    return X


def context_parallel_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    group=None,
    log_decay: Optional[torch.Tensor] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    **kwargs,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``delta_rule`` on a sequence split over the ranks of ``group`` (default: the world).

    Rank r passes its contiguous slice (q, k [B, T_r, H, Dk], v [B, T_r, H, Dv], beta [B, T_r, H],
    log_decay [B, T_r, H] or a fixed [H]), the ranks in sequence order, with the same B, H, D and
    options (``kwargs``: ``form``, ``chunk_size``, ``scale``, ``l2_normalize``) on every rank;
    ``initial_state`` is the state before rank 0's first token, the same on every rank.

    Returns ``(o_local, state)``: ``o_local`` equals this rank's slice of ``delta_rule`` on the whole
    sequence; ``state`` (with ``output_final_state``) the whole sequence's final state, on every rank.
    Gradients of q, k, v, beta and a per-token log_decay are this rank's slices of the one-process
    gradients; for tensors every rank holds whole (a fixed log_decay, initial_state) the ranks' parts
    sum to it.
    """
    group, rank, R = _group_rank(group, "context_parallel_delta_rule")
    B, T, H, Dk, Dv = check_qkv(q, k, v)
    if initial_state is not None:  # here, on every rank: a bad state must not fail rank 0 alone
        _check_state(initial_state, B, H, Dk, Dv, q.device, "initial_state")
    dtype = compute_dtype(q.dtype)
    zeros = torch.zeros(B, T, H, Dk, dtype=v.dtype, device=q.device)  # q, k, v must share a dtype
    eye = torch.eye(Dk, dtype=dtype, device=q.device).expand(B, H, Dk, Dk)
    start = torch.cat([torch.zeros(B, H, Dk, Dv, dtype=dtype, device=q.device), eye], dim=-1)
    _, summary = delta_rule(q, k, torch.cat([v, zeros], dim=-1), beta, log_decay=log_decay,
                            initial_state=start, output_final_state=True, **kwargs)  # [B,H,Dk,Dv+Dk] = [D | M]
    maps = _AllGather.apply(summary.flatten(), group).view(R, B, H, Dk, Dv + Dk)  # the one collective
    S0 = None if initial_state is None else initial_state.to(dtype)
    X = _compose(S0, maps, rank, Dv)
    if rank == 0:  # X does not depend on the maps here; a branch of zero weight makes this rank's backward
        # reach the all-gather's reduce-scatter, in which every other rank waits (torch.where, not 0 * maps,
        # so that a non-finite map cannot reach X)
        keep = X if X is not None else maps.new_zeros(B, H, Dk, Dv)
        X = torch.where(torch.ones((), dtype=torch.bool, device=keep.device), keep, maps[0, ..., :Dv])
    o, _ = delta_rule(q, k, v, beta, log_decay=log_decay, initial_state=X, **kwargs)
    state = None
    if output_final_state:
        state = _compose(S0, maps, R, Dv)
    return o, state
