"""Gated (decayed-state) linear attention: every form against the float64 term-by-term reference,
gradients (log_decay included), extreme decays, decoding, and the flash-linear-attention algebra."""
import math

import pytest
import torch

from lintrans.ops import FORMS, linear_attention, linear_attention_reference, linear_attention_step

# (B, T, H, Dk, Dv, chunk): T=1, T not a multiple of the chunk, chunk > T, Dk != Dv, odd D
SHAPES = [
    (1, 1, 1, 4, 4, 4),
    (2, 37, 3, 5, 7, 8),
    (1, 16, 2, 8, 3, 64),
    (1, 9, 1, 3, 2, 1),
]


def rand(B, T, H, Dk, Dv, dtype=torch.float64, requires_grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, T, H, d, dtype=dtype, generator=g).requires_grad_(requires_grad) for d in (Dk, Dk, Dv))


def gates(shape, low=-2.0, dtype=torch.float64, seed=1):
    """log-decays in [low, 0): a mix of near-1 and strong gates."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, dtype=dtype, generator=g) * low


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fixed", [False, True])
def test_forms_equal_reference(form, shape, fixed):
    B, T, H, Dk, Dv, c = shape
    q, k, v = rand(B, T, H, Dk, Dv)
    ld = gates((H,) if fixed else (B, T, H))
    S0, z0 = torch.randn(B, H, Dk, Dv, dtype=torch.float64), torch.rand(B, H, Dk, dtype=torch.float64) + 0.5
    o, (S, z) = linear_attention(q, k, v, form=form, chunk_size=c, log_decay=ld, initial_state=(S0, z0),
                                 output_final_state=True)
    ref, (S_ref, z_ref) = linear_attention_reference(q, k, v, log_decay=ld, initial_state=(S0, z0))
    torch.testing.assert_close(o, ref, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(S, S_ref, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(z, z_ref, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("normalize,feature_map", [(False, "identity"), (True, "based"), (False, "softplus")])
def test_forms_options(form, normalize, feature_map):
    q, k, v = rand(2, 21, 2, 5, 3)
    kw = dict(normalize=normalize, scale=0.4, feature_map=feature_map, log_decay=gates((2, 21, 2)))
    o, _ = linear_attention(q, k, v, form=form, chunk_size=4, **kw)
    torch.testing.assert_close(o, linear_attention_reference(q, k, v, **kw)[0], rtol=1e-9, atol=1e-10)


def test_reference_is_the_recurrence():
    """The reference's term-by-term sums agree with the state recurrence of the definition."""
    B, T, H, D = 1, 6, 2, 3
    q, k, v = rand(B, T, H, D, D)
    ld = gates((B, T, H))
    fq, fk = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    S, z = torch.zeros(B, H, D, D, dtype=torch.float64), torch.zeros(B, H, D, dtype=torch.float64)
    want = []
    for t in range(T):
        g = ld[:, t].exp()
        S = g[..., None, None] * S + fk[:, t, :, :, None] * v[:, t, :, None, :]
        z = g[..., None] * z + fk[:, t]
        want.append(torch.einsum("bhf,bhfe->bhe", fq[:, t], S) / (torch.einsum("bhf,bhf->bh", fq[:, t], z)[..., None] + 1e-6))
    torch.testing.assert_close(linear_attention_reference(q, k, v, log_decay=ld)[0], torch.stack(want, 1))


