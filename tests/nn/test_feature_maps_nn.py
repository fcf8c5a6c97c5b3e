"""ReBased, Hedgehog and Performer modules through linear_attention, against their direct definitions."""
import copy
import math

import pytest
import torch
from torch.func import functional_call

from lintrans.ops import linear_attention, linear_attention_step, softmax_attention_reference
from lintrans.ops.feature_maps import feature_dim_for as ops_feature_dim_for
from lintrans.nn.feature_maps import (
    Hedgehog,
    Performer,
    ReBased,
    attention_weights,
    distill_feature_maps,
    feature_dim_for,
    gaussian_orthogonal_matrix,
    hedgehog_distillation_loss,
    softmax_attention_weights,
)

EPS = 1e-6  # linear_attention's default


# --- direct definitions: the similarity of one query row and one key row, no feature vectors ---


def _per_head(p, module, h):
    return p[h] if module.num_heads is not None else p


def rebased_similarity(mq, mk, h):
    def norm(x, m):
        mu = x.mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(((x - mu) ** 2).mean(-1, keepdim=True) + m.eps)

    def sim(q, k):  # [T, D], [T, D] -> [T, T]
        yq = _per_head(mq.gamma, mq, h) * norm(q, mq) + _per_head(mq.beta, mq, h)
        yk = _per_head(mk.gamma, mk, h) * norm(k, mk) + _per_head(mk.beta, mk, h)
        return (yq @ yk.T) ** 2 / q.shape[-1]

    return sim


def hedgehog_similarity(mq, mk, h):
    # softmax([z, -z]) . softmax([y, -y]) = sum_f cosh(z_f + y_f) / (2 sum_f cosh z_f sum_f cosh y_f)
    def project(x, m):
        z = x @ _per_head(m.weight, m, h).T
        return z + _per_head(m.bias, m, h) if m.bias is not None else z

    def sim(q, k):
        zq, zk = project(q, mq), project(k, mk)  # [T, f]
        num = torch.cosh(zq[:, None, :] + zk[None, :, :]).sum(-1)  # [T, T]
        return num / (2 * torch.cosh(zq).sum(-1)[:, None] * torch.cosh(zk).sum(-1)[None, :])

    return sim


def performer_similarity(m, _m, h):
    def sim(q, k):
        d = q.shape[-1]
        q, k = q * d**-0.25, k * d**-0.25
        w = m.projection.double()  # [m, d]
        expo = (q @ w.T)[:, None, :] + (k @ w.T)[None, :, :]  # [T, T, m]
        expo = expo - (q * q).sum(-1)[:, None, None] / 2 - (k * k).sum(-1)[None, :, None] / 2
        return torch.exp(expo).mean(-1)

    return sim


def direct_attention(similarity, mq, mk, q, k, v, eps=EPS):
    B, T, H, _ = q.shape
    mask = torch.ones(T, T, dtype=torch.float64).tril()
    rows = []
    for b in range(B):
        heads = []
        for h in range(H):
            a = similarity(mq, mk, h)(q[b, :, h].double(), k[b, :, h].double()) * mask  # [T,T]
            heads.append(a @ v[b, :, h].double() / (a.sum(-1, keepdim=True) + eps))
        rows.append(torch.stack(heads, dim=1))  # [T,H,Dv]
    return torch.stack(rows)  # [B,T,H,Dv]


# --- the cases: (name, maker of the (phi_q, phi_k) modules, direct similarity) ---

D, H = 5, 3


def _perturb(*modules):
    """Move the parameters off their initial values so every one of them matters."""
    with torch.no_grad():
        for m in modules:
            for name, p in m.named_parameters():
                p.add_(0.4 * torch.randn_like(p))
    return modules


