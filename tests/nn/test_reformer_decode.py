"""Reformer decoding: the causal window mask counted from bucket-mates (no sort per round), and the
cache of unit keys (each key normalised once), against the sorted-order definition and the forward."""
import pytest
import torch

from lintrans.bench.cost import ModelShape, cache_bytes
from lintrans.models import GPT, GPTConfig
from lintrans.nn.reformer import ReformerAttention
from lintrans.ops.lsh import lsh_buckets, lsh_mask, unit_keys

from decoding import assert_decoding_equals_forward, decode


def sorted_order_mask(buckets, chunk_size):
    """The definition, by sorting: per round, positions sorted by (bucket, position); query i may see
    key j <= i of its bucket at most chunk_size places before it. [B, H, R, T] -> [B, H, T, T]."""
    T = buckets.shape[-1]
    pos = torch.arange(T)
    order = torch.sort(buckets * T + pos, dim=-1).indices
    place = torch.empty_like(order).scatter_(-1, order, pos.expand_as(order))
    same = buckets[..., :, None] == buckets[..., None, :]
    near = (place[..., :, None] - place[..., None, :]).abs() <= chunk_size
    return (same & near).any(dim=2) & (pos[None, :] <= pos[:, None])


def test_the_counted_mask_is_the_sorted_orders_for_many_layouts():
    """Random buckets from few values (many mates and ties: equal buckets at every distance), one to
    four rounds, chunks from 1 to longer than T: the full mask, the last row (decoding) and a middle
    start all equal the sorted-order definition."""
    g = torch.Generator().manual_seed(0)
    cut = 0  # pairs of one bucket that the chunk rule leaves out: the check has teeth
    for trial in range(200):
        T = int(torch.randint(1, 50, (), generator=g))
        R = int(torch.randint(1, 5, (), generator=g))
        values = (1, 2, 3, 8)[trial % 4]
        c = (1, 2, 3, 5, 64)[trial % 5]
        buckets = torch.randint(0, values, (2, 2, R, T), generator=g)
        want = sorted_order_mask(buckets, c)
        assert torch.equal(lsh_mask(buckets, chunk_size=c, causal=True, lookback="window"), want), (T, R, c)
        assert torch.equal(lsh_mask(buckets, chunk_size=c, causal=True, lookback="window", start=T - 1),
                           want[:, :, T - 1 :]), (T, R, c)
        start = int(torch.randint(0, T, (), generator=g))
        assert torch.equal(lsh_mask(buckets, chunk_size=c, causal=True, lookback="window", start=start),
                           want[:, :, start:]), (T, R, c, start)
        mates = (buckets[..., :, None] == buckets[..., None, :]).any(dim=2).tril()
        cut += int((mates & ~want).sum())
    assert cut > 0


def layer_of(dtype=torch.float64, **opts):
    torch.manual_seed(0)
    config = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=64, vocab_size=16, attention="reformer",
                       attention_options={"n_buckets": 2, "n_hashes": 3, "chunk_size": 3, **opts})
    return ReformerAttention(config).to(dtype)


@pytest.mark.parametrize("prompt, step", [(1, 1), (9, 1), (5, 4)])
def test_decoding_equals_the_forward_and_its_gradients(prompt, step):
    """Far past the chunk size with two buckets (most mates out of reach); one token at a time and
    several at once; backward through the steps equals backward through the forward."""
    layer = layer_of()
    x = (3 * torch.randn(2, 30, 16, dtype=torch.float64)).requires_grad_()
    assert_decoding_equals_forward(layer, x, prompt, step)
    with torch.no_grad():
        qk, _ = layer.qkv(x)
        buckets = lsh_buckets(qk, n_buckets=2, n_hashes=3)
        same = (buckets[..., :, None] == buckets[..., None, :]).any(dim=2).tril()
        assert (same & ~lsh_mask(buckets, chunk_size=3, causal=True, lookback="window")).any()  # the rule matters


def test_the_cache_holds_unit_keys_in_the_compute_dtype():
    """Each key normalised once, when cached: the cache's keys are the unit keys of every token,
    float32 for a bfloat16 model (its forward normalises in float32 too), counted so in nbytes."""
    layer = layer_of()
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    with torch.no_grad():
        _, cache = decode(layer, x, prompt=4)
        qk, _ = layer.qkv(x)
    torch.testing.assert_close(cache.k, unit_keys(qk.transpose(1, 2)), atol=1e-15, rtol=0)
    torch.testing.assert_close(cache.k.norm(dim=-1), torch.ones(2, 2, 11, dtype=torch.float64))

    half = layer_of(torch.bfloat16)
    with torch.no_grad():
        full, _ = half(x.bfloat16())
        stepped, cache = decode(half, x.bfloat16(), prompt=4)
    assert cache.k.dtype == torch.float32 and cache.v.dtype == torch.bfloat16
    torch.testing.assert_close(stepped, full, atol=2e-2, rtol=2e-2)
    assert cache.nbytes() == 2 * 2 * 11 * 8 * (4 + 2) + 2 * 2 * 11 * 3 * 8  # keys, values, buckets


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_cost_model_counts_the_unit_keys(dtype):
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=20, block_size=64, attention="reformer",
                    attention_options={"n_buckets": 4, "chunk_size": 4})
    model = GPT(cfg).to(getattr(torch, dtype)).eval()
    with torch.no_grad():
        _, cache = model.forward_cached(torch.zeros(1, 9, dtype=torch.long))
        for _ in range(3):
            _, cache = model.forward_cached(torch.zeros(1, 1, dtype=torch.long), cache)
    assert cache_bytes(ModelShape.from_config(cfg), 12, dtype=dtype) == cache.nbytes()
