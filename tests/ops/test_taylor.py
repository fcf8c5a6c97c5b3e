"""Taylor attention: equals the `based` map at order 2 and approaches softmax as the order grows."""
import math

import pytest
import torch

from lintrans.ops import linear_attention, softmax_attention_reference
from lintrans.ops.taylor import taylor_attention, taylor_polynomial


def rand(B, T, H, Dk, Dv, dtype=torch.float64):
    return tuple(torch.randn(B, T, H, d, dtype=dtype) for d in (Dk, Dk, Dv))


def taylor_reference(q, k, v, order, causal, scale):
    """Entry by entry, with math.factorial: the definition, slow."""
    B, T, H, _ = q.shape
    out = torch.zeros(B, T, H, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(T):
                num, den = 0.0, 0.0
                for j in range(i + 1 if causal else T):
                    s = scale * float(q[b, i, h].double() @ k[b, j, h].double())
                    p = sum(s**n / math.factorial(n) for n in range(order + 1))
                    num, den = num + p * v[b, j, h].double(), den + p
                out[b, i, h] = num / den
    return out


@pytest.mark.parametrize("order", [0, 1, 2, 3, 5])
def test_polynomial(order):
    s = torch.linspace(-3, 3, 13, dtype=torch.float64)
    expected = sum(s**n / math.factorial(n) for n in range(order + 1))
    torch.testing.assert_close(taylor_polynomial(s, order), expected, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("order, causal", [(0, True), (2, True), (2, False), (4, True), (3, False)])
@pytest.mark.parametrize("shape", [(1, 1, 1, 3, 2), (2, 5, 2, 5, 3)])
def test_matches_entrywise_definition(order, causal, shape):
    q, k, v = rand(*shape)
    q, k = 0.5 * q, 0.5 * k  # odd orders: keep every row sum positive
    scale = 1.0 / math.sqrt(shape[3])
    o = taylor_attention(q, k, v, order=order, causal=causal)
    torch.testing.assert_close(o, taylor_reference(q, k, v, order, causal, scale), rtol=1e-11, atol=1e-12)
    o2 = taylor_attention(q, k, v, order=order, causal=causal, scale=0.3)
    torch.testing.assert_close(o2, taylor_reference(q, k, v, order, causal, 0.3), rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("form", ["chunked", "state_loop", "attention"])
@pytest.mark.parametrize("shape", [(1, 1, 1, 4, 4), (2, 37, 3, 5, 7), (1, 64, 2, 16, 8), (3, 10, 1, 1, 2)])
def test_based_equals_order_two(form, shape):
    q, k, v = rand(*shape)
    q, k = 2 * q, 2 * k  # large scores: the s^2 term matters
    o, _ = linear_attention(q, k, v, form=form, feature_map="based", chunk_size=16, eps=0.0)
    torch.testing.assert_close(o, taylor_attention(q, k, v, order=2), rtol=1e-10, atol=1e-11)


def test_order_two_differs_from_other_orders():
    q, k, v = rand(2, 12, 2, 4, 4)
    o2 = taylor_attention(q, k, v, order=2)
    for order in (1, 3):
        assert (taylor_attention(q, k, v, order=order) - o2).abs().max() > 1e-3


@pytest.mark.parametrize("causal", [True, False])
def test_error_against_softmax_decreases_with_order(causal):
    q, k, v = rand(2, 24, 2, 8, 8)
    q, k = 0.5 * q, 0.5 * k  # |s| mostly < 1: the series converges fast
    ref = softmax_attention_reference(q, k, v, causal=causal)
    errors = [(taylor_attention(q, k, v, order=m, causal=causal) - ref).abs().max().item() for m in range(7)]
    assert all(b < 0.5 * a for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 1e-3 * errors[0], errors


def test_float32_and_half_inputs():
    q, k, v = rand(1, 9, 2, 6, 5, dtype=torch.float32)
    ref = taylor_attention(q.double(), k.double(), v.double())
    torch.testing.assert_close(taylor_attention(q, k, v).double(), ref, rtol=1e-5, atol=1e-5)
    o16 = taylor_attention(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert o16.dtype == torch.bfloat16
    torch.testing.assert_close(o16.double(), ref, rtol=5e-2, atol=5e-2)


def test_gradients_flow():
    q, k, v = (x.requires_grad_() for x in rand(1, 4, 1, 3, 2))
    assert torch.autograd.gradcheck(lambda q, k, v: taylor_attention(q, k, v, order=3), (q, k, v))


def test_bad_arguments_raise():
    q, k, v = rand(1, 3, 1, 2, 2)
    with pytest.raises(ValueError, match="order must be an int >= 0"):
        taylor_attention(q, k, v, order=-1)
    with pytest.raises(TypeError, match="order must be an int >= 0"):
        taylor_attention(q, k, v, order=2.0)
    with pytest.raises(TypeError, match="causal must be a bool"):
        taylor_attention(q, k, v, causal=1)
    with pytest.raises(TypeError, match="scale must be a number or None"):
        taylor_attention(q, k, v, scale="0.5")
    with pytest.raises(ValueError, match="q and k must have the same shape"):
        taylor_attention(q, k[:, :2], v)