def test_none_is_the_ungated_op_and_zero_decay_matches_it():
    q, k, v = rand(1, 40, 2, 8, 8, dtype=torch.float32)
    o, st = linear_attention(q, k, v, output_final_state=True)
    o2, st2 = linear_attention(q, k, v, output_final_state=True, log_decay=None)
    assert torch.equal(o, o2) and all(torch.equal(a, b) for a, b in zip(st, st2))
    o3, st3 = linear_attention(q, k, v, output_final_state=True, log_decay=torch.zeros(2))
    torch.testing.assert_close(o3, o)
    torch.testing.assert_close(st3[0], st[0])


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("shape,fixed", [((2, 13, 2, 5, 3, 4), False), ((1, 1, 1, 3, 3, 2), False), ((2, 11, 2, 4, 4, 4), True)])
def test_gradients_equal_reference(form, shape, fixed):
    B, T, H, Dk, Dv, c = shape
    q, k, v = rand(B, T, H, Dk, Dv, requires_grad=True)
    ld = gates((H,) if fixed else (B, T, H)).requires_grad_()
    S0 = torch.randn(B, H, Dk, Dv, dtype=torch.float64, requires_grad=True)
    z0 = (torch.rand(B, H, Dk, dtype=torch.float64) + 0.5).requires_grad_()
    w = torch.randn(B, T, H, Dv, dtype=torch.float64)
    wS = torch.randn(B, H, Dk, Dv, dtype=torch.float64)

    def loss(o, S, z):
        return (o * w).sum() + (S * wS).sum() + z.sum()

    inputs = (q, k, v, ld, S0, z0)
    o, (S, z) = linear_attention(q, k, v, form=form, chunk_size=c, log_decay=ld, initial_state=(S0, z0),
                                 output_final_state=True)
    got = torch.autograd.grad(loss(o, S, z), inputs)
    o, (S, z) = linear_attention_reference(q, k, v, log_decay=ld, initial_state=(S0, z0))
    want = torch.autograd.grad(loss(o, S, z), inputs)
    for name, g, r in zip("q k v log_decay S0 z0".split(), got, want):
        torch.testing.assert_close(g, r, rtol=1e-8, atol=1e-10, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("normalize", [True, False])
def test_gradcheck(form, normalize):
    q, k, v = rand(1, 5, 2, 3, 2, requires_grad=True)
    ld = gates((1, 5, 2)).requires_grad_()

    def fn(q, k, v, ld):
        return linear_attention(q, k, v, form=form, chunk_size=2, feature_map="softplus", normalize=normalize,
                                log_decay=ld)[0]

    assert torch.autograd.gradcheck(fn, (q, k, v, ld))


@pytest.mark.parametrize("form", ["chunked", "attention_blocked", "state_parallel"])
def test_split_into_two_calls_equals_one(form):
    q, k, v = rand(2, 30, 2, 4, 3)
    ld = gates((2, 30, 2))
    o, st = linear_attention(q, k, v, form=form, chunk_size=8, log_decay=ld, output_final_state=True)
    a, st_a = linear_attention(q[:, :13], k[:, :13], v[:, :13], form=form, chunk_size=8, log_decay=ld[:, :13],
                               output_final_state=True)
    b, st_b = linear_attention(q[:, 13:], k[:, 13:], v[:, 13:], form=form, chunk_size=8, log_decay=ld[:, 13:],
                               initial_state=st_a, output_final_state=True)
    torch.testing.assert_close(torch.cat([a, b], 1), o, rtol=1e-10, atol=1e-12)
    for x, y in zip(st_b, st):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)


def test_step_continues_the_sequence():
    B, T, H, D = 2, 12, 3, 4
    q, k, v = rand(B, T, H, D, D)
    for ld in (gates((B, T, H)), gates((H,))):
        o, state = linear_attention(q[:, :7], k[:, :7], v[:, :7], log_decay=ld[:, :7] if ld.dim() == 3 else ld,
                                    output_final_state=True)
        steps = []
        for t in range(7, T):
            step_ld = ld[:, t] if ld.dim() == 3 else ld
            o_t, state = linear_attention_step(q[:, t], k[:, t], v[:, t], state, log_decay=step_ld)
            steps.append(o_t)
        ref, (S, z) = linear_attention_reference(q, k, v, log_decay=ld)
        torch.testing.assert_close(torch.cat([o, torch.stack(steps, 1)], 1), ref)
        torch.testing.assert_close(state[0], S)
        torch.testing.assert_close(state[1], z)


def _exact_at(q, k, v, ld, positions, normalize=True, eps=1e-6):
    """float64 o_i at a few positions straight from the definition (feature map elu + 1)."""
    fq = (torch.nn.functional.elu(q.double()) + 1)[0, :, 0]  # [T,F]
    fk = (torch.nn.functional.elu(k.double()) + 1)[0, :, 0]
    vv, L = v.double()[0, :, 0], ld.double()[0, :, 0].cumsum(0)  # [T,E], [T]
    out = []
    for i in positions:
        w = (fk[: i + 1] @ fq[i]) * (L[i] - L[: i + 1]).exp()  # [i+1]
        num = w @ vv[: i + 1]
        out.append(num / (w.sum() + eps) if normalize else num)
    return torch.stack(out)


@pytest.mark.parametrize("name,ld_value", [("gate near 1", -1e-6), ("cumulative underflow", -0.01),
                                           ("gate that shuts", -50.0)])
