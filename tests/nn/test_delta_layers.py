"""The delta-rule GPT layers (deltanet, gated-deltanet) against a plain float64 token loop of the same
layer math, decoding against one forward, their options, init, cost terms and the CLI."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

from lintrans.models import GPT, GPTConfig
from lintrans.nn import get_attention
from lintrans.nn.delta import causal_conv

MECHS = ["deltanet", "gated-deltanet"]


def config(attention, opts=None, **kw):
    base = dict(n_layer=1, n_head=4, n_embd=24, block_size=96, vocab_size=10, attention=attention,
                attention_options=opts or {})
    return GPTConfig(**{**base, **kw})


def perturbed_layer(attention, opts=None, dtype=torch.float64, **kw):
    layer = get_attention(attention)(config(attention, opts, **kw))
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return layer.to(dtype)


def linear(x, mod):
    return x @ mod.weight.T + (0 if mod.bias is None else mod.bias)


def reference(layer, x):
    """The layer's math written out in float64, one token at a time (no op, no conv1d)."""
    B, T, C = x.shape
    H, Hk, D = layer.n_head, layer.n_kv_head, layer.head_dim
    opts = layer.options
    u = linear(x, layer.c_attn)  # [B,T,W]
    K = opts["conv_size"]
    if K:
        w = layer.conv.weight[:, 0]  # [W,K]: tap K-1 multiplies the current input
        u = torch.stack([sum(w[:, K - 1 - j] * u[:, t - j] for j in range(min(K, t + 1))) for t in range(T)], 1)
    if opts["qkv_activation"] == "silu":
        u = F.silu(u)
    q = u[..., : H * D].reshape(B, T, H, D)
    k = u[..., H * D: (H + Hk) * D].reshape(B, T, Hk, D).repeat_interleave(H // Hk, dim=2)
    v = u[..., (H + Hk) * D:].reshape(B, T, Hk, D).repeat_interleave(H // Hk, dim=2)
    if opts["qk_norm"] == "l2":
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    if opts["learned_beta"]:
        beta = torch.sigmoid(linear(x, layer.beta_proj)) * (2.0 if opts["allow_neg_eigval"] else 1.0)  # [B,T,H]
    else:
        beta = torch.ones(B, T, H, dtype=x.dtype)
    if hasattr(layer, "A_log"):
        a = torch.exp(-torch.exp(layer.A_log) * F.softplus(linear(x, layer.a_proj) + layer.dt_bias))
    else:
        a = torch.ones(B, T, H, dtype=x.dtype)
    S = torch.zeros(B, H, D, D, dtype=x.dtype)
    outs = []
    for t in range(T):
        at = a[:, t, :, None, None]
        # rule="linear" (the ablation) only adds: nothing of what S predicts for k_t is erased
        pred = torch.einsum("bhkv,bhk->bhv", at * S, k[:, t]) if opts["rule"] == "delta" else 0
        S = at * S + torch.einsum("bhk,bhv->bhkv", k[:, t], beta[:, t, :, None] * (v[:, t] - pred))
        outs.append(D ** -0.5 * torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    o = torch.stack(outs, 1)  # [B,T,H,D]
    if opts["output_norm"]:
        o = o / torch.sqrt((o * o).mean(-1, keepdim=True) + opts["norm_eps"]) * layer.o_norm
    if opts["output_gate"]:
        o = o * F.silu(linear(x, layer.g_proj)).reshape(B, T, H, D)
    return linear(o.reshape(B, T, C), layer.c_proj)


@pytest.mark.parametrize("attention", MECHS)
@pytest.mark.parametrize("T", [1, 5, 13])
@pytest.mark.parametrize("n_kv_head", [4, 2])
@pytest.mark.parametrize("opts", [{"chunk_size": 4}, {"form": "recurrent", "conv_size": 2, "allow_neg_eigval": True},
                                  {"conv_size": 0, "chunk_size": 5, "norm_eps": 1e-3, "output_gate": False},
                                  {"output_norm": False, "chunk_size": 4},
                                  {"qkv_activation": "identity", "learned_beta": False, "chunk_size": 4},
                                  {"learned_beta": False, "rule": "linear", "form": "recurrent"},
                                  {"rule": "linear", "chunk_size": 4}, {"rule": "linear", "form": "recurrent"},
                                  {"rule": "linear", "qk_norm": "none", "conv_size": 0, "output_gate": False,
                                   "chunk_size": 4}])
def test_layer_equals_token_loop_outputs_and_grads(attention, T, n_kv_head, opts):
    layer = perturbed_layer(attention, opts, n_kv_head=n_kv_head)
    x = torch.randn(2, T, 24, dtype=torch.float64, requires_grad=True)
    y, _ = layer(x)
    ref_layer = copy.deepcopy(layer)
    ref = reference(ref_layer, x)
    torch.testing.assert_close(y, ref, atol=1e-10, rtol=1e-9)
    g = torch.randn_like(ref)
    names = [n for n, _ in sorted(layer.named_parameters())]
    got = torch.autograd.grad(y, [x, *[p for _, p in sorted(layer.named_parameters())]], g)
    want = torch.autograd.grad(ref, [x, *[p for _, p in sorted(ref_layer.named_parameters())]], g)
    for name, a, b in zip(["x", *names], got, want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8, msg=name)


@pytest.mark.parametrize("attention", MECHS)
def test_chunk_boundaries_default_chunk(attention):
    """T = 70 with the default chunk of 64: one full chunk and a remainder, against the token loop."""
    layer = perturbed_layer(attention)
    x = torch.randn(1, 70, 24, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(layer(x)[0], reference(layer, x), atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("attention", MECHS)
def test_float32_output_and_gradient_finite(attention):
    torch.manual_seed(0)
    model = GPT(config(attention, n_layer=2))
    idx = torch.randint(0, 10, (2, 70))
    logits, loss = model(idx, idx)
    assert torch.isfinite(logits).all() and torch.isfinite(loss)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    attn = model.transformer.h[0].attn
    for mod in ("conv.weight", "beta_proj.weight", "g_proj.weight", "o_norm"):
        assert attn.get_parameter(mod).grad.abs().sum() > 0, mod
    if attention == "gated-deltanet":
        assert attn.A_log.grad.abs().sum() > 0 and attn.dt_bias.grad.abs().sum() > 0


def decode_all(model, idx, prompt):
    cache, outs = None, []
    logits, cache = model.forward_cached(idx[:, :prompt], cache)
    outs.append(logits)
    for t in range(prompt, idx.shape[1]):
        logits, cache = model.forward_cached(idx[:, t: t + 1], cache)
        outs.append(logits)
    return torch.cat(outs, 1), cache


@pytest.mark.parametrize("attention", MECHS)
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-11), (torch.float32, 1e-4)])
@pytest.mark.parametrize("opts", [{}, {"conv_size": 2, "chunk_size": 4, "allow_neg_eigval": True},
                                  {"rule": "linear", "chunk_size": 4}, {"output_norm": False},
                                  {"qkv_activation": "identity", "learned_beta": False},
                                  {"rule": "linear", "qk_norm": "none", "chunk_size": 4}])
def test_decode_equals_forward(attention, dtype, tol, opts):
    torch.manual_seed(1)
    model = GPT(config(attention, opts, n_layer=2, n_head=2, n_embd=16, n_kv_head=1)).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    model.eval()
    idx = torch.randint(0, 10, (2, 70))
    with torch.no_grad():
        full, _ = model(idx)
        for prompt in (1, 2, 66):  # shorter than the convolution, and past the first chunk of 64
            step, cache = decode_all(model, idx, prompt)
            assert (step - full).abs().max() <= tol, prompt
    # the cache does not grow: the convolution's last K-1 inputs and S per layer
    K = model.config.attention_options.get("conv_size", 4)
    conv_prev, S = cache.layers[0]
    if opts.get("rule") == "linear":  # linear attention's (S, z)
        S, z = S
        assert z.shape == (2, 2, 8)
    assert conv_prev.shape == (2, K - 1, 4 * 8) and S.shape == (2, 2, 8, 8)
    _, short = decode_all(model, idx[:, :10], 5)
    assert short.nbytes() == cache.nbytes()


@pytest.mark.parametrize("attention", MECHS)
def test_greedy_generation_runs(attention):
    model = GPT(config(attention, n_layer=1)).eval()
    out = model.generate(torch.zeros(1, 3, dtype=torch.int64), 5, temperature=0)
    assert out.shape == (1, 8)


def test_mamba2_decay_init_and_range():
    torch.manual_seed(0)
    model = GPT(config("gated-deltanet", n_head=8, n_embd=32))  # GPT's init must leave A_log, dt_bias alone
    attn = model.transformer.h[0].attn
    A, dt = attn.A_log.exp(), F.softplus(attn.dt_bias)
    assert ((A > 0) & (A <= 16)).all()
    assert ((dt >= 1e-4 - 1e-9) & (dt <= 0.1 + 1e-6)).all()
    ld = attn.log_decay(torch.randn(2, 5, 32))
    assert ld.shape == (2, 5, 8) and (ld <= 0).all() and torch.isfinite(ld).all()
    assert get_attention("deltanet")(config("deltanet")).log_decay(torch.randn(1, 2, 24)) is None
    assert not hasattr(get_attention("deltanet")(config("deltanet")), "A_log")


@pytest.mark.parametrize("attention", MECHS)
def test_identity_conv_init_passes_each_token_through(attention):
    model = GPT(config(attention, {"conv_init": "identity"}, n_layer=2))  # GPT's init must leave it alone
    for block in model.transformer.h:
        conv = block.attn.conv
        assert (conv.weight[..., -1] == 1).all() and (conv.weight[..., :-1] == 0).all()
        u = torch.randn(2, 7, conv.weight.shape[0])
        torch.testing.assert_close(causal_conv(u, conv.weight, None)[0], u, rtol=0, atol=0)
    default = GPT(config(attention, n_layer=1)).transformer.h[0].attn.conv.weight
    assert (default[..., :-1] != 0).any()  # PyTorch's uniform init, as flash-linear-attention's


@pytest.mark.parametrize("opts, error, match", [
    ({"form": "attention"}, ValueError, r"attention_options\['form'\] must be one of \['recurrent', 'chunked'\]"),
    ({"chunk_size": 0}, ValueError, r"attention_options\['chunk_size'\] must be an int >= 1 or None, got 0"),
    ({"conv_size": -1}, ValueError, r"attention_options\['conv_size'\] must be an int >= 0, got -1"),
    ({"conv_size": 2.5}, TypeError, r"attention_options\['conv_size'\] must be an int"),
    ({"conv_init": "dirac"}, ValueError, r"attention_options\['conv_init'\] must be one of \['uniform', 'identity'\]"),
    ({"allow_neg_eigval": "yes"}, TypeError, r"attention_options\['allow_neg_eigval'\] must be a bool"),
    ({"rule": "gated"}, ValueError, r"attention_options\['rule'\] must be one of \['delta', 'linear'\]"),
    ({"qk_norm": "sum"}, ValueError, r"attention_options\['qk_norm'\] must be one of \['l2', 'none'\]"),
    ({"qk_norm": "none"}, ValueError, r"qk_norm='none' goes with rule='linear' only"),
    ({"feature_map": "elu"}, ValueError, r"unknown attention_options \['feature_map'\] for '(gated-)?deltanet'"),
])
@pytest.mark.parametrize("attention", MECHS)
def test_bad_options_raise_clearly(attention, opts, error, match):
    with pytest.raises(error, match=match):
        get_attention(attention)(config(attention, opts))


def test_a_init_max_sets_the_range_of_gated_deltanets_initial_A():
    """A starts uniform in (0, a_init_max): a_init_max = 16 is the default (flash-linear-attention's), a
    smaller one a slower initial decay with the other parameters drawn as before; deltanet refuses
    the option and it must be > 0."""
    def layer(opts):
        torch.manual_seed(0)
        return get_attention("gated-deltanet")(config("gated-deltanet", opts, n_head=64, n_embd=256))

    default, same, slow = layer({}), layer({"a_init_max": 16.0}), layer({"a_init_max": 0.01})
    assert torch.equal(default.A_log, same.A_log)
    A = slow.A_log.exp()
    assert 0 < A.min() and A.max() <= 0.01 and A.max() > 0.005  # 64 draws spread over the range
    torch.testing.assert_close(A, default.A_log.exp() / 1600, rtol=1e-5, atol=0)  # the same uniform draws
    assert torch.equal(slow.dt_bias, default.dt_bias) and torch.equal(slow.c_attn.weight, default.c_attn.weight)
    with pytest.raises(ValueError, match=r"unknown attention_options \['a_init_max'\] for 'deltanet'"):
        get_attention("deltanet")(config("deltanet", {"a_init_max": 1.0}))
    with pytest.raises(ValueError, match=r"attention_options\['a_init_max'\] must be a number > 0, got 0"):
        get_attention("gated-deltanet")(config("gated-deltanet", {"a_init_max": 0}))


def test_decay_trainable_false_freezes_only_the_decay():
    """decay_trainable=False (an ablation): A_log, dt_bias and W_a get no gradient and keep their values
    through an optimizer step, everything else trains; the default trains them; deltanet refuses it."""
    def layer(opts):
        torch.manual_seed(0)
        return get_attention("gated-deltanet")(config("gated-deltanet", {"chunk_size": 4, **opts}, n_head=2, n_embd=16))

    frozen, default = layer({"decay_trainable": False}), layer({})
    decay = {"A_log", "dt_bias"} | {f"a_proj.{n}" for n, _ in frozen.a_proj.named_parameters()}
    assert {n for n, p in default.named_parameters() if p.requires_grad} >= decay
    assert {n for n, p in frozen.named_parameters() if not p.requires_grad} == decay
    before = {n: p.detach().clone() for n, p in frozen.named_parameters()}
    opt = torch.optim.AdamW([p for p in frozen.parameters() if p.requires_grad], lr=1e-2)
    frozen(torch.randn(2, 5, 16))[0].square().sum().backward()  # (output, cache)
    opt.step()
    for n, p in frozen.named_parameters():
        assert torch.equal(p, before[n]) == (n in decay), n
    with pytest.raises(ValueError, match=r"unknown attention_options \['decay_trainable'\] for 'deltanet'"):
        get_attention("deltanet")(config("deltanet", {"decay_trainable": False}))


def test_gated_deltanet_without_decay_is_deltanet():
    """With A -> 0 (a decay of 1) and DeltaNet's weights, Gated DeltaNet's output and the gradients of
    the shared weights are DeltaNet's: the gate adds nothing else (checked when Gated DeltaNet failed
    the hard recall setting where DeltaNet learned it)."""
    cfg = dict(n_head=2, n_embd=16)
    torch.manual_seed(0)
    dn = get_attention("deltanet")(config("deltanet", {"chunk_size": 4}, **cfg)).double()
    gd = get_attention("gated-deltanet")(config("gated-deltanet", {"chunk_size": 4}, **cfg)).double()
    missing = gd.load_state_dict(dn.state_dict(), strict=False).missing_keys
    assert sorted(missing) == ["A_log", "a_proj.bias", "a_proj.weight", "dt_bias"]
    with torch.no_grad():
        gd.A_log.fill_(-80.0)  # log a = -exp(-80) softplus(.): 1e-35 per token
    x = torch.randn(2, 11, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    w = torch.randn(2, 11, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    names, outs = dn.state_dict().keys(), []
    for layer in (dn, gd):
        y, _ = layer(x)
        shared = [p for n, p in layer.named_parameters() if n in names]
        outs.append((y, torch.autograd.grad((y * w).sum(), shared)))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-12, atol=1e-12)
    for a, b in zip(outs[1][1], outs[0][1]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("attention", MECHS)
@pytest.mark.parametrize("n_kv_head, bias", [(None, True), (2, False)])
def test_cost_terms(attention, n_kv_head, bias):
    from lintrans.bench.cost import ModelShape, attention_core_flops, cache_bytes, parameters
    from lintrans.experiments.models import state_floats

    cfg = config(attention, n_layer=2, n_embd=32, n_kv_head=n_kv_head, bias=bias, vocab_size=50)
    model = GPT(cfg)
    shape = ModelShape.from_config(cfg)
    assert parameters(shape)["total"] == sum(p.numel() for p in model.parameters())
    ungated = config(attention, {"output_gate": False}, n_layer=2, n_embd=32, n_kv_head=n_kv_head, bias=bias,
                     vocab_size=50)
    assert parameters(ModelShape.from_config(ungated))["total"] == sum(p.numel() for p in GPT(ungated).parameters())
    unnormed = config(attention, {"output_norm": False}, n_layer=2, n_embd=32, n_kv_head=n_kv_head, bias=bias,
                      vocab_size=50)
    assert GPT(unnormed).transformer.h[0].attn.o_norm is None
    assert parameters(ModelShape.from_config(unnormed))["total"] == sum(p.numel() for p in GPT(unnormed).parameters())
    fixed_beta = config(attention, {"learned_beta": False}, n_layer=2, n_embd=32, n_kv_head=n_kv_head, bias=bias,
                        vocab_size=50)
    assert GPT(fixed_beta).transformer.h[0].attn.beta_proj is None
    assert (parameters(ModelShape.from_config(fixed_beta))["total"]
            == sum(p.numel() for p in GPT(fixed_beta).parameters()))
    # the cache the model keeps (float32) is what the cost model says, at any length
    assert state_floats(model, 40) * 4 * 2 == cache_bytes(shape, 40) == cache_bytes(shape, 4000)
    N, h = 4, 8
    one = ModelShape(**{**shape.__dict__, "n_layer": 1})
    rec = ModelShape(**{**one.__dict__, "attention_options": {"form": "recurrent"}})
    assert attention_core_flops(rec, 100) == 6 * N * 100 * h * h
    per = lambda L: 10 * L * L * h + 6 * L * h * h + 2 * L ** 3 / 3  # noqa: E731
    # the default chunk (None) is the CPU kernel's, 32: T = 100 is three chunks of 32 and one of 4
    assert math.isclose(attention_core_flops(one, 100), N * (3 * per(32) + per(4)))
    c64 = ModelShape(**{**one.__dict__, "attention_options": {"chunk_size": 64}})
    assert math.isclose(attention_core_flops(c64, 100), N * (per(64) + per(36)))  # one chunk of 64, one of 36
    assert math.isclose(attention_core_flops(c64, 128, B=3), 3 * N * 2 * per(64))
    # rule="linear": linear attention's count with F = h features and E = h + 1 columns (z rides along)
    lin = ModelShape(**{**one.__dict__, "attention_options": {"rule": "linear"}})
    E = h + 1
    assert attention_core_flops(lin, 100) == N * (4 * 100 * h * E + 2 * (64 * 64 + 36 * 36) * (h + E))
    lin_rec = ModelShape(**{**one.__dict__, "attention_options": {"rule": "linear", "form": "recurrent"}})
    assert attention_core_flops(lin_rec, 100) == 2 * N * 100 * h * E
    lin_cfg = config(attention, {"rule": "linear"}, n_layer=2, n_embd=32, n_kv_head=n_kv_head, bias=bias, vocab_size=50)
    lin_shape = ModelShape.from_config(lin_cfg)
    assert state_floats(GPT(lin_cfg), 40) * 4 * 2 == cache_bytes(lin_shape, 40) == cache_bytes(shape, 40) + 2 * N * h * 4


@pytest.mark.parametrize("attention", MECHS)
def test_train_and_sample_from_the_cli(attention, tmp_path, capsys):
    from lintrans.cli import main

    out = tmp_path / "run"
    rc = main(["train", "--config", "tiny", "--set", f"model.attention={attention}", "--set", "model.n_layer=1",
               "--set", "model.n_embd=32", "--set", "model.block_size=32", "--set", "train.max_steps=2",
               "--set", "train.batch_size=2", "--set", "train.eval_interval=2", "--set", "train.eval_batches=1",
               "--set", "train.checkpoint_interval=2", "--set", f"train.out_dir={out}", "--set", "train.device=cpu"])
    assert rc == 0, capsys.readouterr().err
    capsys.readouterr()
    rc = main(["sample", "--checkpoint", str(out / "checkpoint"), "--prompt", "def ", "--max-new-tokens", "40",
               "--temperature", "0"])
    assert rc == 0
    assert capsys.readouterr().out.startswith("def ")


@pytest.mark.parametrize("attention", MECHS)
@pytest.mark.parametrize("rule", ["delta", "linear"])
def test_fla_backend_layer_equals_torch_backend(stand_in_fla, stand_in_fla_delta, attention, rule):
    """backend="fla" (fla's kernels replaced by their documented recurrences, tests/conftest.py): the same
    outputs and gradients as the torch backend, a whole sequence and then decoding (ours) from its cache."""
    torch.manual_seed(0)
    layers = {b: perturbed_layer(attention, {"backend": b, "rule": rule}, dtype=torch.float32) for b in ("torch", "fla")}
    layers["fla"].load_state_dict(layers["torch"].state_dict())
    x = torch.randn(2, 9, 24)
    got = {}
    for b, layer in layers.items():
        y, cache = layer(x[:, :8], use_cache=True)
        y_next, _ = layer(x[:, 8:], cache=cache, use_cache=True)
        y.square().sum().backward()
        got[b] = [y, y_next] + [p.grad for _, p in sorted(layer.named_parameters())]
    for a, b in zip(got["fla"], got["torch"]):  # float32 both, summed in different orders: relative to the size
        assert (a - b).abs().max() <= 1e-4 * b.abs().max()
    assert stand_in_fla_delta if rule == "delta" else stand_in_fla  # fla's stand-in ran


def test_fla_backend_needs_the_chunked_form():
    with pytest.raises(ValueError, match="backend='fla' computes the chunked form only"):
        perturbed_layer("deltanet", {"backend": "fla", "form": "recurrent"})


def test_fixed_beta_refuses_negative_eigenvalues():
    with pytest.raises(ValueError, match="allow_neg_eigval scales a learned beta"):
        perturbed_layer("deltanet", {"learned_beta": False, "allow_neg_eigval": True})


@pytest.mark.parametrize("rule", ["delta", "linear"])
@pytest.mark.parametrize("learned_beta", [True, False])
def test_bf16_autocast_forward_and_decode(rule, learned_beta):
    """Under CPU bf16 autocast (as training on a GPU runs) q, k, v are bf16 and x is not: every piece the
    layer makes itself (a fixed beta too) must fit both rules' ops, whole sequences and decoding steps."""
    torch.manual_seed(0)
    layer = perturbed_layer("gated-deltanet", {"rule": rule, "learned_beta": learned_beta}, dtype=torch.float32)
    x = torch.randn(2, 6, 24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, cache = layer(x[:, :5], use_cache=True)
        y_next, _ = layer(x[:, 5:], cache=cache, use_cache=True)
    assert torch.isfinite(y).all() and torch.isfinite(y_next).all()


@pytest.mark.parametrize("K", [1, 2, 4])
@pytest.mark.parametrize("T", [9, 1])  # 1: a decoding step's own path
def test_causal_conv_is_conv1d_and_keeps_the_channels_contiguous(K, T):
    """The short convolution equals F.conv1d (outputs and gradients, float64), and its output keeps
    [B, T, W] with unit stride along W: conv1d's transposed output gave q, k, v a stride of T there,
    which the delta-rule kernel copied on every call, forward and backward."""
    g = torch.Generator().manual_seed(K)
    u, prev = (torch.randn(2, n, 6, dtype=torch.float64, generator=g, requires_grad=True) for n in (T, K - 1))
    w = torch.randn(6, 1, K, dtype=torch.float64, generator=g, requires_grad=True)
    y, last = causal_conv(u, w, prev)
    full = torch.cat([prev, u], 1)
    ref = F.conv1d(full.transpose(1, 2), w, groups=6).transpose(1, 2)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(last, full[:, T:], rtol=0, atol=0)
    dy = torch.randn(y.shape, dtype=torch.float64, generator=g)
    for a, b in zip(torch.autograd.grad((y * dy).sum(), (u, w)), torch.autograd.grad((ref * dy).sum(), (u, w))):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    assert y.stride(-1) == 1
