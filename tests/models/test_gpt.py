import math

import pytest
import torch

from lintrans.models import GPT, GPTConfig


def tiny(**kw):
    base = dict(n_layer=2, n_head=4, n_embd=32, block_size=32, vocab_size=61)
    return GPTConfig(**{**base, **kw})


def test_config_round_trip_and_unknown_keys():
    cfg = tiny(attention="linear", attention_options={"feature_map": "relu", "chunk_size": 8}, n_kv_head=2)
    assert GPTConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match=r"unknown GPTConfig keys \['n_layers'\]"):
        GPTConfig.from_dict({**cfg.to_dict(), "n_layers": 3})


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(n_embd=30), "divisible by n_head"),
        (dict(n_kv_head=3), "divisible by n_kv_head"),
        (dict(mlp="relu"), "mlp must be one of"),
        (dict(gelu_approximate="erf"), "gelu_approximate must be one of"),
        (dict(dropout=1.0), "dropout"),
        (dict(n_layer=0), "n_layer"),
    ],
)
def test_config_rejects_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        tiny(**kw)


def test_unknown_attention_name_lists_allowed():
    with pytest.raises(ValueError, match=r"attention must be one of \[.*'linear'.*'softmax'.*\], got 'flash'"):
        GPT(tiny(attention="flash"))


def test_unknown_attention_option():
    with pytest.raises(ValueError, match=r"unknown attention_options \['chunk'\] for 'linear'"):
        GPT(tiny(attention="linear", attention_options={"chunk": 4}))
    with pytest.raises(ValueError, match="feature_map'\\] must be one of"):
        GPT(tiny(attention="linear", attention_options={"feature_map": "nope"}))


def test_forward_shapes_loss_and_names():
    model = GPT(tiny())
    idx = torch.randint(0, 61, (3, 17))
    logits, loss = model(idx)
    assert logits.shape == (3, 17, 61) and loss is None
    targets = torch.randint(0, 61, (3, 17))
    logits, loss = model(idx, targets)
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 61), targets.reshape(-1))
    torch.testing.assert_close(loss, ref)
    # a fresh model predicts nearly uniformly
    assert abs(loss.item() - math.log(61)) < 0.3
    names = set(model.state_dict())
    for n in ("transformer.wte.weight", "transformer.wpe.weight", "transformer.h.1.attn.c_attn.weight",
              "transformer.h.1.attn.c_proj.bias", "transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_proj.weight",
              "transformer.h.0.ln_1.weight", "transformer.h.0.ln_2.bias", "transformer.ln_f.weight", "lm_head.weight"):
        assert n in names
    assert model.lm_head.weight is model.transformer.wte.weight


def test_ignore_index_in_targets():
    model = GPT(tiny())
    idx = torch.randint(0, 61, (2, 9))
    targets = idx.clone()
    targets[:, :4] = -1
    logits, loss = model(idx, targets)
    ref = torch.nn.functional.cross_entropy(logits[:, 4:].reshape(-1, 61), idx[:, 4:].reshape(-1))
    torch.testing.assert_close(loss, ref)


@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_loss_without_logits_equals_plain_loss_and_grads(attention):
    """return_logits=False (the training path) gives the same loss and gradients, tied head included."""
    model = GPT(tiny(attention=attention, vocab_size=61)).double()
    idx = torch.randint(0, 61, (2, 9))
    targets = idx.roll(-1, 1)
    targets[0, :3] = -1
    logits, ref = model(idx, targets)
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    none, got = model(idx, targets, return_logits=False)
    assert none is None
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got, list(model.parameters())), ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="return_logits=False needs targets"):
        model(idx, return_logits=False)
    # int32 targets work on both paths; bad targets get the same one-line errors on both
    torch.testing.assert_close(model(idx, targets.int())[1], ref, rtol=0, atol=0)
    torch.testing.assert_close(model(idx, targets.int(), return_logits=False)[1], ref, rtol=1e-12, atol=1e-12)
    for return_logits in (True, False):
        with pytest.raises(ValueError, match=r"targets must have the shape of idx \(2, 9\), got \(2, 4\)"):
            model(idx, targets[:, :4], return_logits=return_logits)
        with pytest.raises(TypeError, match="targets must be an int64 .* got torch.float32"):
            model(idx, targets.float(), return_logits=return_logits)
        with pytest.raises(TypeError, match="targets must be an int64 .* got list"):
            model(idx, targets.tolist(), return_logits=return_logits)
        for bad in (61, -2):
            wrong = targets.clone()
            wrong[1, 4] = bad
            with pytest.raises(ValueError, match=rf"targets must lie in \[0, 60\] \(vocab_size 61\) or equal -1 "
                                                 rf"\(ignored\), got {bad}$"):
                model(idx, wrong, return_logits=return_logits)


