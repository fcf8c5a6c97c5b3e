"""BigBird block-sparse attention against dense float64 softmax under its own mask."""
import pytest
import torch
from allocations import Allocations
from qkv import random_qkv

from lintrans.ops.bigbird import bigbird_attention, bigbird_attention_reference, bigbird_mask, block_pattern


inputs = random_qkv


PATTERNS = [dict(block_size=4, window_blocks=3, global_blocks=1, random_blocks=2),
            dict(block_size=5, window_blocks=1, global_blocks=0, random_blocks=0),
            dict(block_size=3, window_blocks=2, global_blocks=2, random_blocks=1, seed=7),
            dict(block_size=64, window_blocks=3, global_blocks=1, random_blocks=2)]  # one block > T


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("T", [1, 13, 40])
def test_outputs_match_dense_softmax_under_the_mask(T, pattern, causal):
    q, k, v = inputs(2, T, 2, 5, 3)  # odd D, Dk != Dv, T not a multiple of the block
    o = bigbird_attention(q, k, v, causal=causal, **pattern)
    assert o.shape == (2, T, 2, 3) and o.dtype == torch.float64
    torch.testing.assert_close(o, bigbird_attention_reference(q, k, v, causal=causal, **pattern), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal", [True, False])
def test_gradients_match(causal):
    q, k, v = inputs(1, 29, 2, 4, 6, seed=1)
    for x in (q, k, v):
        x.requires_grad_(True)
    kw = dict(block_size=4, window_blocks=3, global_blocks=1, random_blocks=2, causal=causal, scale=0.6)
    dout = torch.randn(1, 29, 2, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    got = torch.autograd.grad((bigbird_attention(q, k, v, **kw) * dout).sum(), (q, k, v))
    want = torch.autograd.grad((bigbird_attention_reference(q, k, v, **kw) * dout).sum(), (q, k, v))
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=f"grad of {name}")


@pytest.mark.parametrize("causal", [True, False])
def test_a_block_longer_than_the_sequence_is_one_block_of_it(causal):
    q, k, v = random_qkv(1, 7, 2, 3, 4, seed=3)
    torch.testing.assert_close(bigbird_attention(q, k, v, block_size=2**40, causal=causal),
                               bigbird_attention(q, k, v, block_size=7, causal=causal))
    assert torch.equal(bigbird_mask(7, block_size=2**40, causal=causal), bigbird_mask(7, block_size=7, causal=causal))


def test_the_mask_is_bigbirds():
    m = bigbird_mask(64, block_size=8, window_blocks=3, global_blocks=1, random_blocks=2, seed=0, causal=True)
    assert torch.equal(m, m & torch.ones(64, 64, dtype=torch.bool).tril())  # causal
    assert m[:8].sum() == torch.ones(8, 8).tril().sum()  # the global block: every earlier key
    assert m[:, :8].tril().sum() == torch.ones(64, 8).tril().sum()  # everyone sees the global block
    rows = m.view(8, 8, 8, 8).any(dim=(1, 3))  # [query block, key block]
    for b in range(3, 8):  # window 2 back + global + 2 random (from earlier blocks) = at most 6 blocks
        assert rows[b, b] and rows[b, b - 1] and rows[b, b - 2] and rows[b, 0]
        assert rows[b].sum() == min(b + 1, 6) and not rows[b, b + 1:].any()
    # the pattern of a block does not depend on how long the sequence is (decoding relies on it)
    assert block_pattern(5, seed=3) == block_pattern(12, seed=3)[:5]
    assert bigbird_mask(64, block_size=8, seed=1).ne(m).any()  # another seed, other random blocks


def test_sparse_work_never_builds_t_by_t():
    # at T = 4096 with blocks of 64 the dense scores would be 16.8M floats per head; the op's are 64*6*64*64
    # (3 window + 1 global + 2 random blocks a row): no tensor it creates is more than twice those, and
    # all of them together less than one T x T
    T, n = 4096, 64
    q, k, v = inputs(1, T, 1, 8, 8, dtype=torch.float32)
    with Allocations() as a:
        o = bigbird_attention(q, k, v, block_size=n)
    assert o.shape == (1, T, 1, 8) and torch.isfinite(o).all()
    assert a.largest <= 2 * (T // n) * 6 * n * n * 4 and a.total < T * T * 4
    with Allocations() as a:  # the count sees a dense op's scores
        bigbird_attention_reference(q[:, :256], k[:, :256], v[:, :256], block_size=n)
    assert a.largest >= 256 * 256 * 4


@pytest.mark.parametrize("kw, err, match", [
    (dict(block_size=0), ValueError, "block_size must be an int >= 1"),
    (dict(window_blocks=0), ValueError, "window_blocks must be an int >= 1"),
    (dict(random_blocks=-1), ValueError, "random_blocks must be an int >= 0"),
    (dict(seed=1.5), TypeError, "seed must be an int"),
    (dict(seed=2**45), ValueError, "seed must be an int"),  # seed * 1_000_003 + block would overflow 64 bits
    (dict(causal="yes"), TypeError, "causal must be a bool"),
])
def test_bad_arguments(kw, err, match):
    q, k, v = inputs(1, 8, 1, 4, 4)
    with pytest.raises(err, match=match):
        bigbird_attention(q, k, v, **kw)


def test_mask_rows_for_decoding_are_the_full_masks_rows():
    kw = dict(block_size=4, window_blocks=2, global_blocks=1, random_blocks=1, seed=5)
    full = bigbird_mask(30, **kw)
    assert torch.equal(bigbird_mask(30, start=23, **kw), full[23:])
    assert torch.equal(bigbird_mask(24, **kw), full[:24, :24])  # earlier rows do not change as T grows
