"""Hugging Face transformers' Gated DeltaNet layers on ``lintrans.ops.delta_rule``.

Qwen3-Next and its family (``Qwen3NextGatedDeltaNet``, and the Qwen3.5 / OLMo-hybrid layers built the
same way) call ``torch_chunk_gated_delta_rule`` for prefill and ``torch_recurrent_gated_delta_rule`` for
one-token decoding when flash-linear-attention is absent, as on a CPU. ``chunk_gated_delta_rule`` and
``recurrent_gated_delta_rule`` here take the same arguments and return the same things, computed by our op;
``patch_qwen3_next(model)`` makes a model's layers call them:

    from lintrans.interop.transformers import patch_qwen3_next
    patch_qwen3_next(model)          # every Gated DeltaNet layer of this model, until unpatch_qwen3_next
    with patched_qwen3_next(model):  # or only inside the block
        model.generate(...)

transformers is imported by the caller, never here: this module only reads the layers it is given.
"""
from __future__ import annotations

import sys
import types
from contextlib import contextmanager
from typing import Iterator, Optional, Tuple

import torch

from lintrans.ops.delta import delta_rule, delta_rule_step

# the module-level names the layers' forward calls (transformers 5), and the attributes it calls instead
# in the transformers 4 releases that stored the functions on the layer
_GLOBAL_NAMES = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
_ATTRIBUTE_NAMES = ("chunk_gated_delta_rule", "recurrent_gated_delta_rule")
_MARK = "_lintrans_delta_rule_patch"


