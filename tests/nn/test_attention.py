"""The GPT's attention layers against the float64 references of the ops they wrap."""
import pytest
import torch

from lintrans.models import GPT, GPTConfig
from lintrans.nn import get_attention
from lintrans.ops.linear import linear_attention_reference
from lintrans.ops.softmax import softmax_attention_reference
from _qkv_reference import project_qkv


def config(**kw):
    base = dict(n_layer=1, n_head=4, n_embd=24, block_size=32, vocab_size=10)
    return GPTConfig(**{**base, **kw})


def reference(layer, x, attention, n_kv_head, **opts):
    """Projections by hand in float64, attention by the op's reference, kv heads repeated explicitly."""
    layer, x, q, k, v = project_qkv(layer, x, n_kv_head)
    B, T, C = x.shape
    if attention == "softmax":
        o = softmax_attention_reference(q, k, v)
    elif attention == "none":  # softmax restricted to the diagonal: each token's own value
        o = v
    else:
        o, _ = linear_attention_reference(q, k, v, **opts)
    return o.reshape(B, T, C) @ layer.c_proj.weight.T + layer.c_proj.bias


@pytest.mark.parametrize("T", [1, 5, 13])
@pytest.mark.parametrize("n_kv_head", [4, 2, 1])
@pytest.mark.parametrize(
    "attention, opts",
    [("softmax", {}), ("none", {}), ("linear", {"feature_map": "elu", "chunk_size": 4}),
     # eps large enough that rows whose relu features nearly vanish stay well-conditioned in float32
     ("linear", {"feature_map": "relu", "form": "attention", "eps": 1e-2}),
     ("linear", {"feature_map": "identity", "normalize": False, "scale": 0.5}),
     # Based's projection: queries and keys of width 4 (not the head's 6), Taylor features of those
     ("linear", {"feature_map": "based", "qk_dim": 4, "chunk_size": 4})],
)
def test_layer_equals_reference_outputs_and_grads(attention, opts, n_kv_head, T):
    layer = get_attention(attention)(config(attention=attention, attention_options=opts, n_kv_head=n_kv_head))
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    op_opts = {k: v for k, v in opts.items() if k not in ("chunk_size", "form", "qk_dim")}
    x = torch.randn(2, T, 24, requires_grad=True)
    y, cache = layer(x)
    assert cache is None
    x64 = x.detach().double().requires_grad_()
    import copy

    ref = reference(copy.deepcopy(layer), x64, attention, n_kv_head, **op_opts)
    # the layer runs in float32, whose sums carry errors relative to their largest terms: without the
    # normaliser outputs and gradients grow with T, so atol is relative to each one's largest entry
    torch.testing.assert_close(y.double(), ref, atol=1e-5 * max(1.0, ref.abs().max().item()), rtol=1e-4)
    g = torch.randn_like(ref)
    (gx,) = torch.autograd.grad(y, x, g.float())
    (gx_ref,) = torch.autograd.grad(ref, x64, g)
    torch.testing.assert_close(gx.double(), gx_ref, atol=1e-5 * max(1.0, gx_ref.abs().max().item()), rtol=1e-4)


def test_softmax_cache_covers_prompt_and_steps():
    layer = get_attention("softmax")(config(n_kv_head=2)).eval()
    x = torch.randn(2, 9, 24)
    full, _ = layer(x)
    y1, cache = layer(x[:, :4], use_cache=True)
    y2, cache = layer(x[:, 4:7], cache=cache, use_cache=True)  # a second prompt piece: masked, not causal
    y3, cache = layer(x[:, 7:8], cache=cache, use_cache=True)
    y4, _ = layer(x[:, 8:], cache=cache, use_cache=False)
    torch.testing.assert_close(torch.cat([y1, y2, y3, y4], 1), full, atol=1e-6, rtol=1e-5)
    assert cache.length == 8 and cache.k.shape == (2, 2, 8, 6)


