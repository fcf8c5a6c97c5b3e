"""Argument checks and the shared preparation of states, decays and features."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..feature_maps import resolve_feature_map
from ..validation import check_number, compute_dtype, reads_gate_values

State = Tuple[torch.Tensor, torch.Tensor]


def check_state(
    initial_state, B: int, H: int, Fd: int, Dv: int, dtype: torch.dtype, device, arg: str = "initial_state"
) -> State:
    if not (isinstance(initial_state, (tuple, list)) and len(initial_state) == 2):
        raise TypeError(f"{arg} must be a pair (S [B, H, F, Dv], z [B, H, F]) or None")
    S, z = initial_state
    for name, x, shape in ((f"{arg} S", S, (B, H, Fd, Dv)), (f"{arg} z", z, (B, H, Fd))):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)} [B, H, F(, Dv)], got {list(x.shape)}")
        if x.dtype != dtype:
            raise TypeError(
                f"{name} must be {dtype} (states accumulate in float32, or float64 for float64 inputs), got {x.dtype}"
            )
        if x.device != device:
            raise ValueError(f"{name} must be on {device}, got {x.device}")
    return S, z


def featurize(q, k, feature_map, scale):
    phi_q, phi_k = resolve_feature_map(feature_map)
    dtype = compute_dtype(q.dtype)
    if isinstance(feature_map, str):  # as the chunked form applies it: in the state dtype, so that every
        q, k = q.to(dtype), k.to(dtype)  # form and the step agree under 16-bit inputs (modules keep theirs)
    fq, fk = phi_q(q), phi_k(k)
    if fq.shape != fk.shape or fq.shape[:-1] != q.shape[:-1]:
        raise ValueError(
            f"feature_map must map q and k to one shape [..., F], got {tuple(fq.shape)} and {tuple(fk.shape)}"
        )
    fq = fq.to(dtype)
    if scale != 1.0:
        fq = fq * scale
    return fq, fk.to(dtype)


def check_scalars(normalize, scale, eps):
    if not isinstance(normalize, bool):
        raise TypeError(f"normalize must be a bool, got {normalize!r}")
    check_number("scale", scale)
    check_number("eps", eps, low=0)


def check_log_decay(log_decay, B: int, T: Optional[int], H: int, device) -> None:
    """Shapes always; values (finite, <= 0) only on the CPU, where checking them costs no device sync
    (``reads_gate_values``: not inside ``gates_from_layer``)."""
    layout = "[B, T, H] or [H]" if T is not None else "[B, H] or [H]"
    if not isinstance(log_decay, torch.Tensor):
        raise TypeError(f"log_decay must be None or a torch.Tensor {layout}, got {type(log_decay).__name__}")
    if not log_decay.is_floating_point():
        raise TypeError(f"log_decay must be a floating tensor, got {log_decay.dtype}")
    full = (B, T, H) if T is not None else (B, H)
    if tuple(log_decay.shape) not in (full, (H,)):
        raise ValueError(f"log_decay must have shape {list(full)} or [{H}] ({layout}), got {list(log_decay.shape)}")
    if log_decay.device != device:
        raise ValueError(f"log_decay must be on {device} like q, got {log_decay.device}")
    if reads_gate_values(log_decay.device) and log_decay.numel():  # an empty batch has no values to check
        lo, hi = torch.aminmax(log_decay)  # one pass; a NaN makes both NaN
        if not (hi <= 0 and lo > float("-inf")):
            bad = ~(log_decay <= 0) | torch.isinf(log_decay)  # NaN fails <= 0
            raise ValueError(f"log_decay must be finite and <= 0 (decays in (0, 1]), got {log_decay[bad][0].item()}")


def log_decay_head_first(log_decay, B: int, T: int, H: int, dtype) -> torch.Tensor:
    """[B, T, H] -> [B, H, T]; a fixed [H] -> [1, H, T] (broadcast over the batch)."""
    if log_decay.dim() == 1:
        return log_decay.to(dtype)[None, :, None].expand(1, H, T)
    return log_decay.to(dtype).transpose(1, 2)


def resolve_chunk(chunk_size, T: int, Dv: int, Fd: int, dtype, device, gated: bool, form: str = "chunked",
                  kernel: Optional[bool] = None) -> int:
    if chunk_size == "auto":  # measured once per shape class (form, path), then read from the on-disk cache
        from ..chunk_tuning import auto_chunk_size

        return auto_chunk_size(T, Dv, Fd, dtype, device, gated=gated, form=form, kernel=kernel)
    return chunk_size


def state0(initial_state, B: int, H: int, Fd: int, Dv: int, dtype, device) -> torch.Tensor:
    """The state to start from, [B, H, F, Dv + 1]: S with z as its last column."""
    if initial_state is None:
        return torch.zeros(B, H, Fd, Dv + 1, dtype=dtype, device=device)
    S, z = check_state(initial_state, B, H, Fd, Dv, dtype, device)
    return torch.cat([S, z[..., None]], dim=-1)

