"""``linear_attention_reference``: the definition in float64, term by term, for the tests."""
from __future__ import annotations

from typing import Tuple

import torch

from ..feature_maps import resolve_feature_map
from .checks import State


def linear_attention_reference(
    q, k, v, *, feature_map="elu", normalize=True, scale=1.0, eps=1e-6, initial_state=None, log_decay=None
) -> Tuple[torch.Tensor, State]:
    """Plain float64 definition, term by term, for tests: (o, (S, z)). Slow; small inputs only.

    With ``log_decay`` ([B, T, H] or [H]) key j's score at query i is multiplied by the product of
    the gates g_{j+1} .. g_i, and the initial state by g_1 .. g_i.
    """
    phi_q, phi_k = resolve_feature_map(feature_map)
    fq = phi_q(q).double() * scale
    fk = phi_k(k).double()
    v = v.double()
    B, T, H, Fd = fq.shape
    Dv = v.shape[-1]
    g = torch.ones(B, T, H, dtype=torch.float64)
    if log_decay is not None:
        g = g * log_decay.double().exp()  # [B,T,H]; an [H] decay broadcasts
    if initial_state is None:
        S0 = torch.zeros(B, H, Fd, Dv, dtype=torch.float64)
        z0 = torch.zeros(B, H, Fd, dtype=torch.float64)
    else:
        S0, z0 = (x.double() for x in initial_state)
    o = torch.zeros(B, T, H, Dv, dtype=torch.float64)
    for i in range(T):
        gate = torch.ones(B, H, dtype=torch.float64)  # prod_{t=j+1..i} g_t, built as j goes down
        num = torch.zeros(B, H, Dv, dtype=torch.float64)
        den = torch.zeros(B, H, dtype=torch.float64)
        for j in range(i, -1, -1):
            s = (fq[:, i] * fk[:, j]).sum(-1) * gate  # [B,H]
            num = num + s[..., None] * v[:, j]
            den = den + s
            gate = gate * g[:, j]
        num = num + gate[..., None] * torch.einsum("bhf,bhfe->bhe", fq[:, i], S0)  # gate = prod_{t<=i} g_t
        den = den + gate * torch.einsum("bhf,bhf->bh", fq[:, i], z0)
        o[:, i] = num / (den[..., None] + eps) if normalize else num
    S, z = S0, z0
    for t in range(T):
        S = g[:, t, :, None, None] * S + torch.einsum("bhf,bhe->bhfe", fk[:, t], v[:, t])
        z = g[:, t, :, None] * z + fk[:, t]
    return o, (S, z)
