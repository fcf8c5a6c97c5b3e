"""The parameter-free feature maps by name, each against its direct float64 definition."""
import math

import pytest
import torch

from lintrans.ops import linear_attention, linear_attention_step
from lintrans.ops.feature_maps import (
    FEATURE_MAPS,
    based,
    based_feature_dim,
    elu_plus_one,
    feature_dim_for,
    resolve_feature_map,
    squared_feature_dim,
    squared_features,
)

# the similarity each named map stands for, written from its definition rather than its features
SIMILARITY = {
    "identity": lambda q, k: q @ k.T,
    "elu": lambda q, k: torch.where(q > 0, q + 1, q.exp()) @ torch.where(k > 0, k + 1, k.exp()).T,
    "relu": lambda q, k: q.clamp_min(0) @ k.clamp_min(0).T,
    "softplus": lambda q, k: torch.log1p(q.exp()) @ torch.log1p(k.exp()).T,
    "based": lambda q, k: 1 + (q @ k.T) / math.sqrt(q.shape[-1]) + (q @ k.T) ** 2 / (2 * q.shape[-1]),
}


def direct_attention(sim, q, k, v, eps):
    """Causal normalised attention from a similarity function of ([T, D], [T, D]) -> [T, T], per (b, h)."""
    B, T, H, _ = q.shape
    out = torch.empty(B, T, H, v.shape[-1], dtype=torch.float64)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for b in range(B):
        for h in range(H):
            a = sim(q[b, :, h].double(), k[b, :, h].double()) * mask  # [T,T]
            out[b, :, h] = a @ v[b, :, h].double() / (a.sum(-1, keepdim=True) + eps)
    return out


def test_every_name_has_a_definition():
    assert set(SIMILARITY) == set(FEATURE_MAPS)


