"""The gated GPT layers (retention, gated-linear) against the float64 reference of the op."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

from lintrans.models import GPT, GPTConfig
from lintrans.nn import get_attention
from lintrans.nn.gated import retnet_log_decays
from lintrans.ops.linear import linear_attention_reference
from _qkv_reference import project_qkv


def config(attention, opts=None, **kw):
    base = dict(n_layer=1, n_head=4, n_embd=24, block_size=32, vocab_size=10, attention=attention,
                attention_options=opts or {})
    return GPTConfig(**{**base, **kw})


def reference(layer, x, n_kv_head, *, feature_map="identity", normalize=False, scale=None, group_norm=True):
    """float64 by hand: projections, the gate (or RetNet's decays), the op's reference, the norm, c_proj."""
    layer, x, q, k, v = project_qkv(layer, x, n_kv_head)
    B, T, C = x.shape
    if hasattr(layer, "gate"):
        ld = -F.softplus(x @ layer.gate.weight.T + layer.gate.bias) / layer.gate.tau  # [B,T,H]
    else:
        ld = torch.log(1 - 2.0 ** (-5.0 - torch.arange(layer.n_head, dtype=torch.float64)))
    scale = layer.qk_dim ** -0.5 if scale is None else scale
    o, _ = linear_attention_reference(q, k, v, feature_map=feature_map, normalize=normalize, scale=scale, log_decay=ld)
    if group_norm:
        o = (o - o.mean(-1, keepdim=True)) / torch.sqrt(o.var(-1, unbiased=False, keepdim=True) + 1e-5)
    return o.reshape(B, T, C) @ layer.c_proj.weight.T + layer.c_proj.bias


@pytest.mark.parametrize("attention", ["retention", "gated-linear"])
@pytest.mark.parametrize("T", [1, 5, 13])
@pytest.mark.parametrize("n_kv_head", [4, 2])
@pytest.mark.parametrize("opts", [{"chunk_size": 4}, {"feature_map": "elu", "normalize": True, "group_norm": False,
                                                       "scale": 1.0, "form": "attention"},
                                  {"chunk_size": 4, "qk_dim": 4}])  # scale None: 1 / sqrt(qk_dim), not the head's
def test_layer_equals_reference_outputs_and_grads(attention, T, n_kv_head, opts):
    layer = get_attention(attention)(config(attention, opts, n_kv_head=n_kv_head))
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    layer = layer.double()  # float64 end to end: the layer's composition is checked to rounding
    x = torch.randn(2, T, 24, dtype=torch.float64, requires_grad=True)
    y, _ = layer(x)
    ref_layer = copy.deepcopy(layer)
    ref = reference(ref_layer, x, n_kv_head,
                    **{k: v for k, v in opts.items() if k not in ("chunk_size", "form", "qk_dim")})
    torch.testing.assert_close(y, ref, atol=1e-10, rtol=1e-9)
    g = torch.randn_like(ref)
    got = torch.autograd.grad(y, [x, *[p for _, p in sorted(layer.named_parameters())]], g)
    want = torch.autograd.grad(ref, [x, *[p for _, p in sorted(ref_layer.named_parameters())]], g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8)


def test_retention_decays_are_retnets():
    d = retnet_log_decays(8)
    assert d.shape == (8,) and (d < 0).all()
    assert math.isclose(d[0].exp().item(), 1 - 2 ** -5, rel_tol=1e-6)
    assert math.isclose(d[7].exp().item(), 1 - 2 ** -12, rel_tol=1e-6)
    layer = get_attention("retention")(config("retention"))
    assert len(list(layer.parameters())) == 4  # c_attn and c_proj only: the decays are fixed
    assert sorted(layer.state_dict()) == ["c_attn.bias", "c_attn.weight", "c_proj.bias", "c_proj.weight"]


def test_gate_starts_at_retnets_decays_and_learns():
    model = GPT(config("gated-linear", n_layer=2))  # GPT's init must not reset the gate's bias
    gate = model.transformer.h[0].attn.gate
    ld = gate(torch.zeros(1, 1, 24))[0, 0]
    torch.testing.assert_close(ld, retnet_log_decays(4).float(), rtol=1e-5, atol=1e-7)
    idx = torch.randint(0, 10, (2, 20))
    _, loss = model(idx, idx)
    loss.backward()
    assert gate.weight.grad.abs().sum() > 0 and gate.bias.grad.abs().sum() > 0


def test_mamba2_decay_init_starts_at_mamba2s_decays(monkeypatch):
    """decay_init="mamba2": with W x = 0 the gate gives -A softplus(dt_bias) of the Mamba-2 start
    (lintrans.nn.delta.mamba2_decay_init; here fixed values, slow to fast), per head, and it learns; drawn
    for real, the decays lie in [-1.6, 0) (A < 16, dt <= 0.1) and are not RetNet's, which stay the default."""
    from lintrans.nn import delta

    A_log = torch.tensor([-9.0, -1.0, 0.5, 2.7])
    dt_bias = torch.tensor([-6.9, -4.0, -2.3, -2.25])  # softplus: about 1e-3 .. 0.1
    want = -(A_log.double().exp() * F.softplus(dt_bias.double())).float()
    monkeypatch.setattr(delta, "mamba2_decay_init", lambda n_head: (A_log[:n_head], dt_bias[:n_head]))
    layer = get_attention("gated-linear")(config("gated-linear", {"decay_init": "mamba2"}))
    ld = layer.gate(torch.zeros(1, 1, 24))[0, 0]
    torch.testing.assert_close(ld, want, rtol=1e-5, atol=1e-9)
    x = torch.randn(2, 9, 24)
    y, _ = layer(x)
    y.square().sum().backward()
    assert layer.gate.bias.grad.abs().sum() > 0
    monkeypatch.undo()
    torch.manual_seed(3)
    drawn = get_attention("gated-linear")(config("gated-linear", {"decay_init": "mamba2"})).gate(torch.zeros(1, 1, 24))
    assert (drawn < 0).all() and (drawn >= -1.6 * (1 + 1e-5)).all()
    assert not torch.allclose(drawn[0, 0], retnet_log_decays(4).float())


@pytest.mark.parametrize("attention, opts, match", [
    ("gated-linear", {"decay_init": "slow"}, r"attention_options\['decay_init'\] must be one of \['retnet', 'mamba2'\]"),
    ("retention", {"decay_init": "mamba2"}, "unknown attention_options"),
    ("gated-linear", {"tau": 0}, "tau"),
    ("gated-linear", {"tau": "x"}, "tau"),
    ("retention", {"group_norm": 1}, "group_norm"),
    ("retention", {"tau": 2.0}, "unknown attention_options"),
    ("retention", {"form": "nope"}, "form"),
])
def test_bad_options(attention, opts, match):
    with pytest.raises((ValueError, TypeError), match=match):
        get_attention(attention)(config(attention, opts))


@pytest.mark.parametrize("attention", ["retention", "gated-linear"])
def test_generate_uses_a_constant_state(attention):
    torch.manual_seed(0)
    model = GPT(config(attention, n_layer=2, block_size=64, pos_embedding="none")).eval()
    logits, cache = model.forward_cached(torch.randint(0, 10, (1, 7)))
    size = cache.nbytes()
    for _ in range(30):
        logits, cache = model.forward_cached(logits[:, -1:].argmax(-1), cache)
    assert cache.nbytes() == size and cache.length == 37
