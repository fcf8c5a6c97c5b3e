"""Every form of causal linear attention against the plain float64 reference."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from lintrans.ops import FORMS, linear_attention, linear_attention_reference, linear_attention_step

# (B, T, H, Dk, Dv, chunk): T=1, T not a multiple of the chunk, chunk > T, Dk != Dv, odd D, B and H > 1
SHAPES = [
    (1, 1, 1, 4, 4, 4),
    (2, 37, 3, 5, 7, 8),
    (1, 16, 2, 8, 3, 64),
    (2, 64, 2, 6, 6, 16),
    (1, 9, 1, 3, 2, 1),
]
MAPS = ["elu", "relu", "softplus", "based"]


def rand(B, T, H, Dk, Dv, dtype=torch.float64, requires_grad=False):
    q, k, v = (torch.randn(B, T, H, d, dtype=dtype, requires_grad=requires_grad) for d in (Dk, Dk, Dv))
    return q, k, v


def rand_state(B, H, F, Dv, dtype=torch.float64):
    return torch.randn(B, H, F, Dv, dtype=dtype), torch.rand(B, H, F, dtype=dtype) + 0.5


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("feature_map", MAPS)
def test_forms_equal_reference(form, shape, feature_map):
    B, T, H, Dk, Dv, c = shape
    q, k, v = rand(B, T, H, Dk, Dv)
    o, (S, z) = linear_attention(q, k, v, form=form, chunk_size=c, feature_map=feature_map, output_final_state=True)
    ref, (S_ref, z_ref) = linear_attention_reference(q, k, v, feature_map=feature_map)
    assert o.shape == (B, T, H, Dv) and o.dtype == torch.float64
    torch.testing.assert_close(o, ref, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(S, S_ref, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(z, z_ref, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("normalize,scale,feature_map", [(False, 1.0, "identity"), (True, 0.3, "elu"), (False, 2.0, "softplus")])
def test_forms_options(form, normalize, scale, feature_map):
    q, k, v = rand(2, 21, 2, 5, 3)
    kw = dict(normalize=normalize, scale=scale, feature_map=feature_map)
    o, _ = linear_attention(q, k, v, form=form, chunk_size=4, **kw)
    ref, _ = linear_attention_reference(q, k, v, **kw)
    torch.testing.assert_close(o, ref, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("shape", [(2, 13, 2, 5, 3, 4), (1, 1, 1, 3, 3, 2)])
def test_gradients_equal_reference(form, shape):
    B, T, H, Dk, Dv, c = shape
    q, k, v = rand(B, T, H, Dk, Dv, requires_grad=True)
    S0, z0 = rand_state(B, H, Dk, Dv)
    S0.requires_grad_(True)
    z0.requires_grad_(True)
    w = torch.randn(B, T, H, Dv, dtype=torch.float64)
    wS = torch.randn(B, H, Dk, Dv, dtype=torch.float64)

    def loss(fn):
        o, (S, z) = fn()
        return (o * w).sum() + (S * wS).sum() + z.sum()

    got = torch.autograd.grad(
        loss(lambda: linear_attention(q, k, v, form=form, chunk_size=c, initial_state=(S0, z0), output_final_state=True)),
        (q, k, v, S0, z0),
    )
    want = torch.autograd.grad(loss(lambda: linear_attention_reference(q, k, v, initial_state=(S0, z0))), (q, k, v, S0, z0))
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("form", list(FORMS))
def test_gradcheck(form):
    q, k, v = rand(1, 5, 2, 3, 2, requires_grad=True)
    fn = lambda q, k, v: linear_attention(q, k, v, form=form, chunk_size=2, feature_map="softplus")[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("form", list(FORMS))
def test_split_with_state_equals_one_call(form):
    q, k, v = rand(2, 29, 3, 4, 5)
    whole, (S, z) = linear_attention(q, k, v, form=form, chunk_size=8, output_final_state=True)
    a, st1 = linear_attention(q[:, :11], k[:, :11], v[:, :11], form=form, chunk_size=8, output_final_state=True)
    b, st2 = linear_attention(q[:, 11:], k[:, 11:], v[:, 11:], form=form, chunk_size=8, initial_state=st1, output_final_state=True)
    torch.testing.assert_close(torch.cat([a, b], 1), whole, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(st2[0], S, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(st2[1], z, rtol=1e-10, atol=1e-12)


def test_state_is_none_unless_asked():
    q, k, v = rand(1, 4, 1, 2, 2)
    assert linear_attention(q, k, v)[1] is None


@pytest.mark.parametrize("feature_map", ["elu", "based"])
def test_step_equals_full_forward(feature_map):
    q, k, v = rand(2, 17, 3, 5, 4)
    full, (S, z) = linear_attention(q, k, v, feature_map=feature_map, output_final_state=True)
    state = None
    for t in range(17):
        o, state = linear_attention_step(q[:, t], k[:, t], v[:, t], state, feature_map=feature_map)
        torch.testing.assert_close(o, full[:, t], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(state[0], S)
    torch.testing.assert_close(state[1], z)


def test_step_continues_a_prefill_state_and_keeps_its_size():
    q, k, v = rand(1, 40, 2, 4, 4, dtype=torch.float32)
    _, state = linear_attention(q[:, :30], k[:, :30], v[:, :30], output_final_state=True)
    sizes = {tuple(x.shape) for x in state}
    for t in range(30, 40):
        o, state = linear_attention_step(q[:, t], k[:, t], v[:, t], state)
        assert {tuple(x.shape) for x in state} == sizes and state[0].dtype == torch.float32
    full, _ = linear_attention(q, k, v)
    torch.testing.assert_close(o, full[:, -1], rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(
    B=st.integers(1, 2), T=st.integers(1, 40), H=st.integers(1, 3), Dk=st.integers(1, 9), Dv=st.integers(1, 9),
    chunk=st.integers(1, 48), form=st.sampled_from(["chunked", "attention_blocked", "state_parallel"]),
)
def test_property_random_shapes(B, T, H, Dk, Dv, chunk, form):
    q, k, v = rand(B, T, H, Dk, Dv)
    o, (S, z) = linear_attention(q, k, v, form=form, chunk_size=chunk, output_final_state=True)
    ref, (S_ref, z_ref) = linear_attention_reference(q, k, v)
    torch.testing.assert_close(o, ref, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(S, S_ref, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 3e-2), (torch.float16, 4e-3)])
@pytest.mark.parametrize("form", ["chunked", "attention", "state_loop"])
def test_half_precision_keeps_float32_state(dtype, tol, form):
    q, k, v = rand(2, 70, 2, 16, 8, dtype=torch.float32)
    o32, st32 = linear_attention(q, k, v, form=form, chunk_size=16, output_final_state=True)
    o, st = linear_attention(q.to(dtype), k.to(dtype), v.to(dtype), form=form, chunk_size=16, output_final_state=True)
    assert o.dtype == dtype and st[0].dtype == torch.float32 and st[1].dtype == torch.float32
    # the only error left is rounding the inputs and the output to 16 bits
    assert (o.float() - o32).abs().max().item() < tol
    rel = ((st[0] - st32[0]).abs().max() / st32[0].abs().max()).item()
    assert rel < tol


@pytest.mark.parametrize("feature_map", ["elu", "relu", "based"])
def test_half_precision_inputs_give_every_form_and_the_step_the_same_state(feature_map):
    """A chunked prompt continued by steps: every form and the step apply a named feature map in the
    state dtype (float32), so from the same 16-bit values they agree to float32 rounding, not bf16's."""
    q, k, v = (x.to(torch.bfloat16) for x in rand(1, 40, 2, 8, 4, dtype=torch.float32))
    _, (S64, z64) = linear_attention(q.double(), k.double(), v.double(), feature_map=feature_map,
                                     output_final_state=True)
    states = {form: linear_attention(q, k, v, form=form, feature_map=feature_map, chunk_size=16,
                                     output_final_state=True)[1] for form in FORMS}
    state = None
    for t in range(q.shape[1]):
        _, state = linear_attention_step(q[:, t], k[:, t], v[:, t], state, feature_map=feature_map)
    states["step"] = state
    for name, (S, z) in states.items():
        rel = ((S.double() - S64).abs().max() / S64.abs().max()).item()
        assert rel < 1e-5, (name, rel)


