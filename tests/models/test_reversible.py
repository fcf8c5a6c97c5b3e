"""Reversible residual layers: the recomputing backward against ordinary autograd on the same
architecture, memory flat in depth, dropout replayed, decoding."""
import functools

import pytest
import torch

import lintrans.models.gpt as gpt_module
from lintrans.models import GPT, GPTConfig
from lintrans.models import reversible

OPTIONS = {"reformer": {"n_buckets": 4, "n_hashes": 2, "chunk_size": 4}, "linear": {"chunk_size": 4},
           "bigbird": {"block_size": 4, "window_blocks": 2, "random_blocks": 1}}


def model(attention="softmax", n_layer=3, dtype=torch.float64, **kw):
    cfg = GPTConfig(n_layer=n_layer, n_head=2, n_embd=16, block_size=32, vocab_size=29, attention=attention,
                    attention_options=OPTIONS.get(attention, {}), reversible=True, **kw)
    torch.manual_seed(0)
    m = GPT(cfg).to(dtype)
    with torch.no_grad():  # far from init, so that every path matters
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return m


@pytest.fixture
def storing(monkeypatch):
    """Run the reversible GPT with ordinary autograd (every block's activations stored)."""
    def use():
        monkeypatch.setattr(gpt_module, "reversible_blocks",
                            functools.partial(reversible.reversible_blocks, recompute=False))
    return use


def grads(m, x, idx):
    """Gradients of a loss through the token path (every parameter) and of inputs_embeds x."""
    loss = m(idx, idx)[1] + (m.hidden(inputs_embeds=x) * torch.linspace(-1, 1, 16, dtype=x.dtype)).sum()
    params = [p for p in m.parameters()]
    return loss, torch.autograd.grad(loss, [*params, x])


@pytest.mark.parametrize("attention", ["softmax", "linear", "reformer", "bigbird", "cosformer"])
def test_gradients_equal_ordinary_autograd(attention, storing):
    m = model(attention)
    idx = torch.randint(0, 29, (2, 19), generator=torch.Generator().manual_seed(1))
    x = torch.randn(2, 19, 16, dtype=torch.float64, requires_grad=True)
    loss, got = grads(m, x, idx)
    storing()
    loss_ref, want = grads(m, x, idx)
    assert loss.item() == loss_ref.item()
    names = [n for n, _ in m.named_parameters()] + ["inputs_embeds"]
    assert len(got) == len(names) and all(g is not None for g in got)
    for name, a, b in zip(names, got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=name)
    assert max(g.abs().max() for g in want) > 1e-2  # gradients that can tell a mistake


def test_the_reversible_model_is_its_own_architecture():
    # two streams merged before ln_f: not the ordinary GPT's function of the same parameters
    m = model()
    plain = GPT(m.config.replace(reversible=False)).double()
    plain.load_state_dict(m.state_dict())
    idx = torch.randint(0, 29, (1, 9))
    with torch.no_grad():
        assert (m(idx)[0] - plain(idx)[0]).abs().max() > 1e-3


def test_dropout_is_replayed_in_the_recomputation(storing):
    m = model("softmax", dropout=0.2).train()
    idx = torch.randint(0, 29, (2, 15), generator=torch.Generator().manual_seed(2))
    params = list(m.parameters())

    def run():
        torch.manual_seed(5)
        loss = m(idx, idx)[1]
        g = torch.autograd.grad(loss, params)
        return loss, g, torch.rand(3)  # the RNG after the backward pass

    loss, got, after = run()
    storing()
    loss_ref, want, after_ref = run()
    assert loss.item() == loss_ref.item()
    torch.testing.assert_close(after, after_ref)  # the replay leaves the RNG where ordinary autograd does
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    torch.manual_seed(6)
    assert (m(idx, idx)[1] - loss).abs() > 1e-6  # another seed, other masks: dropout is on


def saved_activation_bytes(m, idx):
    """Bytes the forward pass leaves for the backward pass, parameters excluded (the backward's
    recomputation saves one block's activations at a time, freed as it goes)."""
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = m(idx, idx)[1]
    loss.backward()
    return total


@pytest.mark.parametrize("attention", ["softmax", "reformer"])
def test_activation_memory_is_flat_in_depth(attention, storing):
    idx = torch.randint(0, 29, (2, 32), generator=torch.Generator().manual_seed(3))
    rev = [saved_activation_bytes(model(attention, n, torch.float32), idx) for n in (1, 2, 6)]
    assert rev[0] == rev[1] == rev[2]
    plain = [saved_activation_bytes(GPT(model(attention, n, torch.float32).config.replace(reversible=False)), idx)
             for n in (1, 2, 6)]
    assert plain[2] - plain[1] == 4 * (plain[1] - plain[0]) > 0  # the ordinary GPT: a layer's worth per layer
    storing()
    stored = [saved_activation_bytes(model(attention, n, torch.float32), idx) for n in (1, 2, 6)]
    assert stored[2] - stored[1] == 4 * (stored[1] - stored[0]) > 0  # the measure sees activations
    assert rev[2] < stored[2] / 3


@pytest.mark.parametrize("attention", ["softmax", "linear", "reformer"])
def test_decoding_equals_the_forward_pass(attention):
    m = model(attention, dtype=torch.float32).eval()
    idx = torch.randint(0, 29, (2, 21), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = m(idx)[0]
        logits, cache = m.forward_cached(idx[:, :6])
        steps = [logits]
        for t in range(6, 21):
            logits, cache = m.forward_cached(idx[:, t:t + 1], cache)
            steps.append(logits)
    assert (torch.cat(steps, dim=1) - full).abs().max() < 1e-4


def test_bf16_autocast_recomputes_under_the_same_autocast(storing):
    m = model("linear", dtype=torch.float32)
    idx = torch.randint(0, 29, (2, 17), generator=torch.Generator().manual_seed(5))
    params = list(m.parameters())

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(idx, idx)[1]
        return torch.autograd.grad(loss, params)

    got = run()
    storing()
    want = run()
    # under the forward's autocast F and G recompute the very bf16 values of the forward, so the
    # rebuilt inputs (y - F(x) after y = x + F(x)) differ only by float32 rounding; recomputed
    # without it they would differ by bf16 rounding (2^-8 relative), far outside these tolerances
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * b.abs().max().item())


def test_reversible_config_errors():
    with pytest.raises(TypeError, match="GPTConfig.reversible must be a bool"):
        GPTConfig(reversible="yes")
    with pytest.raises(ValueError, match="gradient_checkpointing must be False"):
        GPTConfig(reversible=True, gradient_checkpointing=True)


def test_a_retained_graph_gives_the_same_gradients_twice():
    m = model("reformer")
    idx = torch.randint(0, 29, (2, 13), generator=torch.Generator().manual_seed(6))
    loss = m(idx, idx)[1]
    params = list(m.parameters())
    first = torch.autograd.grad(loss, params, retain_graph=True)
    for a, b in zip(first, torch.autograd.grad(loss, params)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
