"""delta_rule against its peers: transformers' pure-PyTorch Gated DeltaNet (``torch_chunk_gated_delta_rule``
and ``torch_recurrent_gated_delta_rule``, the CPU fallback of Qwen3-Next) and flash-linear-attention's
``naive_recurrent_gated_delta_rule`` where ``fla`` imports. Outputs, final states and gradients.

The peers compute in float32 whatever their inputs; ours runs in float64 on the same float32 values, so
the tolerances are float32 ones, scaled by each quantity's size."""
import pytest
import torch

from lintrans.ops import delta_rule
from lintrans.ops.delta.reference import l2_normalized

qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

F64 = torch.float64


def gen(seed):
    return torch.Generator().manual_seed(seed)


def case(B, T, H, Dk, Dv, *, beta_hi=1.0, gate="token", seed=0):
    """float32 q, k, v [B, T, H, D], beta [B, T, H], log-decays g [B, T, H] (a fixed [H] one expanded: the
    peers take only per-token gates) and a state [B, H, Dk, Dv]."""
    g = gen(seed)
    q, k = (torch.randn(B, T, H, Dk, generator=g) for _ in range(2))
    v = torch.randn(B, T, H, Dv, generator=g)
    beta = torch.rand(B, T, H, generator=g) * beta_hi
    if gate == "none":
        ld = torch.zeros(B, T, H)
    elif gate == "fixed":
        ld = -torch.rand(H, generator=g)
    else:
        ld = -2 * torch.rand(B, T, H, generator=g)
    S0 = torch.randn(B, H, Dk, Dv, generator=g)
    return q, k, v, beta, ld, S0


def ours(q, k, v, beta, ld, S0, *, form, chunk=64, l2=True, gate="token"):
    """Our op in float64 on the float32 values (no gate: log_decay None, the peers' g = 0)."""
    o, S = delta_rule(q.double(), k.double(), v.double(), beta.double(),
                      log_decay=None if gate == "none" else ld.double(), form=form, chunk_size=chunk,
                      l2_normalize=l2, initial_state=S0.double(), output_final_state=True)
    return o, S


def peer_g(ld, B, T, H):
    return ld.expand(B, T, H) if ld.dim() == 1 else ld


def assert_close(x, y, rel, what):
    err = (x.double() - y.double()).abs().max().item()
    tol = rel * max(1.0, y.abs().max().item())
    assert err <= tol, f"{what}: max abs error {err:.3g} > {tol:.3g}"


SHAPES = [  # (B, T, H, Dk, Dv, chunk): T=1, T not a multiple of the chunk, Dk != Dv, chunk > T
    (1, 1, 2, 8, 8, 64),
    (2, 100, 2, 16, 12, 32),
    (1, 37, 3, 6, 10, 16),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("gate", ["none", "token", "fixed"])
@pytest.mark.parametrize("peer", ["chunk", "recurrent"])
def test_transformers_outputs_and_states(shape, gate, peer):
    B, T, H, Dk, Dv, c = shape
    q, k, v, beta, ld, S0 = case(B, T, H, Dk, Dv, beta_hi=2.0, gate=gate)
    g = peer_g(ld, B, T, H)
    if peer == "chunk":
        o_p, S_p = qwen3_next.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, chunk_size=c, initial_state=S0,
                                                           output_final_state=True, use_qk_l2norm_in_kernel=True)
    else:
        o_p, S_p = qwen3_next.torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=S0,
                                                               output_final_state=True, use_qk_l2norm_in_kernel=True)
    for form in ("chunked", "recurrent"):
        o, S = ours(q, k, v, beta, ld, S0, form=form, chunk=c, gate=gate)
        assert o.shape == o_p.shape and S.shape == S_p.shape
        assert_close(o_p, o, 2e-5, f"o ({form} vs {peer})")
        assert_close(S_p, S, 2e-5, f"S ({form} vs {peer})")