def test_linear_cache_is_the_recurrent_state():
    layer = get_attention("linear")(config(attention="linear", attention_options={"chunk_size": 3}))
    x = torch.randn(1, 7, 24)
    full, _ = layer(x)
    y1, state = layer(x[:, :5], use_cache=True)
    S, z = state
    assert S.shape == (1, 4, 6, 6) and z.shape == (1, 4, 6) and S.dtype == torch.float32
    y2, state = layer(x[:, 5:6], cache=state, use_cache=True)
    y3, _ = layer(x[:, 6:], cache=state, use_cache=True)
    torch.testing.assert_close(torch.cat([y1, y2, y3], 1), full, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("attention", ["linear", "gated-linear"])
def test_qk_dim_narrows_queries_and_keys_and_decodes_as_it_runs(attention):
    """qk_dim=4 on heads of 6: q and k are 4 wide (the state F x D with F Based's 1 + 4 + 10 features),
    and prefill + one-token steps equal the full forward."""
    opts = {"feature_map": "based", "qk_dim": 4, "chunk_size": 3}
    layer = get_attention(attention)(config(attention=attention, attention_options=opts))
    assert layer.c_attn.weight.shape == (4 * 4 + 4 * 4 + 4 * 6, 24)
    x = torch.randn(1, 7, 24)
    full, _ = layer(x)
    y1, state = layer(x[:, :5], use_cache=True)
    assert state[0].shape == (1, 4, 15, 6)
    y2, state = layer(x[:, 5:6], cache=state, use_cache=True)
    y3, _ = layer(x[:, 6:], cache=state, use_cache=True)
    torch.testing.assert_close(torch.cat([y1, y2, y3], 1), full, atol=1e-6, rtol=1e-5)


def test_module_feature_maps_are_trainable_submodules():
    from lintrans.nn.attention import feature_map_names

    if "hedgehog" not in feature_map_names():
        pytest.skip("lintrans.nn.feature_maps not available")
    layer = get_attention("linear")(config(attention="linear", attention_options={"feature_map": "hedgehog"}))
    names = [n for n, _ in layer.named_parameters()]
    assert any(n.startswith("phi_q.") for n in names) and any(n.startswith("phi_k.") for n in names)
    layer(torch.randn(1, 5, 24))[0].sum().backward()
    assert layer.phi_q.weight.grad is not None and layer.phi_q.weight.grad.abs().sum() > 0
    shared = get_attention("linear")(config(attention="linear", attention_options={
        "feature_map": "performer", "feature_map_options": {"num_features": 8}}))
    assert shared.phi_k is None  # FAVOR+ needs one random matrix for q and k
    with pytest.raises(ValueError, match="shared_qk must be True"):
        get_attention("linear")(config(attention="linear", attention_options={
            "feature_map": "performer", "shared_qk": False, "feature_map_options": {"num_features": 8}}))


@pytest.mark.parametrize(
    "opts, err, match",
    [({"form": "magic"}, ValueError, "form'\\] must be one of"),
     ({"chunk_size": 0}, ValueError, "chunk_size"),
     ({"feature_map": "elu", "feature_map_options": {"x": 1}}, ValueError, "takes no feature_map_options"),
     ({"feature_map": "hedgehog", "feature_map_options": {"bogus": 1}}, ValueError,
      r"feature_map_options'\] for 'hedgehog' has unknown keys \['bogus'\]"),
     ({"feature_map": "performer"}, ValueError, r"for 'performer' needs \['num_features'\]"),
     ({"eps": -1.0}, ValueError, r"eps'\] must be a number >= 0"),
     ({"feature_map": 3}, TypeError, "feature_map'\\] must be one of"),
     ({"qk_dim": 0}, ValueError, "qk_dim"),
     ({"qk_dim": 2.5}, TypeError, "qk_dim"),
     # the layer sets num_heads from per_head and n_head
     ({"feature_map": "rebased", "feature_map_options": {"num_heads": 3}}, ValueError,
      r"for 'rebased' has unknown keys \['num_heads'\]")],
)
def test_linear_bad_options(opts, err, match):
    with pytest.raises(err, match=match):
        get_attention("linear")(config(attention="linear", attention_options=opts))


def test_identity_features_with_normalize_warn():
    """Signed features: the normaliser can vanish (outputs of 1e3 and more where elu gives 1). A warning, so
    that models saved with it still load."""
    with pytest.warns(UserWarning, match="feature_map 'identity' with normalize=True"):
        get_attention("linear")(config(attention="linear", attention_options={"feature_map": "identity"}))


def test_softmax_takes_no_options():
    with pytest.raises(ValueError, match=r"unknown attention_options \['window'\] for 'softmax'"):
        get_attention("softmax")(config(attention_options={"window": 4}))


def test_linear_layer_accepts_auto_chunk_size(tmp_path, monkeypatch):
    from lintrans.models import GPT, GPTConfig
    from lintrans.ops import chunk_tuning

    monkeypatch.setattr(chunk_tuning, "auto_chunk_size", lambda *a, **k: 4)  # no timing in tests
    cfg = dict(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=11, attention="linear")
    idx = torch.randint(0, 11, (1, 13))
    torch.manual_seed(0)
    auto = GPT(GPTConfig(**cfg, attention_options={"chunk_size": "auto"}))(idx)[0]
    torch.manual_seed(0)
    fixed = GPT(GPTConfig(**cfg, attention_options={"chunk_size": 4}))(idx)[0]
    torch.testing.assert_close(auto, fixed)
    with pytest.raises((ValueError, TypeError), match="chunk_size"):
        GPT(GPTConfig(**cfg, attention_options={"chunk_size": 0}))


def test_cosformer_layer_is_the_op_on_its_projections_and_checks_max_len():
    from lintrans.models import GPTConfig
    from lintrans.nn.registry import get_attention
    from lintrans.ops.cosformer import cosformer_attention_reference

    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=32, vocab_size=11, attention="cosformer")
    layer = get_attention("cosformer")(cfg).double()
    x = torch.randn(2, 20, 16, dtype=torch.float64)
    q, k, v = layer.qkv(x)
    want = layer.out(cosformer_attention_reference(q, k, v, max_len=32))
    torch.testing.assert_close(layer(x)[0], want, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match=r"attention_options\['max_len'\] must be an int >= 32"):
        get_attention("cosformer")(cfg.replace(attention_options={"max_len": 16}))


