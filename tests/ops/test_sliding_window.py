"""Longformer sliding-window attention against the dense float64 reference: outputs, gradients, decoding, errors."""
import math

import pytest
import torch
from native_paths import on_path, took
from qkv import random_qkv

from lintrans.ops.sliding_window import (
    SlidingWindowCache,
    sliding_window_attention,
    sliding_window_attention_reference,
    sliding_window_cache,
    sliding_window_step,
)
from lintrans.ops.native import sliding_window as native_sw
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


@pytest.mark.parametrize("dilation, glob", [(1, None), (2, None), (1, [0, 3])])
def test_a_window_far_longer_than_the_sequence_costs_what_the_sequence_needs(dilation, glob):
    """The band reaches at most T - 1 positions: a window of 2**40 is the window of 2T (before,
    its padding was sized by the window: a 137 GB allocation)."""
    q, k, v = inputs(1, 9, 2, 4, 3)
    kw = dict(dilation=dilation, causal=False, global_tokens=glob)
    torch.testing.assert_close(sliding_window_attention(q, k, v, window=2**40, **kw),
                               sliding_window_attention(q, k, v, window=18 * dilation + 1, **kw))


def test_reference_pattern_by_hand():
    """Causal window 2, dilation 2, global token 0: row 5 sees keys 5, 3 and 0 and nothing else."""
    q, k, v = inputs(1, 6, 1, 2, 2)
    s = (q[0, 5, 0] @ k[0, [5, 3, 0], 0].T) / 2**0.5
    want = s.softmax(-1) @ v[0, [5, 3, 0], 0]
    got = sliding_window_attention_reference(q, k, v, window=2, dilation=2, global_tokens=[0])[0, 5, 0]
    torch.testing.assert_close(got, want)


def assert_float32_matches_reference(o, q, k, v, **kw):
    """o, computed from float32 q, k, v, against the float64 reference on the same inputs, within what
    float32 can tell apart. Its scores are off by up to delta ~ a few ulps of the largest |score|;
    that moves each softmax weight p_j by a factor within exp(+-2 delta), so the output by at most
    (exp(2 delta) - 1) * 2 max|v| * r, where r = 1 - p_top is the weight off each row's top key, plus
    the rounding of the weighted sum of v. Large scores make r tiny: then the check is tight."""
    B, T, H, _ = q.shape
    q, k, v = q.double(), k.double(), v.double()
    eye = torch.eye(T, dtype=torch.float64).expand(B, H, T, T).transpose(1, 2)  # v_j = e_j: out come the weights
    r = (1 - sliding_window_attention_reference(q, k, eye, **kw).amax(-1)).max().item()
    scale = kw.get("scale") or q.shape[-1] ** -0.5
    eps = torch.finfo(torch.float32).eps
    delta = 8 * eps * (q.norm(dim=-1).max() * k.norm(dim=-1).max()).item() * scale
    atol = math.expm1(2 * delta) * 2 * v.abs().max().item() * r + 8 * eps * v.abs().max().item()
    assert atol < 1e-5, "a case this ill-conditioned cannot check float32 values"
    torch.testing.assert_close(o.double(), sliding_window_attention_reference(q, k, v, **kw), rtol=0, atol=atol)


def test_large_scores_match_the_reference():
    """Scores of tens of thousands, with global tokens: the rows' maxima are taken before exp."""
    q, k, v = inputs(1, 50, 2, 8, 8, dtype=torch.float32, seed=3)
    q, k = q * 100, k * 100
    o = sliding_window_attention(q, k, v, window=7, global_tokens=[0, 3])
    assert_float32_matches_reference(o, q, k, v, window=7, global_tokens=[0, 3])


@pytest.mark.parametrize("window, dilation, glob", [(1, 1, None), (4, 1, None), (3, 3, [0, 2]), (5, 2, [0, 9]),
                                                    (4, 1, [0, 1]), (3, 1, (9, 0, 2))])
@pytest.mark.parametrize("prompt", [1, 6])
@pytest.mark.parametrize("inplace", [False, True])
def test_decode_equals_forward_with_constant_memory(window, dilation, glob, prompt, inplace):
    """Every branch of the step: the ring before and after it fills, dilated slots, global keys in a
    run (a view of the prefix) or scattered, in the band or out of it, global rows."""
    T = 20
    q, k, v = inputs(2, T, 2, 4, 3, seed=4)
    full = sliding_window_attention(q, k, v, window=window, dilation=dilation, global_tokens=glob)
    cache = sliding_window_cache(k[:, :prompt], v[:, :prompt], window=window, dilation=dilation, global_tokens=glob)
    outs, sizes = [], set()
    for t in range(prompt, T):
        o, cache = sliding_window_step(
            q[:, t], k[:, t], v[:, t], cache, window=window, dilation=dilation, global_tokens=glob, inplace=inplace
        )
        outs.append(o)
        if t > 10:  # past the last global token: nothing grows any more
            sizes.add(sum(x.numel() for x in cache[:4]))
    torch.testing.assert_close(torch.stack(outs, 1), full[:, prompt:], rtol=1e-10, atol=1e-10)
    assert len(sizes) == 1
    assert cache.ring_k.shape[2] == (window - 1) * dilation + 1 and cache.pos == T


