"""Longformer sliding-window attention against the dense float64 reference: outputs, gradients, decoding, errors."""
import pytest
import torch
from qkv import random_qkv

from lintrans.ops.sliding_window import (
    SlidingWindowCache,
    sliding_window_attention,
    sliding_window_attention_reference,
    sliding_window_cache,
    sliding_window_step,
)
from lintrans.ops.softmax import softmax_attention_reference


inputs = random_qkv


GLOBALS = [None, [0], "mask"]


def globals_for(kind, T):
    if kind == "mask":  # first, one in the middle and the last token
        m = torch.zeros(T, dtype=torch.bool)
        m[[0, T // 2, T - 1]] = True
        return m
    return kind


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window, dilation", [(1, 1), (4, 1), (5, 2), (3, 4), (64, 1)])
@pytest.mark.parametrize("glob", GLOBALS)
@pytest.mark.parametrize("T", [1, 7, 45])
def test_outputs_match_reference(T, glob, window, dilation, causal):
    q, k, v = inputs(2, T, 2, 5, 3)  # odd D, Dk != Dv; T < window for window 64
    kw = dict(window=window, dilation=dilation, causal=causal, global_tokens=globals_for(glob, T))
    o = sliding_window_attention(q, k, v, **kw)
    assert o.shape == (2, T, 2, 3) and o.dtype == torch.float64
    torch.testing.assert_close(o, sliding_window_attention_reference(q, k, v, **kw), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("glob", GLOBALS)
def test_gradients_match_reference(glob, causal):
    T = 40
    q, k, v = inputs(1, T, 2, 3, 4, seed=1)
    for x in (q, k, v):
        x.requires_grad_(True)
    kw = dict(window=5, dilation=2, causal=causal, global_tokens=globals_for(glob, T), scale=0.7)
    dout = torch.randn(1, T, 2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    got = torch.autograd.grad((sliding_window_attention(q, k, v, **kw) * dout).sum(), (q, k, v))
    want = torch.autograd.grad((sliding_window_attention_reference(q, k, v, **kw) * dout).sum(), (q, k, v))
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=f"grad of {name}")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("glob", [[0], "mask"])
def test_without_global_rows_matches_reference_outputs_and_gradients(glob, causal):
    T = 37
    q, k, v = inputs(2, T, 2, 5, 3, seed=3)
    for x in (q, k, v):
        x.requires_grad_(True)
    kw = dict(window=4, dilation=2, causal=causal, global_tokens=globals_for(glob, T), global_rows=False)
    got = sliding_window_attention(q, k, v, **kw)
    want = sliding_window_attention_reference(q, k, v, **kw)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    full = sliding_window_attention(q, k, v, **{**kw, "global_rows": True})
    rows = [0] if glob == [0] else [0, T // 2, T - 1]
    others = [t for t in range(T) if t not in rows]
    assert torch.equal(got[:, others], full[:, others])  # only the global rows differ
    if not causal or rows != [0]:
        assert not torch.allclose(got[:, rows], full[:, rows])
    dout = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad((got * dout).sum(), (q, k, v)), torch.autograd.grad((want * dout).sum(), (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("causal", [True, False])
def test_window_covering_everything_is_softmax_attention(causal):
    q, k, v = inputs(2, 9, 2, 4, 4)
    o = sliding_window_attention(q, k, v, window=20, causal=causal)
    torch.testing.assert_close(o, softmax_attention_reference(q, k, v, causal=causal))


def test_reference_pattern_by_hand():
    """Causal window 2, dilation 2, global token 0: row 5 sees keys 5, 3 and 0 and nothing else."""
    q, k, v = inputs(1, 6, 1, 2, 2)
    s = (q[0, 5, 0] @ k[0, [5, 3, 0], 0].T) / 2**0.5
    want = s.softmax(-1) @ v[0, [5, 3, 0], 0]
    got = sliding_window_attention_reference(q, k, v, window=2, dilation=2, global_tokens=[0])[0, 5, 0]
    torch.testing.assert_close(got, want)


def test_large_scores_stay_finite():
    q, k, v = inputs(1, 50, 2, 8, 8, dtype=torch.float32, seed=3)
    o = sliding_window_attention(q * 100, k * 100, v, window=7, global_tokens=[0, 3])
    assert torch.isfinite(o).all()


@pytest.mark.parametrize("window, dilation, glob", [(1, 1, None), (4, 1, None), (3, 3, [0, 2]), (5, 2, [0, 9])])
@pytest.mark.parametrize("prompt", [1, 6])
def test_decode_equals_forward_with_constant_memory(window, dilation, glob, prompt):
    T = 20
    q, k, v = inputs(2, T, 2, 4, 3, seed=4)
    full = sliding_window_attention(q, k, v, window=window, dilation=dilation, global_tokens=glob)
    cache = sliding_window_cache(k[:, :prompt], v[:, :prompt], window=window, dilation=dilation, global_tokens=glob)
    outs, sizes = [], set()
    for t in range(prompt, T):
        o, cache = sliding_window_step(
            q[:, t], k[:, t], v[:, t], cache, window=window, dilation=dilation, global_tokens=glob
        )
        outs.append(o)
        if t > 10:  # past the last global token: nothing grows any more
            sizes.add(sum(x.numel() for x in cache[:4]))
    torch.testing.assert_close(torch.stack(outs, 1), full[:, prompt:], rtol=1e-10, atol=1e-10)
    assert len(sizes) == 1
    assert cache.ring_k.shape[2] == (window - 1) * dilation + 1 and cache.pos == T


def test_step_from_empty_cache():
    q, k, v = inputs(1, 5, 1, 2, 2)
    full = sliding_window_attention(q, k, v, window=2)
    cache, outs = None, []
    for t in range(5):
        o, cache = sliding_window_step(q[:, t], k[:, t], v[:, t], cache, window=2)
        outs.append(o)
    torch.testing.assert_close(torch.stack(outs, 1), full)


@pytest.mark.parametrize(
    "kw, err, match",
    [
        (dict(window=0), ValueError, "window must be an int >= 1"),
        (dict(window=2.0), TypeError, "window must be an int >= 1"),
        (dict(window=2, dilation=0), ValueError, "dilation must be an int >= 1"),
        (dict(window=2, causal="yes"), TypeError, "causal must be a bool"),
        (dict(window=2, global_tokens=torch.zeros(5, dtype=torch.bool)), ValueError, r"shape \[T\] = \[6\]"),
        (dict(window=2, global_tokens=[0, 6]), ValueError, r"positions must lie in \[0, 6\)"),
        (dict(window=2, global_tokens=[-1]), ValueError, "positions must lie"),
        (dict(window=2, global_tokens=[0.5]), TypeError, "int positions"),
        (dict(window=2, global_tokens="first"), TypeError, "global_tokens must be"),
        (dict(window=2, scale="big"), TypeError, "scale must be a number"),
    ],
)
def test_bad_arguments(kw, err, match):
    q, k, v = inputs(1, 6, 2, 4, 4, dtype=torch.float32)
    with pytest.raises(err, match=match):
        sliding_window_attention(q, k, v, **kw)


def test_step_rejects_a_cache_from_other_settings():
    q, k, v = inputs(1, 4, 2, 4, 4, dtype=torch.float32)
    cache = sliding_window_cache(k, v, window=3)
    with pytest.raises(ValueError, match="SlidingWindowCache"):
        sliding_window_step(q[:, 0], k[:, 0], v[:, 0], cache, window=5)
    assert isinstance(cache, SlidingWindowCache)