def test_bigbird_layer_is_the_op_on_its_projections_and_checks_options():
    from lintrans.models import GPTConfig
    from lintrans.nn.registry import get_attention
    from lintrans.ops.bigbird import bigbird_attention_reference

    opts = {"block_size": 4, "window_blocks": 2, "global_blocks": 1, "random_blocks": 1, "seed": 2}
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=32, vocab_size=11, attention="bigbird",
                    attention_options=opts)
    layer = get_attention("bigbird")(cfg).double()
    x = torch.randn(2, 23, 16, dtype=torch.float64)
    q, k, v = layer.qkv(x)
    want = layer.out(bigbird_attention_reference(q, k, v, causal=True, **opts))
    torch.testing.assert_close(layer(x)[0], want, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="window_blocks must be an int >= 1"):
        get_attention("bigbird")(cfg.replace(attention_options={"window_blocks": 0}))


def test_reformer_layer_is_the_op_on_its_shared_projection_and_checks_options():
    from lintrans.models import GPTConfig
    from lintrans.nn.registry import get_attention
    from lintrans.ops.lsh import lsh_attention_reference

    opts = {"n_buckets": 4, "n_hashes": 2, "chunk_size": 4, "seed": 2}
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=32, vocab_size=11, attention="reformer",
                    attention_options=opts)
    layer = get_attention("reformer")(cfg).double()
    assert layer.c_attn.weight.shape == (32, 16)  # shared qk and v: 2C, not 3C
    x = torch.randn(2, 23, 16, dtype=torch.float64)
    qk, v = (x @ layer.c_attn.weight.T + layer.c_attn.bias).reshape(2, 23, 2, 2, 8).unbind(2)
    want = layer.out(lsh_attention_reference(qk, v, causal=True, lookback="window", **opts))
    torch.testing.assert_close(layer(x)[0], want, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="attention_options of 'reformer': n_buckets must be 1 or an even int"):
        get_attention("reformer")(cfg.replace(attention_options={"n_buckets": 5}))
    with pytest.raises(ValueError, match="n_kv_head must be None or n_head"):
        get_attention("reformer")(cfg.replace(n_kv_head=1))
    with pytest.raises(ValueError, match="unknown attention_options"):
        get_attention("reformer")(cfg.replace(attention_options={"lookback": "chunk"}))


# ---- typed options per mechanism ------------------------------------------------------------

def _mechanisms():
    from lintrans.nn.registry import available_attention

    return available_attention()


