"""The decoding cache of every attention layer, as a library user meets it: gradients through
token-by-token decoding, use_cache=False leaving a cache as it was, a cache of another batch refused,
the meta device, an empty sequence."""
import pytest
import torch

from lintrans.models import GPTConfig
from lintrans.nn import available_attention, get_attention

from decoding import assert_decoding_equals_forward, decode

# small structure so that T = 12 crosses windows, blocks, buckets and chunks
SMALL = {
    "sliding-window": {"window": 4},
    "aft-local": {"window": 4},
    "aft-conv": {"kernel": 4},
    "bigbird": {"block_size": 2, "window_blocks": 3, "global_blocks": 1, "random_blocks": 1},
    "reformer": {"n_buckets": 4, "chunk_size": 4},
    "linear": {"chunk_size": 4},
    "retention": {"chunk_size": 4},
    "gated-linear": {"chunk_size": 4},
    "cosformer": {"chunk_size": 4},
    "deltanet": {"chunk_size": 4},
    "gated-deltanet": {"chunk_size": 4},
}
NAMES = sorted(available_attention())


def layer_of(name, dtype=torch.float64, device="cpu"):
    torch.manual_seed(0)
    config = GPTConfig(n_layer=1, n_head=4, n_embd=32, block_size=32, vocab_size=16, attention=name,
                       attention_options=SMALL.get(name, {}), dropout=0.0)
    with torch.device(device):
        return get_attention(name)(config).to(dtype)


@pytest.mark.parametrize("name", NAMES)
def test_gradients_flow_through_decoding(name):
    """Backward through prefill + decoding steps equals backward through one full forward (the KV
    caches' in-place appends and AFT's ring slot broke it)."""
    layer = layer_of(name)
    x = torch.randn(2, 12, 32, dtype=torch.float64, requires_grad=True)
    assert_decoding_equals_forward(layer, x, 5, rtol=1e-9)


@pytest.mark.parametrize("name", NAMES)
def test_use_cache_false_leaves_the_cache_as_it_was(name):
    layer = layer_of(name)
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    with torch.no_grad():
        full, _ = layer(x)
        _, cache = decode(layer, x[:, :8], 5)
        first, none = layer(x[:, 8:], cache=cache, use_cache=False)
        again, _ = layer(x[:, 8:], cache=cache, use_cache=False)  # aft-full had appended the token twice
    assert none is None
    torch.testing.assert_close(first, full[:, 8:], atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(again, first, atol=0, rtol=0)


@pytest.mark.parametrize("name", [n for n in NAMES if n != "none"])
def test_a_cache_of_another_batch_is_refused(name):
    """A batch of 2's cache given one token of a batch of 1 (after dropping a finished sequence, say):
    a ValueError, not a broadcast into both rows (the KV caches did that) or a torch.cat error."""
    layer = layer_of(name)
    with torch.no_grad():
        _, cache = layer(torch.randn(2, 5, 32, dtype=torch.float64), use_cache=True)
        with pytest.raises(ValueError, match=r"[\[(]1, .*[\[(]2, |[\[(]2, .*[\[(]1, "):  # both batch sizes named
            layer(torch.randn(1, 1, 32, dtype=torch.float64), cache=cache, use_cache=True)


@pytest.mark.parametrize("name", NAMES)
def test_runs_on_the_meta_device(name):
    """Shape inference without memory (AFT's path choice read a value back: .item() on meta)."""
    layer = layer_of(name, torch.float32, device="meta")
    y, _ = layer(torch.empty(2, 12, 32, device="meta"))
    assert y.shape == (2, 12, 32) and y.device.type == "meta"


@pytest.mark.parametrize("name", NAMES)
def test_an_empty_sequence_is_an_empty_output_or_a_clear_error(name):
    """softmax (SDPA) returns the empty output; the others say T must be at least 1 (deltanet's
    convolution raised a RuntimeError)."""
    layer = layer_of(name)
    try:
        y, _ = layer(torch.randn(2, 0, 32, dtype=torch.float64))
    except ValueError as e:
        assert "at least 1" in str(e)
    else:
        assert y.shape == (2, 0, 32)


@pytest.mark.parametrize("name", NAMES)
def test_decoding_across_grad_modes_and_a_broadcast_prompt(name):
    """Caches a user builds in one mode and continues in another: a prefill under inference_mode
    continued under no_grad; steps with gradients, one step without, then backward; a batch-1
    prompt's cache expanded to two rows. The in-place writes must step aside in each (the sliding
    window's ring once wrote into all three)."""
    layer = layer_of(name)
    x = torch.randn(2, 10, 32, dtype=torch.float64)
    full, _ = layer(x)
    with torch.inference_mode():
        _, cache = layer(x[:, :5], use_cache=True)
    with torch.no_grad():
        for t in range(5, 10):
            y, cache = layer(x[:, t : t + 1], cache=cache, use_cache=True)
    torch.testing.assert_close(y, full[:, 9:], atol=1e-10, rtol=1e-9)

    xg = x.clone().requires_grad_()
    _, cache = layer(xg[:, :5], use_cache=True)
    ys = []
    for t in range(5, 8):
        y, cache = layer(xg[:, t : t + 1], cache=cache, use_cache=True)
        ys.append(y)
    with torch.no_grad():
        layer(xg[:, 8:9], cache=cache, use_cache=True)
    torch.cat(ys, 1).sum().backward()
    assert torch.isfinite(xg.grad).all()

    same = x[:1].expand(2, -1, -1)
    with torch.no_grad():
        _, cache = layer(same[:1, :5], use_cache=True)
        cache = _expand(cache, 2)
        for t in range(5, 10):
            y, cache = layer(same[:, t : t + 1], cache=cache, use_cache=True)
    torch.testing.assert_close(y, full[:1, 9:].expand(2, -1, -1), atol=1e-10, rtol=1e-9)


def _expand(cache, B):
    """A batch-1 cache broadcast to B rows without copying (expand on every tensor in it)."""
    if isinstance(cache, torch.Tensor):
        return cache.expand(B, *cache.shape[1:]) if cache.dim() and cache.shape[0] == 1 else cache
    if isinstance(cache, tuple) and hasattr(cache, "_fields"):
        return type(cache)(*(_expand(c, B) for c in cache))
    if isinstance(cache, (tuple, list)):
        return type(cache)(_expand(c, B) for c in cache)
    if hasattr(cache, "__dict__"):
        import copy

        out = copy.copy(cache)
        for k, v in vars(cache).items():
            setattr(out, k, _expand(v, B))
        return out
    return cache


@pytest.mark.parametrize("name", NAMES)
def test_a_deep_copy_of_a_cache_branches(name):
    """A cache serves one continuation (KV caches and the sliding window's ring are written in place);
    copy.deepcopy gives a branch that decodes as if the other never ran."""
    import copy

    layer = layer_of(name)
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    full, _ = layer(x)
    with torch.no_grad():
        _, cache = layer(x[:, :6], use_cache=True)
        branch = copy.deepcopy(cache)
        for t in range(6, 12):
            _, cache = layer(x[:, t : t + 1], cache=cache, use_cache=True)
        for t in range(6, 9):
            y, branch = layer(x[:, t : t + 1], cache=branch, use_cache=True)
    torch.testing.assert_close(y, full[:, 8:9], atol=1e-10, rtol=1e-9)