CASES = {
    "rebased": (lambda: _perturb(ReBased(D), ReBased(D)), rebased_similarity),
    "rebased_full_per_head": (
        lambda: _perturb(ReBased(D, num_heads=H, symmetric=False), ReBased(D, num_heads=H, symmetric=False)),
        rebased_similarity,
    ),
    "hedgehog": (lambda: _perturb(Hedgehog(D, 4), Hedgehog(D, 4)), hedgehog_similarity),
    "hedgehog_per_head_bias": (
        lambda: _perturb(Hedgehog(D, 6, num_heads=H, bias=True), Hedgehog(D, 6, num_heads=H, bias=True)),
        hedgehog_similarity,
    ),
    "hedgehog_shared": (lambda: 2 * _perturb(Hedgehog(D, 7)), hedgehog_similarity),
    "performer": (lambda: 2 * (Performer(D, 16, seed=0),), performer_similarity),
}
SHAPES = [(1, 1, H, D, 2), (2, 9, H, D, 3)]  # T=1; odd D, Dk != Dv, B, H > 1, T not a multiple of the chunk


def _params(mq, mk):
    return list({id(p): p for m in (mq, mk) for p in m.parameters()}.values())


def _feature_map(mq, mk):
    return mq if mq is mk else (mq, mk)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("shape", SHAPES)
def test_output_and_gradients_match_direct_definition(case, shape):
    make, similarity = CASES[case]
    mq, mk = (m.double() for m in make())
    B, T, _, Dk, Dv = shape
    q, k, v = (torch.randn(B, T, H, d, dtype=torch.float64, requires_grad=True) for d in (Dk, Dk, Dv))
    o, _ = linear_attention(q, k, v, feature_map=_feature_map(mq, mk), chunk_size=4)
    ref = direct_attention(similarity, mq, mk, q, k, v)
    assert o.shape == (B, T, H, Dv)
    torch.testing.assert_close(o, ref, rtol=1e-10, atol=1e-11)
    inputs = [q, k, v] + _params(mq, mk)
    w = torch.randn_like(ref)
    grads = torch.autograd.grad((o * w).sum(), inputs)
    grads_ref = torch.autograd.grad((ref * w).sum(), inputs)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-10)
    if T > 1 and case != "performer":
        assert all(g.abs().max() > 0 for g in grads[3:])  # every parameter reaches the output