def _bad(match, exc=ValueError, **overrides):
    q, k, v = rand(1, 8, 2, 4, 4, dtype=torch.float32)
    args = dict(q=q, k=k, v=v)
    args.update({key: val for key, val in overrides.items() if key in ("q", "k", "v")})
    kw = {key: val for key, val in overrides.items() if key not in ("q", "k", "v")}
    with pytest.raises(exc, match=match):
        linear_attention(args["q"], args["k"], args["v"], **kw)


def test_bad_input_errors_name_the_argument():
    _bad(r"q must have 4 dimensions", q=torch.randn(8, 2, 4))
    _bad(r"q and k must have the same shape", k=torch.randn(1, 9, 2, 4))
    _bad(r"v must match q", v=torch.randn(1, 8, 3, 4))
    _bad(r"v must match q", v=torch.randn(2, 8, 2, 4))
    _bad(r"form must be one of", form="flash")
    _bad(r"feature_map must be one of", feature_map="cosine")
    _bad(r"feature_map must be a name", exc=TypeError, feature_map=3)
    _bad(r"chunk_size must be an int >= 1", chunk_size=0)
    _bad(r"chunk_size must be an int >= 1", exc=TypeError, chunk_size=2.5)
    _bad(r"output_final_state must be a bool", exc=TypeError, output_final_state="yes")
    _bad(r"q must be a floating tensor", exc=TypeError, q=torch.ones(1, 8, 2, 4, dtype=torch.long))
    _bad(r"q, k and v must share one dtype", exc=TypeError, v=torch.randn(1, 8, 2, 4, dtype=torch.float64))
    _bad(r"T must be at least 1", q=torch.randn(1, 0, 2, 4), k=torch.randn(1, 0, 2, 4), v=torch.randn(1, 0, 2, 4))
    _bad(r"eps must be", eps=-1.0)
    _bad(r"normalize must be a bool", exc=TypeError, normalize=1)
    good = (torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4))
    _bad(r"initial_state S must have shape \[1, 2, 4, 4\]", initial_state=(torch.zeros(1, 2, 4, 5), good[1]))
    _bad(r"initial_state z must have shape", initial_state=(good[0], torch.zeros(1, 2)))
    _bad(r"initial_state S must be torch.float32", exc=TypeError, initial_state=(good[0].half(), good[1]))
    _bad(r"initial_state must be a pair", exc=TypeError, initial_state=good[0])


def test_step_bad_input():
    q = torch.randn(1, 2, 4)
    with pytest.raises(ValueError, match=r"q must have 3 dimensions \[B, H, D\]"):
        linear_attention_step(q[None], q[None], q[None], None)
    with pytest.raises(ValueError, match="state S must have shape"):
        linear_attention_step(q, q, q, (torch.zeros(1, 2, 4, 3), torch.zeros(1, 2, 4)))
