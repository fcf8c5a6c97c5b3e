"""Argument checks shared by every op: clear errors instead of silent broadcasts."""
from __future__ import annotations

import contextlib
import sys
import threading
import warnings

import torch

from lintrans.checks import check_bool, check_choice, check_number, check_positive_int  # noqa: F401 (the ops import them from here)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Device types whose tensors the host reads for free. Checks of values (``.item()``, ``bool(t)``)
# and choices of path made from values run only there: on an accelerator each read waits for every
# queued kernel (a host sync), so there only shapes, dtypes and devices are checked.
HOST_READ_DEVICES = frozenset({"cpu"})


def reads_values(device: torch.device) -> bool:
    """Whether value checks run for tensors on ``device`` (see ``HOST_READ_DEVICES``)."""
    return device.type in HOST_READ_DEVICES


class _GatesFromLayer(threading.local):
    on = False


_GATES = _GatesFromLayer()


class gates_from_layer:
    """Within it the ops do not read the values of the gates they are given (beta, log_decay), only
    their shapes: for a layer's decoding step, whose gates come from sigmoid and -softplus and are in
    range by construction; per token the read (an aminmax and host comparisons per gate) is a
    noticeable part of a small model's step. Per thread; a class, not a generator: cheaper per token."""

    def __enter__(self):
        self.before, _GATES.on = _GATES.on, True

    def __exit__(self, *exc):
        _GATES.on = self.before


def reads_gate_values(device: torch.device) -> bool:
    """``reads_values``, except inside ``gates_from_layer``."""
    return not _GATES.on and reads_values(device)


_NOTHING = contextlib.nullcontext()  # reusable: a decoding step asks once per layer and token


_AUTOCAST_AVAILABLE: dict = {}  # a plain dict, not lru_cache: torch.compile traces it without a warning


def _has_autocast(kind: str) -> bool:
    if kind not in _AUTOCAST_AVAILABLE:
        _AUTOCAST_AVAILABLE[kind] = torch.amp.is_autocast_available(kind)
    return _AUTOCAST_AVAILABLE[kind]


def autocast_off(device: torch.device):
    """A context with autocast off for ``device``'s type (a no-op where it is off or has none): ops
    that choose their own dtypes (states and normalisers in float32) run in them under a
    mixed-precision training step too, instead of autocast turning their matmuls to 16 bits."""
    kind = device.type
    if _has_autocast(kind) and torch.is_autocast_enabled(kind):
        return torch.autocast(kind, enabled=False)
    return _NOTHING


def check_tensor(name: str, x, ndim: int, layout: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {layout}, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be a floating tensor (float16, bfloat16, float32 or float64), got {x.dtype}"
        )
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions {layout}, got shape {tuple(x.shape)}")


# head counts from here on are rare in real models; below it, short sequences (T < H) are common
# (a few prompt tokens, chunks, tests) and a warning would be noise
HEAD_FIRST_MIN_H = 64


def looks_head_first(T: int, H: int) -> bool:
    """Whether a [B, T, H, D] tensor is more likely a [B, H, T, D] one passed by mistake: fewer
    positions than heads, and more heads than models have."""
    return T < H and H >= HEAD_FIRST_MIN_H


def _called_from_outside() -> bool:
    """Whether the op whose check is running (three frames up) was called from outside lintrans:
    tensors that lintrans builds itself (a layer's heads, an op calling another op) are laid out
    [B, T, H, D] by construction, and the outer op has warned already."""
    caller = sys._getframe(3).f_back
    return caller is None or not caller.f_globals.get("__name__", "").startswith("lintrans.")


def warn_if_head_first(name: str, x: torch.Tensor) -> None:
    """A UserWarning, pointing at the user's call, when the [B, T, H, D] tensor ``x`` looks like a
    [B, H, T, D] one (``looks_head_first``). Call it from the op's own check function."""
    _, T, H, _ = x.shape
    if looks_head_first(T, H) and _called_from_outside():
        stacklevel = 4  # this function, the check, the op, its caller
        warnings.warn(f"{name} has shape {tuple(x.shape)}, read as [B, T, H, D] with T = {T} and H = {H}: more "
                      "heads than positions suggests a [B, H, T, D] tensor; the ops take [B, T, H, D] "
                      f"({name}.transpose(1, 2) converts)", UserWarning, stacklevel=stacklevel)


def check_head_dims(layout: str, **tensors) -> None:
    """Every tensor's last (head) dimension at least 1: an empty head is no attention, and the ops'
    scale (D ** -0.5) and BLAS calls would fail obscurely on it."""
    if any(x.shape[-1] < 1 for x in tensors.values()):
        got = " and ".join(f"{name} {tuple(x.shape)}" for name, x in tensors.items())
        raise ValueError(f"the head dimensions (the last of {layout}) must be at least 1, got {got}")


def check_qkv(q, k, v, *, layout: str = "[B, T, H, D]") -> tuple[int, int, int, int, int]:
    """Validate q, k: [B, T, H, Dk] and v: [B, T, H, Dv]; returns (B, T, H, Dk, Dv)."""
    ndim = layout.count(",") + 1
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x, ndim, layout)
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape {layout}, got {tuple(q.shape)} and {tuple(k.shape)}")
    if v.shape[:-1] != q.shape[:-1]:
        raise ValueError(
            f"v must match q in every dimension but the last ({layout}), "
            f"got q {tuple(q.shape)} and v {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    check_head_dims(layout, q=q, v=v)
    if ndim == 4:
        B, T, H, Dk = q.shape
        if T < 1:
            raise ValueError("sequence length T must be at least 1")
        warn_if_head_first("q", q)
        return B, T, H, Dk, v.shape[-1]
    B, H, Dk = q.shape
    return B, 1, H, Dk, v.shape[-1]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 stays float64, everything else accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def can_write_in_place(ring_k, ring_v, *inputs) -> bool:
    """Whether a decoding step (sliding window, AFT-local/conv) may write into these rings: not where
    autograd saved them or will (a ring that requires grad was saved by earlier steps, whatever the
    grad mode now; inputs that require grad make this step save them), not an inference tensor
    outside inference mode, not a broadcast view (an expanded prompt cache: one memory location
    behind several rows)."""
    rings = (ring_k, ring_v)
    if any(r.requires_grad for r in rings):
        return False
    if torch.is_grad_enabled() and any(x.requires_grad for x in inputs):
        return False
    if not torch.is_inference_mode_enabled() and any(r.is_inference() for r in rings):
        return False
    return all(r.is_contiguous() for r in rings)