def test_step_leaves_the_cache_it_was_given_unless_inplace():
    q, k, v = inputs(1, 9, 2, 4, 3, seed=5)
    cache = sliding_window_cache(k[:, :8], v[:, :8], window=4)
    before = [x.clone() for x in cache[:4]]
    o, new = sliding_window_step(q[:, 8], k[:, 8], v[:, 8], cache, window=4)
    for x, y in zip(cache[:4], before):
        assert torch.equal(x, y)
    o2, new2 = sliding_window_step(q[:, 8], k[:, 8], v[:, 8], cache, window=4, inplace=True)
    assert torch.equal(o2, o) and new2.ring_k is cache.ring_k and torch.equal(cache.ring_k, new.ring_k)
    with pytest.raises(TypeError, match="inplace"):
        sliding_window_step(q[:, 8], k[:, 8], v[:, 8], cache, window=4, inplace="yes")


@pytest.mark.parametrize("needs_grad", ["qkv", "q"])
def test_inplace_step_is_ignored_where_autograd_records(needs_grad):
    """Gradients through steps asked to write in place equal those of the full forward: the rings are
    copied where autograd saved them for backward (also when only q needs a gradient: the scores
    save the rings)."""
    q, k, v = inputs(1, 12, 2, 4, 3, seed=6)
    wrt = [x.requires_grad_() for x, name in zip((q, k, v), "qkv") if name in needs_grad]
    full = sliding_window_attention(q, k, v, window=3, global_tokens=[0])
    dout = torch.randn_like(full)
    want = torch.autograd.grad(full, wrt, dout)
    cache, outs = None, []
    for t in range(12):
        o, cache = sliding_window_step(q[:, t], k[:, t], v[:, t], cache, window=3, global_tokens=[0], inplace=True)
        outs.append(o)
    got = torch.autograd.grad(torch.stack(outs, 1), wrt, dout)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("change", ["ring_v_dtype", "negative_pos", "float_pos"])
def test_step_refuses_a_broken_cache_before_writing(change):
    q, k, v = inputs(1, 9, 2, 4, 4, seed=5)
    cache = sliding_window_cache(k[:, :8], v[:, :8], window=4)
    if change == "ring_v_dtype":
        cache = cache._replace(ring_v=cache.ring_v.float())
    else:
        cache = cache._replace(pos=-1 if change == "negative_pos" else 8.0)
    before = [x.clone() for x in cache[:4]]
    with pytest.raises(ValueError, match="cache must be a SlidingWindowCache"):
        sliding_window_step(q[:, 8], k[:, 8], v[:, 8], cache, window=4, inplace=True)
    assert all(torch.equal(x, y) for x, y in zip(cache[:4], before))


def test_step_from_empty_cache():
    q, k, v = inputs(1, 5, 1, 2, 2)
    full = sliding_window_attention(q, k, v, window=2)
    cache, outs = None, []
    for t in range(5):
        o, cache = sliding_window_step(q[:, t], k[:, t], v[:, t], cache, window=2)
        outs.append(o)
    torch.testing.assert_close(torch.stack(outs, 1), full)


def _grads(fn, q, k, v, dout, **kw):
    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
    o = fn(q, k, v, **kw)
    return (o, *torch.autograd.grad((o * dout).sum(), (q, k, v)))


# The causal fast path (dilation 1, no global tokens) runs block by block: small blocks and groups
# here, so that these shapes span several groups, partial last groups and blocks, and the key
# gradients carried from one group to the one before it (the fused kernel takes the same blocks)
@pytest.fixture(params=[(4, 8), (3, 1), (64, 4096)], ids=["block4-group2", "block3-group1", "default"])
def fast_path_sizes(request, monkeypatch):
    import lintrans.ops.sliding_window as sw

    monkeypatch.setattr(sw, "SW_BLOCK", request.param[0])
    monkeypatch.setattr(sw, "SW_GROUP_TOKEN_HEADS", request.param[1])
    monkeypatch.setattr(native_sw, "BLOCK", request.param[0])
    return request.param


@pytest.fixture(params=["pytorch", "native"])
def path(request, monkeypatch):
    """The fast-path tests run on both CPU paths: the fused kernel (ops/native) and the PyTorch blocks."""
    return on_path(request.param, monkeypatch, native_sw)