@pytest.mark.parametrize("name", _mechanisms())
def test_every_mechanism_has_typed_options_and_rejects_unknown_keys(name):
    import dataclasses

    from lintrans.nn.registry import attention_options

    schema = attention_options(name)
    allowed = sorted(f.name for f in dataclasses.fields(schema))
    n_head = 4
    cfg = config(attention=name, n_head=n_head, block_size=64)
    with torch.device("meta"):
        get_attention(name)(cfg)  # the defaults build the layer
        with pytest.raises(ValueError, match=rf"unknown attention_options \['bogus'\] for '{name}'; allowed: "
                                             + __import__("re").escape(str(allowed))):
            get_attention(name)(cfg.replace(attention_options={"bogus": 1}))


@pytest.mark.parametrize("name, opts, error, match", [
    ("linear", {"chunk_size": "64"}, TypeError, r"attention_options\['chunk_size'\] must be an int >= 1 or one of "
                                                r"\['auto'\], got '64'"),
    ("linear", {"chunk_size": 0}, ValueError, r"attention_options\['chunk_size'\] must be an int >= 1, got 0"),
    ("linear", {"normalize": "yes"}, TypeError, r"attention_options\['normalize'\] must be a bool"),
    ("linear", {"scale": "1"}, TypeError, r"attention_options\['scale'\] must be a number or None"),
    ("linear", {"feature_map_options": [1]}, TypeError, r"attention_options\['feature_map_options'\] must be a table"),
    ("gated-linear", {"tau": "x"}, TypeError, r"attention_options\['tau'\] must be a number"),
    ("sliding-window", {"global_tokens": 0}, TypeError, r"attention_options\['global_tokens'\] must be a list of int"),
    ("sliding-window", {"window": True}, TypeError, r"attention_options\['window'\] must be an int >= 1, got True"),
    ("cosformer", {"max_len": 1.5}, TypeError, r"attention_options\['max_len'\] must be an int or None"),
    ("bigbird", {"seed": "x"}, TypeError, r"attention_options\['seed'\] must be an int"),
    ("reformer", {"n_hashes": 2.0}, TypeError, r"attention_options\['n_hashes'\] must be an int"),
])
def test_option_types_are_checked_per_mechanism(name, opts, error, match):
    with pytest.raises(error, match=match):
        get_attention(name)(config(attention=name, attention_options=opts))


def test_options_keep_their_values_and_accept_ints_for_floats():
    layer = get_attention("linear")(config(attention="linear", attention_options={"scale": 1, "chunk_size": "auto"}))
    assert layer.options["scale"] == 1.0 and isinstance(layer.options["scale"], float)
    assert layer.chunk_size == "auto" and layer.options["feature_map"] == "elu"


def test_train_config_checks_the_options_of_its_mechanism(tmp_path, capsys):
    from lintrans.cli import main

    (tmp_path / "c.toml").write_text('[model]\nattention = "retention"\n[model.attention_options]\nchunk_size = "32"\n')
    assert main(["train", "--config", str(tmp_path / "c.toml"), "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "attention_options['chunk_size'] must be an int >= 1" in err and err.count("\n") == 1
    assert main(["train", "--set", "model.attention=softmax", "--set", "model.attention_options.window=3",
                 "--print-config"]) == 2
    assert "unknown attention_options ['window'] for 'softmax'; allowed: []" in capsys.readouterr().err
    assert main(["train", "--set", "model.attention=sliding-window", "--set", "model.attention_options.window=3",
                 "--print-config"]) == 0
    assert "window: 3" in capsys.readouterr().out


def test_a_reformer_gpt_compiles():
    """torch.compile's functionalisation refused the in-place write into a view of the self-pair mask;
    and it traced the cached rotations' seeded draw, warning of the cache."""
    import warnings

    torch._dynamo.reset()
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=32, vocab_size=11, attention="reformer",
                    attention_options={"n_buckets": 4, "n_hashes": 2, "chunk_size": 4})
    model = GPT(cfg)
    idx = torch.randint(0, 11, (2, 20))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(model, backend="aot_eager")(idx)[0]
    torch.testing.assert_close(compiled, model(idx)[0])
    assert not [w for w in caught if "lru_cache" in str(w.message)]


def test_options_an_op_checks_are_named_as_attention_options():
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=32, vocab_size=11)
    with pytest.raises(ValueError, match="attention_options of 'bigbird': block_size must be an int >= 1"):
        GPT(cfg.replace(attention="bigbird", attention_options={"block_size": 0}))
