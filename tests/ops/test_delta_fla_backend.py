"""``delta_rule(..., backend="fla")``: the clear errors where it cannot run, and our side of the dispatch
(layout, dtypes, scale, the gate, states, gradients) against the torch backend with a stand-in for fla's
``chunk_gated_delta_rule`` written from its documented recurrence. The real kernel against ours on CUDA
is in test_delta_cuda.py."""
import sys

import pytest
import torch

from lintrans.ops import delta_rule, fla_backend


def _inputs(B, T, H, Dk, Dv, gate, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, Dk, generator=g) for _ in range(2))
    v = torch.randn(B, T, H, Dv, generator=g)
    beta = 1.5 * torch.rand(B, T, H, generator=g)
    ld = {None: None, "token": -torch.rand(B, T, H, generator=g), "fixed": -torch.rand(H, generator=g)}[gate]
    S0 = torch.randn(B, H, Dk, Dv, generator=g) * 0.5
    return [x if x is None else x.to(dtype) for x in (q, k, v, beta, ld)] + [S0]


@pytest.mark.parametrize("gate", [None, "token", "fixed"])
@pytest.mark.parametrize("T", [1, 7])
@pytest.mark.parametrize("l2, scale", [(True, None), (False, 0.3)])
@pytest.mark.parametrize("with_state", [True, False])
def test_dispatch_equals_the_torch_backend(stand_in_fla_delta, gate, T, l2, scale, with_state):
    """Outputs, final states and the gradients of q, k, v, beta, log_decay (a fixed [H] one too) and the
    state; Dk = 3 != Dv = 5."""
    tensors = _inputs(2, T, 2, 3, 5, gate)
    if not l2:  # keys of norm 0.9: the update's eigenvalue 1 - beta |k|^2 stays in (-1, 1), a stable recurrence
        tensors[1] = 0.9 * tensors[1] / tensors[1].norm(dim=-1, keepdim=True)
    if not with_state:
        tensors[-1] = None
    results = {}
    for backend in ("torch", "fla"):
        leaves = [None if t is None else t.clone().requires_grad_() for t in tensors]
        q, k, v, beta, ld, S0 = leaves
        o, S = delta_rule(q, k, v, beta, log_decay=ld, scale=scale, l2_normalize=l2, initial_state=S0,
                          output_final_state=True, backend=backend)
        (o.square().sum() + (S * S.detach().sin()).sum()).backward()
        results[backend] = [o, S] + [t.grad for t in leaves if t is not None]
    for a, b in zip(results["fla"], results["torch"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    (g_shape, g_dtype, dtypes, l2_sent, scale_sent), = stand_in_fla_delta
    assert g_shape == (2, T, 2) and g_dtype == torch.float32 and dtypes == {torch.float32}
    assert l2_sent is l2 and scale_sent == (3 ** -0.5 if scale is None else scale)


def test_sixteen_bit_inputs_go_to_fla_in_float32(stand_in_fla_delta):
    q, k, v, beta, ld, S0 = _inputs(1, 5, 2, 4, 4, "token", dtype=torch.bfloat16)
    o, S = delta_rule(q, k, v, beta, log_decay=ld, initial_state=S0, output_final_state=True, backend="fla")
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    assert stand_in_fla_delta[0][1] == torch.float32 and stand_in_fla_delta[0][2] == {torch.float32}
    o_t, S_t = delta_rule(q, k, v, beta, log_decay=ld, initial_state=S0, output_final_state=True)
    torch.testing.assert_close(o, o_t, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(S, S_t, rtol=1e-5, atol=1e-5)


def test_no_final_state_unless_asked(stand_in_fla_delta):
    q, k, v, beta, _, _ = _inputs(1, 3, 1, 2, 2, None)
    assert delta_rule(q, k, v, beta, backend="fla")[1] is None


def test_clear_errors_where_it_cannot_run(monkeypatch):
    q, k, v, beta, _, _ = _inputs(1, 3, 1, 2, 2, None)
    with pytest.raises(ValueError, match="backend must be 'torch' or 'fla', got 'triton'"):
        delta_rule(q, k, v, beta, backend="triton")
    with pytest.raises(ValueError, match="runs on CUDA tensors only"):
        delta_rule(q, k, v, beta, backend="fla")
    monkeypatch.setattr(fla_backend, "DEVICES", frozenset({"cpu"}))
    with pytest.raises(ValueError, match="computes the chunked form only"):
        delta_rule(q, k, v, beta, form="recurrent", backend="fla")
    with pytest.raises(ValueError, match="does not take float64"):
        delta_rule(q.double(), k.double(), v.double(), beta.double(), backend="fla")
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", None)  # import fails
    with pytest.raises(ValueError, match="needs flash-linear-attention"):
        delta_rule(q, k, v, beta, backend="fla")
