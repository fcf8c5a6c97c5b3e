"""AFT and Longformer layers: against the ops' float64 references, inside a tiny GPT, and decoding."""
import copy

import pytest
import torch

from lintrans.models import GPTConfig
from lintrans.models.gpt import GPT
from lintrans.nn import get_attention
from lintrans.ops.aft import aft_reference
from lintrans.ops.sliding_window import sliding_window_attention_reference
from _qkv_reference import project_qkv

MECHANISMS = [
    ("aft-simple", {}),
    ("aft-full", {}),
    ("aft-full", {"per_head": True}),
    ("aft-local", {"window": 3}),
    ("aft-conv", {"kernel": 4}),
    ("sliding-window", {"window": 3}),
    ("sliding-window", {"window": 3, "dilation": 2, "global_tokens": [0, 7]}),
]


def config(**kw):
    base = dict(n_layer=1, n_head=2, n_embd=12, block_size=24, vocab_size=40)
    return GPTConfig(**{**base, **kw})


def randomize_biases(module, seed=0):
    """Position biases start at zero; make them matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("pos_bias"):
                p.copy_(torch.randn(p.shape, generator=g))


def reference(layer, x, attention, opts, n_kv_head):
    """Projections by hand in float64, the mechanism by its op reference, global rows by hand."""
    layer, x, q, k, v = project_qkv(layer, x, n_kv_head)
    B, T, C = x.shape
    H, D = layer.n_head, layer.head_dim
    if attention == "sliding-window":
        glob = opts.get("global_tokens")
        o = sliding_window_attention_reference(
            q, k, v, window=opts["window"], dilation=opts.get("dilation", 1), global_tokens=glob
        )
        for g in glob or []:
            if g < T:  # global rows: their own projections over every earlier position
                lin = lambda m, y: (y @ m.weight.T + m.bias).reshape(*y.shape[:-1], H, D)  # noqa: E731
                qg = lin(layer.q_global, x[:, g])
                kg, vg = lin(layer.k_global, x[:, : g + 1]), lin(layer.v_global, x[:, : g + 1])
                s = torch.einsum("bhd,bjhd->bhj", qg, kg) / D**0.5
                o[:, g] = torch.einsum("bhj,bjhd->bhd", s.softmax(-1), vg)
    else:
        variant = attention.split("-")[1]
        o = aft_reference(q, k, v, variant=variant, pos_bias=layer.pos_bias, window=opts.get("window"))
    return o.reshape(B, T, C) @ layer.c_proj.weight.T + layer.c_proj.bias


@pytest.mark.parametrize("T", [1, 9])
@pytest.mark.parametrize("n_kv_head", [2, 1])
@pytest.mark.parametrize("attention, opts", MECHANISMS)
def test_layer_equals_reference_outputs_and_grads(attention, opts, n_kv_head, T):
    layer = get_attention(attention)(config(attention=attention, attention_options=opts, n_kv_head=n_kv_head))
    randomize_biases(layer)
    layer = layer.double()
    x = torch.randn(2, T, 12, dtype=torch.float64, requires_grad=True)
    y, cache = layer(x)
    assert cache is None and y.shape == x.shape
    ref = reference(copy.deepcopy(layer), x, attention, opts, n_kv_head)
    torch.testing.assert_close(y, ref, rtol=1e-9, atol=1e-10)
    dy = torch.randn_like(y)
    (gx,) = torch.autograd.grad((y * dy).sum(), x, retain_graph=True)
    (rx,) = torch.autograd.grad((ref * dy).sum(), x)
    torch.testing.assert_close(gx, rx, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("attention, opts", MECHANISMS)
def test_tiny_gpt_trains_and_decode_equals_forward(attention, opts):
    torch.manual_seed(0)
    model = GPT(config(n_layer=2, attention=attention, attention_options=opts, n_kv_head=1)).double()
    randomize_biases(model)
    idx = torch.randint(0, 40, (2, 14))
    _, loss = model(idx, idx)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    if "pos_bias" in "".join(grads):
        assert any(g.abs().sum() > 0 for n, g in grads.items() if n.endswith("pos_bias"))
    model.eval()
    with torch.no_grad():
        full, _ = model(idx)
        for prompt in (1, 5):  # the global token 7 is decoded, not prefilled
            logits, cache = model.forward_cached(idx[:, :prompt])
            outs = [logits]
            for t in range(prompt, 14):
                logits, cache = model.forward_cached(idx[:, t : t + 1], cache)
                outs.append(logits)
            torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(
    "attention, opts",
    [("aft-simple", {}), ("aft-local", {"window": 4}), ("aft-conv", {"kernel": 3}),
     ("sliding-window", {"window": 4, "global_tokens": [0]})],
)
def test_decode_state_is_constant_size(attention, opts):
    pos = "none" if attention in ("aft-simple", "aft-conv", "sliding-window") else "learned"
    model = GPT(config(attention=attention, attention_options=opts, pos_embedding=pos, block_size=40)).eval()
    idx = torch.randint(0, 40, (1, 40))
    with torch.no_grad():
        _, cache = model.forward_cached(idx[:, :8])
        size = cache.nbytes()
        for t in range(8, 40):
            _, cache = model.forward_cached(idx[:, t : t + 1], cache)
    assert cache.nbytes() == size


def test_aft_full_decoding_cache_grows_with_the_sequence():
    """Documented: AFT-full's new row spans every earlier key, so its cache holds them all."""
    model = GPT(config(attention="aft-full")).eval()
    idx = torch.randint(0, 40, (1, 12))
    with torch.no_grad():
        _, cache = model.forward_cached(idx[:, :4])
        size = cache.nbytes()
        _, cache = model.forward_cached(idx[:, 4:], cache)
    assert cache.nbytes() > size


def test_global_rows_use_their_own_projections():
    opts = {"window": 2, "global_tokens": [3]}
    layer = get_attention("sliding-window")(config(attention="sliding-window", attention_options=opts))
    x = torch.randn(1, 8, 12)
    y0, _ = layer(x)
    with torch.no_grad():
        layer.q_global.weight.add_(1.0)
    y1, _ = layer(x)
    changed = (y1 - y0).abs().amax(-1)[0] > 0
    assert changed.tolist() == [False, False, False, True, False, False, False, False]


@pytest.mark.parametrize(
    "attention, opts, err, match",
    [
        ("aft-simple", {"window": 3}, ValueError, "unknown attention_options"),
        ("aft-local", {"window": 0}, ValueError, "window'\\] must be an int >= 1"),
        ("aft-conv", {"kernel": 1.5}, TypeError, "kernel'\\] must be an int >= 1"),
        ("aft-full", {"per_head": "yes"}, TypeError, "per_head'\\] must be a bool"),
        ("sliding-window", {"dilation": 0}, ValueError, "dilation'\\] must be an int >= 1"),
        ("sliding-window", {"global_tokens": [-2]}, ValueError, "global_tokens positions must be >= 0"),
    ],
)
def test_bad_options(attention, opts, err, match):
    with pytest.raises(err, match=match):
        get_attention(attention)(config(attention=attention, attention_options=opts))


def test_aft_full_beyond_its_bias_is_a_clear_error():
    model = GPT(config(attention="aft-full", pos_embedding="none", block_size=8))
    with pytest.raises(ValueError, match="sequence length 9 exceeds 8, the positions attention 'aft-full'"):
        model(torch.zeros(1, 9, dtype=torch.long))
