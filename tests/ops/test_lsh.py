"""Reformer LSH attention against dense float64 shared-QK softmax under its own mask."""
import pytest
import torch
from allocations import Allocations
from qkv import random_qkv

from lintrans.ops.lsh import (
    SELF_SCORE, lsh_attention, lsh_attention_reference, lsh_buckets, lsh_mask, shared_qk_attention,
)


def inputs(B, T, H, D, Dv, dtype=torch.float64, seed=0):
    qk, _, v = random_qkv(B, T, H, D, Dv, dtype=dtype, seed=seed)
    return qk * 2, v  # larger norms: peaked attention, so a wrong key shows


PATTERNS = [dict(n_buckets=4, n_hashes=2, chunk_size=4),
            dict(n_buckets=2, n_hashes=1, chunk_size=5),
            dict(n_buckets=8, n_hashes=3, chunk_size=3, seed=7),
            dict(n_buckets=4, n_hashes=2, chunk_size=64)]  # one chunk > T


@pytest.mark.parametrize("lookback", ["chunk", "window"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("T", [1, 13, 40])
def test_outputs_match_dense_softmax_under_the_mask(T, pattern, causal, lookback):
    qk, v = inputs(2, T, 2, 5, 3)  # odd D, D != Dv, T not a multiple of the chunk
    o, buckets = lsh_attention(qk, v, causal=causal, lookback=lookback, output_buckets=True, **pattern)
    assert o.shape == (2, T, 2, 3) and o.dtype == torch.float64
    assert buckets.shape == (2, 2, pattern["n_hashes"], T)
    want = lsh_attention_reference(qk, v, causal=causal, lookback=lookback, **pattern)
    torch.testing.assert_close(o, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("lookback", ["chunk", "window"])
@pytest.mark.parametrize("causal", [True, False])
def test_gradients_match(causal, lookback):
    qk, v = inputs(2, 29, 2, 5, 6, seed=1)
    qk.requires_grad_(True)
    v.requires_grad_(True)
    kw = dict(n_buckets=4, n_hashes=3, chunk_size=4, causal=causal, lookback=lookback, scale=0.6)
    dout = torch.randn(2, 29, 2, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    got = torch.autograd.grad((lsh_attention(qk, v, **kw)[0] * dout).sum(), (qk, v))
    want = torch.autograd.grad((lsh_attention_reference(qk, v, **kw) * dout).sum(), (qk, v))
    for name, a, b in zip(("qk", "v"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=f"grad of {name}")


def test_float32_inputs_compute_in_float32_on_the_same_hashes():
    qk, v = inputs(1, 50, 3, 8, 8, dtype=torch.float32, seed=3)
    kw = dict(n_buckets=6, n_hashes=2, chunk_size=8)
    o, _ = lsh_attention(qk, v, **kw)
    assert o.dtype == torch.float32
    torch.testing.assert_close(o.double(), lsh_attention_reference(qk, v, **kw), rtol=1e-5, atol=1e-5)


def brute_force_mask(buckets, c, causal, lookback):
    """The allowed pairs from the definition, with Python lists: per round, sort (bucket, position),
    cut into chunks of c, compare chunks (or places); same bucket; causal."""
    R, T = buckets.shape
    allowed = torch.zeros(T, T, dtype=torch.bool)
    for r in range(R):
        order = sorted(range(T), key=lambda t: (int(buckets[r, t]), t))
        place = {t: s for s, t in enumerate(order)}
        for i in range(T):
            for j in range(T):
                if buckets[r, i] != buckets[r, j] or (causal and j > i):
                    continue
                if lookback == "chunk":
                    near = place[i] // c - place[j] // c in (0, 1)
                else:
                    near = abs(place[i] - place[j]) <= c
                allowed[i, j] |= near
    return allowed


@pytest.mark.parametrize("lookback", ["chunk", "window"])
@pytest.mark.parametrize("causal", [True, False])
def test_the_mask_is_the_definitions(causal, lookback):
    qk, _ = inputs(1, 37, 2, 6, 1, seed=4)
    buckets = lsh_buckets(qk, n_buckets=4, n_hashes=3, seed=1)
    m = lsh_mask(buckets, chunk_size=3, causal=causal, lookback=lookback)
    for h in range(2):
        assert torch.equal(m[0, h], brute_force_mask(buckets[0, h], 3, causal, lookback))
    assert m.diagonal(dim1=-2, dim2=-1).all()  # a token is always in its own bucket and chunk
    # rows for decoding are the full mask's rows
    assert torch.equal(lsh_mask(buckets, chunk_size=3, causal=causal, lookback=lookback, start=30), m[:, :, 30:])


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n_hashes", [1, 2, 5])
def test_one_bucket_one_chunk_is_full_shared_qk_attention(n_hashes, causal):
    qk, v = inputs(2, 23, 3, 7, 4, seed=5)
    o, _ = lsh_attention(qk, v, n_buckets=1, n_hashes=n_hashes, chunk_size=23, causal=causal)
    torch.testing.assert_close(o, shared_qk_attention(qk, v, causal=causal), rtol=1e-10, atol=1e-10)


def test_shared_qk_attention_is_softmax_over_normalised_keys_with_the_self_rule():
    qk, v = inputs(1, 6, 1, 3, 2, seed=6)
    o = shared_qk_attention(qk, v, causal=True, scale=0.5)
    q, k = qk[0, :, 0], qk[0, :, 0] / qk[0, :, 0].norm(dim=-1, keepdim=True)
    for i in range(6):
        s = [SELF_SCORE if j == i else 0.5 * float(q[i] @ k[j]) for j in range(i + 1)]
        w = torch.tensor(s, dtype=torch.float64).softmax(0)
        torch.testing.assert_close(o[0, i, 0], w @ v[0, : i + 1, 0])
    torch.testing.assert_close(o[0, 0], v[0, 0])  # the first token has only itself


@pytest.mark.parametrize("n_hashes", [1, 2, 4])
def test_the_self_pair_counts_once_over_the_rounds(n_hashes):
    """Every round allows a token's own pair; like any pair allowed by N rounds it must count once.
    Seen only when another key scores near SELF_SCORE: token 1's score on key 0 is made equal to it."""
    a = -SELF_SCORE * 2**0.5  # scale 2**-0.5: token 1's score on key 0 is -a * 2**-0.5 = SELF_SCORE
    qk = torch.tensor([[1.0, 0.0], [-a, 0.0]], dtype=torch.float64).view(1, 2, 1, 2)
    v = torch.tensor([[1.0], [0.0]], dtype=torch.float64).view(1, 2, 1, 1)
    o, _ = lsh_attention(qk, v, n_buckets=1, n_hashes=n_hashes)
    torch.testing.assert_close(o[0, 1, 0, 0], torch.tensor(0.5, dtype=torch.float64))
    torch.testing.assert_close(o, lsh_attention_reference(qk, v, n_buckets=1, n_hashes=n_hashes))


def test_a_token_with_no_bucket_mate_attends_to_itself():
    qk, v = inputs(1, 40, 2, 4, 3, seed=7)
    kw = dict(n_buckets=8, n_hashes=2, chunk_size=4, causal=True)
    o, buckets = lsh_attention(qk, v, output_buckets=True, **kw)
    alone = lsh_mask(buckets, chunk_size=4).sum(-1) == 1  # [B,H,T]: only the self pair allowed
    assert alone.sum() > 2  # the first token of each head, and others first in their buckets
    torch.testing.assert_close(o.transpose(1, 2)[alone], v.transpose(1, 2)[alone], rtol=0, atol=1e-12)


def test_causal_window_is_causal_and_causal_chunk_is_not():
    qk, v = inputs(1, 64, 2, 8, 4, seed=8)
    kw = dict(n_buckets=4, n_hashes=2, chunk_size=4, causal=True)
    full, _ = lsh_attention(qk, v, lookback="window", **kw)
    for t in (1, 17, 40, 63):  # a prefix alone gives the same rows: nothing later is used
        torch.testing.assert_close(lsh_attention(qk[:, :t], v[:, :t], lookback="window", **kw)[0], full[:, :t],
                                   rtol=1e-12, atol=1e-12)
    # the paper's chunks: later tokens' buckets move the chunk boundaries of earlier queries
    chunk, _ = lsh_attention(qk, v, lookback="chunk", **kw)
    prefix, _ = lsh_attention(qk[:, :40], v[:, :40], lookback="chunk", **kw)
    assert (prefix - chunk[:, :40]).abs().max() > 1e-3


def test_more_hashes_add_rounds_and_only_widen_the_mask():
    qk, _ = inputs(2, 48, 2, 6, 1, seed=9)
    masks = [lsh_mask(lsh_buckets(qk, n_buckets=8, n_hashes=r, seed=2), chunk_size=4) for r in (1, 2, 4, 8)]
    for small, big in zip(masks, masks[1:]):
        assert torch.equal(small & big, small) and big.sum() > small.sum()


def test_buckets_are_angular_lsh():
    qk, _ = inputs(2, 30, 3, 6, 1, seed=10)
    b = lsh_buckets(qk, n_buckets=8, n_hashes=4, seed=0)
    assert b.shape == (2, 3, 4, 30) and b.dtype == torch.long and b.min() >= 0 and b.max() < 8
    assert torch.equal(lsh_buckets(qk * 3.7, n_buckets=8, n_hashes=4), b)  # the angle is what counts
    assert torch.equal(lsh_buckets(-qk, n_buckets=8, n_hashes=4), (b + 4) % 8)  # argmax([xR, -xR])
    assert torch.equal(lsh_buckets(qk.float(), n_buckets=8, n_hashes=4), b)  # hashed in float64 for any dtype
    assert not torch.equal(lsh_buckets(qk, n_buckets=8, n_hashes=4, seed=1), b)
    assert not torch.equal(b[:, 0], b[:, 1])  # each head its own rotations
    near = qk + 1e-6 * torch.randn_like(qk)
    assert (lsh_buckets(near, n_buckets=8, n_hashes=4) == b).float().mean() > 0.99


def test_sparse_work_never_builds_t_by_t():
    # dense scores at T = 8192 would be 67M floats per head and round; the op's are T x 2 chunks per
    # round: no tensor it creates is more than twice those, and all of them together less than one T x T
    T, R, c = 8192, 2, 64
    qk, v = inputs(1, T, 1, 8, 8, dtype=torch.float32)
    with Allocations() as a:
        o, _ = lsh_attention(qk, v, n_buckets=64, n_hashes=R, chunk_size=c)
    assert o.shape == (1, T, 1, 8) and torch.isfinite(o).all()
    assert a.largest <= 2 * R * T * 2 * c * 4 and a.total < T * T * 4
    with Allocations() as a:  # the count sees a dense op's scores
        lsh_attention_reference(qk[:, :256], v[:, :256], n_buckets=64, n_hashes=R, chunk_size=c)
    assert a.largest >= 256 * 256 * 4


@pytest.mark.parametrize("kw, err, match", [
    (dict(n_buckets=3), ValueError, "n_buckets must be 1 or an even int >= 2"),
    (dict(n_buckets=0), ValueError, "n_buckets must be an int >= 1"),
    (dict(n_buckets=4.0), TypeError, "n_buckets must be an int"),
    (dict(n_hashes=0), ValueError, "n_hashes must be an int >= 1"),
    (dict(chunk_size=0), ValueError, "chunk_size must be an int >= 1"),
    (dict(seed=1.5), TypeError, "seed must be an int"),
    (dict(seed=2**64), ValueError, "seed must be an int"),
    (dict(causal="yes"), TypeError, "causal must be a bool"),
    (dict(lookback="band"), ValueError, "lookback must be one of"),
    (dict(scale="big"), TypeError, "scale must be a number"),
])
def test_bad_arguments(kw, err, match):
    qk, v = inputs(1, 8, 1, 4, 4)
    with pytest.raises(err, match=match):
        lsh_attention(qk, v, **{"n_buckets": 4, **kw})


def test_bad_tensors():
    qk, v = inputs(1, 8, 2, 4, 3)
    with pytest.raises(ValueError, match="qk must have 4 dimensions"):
        lsh_attention(qk[0], v, n_buckets=2)
    with pytest.raises(ValueError, match="v must match qk"):
        lsh_attention(qk, v[:, :5], n_buckets=2)
    with pytest.raises(TypeError, match="qk and v must share one dtype"):
        lsh_attention(qk, v.float(), n_buckets=2)
    with pytest.raises(TypeError, match="v must be a floating tensor"):
        lsh_attention(qk, v.long(), n_buckets=2)
    with pytest.raises(TypeError, match="buckets must be an int64 tensor"):
        lsh_mask(qk, chunk_size=4)