def test_chunked_extreme_decays_long_sequence(name, ld_value):
    """T = 65,536 in float32: nothing overflows, no NaN, and sampled outputs match float64."""
    T, D = 65536, 4
    q, k, v = rand(1, T, 1, D, D, dtype=torch.float32)
    ld = torch.full((1, T, 1), ld_value)
    ld[0, ::1000] = -50.0  # a few shut gates in every case
    o, (S, z) = linear_attention(q, k, v, log_decay=ld, chunk_size=64, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(S).all() and torch.isfinite(z).all()
    positions = [0, 1, 63, 64, 999, 1000, 1001, 40000, T - 1]
    torch.testing.assert_close(o[0, positions, 0].double(), _exact_at(q, k, v, ld, positions), rtol=2e-4, atol=2e-5)


def test_chunked_extreme_gradients_match_float64():
    """Gates that shut (head 0) and gates near 1 (head 1) in float32: the gradients, those of q, k, v
    and the log-decays, equal the float64 definition's. float32 sums over T carry errors relative to
    their largest terms, not to each entry (the shut head's log-decay gradient is ~1e-21 in float64,
    ~1e-6 in float32): hence atol relative to each gradient's largest entry."""
    T = 300
    q, k, v = rand(1, T, 2, 5, 3, dtype=torch.float32)
    ld = torch.full((1, T, 2), -50.0)
    ld[..., 1] = -1e-6

    def grads(fn, dtype, **kw):
        xs = [x.to(dtype).requires_grad_() for x in (q, k, v, ld)]
        o, (S, z) = fn(*xs[:3], log_decay=xs[3], **kw)
        return torch.autograd.grad(o.square().sum() + S.sum() + z.sum(), xs)

    got = grads(linear_attention, torch.float32, chunk_size=64, output_final_state=True)
    want = grads(linear_attention_reference, torch.float64)
    for name, a, b in zip(("q", "k", "v", "log_decay"), got, want):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4 * b.abs().max().item(),
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_low_precision_inputs_accumulate_in_float32():
    q, k, v = rand(1, 50, 2, 8, 8, dtype=torch.float32)
    ld = gates((1, 50, 2), dtype=torch.float32)
    for dtype in (torch.bfloat16, torch.float16):
        xs = [x.to(dtype) for x in (q, k, v, ld)]
        # the float64 reference on the same rounded inputs: what is left is the output's own rounding,
        # which a low-precision accumulation would exceed
        ref = linear_attention_reference(*(x.double() for x in xs[:3]), log_decay=xs[3].double())[0]
        o, (S, z) = linear_attention(*xs[:3], log_decay=xs[3], chunk_size=16, output_final_state=True)
        assert o.dtype == dtype and S.dtype == torch.float32
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(o.double(), ref, rtol=2 * eps, atol=2 * eps * ref.abs().max().item())


@pytest.mark.parametrize("ld, match", [
    (torch.full((1, 8, 2), 0.1), "finite and <= 0"),
    (torch.tensor([0.0, float("nan")]), "finite and <= 0"),
    (torch.tensor([0.0, float("-inf")]), "finite and <= 0"),
    (torch.zeros(1, 8, 3), r"shape \[1, 8, 2\] or \[2\]"),
    (torch.zeros(8, 2), r"shape"),
    (torch.zeros(1, 8, 2, dtype=torch.int64), "floating"),
    ([0.0, 0.0], "torch.Tensor"),
])
def test_bad_log_decay(ld, match):
    q, k, v = rand(1, 8, 2, 4, 4)
    with pytest.raises((ValueError, TypeError), match=match):
        linear_attention(q, k, v, log_decay=ld)


def test_bad_log_decay_step():
    q, k, v = (torch.randn(1, 2, 4) for _ in range(3))
    with pytest.raises(ValueError, match=r"shape \[1, 2\] or \[2\]"):
        linear_attention_step(q, k, v, log_decay=torch.zeros(1, 1, 2))
    with pytest.raises(ValueError, match="<= 0"):
        linear_attention_step(q, k, v, log_decay=torch.ones(2))


# --- the same computation as flash-linear-attention's simple_gla / retention -------------------
# Their naive recurrence (fla.ops.simple_gla.naive, fla.ops.retention.naive), written out here from
# its definition: q scaled by 1/sqrt(D), S_t = exp(g_t) S_{t-1} + k_t v_t^T, o_t = q_t^T S_t.


def _fla_style_recurrence(q, k, v, g):
    B, T, H, D = q.shape
    scale = D ** -0.5
    S = torch.zeros(B, H, D, v.shape[-1], dtype=q.dtype)
    out = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        out.append(torch.einsum("bhd,bhde->bhe", q[:, t] * scale, S))
    return torch.stack(out, 1), S


def test_equals_simple_gla_recurrence():
    q, k, v = rand(2, 33, 3, 8, 5)
    g = gates((2, 33, 3))
    want, S_want = _fla_style_recurrence(q, k, v, g)
    o, (S, _) = linear_attention(q, k, v, feature_map="identity", normalize=False, scale=8 ** -0.5, log_decay=g,
                                 chunk_size=16, output_final_state=True)
    torch.testing.assert_close(o, want)
    torch.testing.assert_close(S, S_want)


def test_equals_retention_recurrence():
    H = 4
    q, k, v = rand(1, 29, H, 8, 8)
    log_gamma = torch.log(1 - 2.0 ** (-5.0 - torch.arange(H, dtype=torch.float64)))  # RetNet's decays
    want, _ = _fla_style_recurrence(q, k, v, log_gamma.expand(1, 29, H))
    o, _ = linear_attention(q, k, v, feature_map="identity", normalize=False, scale=8 ** -0.5, log_decay=log_gamma)
    torch.testing.assert_close(o, want)
    assert math.isclose(log_gamma[0].exp().item(), 1 - 1 / 32)