def test_loss_without_logits_under_bf16_autocast():
    model = GPT(tiny())
    idx = torch.randint(0, 61, (2, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, ref = model(idx, idx)
        _, got = model(idx, idx, return_logits=False)
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
    got.backward()
    assert model.lm_head.weight.grad.dtype == torch.float32


def test_init_and_param_count_match_nanogpt():
    cfg = tiny(n_layer=8, n_embd=64, vocab_size=500)
    model = GPT(cfg)
    c, L = cfg.n_embd, cfg.n_layer
    per_block = 4 * c + (3 * c * c + 3 * c) + (c * c + c) + (4 * c * c + 4 * c) + (4 * c * c + c)
    assert model.get_num_params() == 500 * c + L * per_block + 2 * c
    assert model.get_num_params(non_embedding=False) == model.get_num_params() + cfg.block_size * c
    std = torch.stack([b.attn.c_proj.weight.std() for b in model.transformer.h]).mean()
    assert abs(std.item() - 0.02 / math.sqrt(2 * L)) < 0.001
    assert abs(model.transformer.h[0].attn.c_attn.weight.std().item() - 0.02) < 0.002
    assert model.transformer.h[0].attn.c_attn.bias.abs().max() == 0


def test_gqa_shapes_and_swiglu():
    model = GPT(tiny(n_kv_head=1, mlp="swiglu")).double().eval()
    assert model.transformer.h[0].attn.c_attn.weight.shape == ((4 + 2) * 8, 32)
    logits, _ = model(torch.randint(0, 61, (2, 5)))
    assert logits.shape == (2, 5, 61)
    # SwiGLU: c_proj(silu(gate) * value), gate the first half of c_fc's outputs; the hidden width is
    # 2/3 of GELU's 4 x 32, rounded up to 8 (88), so its three matrices cost what GELU's two do
    mlp, h = model.transformer.h[0].mlp, 88
    assert mlp.c_fc.weight.shape == (2 * h, 32) and mlp.c_proj.weight.shape == (32, h)
    with torch.no_grad():  # biases start at zero: make them count
        mlp.c_fc.bias.normal_()
        mlp.c_proj.bias.normal_()
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    gate, value = (x @ mlp.c_fc.weight[s].T + mlp.c_fc.bias[s] for s in (slice(0, h), slice(h, 2 * h)))
    want = (gate * torch.sigmoid(gate) * value) @ mlp.c_proj.weight.T + mlp.c_proj.bias
    torch.testing.assert_close(mlp(x), want, rtol=1e-12, atol=1e-12)


def test_gqa_equals_mha_with_repeated_kv_heads():
    """GQA with 2 kv heads == MHA whose k, v projections repeat those heads: checks the grouping."""
    for attention in ("softmax", "linear"):
        gqa = GPT(tiny(n_kv_head=2, attention=attention))
        mha = GPT(tiny(attention=attention))
        sd = gqa.state_dict()
        for i in range(2):
            W, b = sd[f"transformer.h.{i}.attn.c_attn.weight"], sd[f"transformer.h.{i}.attn.c_attn.bias"]
            D = 8

            def expand(x):
                q, k, v = x.split([32, 2 * D, 2 * D])
                rep = lambda t: t.reshape(2, D, *t.shape[1:]).repeat_interleave(2, 0).reshape(4 * D, *t.shape[1:])  # noqa: E731
                return torch.cat([q, rep(k), rep(v)])

            sd[f"transformer.h.{i}.attn.c_attn.weight"], sd[f"transformer.h.{i}.attn.c_attn.bias"] = expand(W), expand(b)
        mha.load_state_dict(sd)
        idx = torch.randint(0, 61, (2, 11))
        torch.testing.assert_close(gqa(idx)[0], mha(idx)[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_gradient_checkpointing_gives_equal_grads(attention, monkeypatch):
    import lintrans.models.gpt as gpt

    calls = []
    real = gpt.checkpoint
    monkeypatch.setattr(gpt, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(1)
    a = GPT(tiny(attention=attention))
    b = GPT(tiny(attention=attention, gradient_checkpointing=True))
    b.load_state_dict(a.state_dict())
    idx = torch.randint(0, 61, (2, 13))
    for m in (a, b):
        m.train()
        m(idx, idx)[1].backward()
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, atol=1e-6, rtol=1e-5, msg=n)
    assert len(calls) == 2  # one checkpointed call per block: b really recomputed


def test_bad_idx():
    model = GPT(tiny())
    with pytest.raises(ValueError, match="exceeds block_size 32"):
        model(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 60\]"):
        model(torch.tensor([[1, 61]]))
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 60\]"):
        model(torch.tensor([[-1, 2]]))
    with pytest.raises(TypeError, match="idx must be an int64"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"shape \[B, T\]"):
        model(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="targets must have the shape of idx"):
        model(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))


def test_no_position_embedding_allows_longer_context():
    model = GPT(tiny(pos_embedding="none", attention="linear"))
    assert "wpe" not in model.transformer
    logits, _ = model(torch.randint(0, 61, (1, 50)))
    assert logits.shape == (1, 50, 61)


def test_hidden_from_inputs_embeds_equals_hidden_from_ids():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=32, vocab_size=50)).eval()
    idx = torch.randint(0, 50, (2, 9))
    from_ids = model.hidden(idx)  # [B,T,C]
    assert torch.equal(from_ids, model.hidden(inputs_embeds=model.transformer.wte(idx)))
    logits, _ = model(idx)
    torch.testing.assert_close(model.lm_head(from_ids), logits)
    with pytest.raises(ValueError, match="exactly one of idx and inputs_embeds"):
        model.hidden(idx, inputs_embeds=model.transformer.wte(idx))
    with pytest.raises(ValueError, match=r"inputs_embeds must be a tensor \[B, T, 16\]"):
        model.hidden(inputs_embeds=torch.zeros(2, 9, 15))
    with pytest.raises(ValueError, match="exceeds block_size 32"):
        model.hidden(inputs_embeds=torch.zeros(1, 33, 16))


