"""Rotary position embeddings: the tables against a plain float64 reference, the GPT's softmax with
pos_embedding='rope' against a hand-written rotary attention, decode == forward, and refusals."""
import math

import pytest
import torch

from lintrans.models import GPT, GPTConfig
from lintrans.nn.rotary import apply_rope, rope_tables


def reference_rope(x, positions, base=10000.0):
    """Loop over positions and half-split pairs (i, i + D/2): each pair turned by p * base^(-2i/D)."""
    out = x.clone()
    D = x.shape[-1]
    half = D // 2
    for t, p in enumerate(positions):
        for i in range(half):
            theta = p * base ** (-2.0 * i / D)
            a, b = x[:, t, :, i], x[:, t, :, i + half]
            out[:, t, :, i] = a * math.cos(theta) - b * math.sin(theta)
            out[:, t, :, i + half] = a * math.sin(theta) + b * math.cos(theta)
    return out


@pytest.mark.parametrize("D", [2, 6, 16])
def test_rope_matches_reference(D):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 3, D, dtype=torch.float64)
    positions = [7, 8, 9, 10, 300]
    cos, sin = rope_tables(torch.tensor(positions), D, dtype=torch.float64)
    torch.testing.assert_close(apply_rope(x, cos, sin), reference_rope(x, positions), rtol=1e-12, atol=1e-12)


def test_rope_scores_depend_on_relative_position_only():
    torch.manual_seed(1)
    q, k = torch.randn(1, 1, 1, 8, dtype=torch.float64), torch.randn(1, 1, 1, 8, dtype=torch.float64)

    def score(m, n):
        rq = apply_rope(q, *rope_tables(torch.tensor([m]), 8, dtype=torch.float64))
        rk = apply_rope(k, *rope_tables(torch.tensor([n]), 8, dtype=torch.float64))
        return float((rq * rk).sum())

    assert score(5, 2) == pytest.approx(score(103, 100), abs=1e-12)
    assert score(5, 2) != pytest.approx(score(5, 3), abs=1e-6)  # and it does depend on them


def test_rope_rejects_odd_head_dim():
    with pytest.raises(ValueError, match="even head_dim"):
        rope_tables(torch.arange(3), 5)
    with pytest.raises(ValueError, match="even head_dim"):
        GPTConfig(n_layer=1, n_head=2, n_embd=10, pos_embedding="rope")


def tiny(**kw):
    base = dict(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=31, pos_embedding="rope")
    return GPTConfig(**{**base, **kw})


def reference_forward(model, idx):
    """The GPT written out by hand in float64: softmax attention on rotated q and k."""
    x = model.transformer.wte(idx)
    B, T = idx.shape
    cos, sin = rope_tables(torch.arange(T), model.config.head_dim, dtype=torch.float64)
    H, D = model.config.n_head, model.config.head_dim
    for block in model.transformer.h:
        a = block.attn
        h = block.ln_1(x)
        q, k, v = a.c_attn(h).split(H * D, dim=2)
        q, k, v = (t.view(B, T, H, D) for t in (q, k, v))
        q, k = reference_rope(q, range(T)), reference_rope(k, range(T))
        s = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(D)
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        o = torch.einsum("bhts,bshd->bthd", s.softmax(-1), v).reshape(B, T, H * D)
        x = x + a.c_proj(o)
        x = x + block.feed(x)
    return model.lm_head(model.transformer.ln_f(x))


def test_gpt_rope_matches_hand_written_reference():
    torch.manual_seed(2)
    model = GPT(tiny()).double().eval()
    idx = torch.randint(0, 31, (2, 7))
    logits, _ = model(idx)
    torch.testing.assert_close(logits, reference_forward(model, idx), rtol=1e-10, atol=1e-10)
    assert "wpe" not in model.transformer  # no table: nothing to learn, no block_size cap


@pytest.mark.parametrize("n_kv_head", [None, 1])
def test_rope_decode_equals_forward(n_kv_head):
    torch.manual_seed(3)
    model = GPT(tiny(n_kv_head=n_kv_head, block_size=4)).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    idx = torch.randint(0, 31, (2, 11))  # longer than block_size: rope has no table to outgrow
    full, _ = model(idx)
    cache, outs, start = None, [], 0
    for end in [3, 5, *range(6, 12)]:  # a prompt in two pieces, then one token per call
        logits, cache = model.forward_cached(idx[:, start:end], cache)
        outs.append(logits)
        start = end
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-10, atol=1e-10)


def test_rope_gradients_flow_and_checkpointing_agrees():
    torch.manual_seed(4)
    model = GPT(tiny()).double()
    idx = torch.randint(0, 31, (2, 6))
    _, loss = model(idx, idx)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    ckpt = GPT(tiny(gradient_checkpointing=True)).double()
    ckpt.load_state_dict(model.state_dict())
    _, loss2 = ckpt(idx, idx)
    grads2 = torch.autograd.grad(loss2, list(ckpt.parameters()))
    torch.testing.assert_close(loss2, loss)
    for g, g2 in zip(grads, grads2):
        torch.testing.assert_close(g2, g)


@pytest.mark.parametrize("attention", ["linear", "gated-linear", "deltanet", "sliding-window"])
def test_rope_refused_by_mechanisms_without_it(attention):
    with pytest.raises(ValueError, match="pos_embedding='rope'.*works with \\['softmax'\\]"):
        GPT(tiny(attention=attention))


def test_rope_refused_with_reversible():
    with pytest.raises(ValueError, match="reversible"):
        tiny(reversible=True)


def test_rope_config_round_trips():
    c = tiny()
    assert GPTConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="pos_embedding must be one of"):
        tiny(pos_embedding="rotary")