@pytest.mark.parametrize("case", sorted(CASES))
def test_float32_close_to_float64_definition(case):
    make, similarity = CASES[case]
    mq, mk = make()  # float32 parameters
    q, k, v = (torch.randn(2, 9, H, d) for d in (D, D, 3))
    # eps=0: with eps, a first row whose one similarity is ~eps (ReBased's zero) amplifies rounding
    o, _ = linear_attention(q, k, v, feature_map=_feature_map(mq, mk), chunk_size=4, eps=0.0)
    assert o.dtype == torch.float32
    ref = direct_attention(similarity, copy.deepcopy(mq).double(), copy.deepcopy(mk).double(), q, k, v, eps=0.0)
    torch.testing.assert_close(o.double(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", sorted(CASES))
def test_decode_equals_full_forward(case):
    mq, mk = (m.double() for m in CASES[case][0]())
    fm = _feature_map(mq, mk)
    B, T = 2, 7
    q, k, v = (torch.randn(B, T, H, d, dtype=torch.float64) for d in (D, D, 2))
    o, (S, z) = linear_attention(q, k, v, feature_map=fm, output_final_state=True)
    state = None
    for t in range(T):
        o_t, state = linear_attention_step(q[:, t], k[:, t], v[:, t], state, feature_map=fm)
        torch.testing.assert_close(o_t, o[:, t], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(state[0], S)
    torch.testing.assert_close(state[1], z)


@pytest.mark.parametrize("module", ["rebased", "hedgehog"])
def test_gradcheck(module):
    if module == "rebased":
        mq, mk = (m.double() for m in _perturb(ReBased(3, num_heads=2), ReBased(3, num_heads=2)))
    else:
        mq, mk = (m.double() for m in _perturb(Hedgehog(3, 2, bias=True), Hedgehog(3, 2, bias=True)))
    names = [n for n, _ in mq.named_parameters()]

    def f(q, k, v, *params):
        pq, pk = dict(zip(names, params[: len(names)])), dict(zip(names, params[len(names) :]))
        fm = (lambda x: functional_call(mq, pq, (x,)), lambda x: functional_call(mk, pk, (x,)))
        return linear_attention(q, k, v, feature_map=fm, chunk_size=2)[0]

    q, k, v = (torch.randn(1, 3, 2, d, dtype=torch.float64, requires_grad=True) for d in (3, 3, 2))
    params = [p.detach().clone().requires_grad_() for m in (mq, mk) for p in m.parameters()]
    assert torch.autograd.gradcheck(f, (q, k, v, *params))


def test_rebased_similarity_is_a_squared_affine_dot_product():
    for symmetric in (True, False):
        m = _perturb(ReBased(6, symmetric=symmetric))[0].double()
        x, y = torch.randn(2, 10, 6, dtype=torch.float64)
        fx, fy = m(x), m(y)
        assert fx.shape[-1] == m.feature_dim == (21 if symmetric else 36)
        nx = torch.nn.functional.layer_norm(x, (6,), eps=m.eps) * m.gamma + m.beta
        ny = torch.nn.functional.layer_norm(y, (6,), eps=m.eps) * m.gamma + m.beta
        torch.testing.assert_close((fx * fy).sum(-1), (nx * ny).sum(-1) ** 2 / 6, rtol=1e-12, atol=1e-12)


def test_feature_dim_matches_output():
    x = torch.randn(2, 3, H, D)
    for m in (ReBased(D), ReBased(D, symmetric=False), Hedgehog(D), Hedgehog(D, 9, num_heads=H), Performer(D, 11)):
        assert m(x).shape == (2, 3, H, m.feature_dim)
    assert feature_dim_for is ops_feature_dim_for


def test_hedgehog_starts_as_identity_and_is_a_distribution():
    m = Hedgehog(4, 6)
    assert torch.equal(m.weight, torch.eye(6, 4))
    phi = m(torch.randn(5, 4))
    assert (phi > 0).all()
    torch.testing.assert_close(phi.sum(-1), torch.ones(5))


# --- Performer ---


def test_performer_estimate_is_unbiased():
    d, m, draws = 8, 512, 100
    q, k = 0.5 * torch.randn(2, 6, d, dtype=torch.float64)
    exact = torch.exp((q * k).sum(-1) / math.sqrt(d))  # [6]
    for orthogonal in (True, False):
        p = Performer(d, m, seed=1, orthogonal=orthogonal).double()
        estimates = []
        for _ in range(draws):
            estimates.append((p(q) * p(k)).sum(-1))
            p.redraw()
        est = torch.stack(estimates)  # [draws, 6]
        stderr = est.std(0) / math.sqrt(draws)
        assert (stderr < 0.03 * exact).all()  # precise enough to see a bias
        assert ((est.mean(0) - exact).abs() < 5 * stderr).all(), (est.mean(0), exact)


def test_performer_approximates_softmax_attention():
    q, k, v = (0.5 * torch.randn(2, 16, 2, 8, dtype=torch.float64) for _ in range(3))
    ref = softmax_attention_reference(q, k, v)
    err = {}
    for m in (32, 4096):
        o, _ = linear_attention(q, k, v, feature_map=Performer(8, m, seed=0).double(), eps=0.0)
        err[m] = (o - ref).abs().mean().item()
    assert err[4096] < 0.01 < err[32], err  # many features: close; few: visibly not


def test_performer_blocks_are_orthogonal():
    d, m = 5, 13  # two full blocks and a partial one
    w = Performer(d, m, seed=0).projection.double()
    assert w.shape == (m, d)
    u = w / w.norm(dim=1, keepdim=True)
    for start in range(0, m, d):
        block = u[start : start + d]
        torch.testing.assert_close(block @ block.T, torch.eye(len(block), dtype=torch.float64), atol=1e-6, rtol=0)
    # i.i.d. rows are not orthogonal: the check above can fail
    u = gaussian_orthogonal_matrix(d, d, orthogonal=False, generator=torch.Generator().manual_seed(0))
    u = u / u.norm(dim=1, keepdim=True)
    assert (u @ u.T - torch.eye(d, dtype=torch.float64)).abs().max() > 0.05


def test_performer_row_lengths_are_gaussian():
    w = gaussian_orthogonal_matrix(8192, 8, generator=torch.Generator().manual_seed(0))
    sq = (w * w).sum(1)  # chi-square with 8 degrees of freedom: mean 8, variance 16
    assert abs(sq.mean().item() - 8) < 0.25 and abs(sq.var().item() - 16) < 2.0


def test_performer_seed_redraw_and_state_dict():
    a, b = Performer(6, 10, seed=3), Performer(6, 10, seed=3)
    assert torch.equal(a.projection, b.projection)
    assert not torch.equal(a.projection, Performer(6, 10, seed=4).projection)
    first = a.projection.clone()
    a.redraw()
    assert not torch.equal(a.projection, first)
    b.redraw()
    assert torch.equal(a.projection, b.projection)  # the redraw sequence is reproducible too
    torch.manual_seed(7)
    c = Performer(6, 10)
    torch.manual_seed(7)
    assert torch.equal(c.projection, Performer(6, 10).projection)  # seed=None follows torch's generator
    # the features travel with the state_dict, and with them the count of draws
    assert set(a.state_dict()) == {"projection", "draws"} and int(a.draws) == 2
    fresh = Performer(6, 10, seed=3)
    fresh.load_state_dict(a.state_dict())
    x = torch.randn(4, 6)
    assert torch.equal(fresh(x), a(x))
    assert list(a.parameters()) == []
    # a reloaded module redraws what the uninterrupted one draws next, not an earlier draw again
    a.redraw()
    fresh.redraw()
    assert torch.equal(fresh.projection, a.projection) and not torch.equal(fresh.projection, first)
    # weights saved before draws were counted hold the first draw: they load, counted as one
    old = Performer(6, 10, seed=3)
    old.load_state_dict({"projection": first})
    assert int(old.draws) == 1 and torch.equal(old.projection, first)


def test_performer_draws_load_through_the_checked_gpt_loader():
    """GPT weights saved before Performer counted its draws lack ``draws``: the checked loader accepts them."""
    from lintrans.models import GPT, GPTConfig
    from lintrans.models.hf import load_state_dict_checked

    cfg = GPTConfig(block_size=8, vocab_size=11, n_layer=1, n_head=2, n_embd=8, attention="linear",
                    attention_options={"feature_map": "performer", "feature_map_options": {"num_features": 4}})
    src, dst = GPT(cfg), GPT(cfg)
    state = {k: v for k, v in src.state_dict().items() if not k.endswith(".draws")}
    load_state_dict_checked(dst, state)
    assert torch.equal(dst.transformer.h[0].attn.phi_q.projection, src.transformer.h[0].attn.phi_q.projection)
    with pytest.raises(ValueError, match="missing keys"):
        load_state_dict_checked(dst, {k: v for k, v in state.items() if not k.endswith(".projection")})


@pytest.mark.parametrize("build", ["performer", "taylor", "cosformer"])
def test_float32_maps_stay_float32_under_autocast(build):
    """Under a bf16 autocast step the maps that promise float32 keep it: autocast would turn their
    products to bf16 (errors of 1e-2 where float32 gives 1e-7)."""
    from lintrans.ops.cosformer import cosformer_attention
    from lintrans.ops.taylor import taylor_attention

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 2, 8, generator=g)
    fn = {"performer": Performer(8, 32, seed=0),
          "taylor": lambda x: taylor_attention(x, x.flip(1), x),
          "cosformer": lambda x: cosformer_attention(x.relu(), x.flip(1).relu(), x, causal=False)[0]}[build]
    want = fn(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fn(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_performer_half_inputs_compute_in_float32():
    p = Performer(8, 64, seed=0)
    x = torch.randn(3, 8)
    out = p(x.bfloat16())
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    torch.testing.assert_close(out, p(x.bfloat16().float()))


def test_performer_refuses_a_pair_of_two_modules():
    q = k = v = torch.randn(1, 5, 1, 8)
    one, other = Performer(8, 16, seed=0), Performer(8, 16, seed=1)
    for pair in ((one, other), (one, ReBased(8)), (ReBased(8), one)):
        with pytest.raises(ValueError, match="feature_map: Performer must serve queries and keys as one module"):
            linear_attention(q, k, v, feature_map=pair)
    torch.testing.assert_close(linear_attention(q, k, v, feature_map=(one, one))[0],
                               linear_attention(q, k, v, feature_map=one)[0])  # the same module twice is fine


def test_float32_modules_accept_other_input_dtypes():
    x = torch.randn(2, 3, H, D, dtype=torch.float64)
    for m in (ReBased(D), Hedgehog(D, 4, num_heads=H, bias=True), Performer(D, 8, seed=0)):
        out64 = m(x)
        assert out64.dtype == torch.float64
        out16 = m(x.bfloat16())
        assert out16.dtype == torch.float32
        torch.testing.assert_close(out16.double(), out64, rtol=0.05, atol=0.02)


# --- distillation ---


def test_distillation_loss_is_cross_entropy():
    target = softmax_attention_weights(*torch.randn(2, 1, 5, 2, 4))  # [1,2,5,5]
    entropy = -(target * target.clamp_min(1e-30).log()).sum(-1).mean()
    torch.testing.assert_close(hedgehog_distillation_loss(target, target), entropy)
    uniform = torch.ones(5, 5).tril()
    uniform = (uniform / uniform.sum(-1, keepdim=True)).expand_as(target)
    assert hedgehog_distillation_loss(uniform, target) > entropy + 0.01
    assert torch.isfinite(hedgehog_distillation_loss(uniform, target))  # masked zeros contribute nothing


def test_attention_weights_match_linear_attention():
    q, k, v = (torch.randn(2, 6, 2, 4, dtype=torch.float64) for _ in range(3))
    fm = (Hedgehog(4).double(), Hedgehog(4).double())
    a = attention_weights(q, k, fm)  # [B,H,T,T]
    o, _ = linear_attention(q, k, v, feature_map=fm, eps=0.0)
    torch.testing.assert_close(torch.einsum("bhij,bjhd->bihd", a, v), o)
    torch.testing.assert_close(
        torch.einsum("bhij,bjhd->bihd", softmax_attention_weights(q, k), v), softmax_attention_reference(q, k, v)
    )


def test_hedgehog_distillation_reduces_the_loss():
    B, T, heads, d = 4, 16, 2, 8
    batches = [(1.5 * torch.randn(B, T, heads, d), 1.5 * torch.randn(B, T, heads, d)) for _ in range(4)]

    def excess(q, k, fm):  # cross-entropy minus its minimum, the target's entropy
        target = softmax_attention_weights(q, k)
        return (
            hedgehog_distillation_loss(attention_weights(q, k, fm), target)
            - hedgehog_distillation_loss(target, target)
        ).item()

    fm = (Hedgehog(d, num_heads=heads), Hedgehog(d, num_heads=heads))
    with torch.no_grad():
        before = sum(excess(q, k, fm) for q, k in batches) / len(batches)
    losses = distill_feature_maps(fm, [batches[i % 4] for i in range(200)], lr=1e-2)
    with torch.no_grad():
        after = sum(excess(q, k, fm) for q, k in batches) / len(batches)
    assert len(losses) == 200 and sum(losses[-4:]) < sum(losses[:4])
    assert after < 0.75 * before, (before, after)


# --- bad input ---


def test_bad_input_raises():
    with pytest.raises(ValueError, match="head_dim=5"):
        ReBased(5)(torch.randn(2, 4))
    with pytest.raises(ValueError, match=r"H=3"):
        Hedgehog(5, num_heads=3)(torch.randn(2, 2, 5))
    with pytest.raises(TypeError, match="floating"):
        Performer(5, 4)(torch.ones(2, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match="feature_dim"):
        Hedgehog(5, 0)
    with pytest.raises(ValueError, match="num_features"):
        Performer(5, 0)
    with pytest.raises(TypeError, match="head_dim"):
        ReBased(5.0)
    with pytest.raises(ValueError, match="num_heads"):
        ReBased(5, num_heads=0)
    with pytest.raises(TypeError, match="seed"):
        Performer(5, 4, seed="a")
    # options that arrive from a config's feature_map_options: checked, not coerced
    with pytest.raises(ValueError, match="eps must be a number > 0"):
        ReBased(5, eps=-1.0)
    with pytest.raises(TypeError, match="symmetric must be a bool"):
        ReBased(5, symmetric="no")
    with pytest.raises(TypeError, match="bias must be a bool"):
        Hedgehog(5, bias="False")
    with pytest.raises(TypeError, match="orthogonal must be a bool"):
        Performer(5, 4, orthogonal="no")
    with pytest.raises(ValueError, match="attn_pred and attn_softmax"):
        hedgehog_distillation_loss(torch.ones(3, 3), torch.ones(4, 4))
    with pytest.raises(ValueError, match="no learnable parameters"):
        distill_feature_maps(Performer(4, 4), [])
    # the weights' einsums would broadcast a batch or head of one, or fail deep inside
    q = torch.randn(2, 5, 3, 4)
    for k, word in ((q[:1], "same shape"), (q[:, :, :1], "same shape"), (q[0], "q must have")):
        with pytest.raises((ValueError, TypeError), match=word):
            attention_weights(k if word == "q must have" else q, q if word == "q must have" else k, "elu")
        with pytest.raises((ValueError, TypeError), match=word):
            softmax_attention_weights(k if word == "q must have" else q, q if word == "q must have" else k)
    with pytest.raises(TypeError, match="scale"):
        softmax_attention_weights(q, q, scale="big")


def test_a_seeded_performer_config_passes_the_meta_device_check():
    """check_attention builds a layer on the meta device: the seeded draw read its count there (.item() on a
    meta tensor, a RuntimeError), so train's config check refused a config GPT(cfg) builds."""
    from lintrans.models import GPT, GPTConfig
    from lintrans.nn.registry import check_attention

    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=11, attention="linear",
                    attention_options={"feature_map": "performer", "feature_map_options": {"num_features": 8, "seed": 1}})
    check_attention(cfg)
    GPT(cfg)
    bad = GPTConfig(**{**cfg.__dict__, "attention_options": {"feature_map": "performer",
                                                             "feature_map_options": {"num_features": 0, "seed": 1}}})
    with pytest.raises(ValueError, match="num_features"):
        check_attention(bad)


def test_check_attention_builds_for_real_where_the_meta_device_cannot(monkeypatch):
    """A layer whose constructor reads a tensor's value cannot be built on the meta device: the check
    builds it on the CPU instead of failing a config the model builds (as a seeded Performer did)."""
    from lintrans.models import GPTConfig
    from lintrans.nn.registry import check_attention

    def reads_a_value(self):
        int(self.projection.sum())  # .item(): a RuntimeError on meta tensors
        self.projection.normal_()

    monkeypatch.setattr(Performer, "redraw", reads_a_value)
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=11, attention="linear",
                    attention_options={"feature_map": "performer", "feature_map_options": {"num_features": 8}})
    check_attention(cfg)


def test_non_causal_weights_take_keys_of_another_length():
    q, k = torch.randn(2, 3, 2, 4), torch.randn(2, 5, 2, 4)
    assert attention_weights(q, k, "elu", causal=False).shape == (2, 2, 3, 5)
    assert softmax_attention_weights(q, k, causal=False).shape == (2, 2, 3, 5)
    with pytest.raises(ValueError, match="same shape"):
        attention_weights(q, k, "elu")  # causal: one T
    with pytest.raises(TypeError, match="q and k must share one dtype"):
        softmax_attention_weights(q, k.double(), causal=False)


def test_a_partial_load_leaves_the_draw_count_alone():
    """A state_dict that holds nothing of a Performer (strict=False loads of other modules) reset its count
    to 1, so that its next redraw repeated the first."""
    p = Performer(6, 10, seed=3)
    first = p.projection.clone()
    p.redraw()
    p.redraw()
    p.load_state_dict({}, strict=False)
    assert int(p.draws) == 3
    p.redraw()
    assert not torch.equal(p.projection, first)