def _grouped(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """q, k with num_k_heads repeated to value's num_v_heads, as transformers does: value head h reads
    key head h // (num_v_heads // num_k_heads)."""
    hk, hv = key.shape[2], value.shape[2]
    if query.shape != key.shape:
        raise ValueError(f"query and key must have one shape [B, T, H, Dk], got {list(query.shape)} and "
                         f"{list(key.shape)}")
    if hv % hk:
        raise ValueError(f"value's heads ({hv}) must be a multiple of key's heads ({hk})")
    if hv != hk:
        query, key = (x.repeat_interleave(hv // hk, dim=2) for x in (query, key))
    return query, key


def _packed(kwargs: dict) -> None:
    if kwargs.get("cu_seqlens") is not None:
        raise ValueError("cu_seqlens: packed sequences are not supported by lintrans' delta rule; pass one "
                         "sequence per batch row")


def _same_dtype(query, key, value):
    # the layers hand over q, k, v in the model's dtype; transformers' fallback accepts mixed ones too and
    # computes in float32, so mixed inputs meet at their promoted dtype rather than the query's
    dtype = torch.promote_types(torch.promote_types(query.dtype, key.dtype), value.dtype)
    return query.to(dtype), key.to(dtype), value.to(dtype)


def chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: Optional[int] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """transformers' ``torch_chunk_gated_delta_rule`` on ``delta_rule(form="chunked")``.

    query, key [B, T, Hk, Dk]; value [B, T, Hv, Dv] with Hv a multiple of Hk; g (log-decays, <= 0) and
    beta [B, T, Hv]; initial_state [B, Hv, Dk, Dv]. Returns (o [B, T, Hv, Dv] in query's dtype, the final
    state [B, Hv, Dk, Dv] in float32 (float64 for float64 inputs) or None). The scale is Dk ** -0.5, as in
    transformers. Other keyword arguments the layers pass are ignored, but for ``cu_seqlens`` (packed
    sequences), which is refused."""
    _packed(kwargs)
    out_dtype = query.dtype  # transformers returns o in the query's dtype
    query, key, value = _same_dtype(query, key, value)
    q, k = _grouped(query, key, value)
    o, S = delta_rule(q, k, value, beta, log_decay=g, form="chunked", chunk_size=chunk_size,
                      l2_normalize=bool(use_qk_l2norm_in_kernel), initial_state=initial_state,
                      output_final_state=output_final_state)
    return o.to(out_dtype), S


def recurrent_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """transformers' ``torch_recurrent_gated_delta_rule``: the same arguments as ``chunk_gated_delta_rule``
    but ``chunk_size``. One token (decoding) runs ``delta_rule_step``; longer inputs run the chunked form,
    which computes the same recurrence."""
    _packed(kwargs)
    out_dtype = query.dtype
    query, key, value = _same_dtype(query, key, value)
    q, k = _grouped(query, key, value)
    l2 = bool(use_qk_l2norm_in_kernel)
    if q.shape[1] != 1:
        o, S = delta_rule(q, k, value, beta, log_decay=g, form="chunked", l2_normalize=l2,
                          initial_state=initial_state, output_final_state=output_final_state)
        return o.to(out_dtype), S
    if g.dim() != 3 or beta.dim() != 3:
        raise ValueError(f"g and beta must be [B, T, H] tensors, got {list(g.shape)} and {list(beta.shape)}")
    o, S = delta_rule_step(q[:, 0], k[:, 0], value[:, 0], beta[:, 0], initial_state, log_decay=g[:, 0],
                           l2_normalize=l2)
    return o[:, None].to(out_dtype), (S if output_final_state else None)


def _is_gated_deltanet(module: torch.nn.Module) -> bool:
    if all(hasattr(module, name) for name in _ATTRIBUTE_NAMES):
        return True
    defining = sys.modules.get(type(module).__module__)
    return (type(module).__name__.endswith("GatedDeltaNet") and defining is not None
            and all(hasattr(defining, name) for name in _GLOBAL_NAMES))


def _patched_forward(self, *args, **kwargs):
    """The layer's class forward with the defining module's two functions swapped for ours during the
    call (the layers look them up as globals at call time). Bound to the layer as a method, so a copy of
    the model (``copy.deepcopy``) runs its own weights. Not for a patched and an unpatched model of one
    family running at once in two threads: the swap is per Python module."""
    defining = sys.modules[type(self).__module__]
    own = self.__dict__[_MARK][1]  # an instance forward that was there first (e.g. accelerate's offloading hook)
    saved = [getattr(defining, name) for name in _GLOBAL_NAMES]
    for name, fn in zip(_GLOBAL_NAMES, (chunk_gated_delta_rule, recurrent_gated_delta_rule)):
        setattr(defining, name, fn)
    try:
        return own(*args, **kwargs) if own is not None else type(self).forward(self, *args, **kwargs)
    finally:
        for name, fn in zip(_GLOBAL_NAMES, saved):
            setattr(defining, name, fn)


def patch_qwen3_next(model: torch.nn.Module) -> int:
    """Make every Gated DeltaNet layer of ``model`` (a transformers Qwen3-Next-family model, or one such
    layer) run ``lintrans.ops.delta_rule``; returns how many layers it patched (already patched ones
    count, and stay as they are). Raises ValueError when ``model`` has none. ``unpatch_qwen3_next`` undoes
    it. Other models of the same class are not affected."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    count = 0
    for module in model.modules():
        if not _is_gated_deltanet(module):
            continue
        count += 1
        if hasattr(module, _MARK):
            continue
        if all(hasattr(module, name) for name in _ATTRIBUTE_NAMES):  # the layer calls its own attributes
            saved = {name: module.__dict__.get(name) for name in _ATTRIBUTE_NAMES}
            module.chunk_gated_delta_rule = chunk_gated_delta_rule
            module.recurrent_gated_delta_rule = recurrent_gated_delta_rule
            setattr(module, _MARK, ("attributes", saved))
        else:  # the layer calls module-level functions
            own = module.__dict__.get("forward")  # kept, called inside ours and restored by unpatch
            setattr(module, _MARK, ("forward", own))
            module.forward = types.MethodType(_patched_forward, module)
    if count == 0:
        raise ValueError(f"model ({type(model).__name__}) has no Gated DeltaNet layer (a Qwen3-Next-family "
                         "layer calling torch_chunk_gated_delta_rule) to patch")
    return count


def unpatch_qwen3_next(model: torch.nn.Module) -> int:
    """Undo ``patch_qwen3_next``: the layers call transformers' functions again. Returns how many it
    restored."""
    count = 0
    for module in model.modules():
        mark = module.__dict__.get(_MARK)
        if mark is None:
            continue
        kind, saved = mark
        if kind == "attributes":
            for name, fn in saved.items():
                if fn is None:
                    delattr(module, name)
                else:
                    setattr(module, name, fn)
        elif saved is None:
            del module.forward
        else:
            module.forward = saved
        delattr(module, _MARK)
        count += 1
    return count


@contextmanager
def patched_qwen3_next(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``patch_qwen3_next(model)`` inside the block only (layers patched before it stay patched)."""
    before = {id(m) for m in model.modules() if hasattr(m, _MARK)}
    patch_qwen3_next(model)
    try:
        yield model
    finally:
        for module in model.modules():
            if id(module) not in before and hasattr(module, _MARK):
                unpatch_qwen3_next(module)