def test_context_parallel_is_refused_by_softmax():
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=64))
    with pytest.raises(ValueError, match="attention 'softmax' cannot split a sequence over processes.*'linear'"):
        model.set_context_parallel(object())  # refused before the group is looked at
    assert model.context_parallel is None


@pytest.mark.parametrize("attention, options", [("aft-full", {}), ("aft-local", {"window": 4}),
                                                ("cosformer", {"max_len": 40})])
def test_layers_with_a_position_limit(attention, options):
    """AFT-full/local's pairwise bias has block_size positions and cosFormer's re-weighting max_len: a
    longer input gets a clear error naming them (not one from inside the op), and generation crops
    to the limit as it does for learned positions."""
    torch.manual_seed(0)
    model = GPT(tiny(attention=attention, attention_options=options, pos_embedding="none")).eval()
    limit = options.get("max_len", 32)
    assert model.position_limit() == limit
    with pytest.raises(ValueError, match=f"exceeds {limit}, the positions attention '{attention}'"):
        model(torch.zeros(1, limit + 1, dtype=torch.long))
    out = model.generate(torch.randint(0, 61, (2, 5)), limit + 6, temperature=0.0)
    assert out.shape == (2, limit + 11)
    # past the limit each token comes from the last `limit` tokens alone, as a fresh forward gives
    logits, _ = model(out[:, -limit - 1 : -1])
    assert torch.equal(logits[:, -1].argmax(-1), out[:, -1])
    assert GPT(tiny(attention="aft-simple", pos_embedding="none")).position_limit() is None


def test_generate_checks_idx_first():
    model = GPT(tiny())
    with pytest.raises(ValueError, match=r"shape \[B, T\]"):
        model.generate(torch.zeros(3, dtype=torch.long), 2)
    with pytest.raises(TypeError, match="idx must be an int64"):
        model.generate([[1, 2]], 2)
