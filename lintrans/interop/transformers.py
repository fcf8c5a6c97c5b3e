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

import functools
import sys
import threading
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


# Layers that call module globals (transformers 5): each of the two globals becomes, once, a dispatcher
# that runs ours while a patched layer's forward runs in this thread and transformers' function
# otherwise. The dispatchers stay for the process (for every other caller they are transformers'
# functions), so nothing is swapped per call: threads, torch.compile (which reads globals as it traces)
# and unpatched models of the same class all see one fixed function.
_running = threading.local()  # .on: a patched layer's forward is running in this thread
_install_lock = threading.Lock()


def _dispatcher(original, ours):
    @functools.wraps(original)
    def dispatch(*args, **kwargs):
        if getattr(_running, "on", False):
            return ours(*args, **kwargs)
        return original(*args, **kwargs)

    dispatch._lintrans_dispatch = True
    return dispatch


def _install_dispatchers(defining) -> None:
    if all(getattr(getattr(defining, name), "_lintrans_dispatch", False) for name in _GLOBAL_NAMES):
        return
    with _install_lock:
        for name, ours in zip(_GLOBAL_NAMES, (chunk_gated_delta_rule, recurrent_gated_delta_rule)):
            current = getattr(defining, name)
            if not getattr(current, "_lintrans_dispatch", False):
                setattr(defining, name, _dispatcher(current, ours))


def _patched_forward(self, *args, **kwargs):
    """A patched layer's forward: the forward it had (an instance-level one such as accelerate's
    offloading hook, else the class's) with ours dispatched to during the call. Set on the layer as
    ``functools.partial(_patched_forward, layer)``, which ``copy.deepcopy`` rebinds to the copy and
    pickle stores by name. After ``unpatch_qwen3_next`` it stays only where a hook installed later keeps it
    in its chain, and then just calls through."""
    mark = self.__dict__.get(_MARK)
    own = mark["own"] if mark is not None else None
    call = own if own is not None else functools.partial(type(self).forward, self)
    if mark is None or not mark["on"]:
        return call(*args, **kwargs)
    _install_dispatchers(sys.modules[type(self).__module__])  # also after unpickling in a new process
    before = getattr(_running, "on", False)
    _running.on = True
    try:
        return call(*args, **kwargs)
    finally:
        _running.on = before


def _is_ours(forward, module) -> bool:
    return (isinstance(forward, functools.partial) and forward.func is _patched_forward
            and forward.args[:1] == (module,))


def _active(module) -> bool:
    mark = module.__dict__.get(_MARK)
    return mark is not None and mark["on"]


def patch_qwen3_next(model: torch.nn.Module) -> int:
    """Make every Gated DeltaNet layer of ``model`` (a transformers Qwen3-Next-family model, or one such
    layer) run ``lintrans.ops.delta_rule``; returns how many layers it patched (already patched ones
    count, and stay as they are). Raises ValueError when ``model`` has none. ``unpatch_qwen3_next`` undoes
    it. Other models of the same class are not affected, also when they run at the same time in other
    threads."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    count = 0
    for module in model.modules():
        if not _is_gated_deltanet(module):
            continue
        count += 1
        mark = module.__dict__.get(_MARK)
        if mark is not None:  # patched, or unpatched under a later hook that still calls ours: on again
            mark["on"] = True
            continue
        if all(hasattr(module, name) for name in _ATTRIBUTE_NAMES):  # the layer calls its own attributes
            saved = {name: module.__dict__.get(name) for name in _ATTRIBUTE_NAMES}
            module.chunk_gated_delta_rule = chunk_gated_delta_rule
            module.recurrent_gated_delta_rule = recurrent_gated_delta_rule
            setattr(module, _MARK, {"kind": "attributes", "saved": saved, "on": True})
        else:  # the layer calls module-level functions
            _install_dispatchers(sys.modules[type(module).__module__])
            own = module.__dict__.get("forward")  # kept, called inside ours and restored by unpatch
            setattr(module, _MARK, {"kind": "forward", "own": own, "on": True})
            module.forward = functools.partial(_patched_forward, module)
    if count == 0:
        raise ValueError(f"model ({type(model).__name__}) has no Gated DeltaNet layer (a Qwen3-Next-family "
                         "layer calling torch_chunk_gated_delta_rule) to patch")
    return count


def unpatch_qwen3_next(model: torch.nn.Module) -> int:
    """Undo ``patch_qwen3_next``: the layers call transformers' functions again. Returns how many it
    restored. A forward hook installed on a layer after it was patched (accelerate's, say) stays; ours
    then only calls through it."""
    count = 0
    for module in model.modules():
        mark = module.__dict__.get(_MARK)
        if mark is None or not mark["on"]:
            continue
        count += 1
        if mark["kind"] == "attributes":
            for name, fn in mark["saved"].items():
                if fn is None:
                    delattr(module, name)
                else:
                    setattr(module, name, fn)
        elif not _is_ours(module.__dict__.get("forward"), module):
            mark["on"] = False  # a later hook wraps ours: leave its chain whole
            continue
        elif mark["own"] is None:
            del module.forward
        else:
            module.forward = mark["own"]
        delattr(module, _MARK)
    return count


@contextmanager
def patched_qwen3_next(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``patch_qwen3_next(model)`` inside the block only (layers patched before it stay patched)."""
    before = {id(m) for m in model.modules() if _active(m)}
    patch_qwen3_next(model)
    try:
        yield model
    finally:
        for module in model.modules():
            if id(module) not in before and _active(module):
                unpatch_qwen3_next(module)