def test_elu_plus_one_values_and_gradients_match_the_definition():
    # the fused map writes exp(min(x, 0)) + max(x, 0): exact where F.elu(x) + 1 cancels (x << 0)
    x = torch.cat([torch.randn(200, dtype=torch.float64) * 4,
                   torch.tensor([0.0, -0.0, -800.0, 1e-300, -1e-300, 50.0], dtype=torch.float64)])
    x.requires_grad_()
    y = elu_plus_one(x)
    torch.testing.assert_close(y, torch.where(x > 0, x + 1, x.exp()), rtol=1e-15, atol=0)
    g = torch.randn_like(x)
    (y * g).sum().backward()
    torch.testing.assert_close(x.grad, g * torch.where(x > 0, 1.0, x.exp()), rtol=1e-15, atol=0)
    with torch.no_grad():  # decoding takes a path without the autograd function: same values, bit for bit
        assert torch.equal(elu_plus_one(x), y)
    xs = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(elu_plus_one, (xs,))
    assert torch.autograd.gradgradcheck(elu_plus_one, (xs,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_elu_plus_one_writes_a_contiguous_copy_of_any_layout(dtype):
    # linear_attention hands it [B,H,T,D] views of [B,T,H,D] and relies on getting [B,H,T,F] memory
    x = torch.randn(2, 9, 3, 5).to(dtype)
    view = x.transpose(1, 2)
    y = elu_plus_one(view)
    assert y.is_contiguous() and y.dtype == dtype and y.shape == view.shape
    x64 = view.double()
    torch.testing.assert_close(y, torch.where(x64 > 0, x64 + 1, x64.exp()).to(dtype))


@pytest.mark.parametrize("d", [1, 2, 5, 8, 16])
def test_based_inner_product_is_second_order_taylor(d):
    q, k = torch.randn(2, 11, d, dtype=torch.float64), torch.randn(2, 11, d, dtype=torch.float64)
    fq, fk = based(q), based(k)
    assert fq.shape == (2, 11, based_feature_dim(d)) == (2, 11, 1 + d + d * (d + 1) // 2)
    s = (q * k).sum(-1) / math.sqrt(d)
    torch.testing.assert_close((fq * fk).sum(-1), 1 + s + s**2 / 2, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("d", [1, 3, 6])
def test_squared_features_give_squared_dot_product(d, symmetric):
    x, y = torch.randn(4, d, dtype=torch.float64), torch.randn(4, d, dtype=torch.float64)
    px, py = squared_features(x, symmetric=symmetric), squared_features(y, symmetric=symmetric)
    assert px.shape[-1] == squared_feature_dim(d, symmetric=symmetric)
    torch.testing.assert_close((px * py).sum(-1), (x * y).sum(-1) ** 2, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("d", [1, 2, 7])
def test_symmetric_squared_features_layout_and_gradients(d):
    """Row-major upper triangle: x_a x_b for a <= b, off-diagonal scaled by sqrt(2); gradients
    through the sliced construction equal those of the explicit product list."""
    x = torch.randn(3, 2, d, dtype=torch.float64, requires_grad=True)
    pairs = [(a, b) for a in range(d) for b in range(a, d)]
    explicit = torch.stack([x[..., a] * x[..., b] * (1.0 if a == b else math.sqrt(2.0)) for a, b in pairs], -1)
    got = squared_features(x)
    torch.testing.assert_close(got, explicit, rtol=1e-14, atol=1e-14)
    w = torch.randn_like(explicit)
    (g,) = torch.autograd.grad((got * w).sum(), x)
    (g_ref,) = torch.autograd.grad((explicit * w).sum(), x)
    torch.testing.assert_close(g, g_ref, rtol=1e-13, atol=1e-13)
    assert squared_features(x.detach().float()).dtype == torch.float32


@pytest.mark.parametrize("name", sorted(FEATURE_MAPS))
@pytest.mark.parametrize("shape", [(1, 1, 1, 4, 4), (2, 9, 3, 5, 3)])  # T=1; odd D, Dk != Dv, B, H > 1
def test_named_map_output_and_gradients_match_definition(name, shape):
    B, T, H, Dk, Dv = shape
    eps = 1e-6
    q, k, v = (torch.randn(B, T, H, d, dtype=torch.float64, requires_grad=True) for d in (Dk, Dk, Dv))
    if name == "identity":  # signed similarities: keep the denominator away from zero
        q, k = (x.detach().abs().requires_grad_() for x in (q, k))
    o, _ = linear_attention(q, k, v, feature_map=name, chunk_size=4, eps=eps)
    ref = direct_attention(SIMILARITY[name], q, k, v, eps)
    torch.testing.assert_close(o, ref, rtol=1e-10, atol=1e-11)
    w = torch.randn_like(ref)
    grads = torch.autograd.grad((o * w).sum(), (q, k, v))
    grads_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-10)
    # float32 inputs stay close to the float64 definition
    o32, _ = linear_attention(q.float(), k.float(), v.float(), feature_map=name, chunk_size=4, eps=eps)
    torch.testing.assert_close(o32.double(), ref.detach(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", sorted(FEATURE_MAPS))
def test_named_map_decode_equals_full_forward(name):
    B, T, H, Dk, Dv = 2, 6, 2, 5, 3
    q, k, v = (torch.randn(B, T, H, d, dtype=torch.float64).abs() for d in (Dk, Dk, Dv))
    o, _ = linear_attention(q, k, v, feature_map=name)
    state = None
    for t in range(T):
        o_t, state = linear_attention_step(q[:, t], k[:, t], v[:, t], state, feature_map=name)
        torch.testing.assert_close(o_t, o[:, t], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "kind, head_dim, n_head, expected",
    [
        ("based", 64, 1, 10),  # F(9) = 55, F(10) = 66: 66 is closer to 64
        ("rebased", 64, 1, 11),  # 10*11/2 = 55, 11*12/2 = 66
        ("rebased_full", 64, 1, 8),  # 8^2 = 64 exactly
        ("rebased_full", 64, 4, 32),  # seed 004: d = 256, h = 4, head 64 -> d-hat 32
        ("rebased", 16, 1, 5),  # 15 beats 21
        ("rebased_full", 12, 1, 3),  # |9 - 12| = 3 < |16 - 12| = 4
        ("rebased_full", 14, 1, 4),  # |9 - 14| = 5 > |16 - 14| = 2
        ("based", 1, 2, 2),  # never below 1 per head
    ],
)
def test_feature_dim_for(kind, head_dim, n_head, expected):
    assert feature_dim_for(kind, head_dim, n_head) == expected


@pytest.mark.parametrize("kind, expanded", [("based", based_feature_dim), ("rebased", squared_feature_dim)])
@pytest.mark.parametrize("head_dim", range(1, 80))
def test_feature_dim_for_is_the_closest(kind, expanded, head_dim):
    p = feature_dim_for(kind, head_dim)
    best = min(abs(expanded(c) - head_dim) for c in range(1, head_dim + 2))
    assert abs(expanded(p) - head_dim) == best
    assert all(abs(expanded(c) - head_dim) > best for c in range(1, p))  # ties go to the smaller p


def test_feature_dim_for_tie_goes_to_smaller():
    # rebased F(p) = 1, 3, 6, ...: head_dim 2 is 1 away from both F(1) and F(2)
    assert feature_dim_for("rebased", 2) == 1
    assert feature_dim_for("rebased_full", 6) == 2  # 4 and 9: |2| < |3|


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="kind must be one of"):
        feature_dim_for("softmax", 64)
    with pytest.raises(ValueError, match="head_dim"):
        feature_dim_for("based", 0)
    with pytest.raises(TypeError, match="n_head"):
        feature_dim_for("based", 64, 2.0)
    with pytest.raises(ValueError, match="feature_map must be one of"):
        resolve_feature_map("cosine")
    with pytest.raises(TypeError, match="feature_map must be a name"):
        resolve_feature_map(3)


def test_based_keeps_input_dtype():
    x = torch.randn(3, 4, dtype=torch.float64)
    assert based(x).dtype == torch.float64
    assert based(x.float()).dtype == torch.float32


def test_feature_dim_for_is_exported_with_the_ops():
    import lintrans.ops

    assert lintrans.ops.feature_dim_for is feature_dim_for and "feature_dim_for" in lintrans.ops.__all__
