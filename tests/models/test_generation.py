import pytest
import torch

from lintrans.models import GPT, GPTConfig
from lintrans.models.generate import sample_next
from lintrans.nn import available_attention

# options that make each mechanism exercise its awkward paths (chunk boundaries inside the prompt)
OPTIONS = {"linear": {"chunk_size": 4}, "retention": {"chunk_size": 4}, "gated-linear": {"chunk_size": 4}}


def perturbed(model):
    """Weights far from init so logits are large and decisive, and mistakes show."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


def tiny(attention="softmax", **kw):
    base = dict(n_layer=2, n_head=4, n_embd=32, block_size=64, vocab_size=53, attention=attention,
                attention_options=OPTIONS.get(attention, {}))
    return GPTConfig(**{**base, **kw})


def decode_logits(model, idx, prompt_splits):
    """Logits of every position computed incrementally: the prompt in pieces, then one token per call."""
    cache, outs, start = None, [], 0
    for end in [*prompt_splits, *range(prompt_splits[-1] + 1, idx.shape[1] + 1)]:
        logits, cache = model.forward_cached(idx[:, start:end], cache)
        outs.append(logits)
        start = end
    return torch.cat(outs, dim=1), cache


CASES = [
    *[(name, {}) for name in available_attention()],
    ("linear", {"feature_map": "based", "chunk_size": 5}),
    ("linear", {"feature_map": "softplus", "form": "state_parallel"}),
    ("linear", {"feature_map": "rebased"}),
    ("linear", {"feature_map": "hedgehog"}),
    ("linear", {"feature_map": "performer", "feature_map_options": {"num_features": 16}}),
    ("gated-linear", {"feature_map": "elu", "normalize": True, "chunk_size": 5}),
    ("retention", {"feature_map": "elu", "group_norm": False, "form": "state_parallel"}),
    ("bigbird", {"block_size": 4, "window_blocks": 2, "global_blocks": 1, "random_blocks": 2, "seed": 3}),
    ("reformer", {"n_buckets": 4, "n_hashes": 3, "chunk_size": 3, "seed": 1}),
]


@pytest.mark.parametrize("attention, options", CASES, ids=lambda x: str(x) if x else "default")
@pytest.mark.parametrize("n_kv_head", [None, 2])
def test_decoding_equals_one_forward(attention, options, n_kv_head):
    from lintrans.nn.attention import feature_map_names

    if options.get("feature_map", "elu") not in feature_map_names():
        pytest.skip(f"feature map {options['feature_map']} not available")
    cfg = tiny(attention, n_kv_head=n_kv_head)
    if options:
        cfg = cfg.replace(attention_options=options)
    try:
        model = perturbed(GPT(cfg))
    except (TypeError, ValueError, NotImplementedError) as e:
        if n_kv_head is None or "n_kv_head" not in str(e):
            raise
        pytest.skip(f"{attention} has no grouped-query support: {e}")
    idx = torch.randint(0, 53, (2, 23))
    with torch.no_grad():  # every mechanism decodes incrementally: one that stops is a failure, not a skip
        full, _ = model(idx)
        for splits in ([7], [1], [3, 9]):  # one prefill, a 1-token prompt, a prompt in two calls
            step, cache = decode_logits(model, idx, splits)
            assert step.shape == full.shape
            assert (step - full).abs().max() <= 1e-4, splits
    assert cache.length == 23


@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_greedy_generate_equals_recomputing_everything(attention):
    model = perturbed(GPT(tiny(attention)))
    prompt = torch.randint(0, 53, (2, 5))
    out = model.generate(prompt, 20, temperature=0)
    ref = prompt
    with torch.no_grad():
        for _ in range(20):  # nanoGPT's way: a full forward for every new token
            ref = torch.cat([ref, model(ref)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, ref)
    assert len(set(out[0, 5:].tolist())) > 1  # not a constant sequence: the check has teeth


def test_linear_state_size_is_constant():
    model = GPT(tiny("linear", n_layer=1, n_embd=16, n_head=2, block_size=1024)).eval()
    sizes = {}
    with torch.no_grad():
        logits, cache = model.forward_cached(torch.randint(0, 53, (1, 4)))
        for t in range(4, 1001):
            if t in (10, 1000):
                sizes[t] = cache.nbytes()
            logits, cache = model.forward_cached(logits[:, -1:].argmax(-1), cache)
    assert sizes[10] == sizes[1000] > 0
    # ... while the KV cache grows with the context
    soft = GPT(tiny("softmax", n_layer=1, n_embd=16, n_head=2, block_size=1024)).eval()
    with torch.no_grad():
        _, c10 = soft.forward_cached(torch.randint(0, 53, (1, 10)))
        _, c100 = soft.forward_cached(torch.randint(0, 53, (1, 100)))
    assert c100.nbytes() == 10 * c10.nbytes()


def test_sampling_is_seeded_and_top_k_1_is_greedy():
    model = perturbed(GPT(tiny()))
    prompt = torch.randint(0, 53, (3, 4))
    a = model.generate(prompt, 15, temperature=1.0, seed=7)
    b = model.generate(prompt, 15, temperature=1.0, seed=7)
    c = model.generate(prompt, 15, temperature=1.0, seed=8)
    assert torch.equal(a, b) and not torch.equal(a, c)
    greedy = model.generate(prompt, 15, temperature=0)
    assert torch.equal(model.generate(prompt, 15, temperature=1.3, top_k=1, seed=1), greedy)
    assert torch.equal(model.generate(prompt, 15, temperature=1.0, top_p=1e-6, seed=1), greedy)
    streamed = torch.cat([prompt, *model.generate_stream(prompt, 15, seed=7)], dim=1)
    assert torch.equal(streamed, a)


def test_a_tiny_temperature_is_greedy_not_nan():
    """logits / 1e-38 overflow float32 to inf, and softmax of inf - inf is nan (multinomial failed)."""
    logits = torch.randn(3, 50) * 7
    for t in (1e-38, 1e-45, 1e-30, 1e-46, 1e-300):
        assert torch.equal(sample_next(logits, t), logits.argmax(-1, keepdim=True))


@pytest.mark.parametrize("attention", available_attention())
def test_an_empty_batch_runs(attention):
    options = {"block_size": 4} if attention == "bigbird" else {}
    model = GPT(tiny(attention=attention, attention_options=options))
    logits, _ = model(torch.zeros(0, 5, dtype=torch.long))
    assert logits.shape == (0, 5, model.config.vocab_size)


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    g = torch.Generator().manual_seed(0)
    assert set(sample_next(logits, 1.0, top_k=2, generator=g).unique().tolist()) == {0, 1}
    # 0.5 < 0.7 so token 1 is needed; 0.5 + 0.3 >= 0.7 so tokens 2 and 3 are not
    assert set(sample_next(logits, 1.0, top_p=0.7, generator=g).unique().tolist()) == {0, 1}
    assert set(sample_next(logits, 1.0, generator=g).unique().tolist()) == {0, 1, 2, 3}
    freq = (sample_next(logits, 1.0, generator=g) == 0).float().mean().item()
    assert abs(freq - 0.5) < 0.05


def test_generation_restores_training_mode_and_ignores_dropout():
    model = perturbed(GPT(tiny(dropout=0.5)))
    model.train()
    prompt = torch.randint(0, 53, (1, 4))
    a = model.generate(prompt, 8, temperature=0)
    assert model.training
    assert torch.equal(a, model.generate(prompt, 8, temperature=0))


def test_generation_bad_input():
    model = GPT(tiny())
    prompt = torch.randint(0, 53, (1, 60))
    for kw, match in (
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=2, temperature=-1), "temperature"),
        (dict(max_new_tokens=2, top_k=0), "top_k"),
        (dict(max_new_tokens=2, top_p=1.5), "top_p"),
        (dict(max_new_tokens=2, seed=2**64), "seed"),  # past what torch's generator takes
    ):
        with pytest.raises(ValueError, match=match):
            model.generate(prompt[:, :3], **kw)


def nanogpt_greedy(model, idx, n):
    """nanoGPT's generate, greedy: full forward over the last block_size tokens for every token."""
    for _ in range(n):
        logits, _ = model(idx[:, -model.config.block_size:])
        idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx


@pytest.mark.parametrize("attention", ["softmax", "linear", "gated-linear", "sliding-window"])
@pytest.mark.parametrize("prompt_len", [5, 70])  # shorter and longer than the block size
def test_generation_past_block_size_crops_like_nanogpt(attention, prompt_len):
    torch.manual_seed(0)
    model = perturbed(GPT(tiny(attention=attention))).eval()  # block_size 64, learned positions
    prompt = torch.randint(0, 53, (2, prompt_len))
    out = model.generate(prompt, 80, temperature=0)
    assert out.shape == (2, prompt_len + 80)
    assert torch.equal(out, nanogpt_greedy(model, prompt, 80))


@pytest.mark.parametrize("attention", ["linear", "gated-linear"])
def test_generation_without_positions_keeps_the_recurrent_state(attention):
    torch.manual_seed(0)
    model = perturbed(GPT(tiny(attention=attention, pos_embedding="none"))).eval()
    prompt = torch.randint(0, 53, (1, 10))
    out = model.generate(prompt, 100, temperature=0)  # 110 > block_size 64: nothing cropped
    logits, _ = model(out[:, :-1])  # the whole sequence in one forward: no position limit
    assert torch.equal(out[:, 10:], logits[:, 9:].argmax(-1))


@pytest.mark.parametrize("attention", available_attention())
def test_inference_mode_first_then_training(attention):
    """Constants an op caches (BigBird's block pattern, LSH's rotations, causal masks) made during a
    first call under torch.inference_mode must not be inference tensors: a later training step saves
    them for backward (BigBird's pattern failed so). T = 61 is used by no other test, so the
    caches are first filled here."""
    model = GPT(tiny(attention=attention))
    idx = torch.randint(0, 53, (1, 61), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model(idx)
        model.generate(idx[:, :7], 3)
    _, loss = model(idx, idx)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_top_p_keeps_the_exact_nucleus_on_a_large_vocabulary():
    """The smallest set of tokens whose mass reaches p, by the float64 definition: float32's running
    sum over 50k probabilities drifted enough to move the edge by one token in 12 of 144 rows."""
    from unittest import mock

    torch.manual_seed(0)
    logits = torch.randn(144, 50257) * 4
    kept = {}
    real = torch.multinomial

    def draw(probs, n, generator=None):  # the filtered distribution, as sampled from
        kept["p"] = probs
        return real(probs, n, generator=generator)

    with mock.patch("torch.multinomial", draw):
        sample_next(logits, 1.0, top_p=0.95)
    probs = logits.double().softmax(-1).sort(-1, descending=True).values
    exact = (probs.cumsum(-1) < 0.95).sum(-1) + 1  # tokens before the mass reaches p, and the one that does
    assert torch.equal((kept["p"] > 0).sum(-1), exact)


def test_generation_restores_every_modules_own_mode():
    """A user's eval-mode submodule stays in eval mode (generate put the top-level mode back on all)."""
    model = GPT(tiny())
    model.train()
    model.transformer.h[0].eval()
    model.generate(torch.zeros(1, 3, dtype=torch.long), 2)
    assert model.training and not model.transformer.h[0].training and model.transformer.h[1].training


@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_eos_token_id_ends_rows_and_stops_when_all_have(attention):
    """As Hugging Face's: a row that produced eos_token_id repeats it; generation stops once every row
    has; rows before their end are the unstopped generation's."""
    model = perturbed(GPT(tiny(attention=attention)))
    prompt = torch.randint(0, 53, (3, 4), generator=torch.Generator().manual_seed(1))
    free = model.generate(prompt, 12, temperature=0)
    new = free[:, 4:]
    eos = int(new[0, 2])  # row 0 ends at its third new token
    out = model.generate(prompt, 12, temperature=0, eos_token_id=eos)
    for r in range(3):
        hits = (new[r] == eos).nonzero()
        end = int(hits[0]) if len(hits) else None
        got = out[r, 4:]
        if end is None:
            assert torch.equal(got, new[r, : got.shape[0]])
        else:
            assert torch.equal(got[: end + 1], new[r, : end + 1]) and (got[end:] == eos).all()
    stops = [int((new[r] == eos).nonzero()[0]) if (new[r] == eos).any() else 11 for r in range(3)]
    assert out.shape[1] == 4 + max(stops) + 1
    with pytest.raises(ValueError, match="eos_token_id"):
        model.generate(prompt, 2, eos_token_id=53)