def test_transformers_without_l2_normalisation():
    B, T, H, D = 1, 50, 2, 8
    q, k, v, beta, ld, S0 = case(B, T, H, D, D)
    k = k / (k.norm(dim=-1, keepdim=True) * 1.1)  # beta |k|^2 <= 1: bounded without normalisation
    o_p, S_p = qwen3_next.torch_chunk_gated_delta_rule(q, k, v, g=ld, beta=beta, chunk_size=16, initial_state=S0,
                                                       output_final_state=True, use_qk_l2norm_in_kernel=False)
    o, S = ours(q, k, v, beta, ld, S0, form="chunked", chunk=16, l2=False)
    assert_close(o_p, o, 2e-5, "o")
    assert_close(S_p, S, 2e-5, "S")


@pytest.mark.parametrize("gate", ["token", "none"])
@pytest.mark.parametrize("peer", ["chunk", "recurrent"])
def test_transformers_gradients(gate, peer):
    B, T, H, Dk, Dv, c = 2, 45, 2, 8, 6, 16
    base = case(B, T, H, Dk, Dv, beta_hi=1.5, gate=gate)
    theirs_in = [x.clone().requires_grad_() for x in base]
    ours_in = [x.double().requires_grad_() for x in base]
    q, k, v, beta, ld, S0 = theirs_in
    kw = dict(g=ld, beta=beta, initial_state=S0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    if peer == "chunk":
        o_p, S_p = qwen3_next.torch_chunk_gated_delta_rule(q, k, v, chunk_size=c, **kw)
    else:
        o_p, S_p = qwen3_next.torch_recurrent_gated_delta_rule(q, k, v, **kw)
    wo = torch.randn(o_p.shape, generator=gen(5))
    wS = torch.randn(S_p.shape, generator=gen(6))
    grads_p = torch.autograd.grad((o_p * wo).sum() + (S_p * wS).sum(),
                                  theirs_in if gate != "none" else theirs_in[:4] + theirs_in[5:])
    q, k, v, beta, ld, S0 = ours_in
    o, S = delta_rule(q, k, v, beta, log_decay=None if gate == "none" else ld, chunk_size=c, initial_state=S0,
                      output_final_state=True)
    grads = torch.autograd.grad((o * wo.double()).sum() + (S * wS.double()).sum(),
                                ours_in if gate != "none" else ours_in[:4] + ours_in[5:])
    names = ["q", "k", "v", "beta"] + (["log_decay"] if gate != "none" else []) + ["initial_state"]
    for name, a, b in zip(names, grads_p, grads):
        assert b.abs().max() > 1e-3, name  # not trivially zero
        assert_close(a, b, 1e-4, f"d{name}")


def _naive_fla():
    try:
        from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    except Exception as e:  # fla imports triton; on a CPU-only machine it is usually absent
        pytest.skip(f"flash-linear-attention is not importable here ({type(e).__name__}: {e})")
    return naive_recurrent_gated_delta_rule


@pytest.mark.parametrize("gate", ["none", "token"])
def test_fla_naive_recurrent(gate):
    """fla's reference takes q, k as they are (normalise them first) and the scale."""
    naive = _naive_fla()
    B, T, H, Dk, Dv = 2, 40, 2, 8, 6
    base = case(B, T, H, Dk, Dv, beta_hi=2.0, gate=gate)
    q, k, v, beta, ld, S0 = [x.clone().requires_grad_() for x in base]
    o_p, S_p = naive(l2_normalized(q), l2_normalized(k), v, beta, ld, scale=Dk ** -0.5, initial_state=S0,
                     output_final_state=True)
    ours_in = [x.double().requires_grad_() for x in base]
    qd, kd, vd, bd, ldd, S0d = ours_in
    o, S = delta_rule(qd, kd, vd, bd, log_decay=None if gate == "none" else ldd, chunk_size=16, initial_state=S0d,
                      output_final_state=True)
    assert_close(o_p, o, 2e-5, "o")
    assert_close(S_p, S, 2e-5, "S")
    wo, wS = torch.randn(o.shape, generator=gen(5)), torch.randn(S.shape, generator=gen(6))
    grads_p = torch.autograd.grad((o_p * wo).sum() + (S_p * wS).sum(), (q, k, v, beta, S0))
    grads = torch.autograd.grad((o * wo.double()).sum() + (S * wS.double()).sum(), (qd, kd, vd, bd, S0d))
    for name, a, b in zip(["q", "k", "v", "beta", "initial_state"], grads_p, grads):
        assert_close(a, b, 1e-4, f"d{name}")