@pytest.mark.parametrize(
    "B, T, H, Dk, Dv, window",
    [
        (1, 1, 1, 3, 2, 1),  # one token
        (2, 1, 2, 5, 3, 4),
        (1, 23, 2, 5, 3, 1),  # window 1: each row sees only itself
        (2, 23, 2, 5, 3, 6),  # T not a multiple of the block, odd D, Dk != Dv, B > 1
        (1, 30, 3, 4, 6, 8),  # window a multiple of the block
        (1, 17, 1, 3, 3, 40),  # window > T
        (2, 40, 2, 3, 5, 11),
    ],
)
def test_causal_fast_path_outputs_and_gradients_match_reference(B, T, H, Dk, Dv, window, fast_path_sizes, path):
    q, k, v = inputs(B, T, H, Dk, Dv, seed=T + window)
    dout = torch.randn(B, T, H, Dv, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    kw = dict(window=window, scale=0.8)
    got = _grads(sliding_window_attention, q, k, v, dout, **kw)
    want = _grads(sliding_window_attention_reference, q, k, v, dout, **kw)
    for name, a, b in zip(["o", "dq", "dk", "dv"], got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)
    assert took(path)


def test_causal_fast_path_takes_strided_views(fast_path_sizes, path):
    """The GPT hands in views of one [B, T, 3 H D] projection; inputs in any dtype come back in it."""
    B, T, H, D = 2, 21, 2, 4
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(B, T, 3 * H * D, dtype=torch.float64, generator=g)
    q, k, v = (x.view(B, T, H, D) for x in qkv.split(H * D, dim=-1))
    assert not q.is_contiguous()
    dout = torch.randn(B, T, H, D, dtype=torch.float64, generator=g)
    got = _grads(sliding_window_attention, q, k, v, dout, window=5)
    want = _grads(sliding_window_attention_reference, q, k, v, dout, window=5)
    for name, a, b in zip(["o", "dq", "dk", "dv"], got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)
    assert took(path)


def test_causal_fast_path_gradcheck(fast_path_sizes, path):
    q, k, v = (x.requires_grad_(True) for x in inputs(1, 9, 2, 3, 2, seed=8))
    assert torch.autograd.gradcheck(lambda a, b, c: sliding_window_attention(a, b, c, window=4), (q, k, v))
    assert took(path)


def test_causal_fast_path_large_scores(fast_path_sizes, path):
    """Scores of thousands: each row's maximum is taken before exp2, and its logsumexp kept for backward."""
    q, k, v = inputs(1, 30, 2, 4, 3, seed=10)
    q, k = q * 40, k * 40
    dout = torch.randn(1, 30, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(11))
    got = _grads(sliding_window_attention, q, k, v, dout, window=6)
    want = _grads(sliding_window_attention_reference, q, k, v, dout, window=6)
    for name, a, b in zip(["o", "dq", "dk", "dv"], got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=name)
    q, k, v = q.float(), k.float(), v.float()
    assert_float32_matches_reference(sliding_window_attention(q, k, v, window=6), q, k, v, window=6)
    assert took(path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_causal_fast_path_low_precision(dtype, path):
    """16-bit and float32 inputs compute in float32 and return their own dtype; autocast stays off
    inside; 16-bit inputs reach the fused kernel (as float32 copies) where it is built."""
    q, k, v = inputs(1, 70, 2, 8, 8, seed=9)
    want = sliding_window_attention_reference(q, k, v, window=9)
    ql, kl, vl = (x.to(dtype).requires_grad_(True) for x in (q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = sliding_window_attention(ql, kl, vl, window=9)
    assert o.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(o.double(), want, rtol=tol, atol=tol)
    o.float().sum().backward()
    assert all(x.grad.dtype == dtype and torch.isfinite(x.grad).all() for x in (ql, kl, vl))
    assert took(path)


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
    with pytest.raises(ValueError, match="SlidingWindowCache"):  # values of another width
        sliding_window_step(q[:, 0], k[:, 0], torch.randn(1, 2, 3), cache, window=3)


def test_gradients_survive_a_later_in_place_step_when_only_q_needs_them():
    """Steps with only q requiring grad copy the rings, and those copies go on in the cache: a later
    in-place step under no_grad wrote into what the scores had saved, and backward failed."""
    q, k, v = inputs(1, 8, 2, 4, 3, seed=7)
    q.requires_grad_()
    cache = sliding_window_cache(k[:, :4], v[:, :4], window=3)
    outs = []
    for t in range(4, 7):
        o, cache = sliding_window_step(q[:, t], k[:, t], v[:, t], cache, window=3, inplace=True)
        outs.append(o)
    with torch.no_grad():
        sliding_window_step(q[:, 7], k[:, 7], v[:, 7], cache, window=3, inplace=True)
    (g,) = torch.autograd.grad(torch.stack(outs, 1).sum(), q)
    full = sliding_window_attention(q, k, v, window=3)[:, 4:7]
    (want,) = torch.autograd.grad(full.sum(), q)
    torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-10)


def test_a_cache_position_may_be_any_integer():
    import numpy as np

    q, k, v = inputs(1, 5, 1, 2, 2)
    cache = sliding_window_cache(k[:, :4], v[:, :4], window=2)
    o, new = sliding_window_step(q[:, 4], k[:, 4], v[:, 4], cache._replace(pos=np.int64(4)), window=2)
    torch.testing.assert_close(o, sliding_window_attention(q, k, v, window=2)[:, 4])
    assert new.pos == 5 and type(new.pos) is int
