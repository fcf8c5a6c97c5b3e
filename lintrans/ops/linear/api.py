"""``linear_attention``: argument checks, then the chunked form (``chunked.py``), one of the other
forms (``forms.py``) or flash-linear-attention's kernel."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..feature_maps import OUTPUT_DERIVATIVES, named_feature_dim, resolve_feature_map
from ..native import chunked as native_chunked
from ..validation import autocast_off, check_bool, check_choice, check_positive_int, check_qkv, compute_dtype
from .checks import State, check_log_decay, check_scalars, featurize, log_decay_head_first, resolve_chunk, state0
from .chunked import Chunked, ChunkedAttention, chunks_per_block
from .forms import FORMS


def _chunked_attention(q, k, v, feature_map, chunk_size, normalize, scale, eps, initial_state,
                       output_final_state, log_decay):
    """The chunked form on q, k, v [B, T, H, D] (``ChunkedAttention``); a named feature map is
    applied inside it, block by block, so that no T-sized features are ever stored."""
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    dtype = compute_dtype(q.dtype)
    if isinstance(feature_map, str) and feature_map != "identity":
        phi, Fd = resolve_feature_map(feature_map)[0], named_feature_dim(feature_map, Dk)
    else:  # a module may hold (per-head) parameters: it is applied here, to [B, T, H, D]
        phi, (q, k) = None, featurize(q, k, feature_map, 1.0)
        Fd = q.shape[-1]
    dphi = OUTPUT_DERIVATIVES.get(feature_map) if phi is not None else None
    S0 = state0(initial_state, B, H, Fd, Dv, dtype, q.device)
    ld = None
    if log_decay is not None:
        ld = log_decay.to(dtype)
        ld = ld.expand(1, T, H) if ld.dim() == 1 else ld  # a fixed [H] decay: the same for every token
    native = feature_map if phi is not None else "identity"
    out_dtype = v.dtype
    # 16-bit inputs (CPU autocast) reach the kernel as float32 copies, made once: the float32 the blocks
    # compute in anyway (the blocks ran instead, about twice as slow); as delta_rule does
    up = [x.to(dtype) for x in (q, k, v)] if q.device.type == "cpu" else (q, k, v)
    if native_chunked.supports(*up, ld, native, normalize, dtype):
        q, k, v = up
    else:
        native = None
    # "auto": the chunk measured on the path this call takes (the kernel's and the blocks' differ)
    chunk = min(resolve_chunk(chunk_size, T, Dv, Fd, dtype, q.device, log_decay is not None,
                              kernel=(native is not None) if q.device.type == "cpu" else None), T)
    cfg = Chunked(phi, dphi, scale, chunk, chunks_per_block(q.device, B * H, chunk, T // chunk), normalize, eps,
                   dtype, v.dtype, native)
    o, S_end = ChunkedAttention.apply(q, k, v, ld, S0, cfg)
    return o.to(out_dtype), ((S_end[..., :Dv], S_end[..., Dv]) if output_final_state else None)


def _fla_attention(q, k, v, form, feature_map, normalize, scale, eps, initial_state, output_final_state, log_decay):
    """backend="fla": our feature map and state layout around flash-linear-attention's chunked kernel."""
    from ..fla_backend import check_fla_case, fla_linear_attention

    check_fla_case(q, form)
    B, _, H, _, Dv = check_qkv(q, k, v)
    fq, fk = featurize(q, k, feature_map, 1.0)  # [B,T,H,F] in the state dtype
    S0 = None if initial_state is None else state0(initial_state, B, H, fq.shape[-1], Dv, fq.dtype, q.device)
    return fla_linear_attention(q, k, v, fq, fk, S0, log_decay, normalize=normalize, scale=scale, eps=eps,
                                output_final_state=output_final_state)


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    form: str = "chunked",
    feature_map="elu",
    chunk_size: int = 64,
    normalize: bool = True,
    scale: float = 1.0,
    eps: float = 1e-6,
    initial_state: Optional[State] = None,
    output_final_state: bool = False,
    log_decay: Optional[torch.Tensor] = None,
    backend: str = "torch",
) -> Tuple[torch.Tensor, Optional[State]]:
    """Causal linear attention. q, k: [B, T, H, Dk], v: [B, T, H, Dv] -> (o [B, T, H, Dv], state).

    form: one of ``attention_loop``, ``state_loop``, ``attention``, ``attention_blocked``,
    ``state_parallel``, ``chunked`` (all equal; ``chunked`` is the fast one for long T).
    feature_map: a name (``identity``, ``elu``, ``relu``, ``softplus``, ``based``), a callable
    ``[..., D] -> [..., F]`` (e.g. a module from ``lintrans.nn.feature_maps``) or a pair of callables
    (phi_q, phi_k). chunk_size: the chunk of ``chunked`` and the block of ``attention_blocked``, or
    ``"auto"``: the fastest measured on this machine (``lintrans.ops.chunk_tuning``, cached on disk).
    state: ``(S [B, H, F, Dv], z [B, H, F])`` in float32 (float64 for float64 inputs), returned when
    ``output_final_state``; pass it back as ``initial_state`` to continue the sequence.
    log_decay: None, or the log of the state's decay, ``[B, T, H]`` (a gate per token and head) or
    ``[H]`` (a fixed decay per head): ``S_t = exp(log_decay_t) S_{t-1} + phi(k_t) v_t^T`` and likewise
    z. Finite and <= 0 (checked on CPU tensors; on an accelerator the check would wait for the
    device, so only its shape is checked there); any float dtype, applied in the state's dtype;
    gradients flow to it.
    backend: ``"torch"`` (ours, the default) or ``"fla"``: the chunked form by flash-linear-attention's
    kernels, on CUDA where ``fla`` is importable (``lintrans.ops.fla_backend``; a ValueError says why
    not otherwise). Verified against ours on an H100, forward and backward (docs/gpu.md).
    """
    B, T, H, Dk, Dv = check_qkv(q, k, v)
    if log_decay is not None:
        check_log_decay(log_decay, B, T, H, q.device)
    check_choice("form", form, FORMS)
    if isinstance(chunk_size, str) and chunk_size != "auto" or not isinstance(chunk_size, (int, str)):
        raise TypeError(f"chunk_size must be an int >= 1 or 'auto', got {chunk_size!r}")
    if chunk_size != "auto":
        check_positive_int("chunk_size", chunk_size)
    check_scalars(normalize, scale, eps)
    check_bool("output_final_state", output_final_state)
    if backend == "fla":
        return _fla_attention(q, k, v, form, feature_map, normalize, scale, eps, initial_state, output_final_state,
                              log_decay)
    if backend != "torch":
        raise ValueError(f"backend must be 'torch' or 'fla', got {backend!r}")
    if form == "chunked":
        return _chunked_attention(q, k, v, feature_map, chunk_size, normalize, scale, eps, initial_state,
                                  output_final_state, log_decay)
    out_dtype = q.dtype
    if isinstance(feature_map, str):  # named maps act on each vector alone: apply them head-first
        fq, fk = featurize(q.transpose(1, 2), k.transpose(1, 2), feature_map, scale)  # [B,H,T,F]
    else:  # modules may hold per-head parameters and expect [B,T,H,D]
        fq, fk = (x.transpose(1, 2) for x in featurize(q, k, feature_map, scale))  # [B,H,T,F]
    dtype = fq.dtype
    Fd = fq.shape[-1]
    chunk_size = resolve_chunk(chunk_size, T, Dv, Fd, dtype, q.device, log_decay is not None, form=form, kernel=False)
    S0 = state0(initial_state, B, H, Fd, Dv, dtype, q.device)
    # the extra column of ones carries the normaliser: y[..., -1] = sum_j s_ij, S0[..., -1] = z
    # built directly in the [B,H,T,Dv+1] layout the forms use: one copy of v instead of two
    ones = torch.ones(B, H, T, 1, dtype=dtype, device=v.device)
    v1 = torch.cat([v.transpose(1, 2).to(dtype), ones], dim=-1)  # [B,H,T,Dv+1]
    # one copy into [B,H,T,F] up front (none for elu, which writes that layout): the forms' batched
    # matmuls would otherwise copy these strided views for every product, forward and backward
    fq, fk = fq.contiguous(), fk.contiguous()  # [B,H,T,F]
    ld = None if log_decay is None else log_decay_head_first(log_decay, B, T, H, dtype)  # [B|1,H,T]
    with autocast_off(q.device):  # the forms accumulate in the state dtype under mixed precision too
        y, S_end = FORMS[form](fq, fk, v1, S0, chunk_size, ld)  # y: [B,H,T,Dv+1]
    y = y.transpose(1, 2)  # [B,T,H,Dv+1]
    o = y[..., :Dv] / (y[..., Dv:] + eps) if normalize else y[..., :Dv]
    state = (S_end[..., :Dv], S_end[..., Dv]) if output_final_state else None
    return o.to(out_dtype), state

