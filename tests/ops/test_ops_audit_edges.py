"""Edges an audit of the AFT, BigBird, LSH, sliding-window and loss ops found: mixed precision (autocast),
AFT rows whose shared references underflow, a decoding cache built for other global tokens, and
arguments that were not checked. Each case failed before its fix."""
import pytest
import torch

from lintrans.ops import (aft, bigbird_attention, linear_cross_entropy, lsh_attention, lsh_attention_reference,
                          sliding_window_attention, softmax_attention)
from lintrans.ops.aft import aft_reference
from lintrans.ops.sliding_window import sliding_window_cache, sliding_window_step


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", ["full", "local", "conv", "simple"])
def test_aft_keeps_float32_under_autocast(dtype, variant):
    """Keys spread over 20 units: under autocast the weights' matmul ran in 16 bits, and fp16 lost every term
    below 6e-8 (rows of 0 / 0)."""
    B, T, H, D = 1, 48, 2, 4
    q, k, v = (torch.randn(B, T, H, D, generator=_g(i)) for i in range(3))
    k[:, 24:] += 20.0
    pb = None if variant == "simple" else (torch.randn(H, 2 * T - 1 if variant == "conv" else T, generator=_g(3))
                                           if variant == "conv" else torch.randn(T, T, generator=_g(3)))
    kw = dict(variant=variant, pos_bias=pb, window=8 if variant == "local" else None)
    if variant == "conv":
        kw["pos_bias"] = torch.randn(H, 5, generator=_g(3))
    want = aft(q, k, v, **kw)
    with torch.autocast("cpu", dtype=dtype):
        got = aft(q, k, v, **kw)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype, gap", [(torch.float32, 120.0), (torch.float64, 840.0)])
def test_aft_rows_whose_largest_key_and_bias_differ_by_more_than_floats_hold(causal, dtype, gap):
    """Row 1 gives the key of 0 a bias of -gap and the key of -gap a bias of 0: against the keys' and the
    biases' separate maxima every term underflowed (0 / 0 = nan); the row is now computed again against
    its own reference. Outputs and gradients against the float64 reference."""
    q = torch.zeros(1, 2, 1, 1, dtype=dtype)
    k = torch.tensor([0.0, -gap], dtype=dtype).view(1, 2, 1, 1).requires_grad_()
    v = torch.tensor([1.0, 3.0], dtype=dtype).view(1, 2, 1, 1).requires_grad_()
    pb = torch.tensor([[0.0, 0.0], [-gap, 0.0]], dtype=dtype).requires_grad_()
    o = aft(q, k, v, variant="full", pos_bias=pb, causal=causal)
    ref = aft_reference(q, k, v, variant="full", pos_bias=pb, causal=causal)
    torch.testing.assert_close(o.double(), ref)
    grads = torch.autograd.grad(o.sum(), (k, v, pb))
    ref_grads = torch.autograd.grad(ref.sum(), (k, v, pb))
    for g, r in zip(grads, ref_grads):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g.double(), r.double(), rtol=1e-6, atol=1e-6)


def test_aft_masked_band_beside_one_huge_key():
    """A -inf band mask with one key raised by 110 inside it: the chunked causal path's rows stayed NaN."""
    B, T, H, D = 1, 40, 1, 3
    q, k, v = (torch.randn(B, T, H, D, generator=_g(i)) for i in range(3))
    pb = torch.zeros(T, T)
    pb[torch.arange(T)[:, None] - torch.arange(T)[None, :] > 2] = float("-inf")
    k[:, 1] += 110.0
    o = aft(q, k, v, variant="full", pos_bias=pb)
    torch.testing.assert_close(o.double(), aft_reference(q, k, v, variant="full", pos_bias=pb), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_hashes", [1, 2])
def test_lsh_runs_under_fp16_autocast(n_hashes):
    """The self pair's score (-1e5) has no fp16 value: under autocast the scores' matmul made them fp16."""
    qk, v = (torch.randn(1, 40, 2, 8, generator=_g(i)) for i in range(2))
    kw = dict(n_buckets=4, n_hashes=n_hashes, chunk_size=8, seed=0)
    with torch.autocast("cpu", dtype=torch.float16):
        o, _ = lsh_attention(qk, v, **kw)
    torch.testing.assert_close(o.double(), lsh_attention_reference(qk, v, **kw), rtol=1e-5, atol=1e-5)


def test_bigbird_keeps_float32_under_autocast():
    q, k, v = (torch.randn(1, 40, 2, 8, generator=_g(i)) for i in range(3))
    kw = dict(block_size=8, window_blocks=1, global_blocks=1, random_blocks=1, seed=0)
    want = bigbird_attention(q, k, v, **kw)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = bigbird_attention(q, k, v, **kw)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_sliding_window_step_refuses_a_cache_built_for_other_global_tokens():
    q, k, v = (torch.randn(1, 9, 2, 4, generator=_g(i)) for i in range(3))
    cache = sliding_window_cache(k, v, window=3)  # no global tokens
    with pytest.raises(ValueError, match=r"global_tokens \[0\] need 1"):
        sliding_window_step(q[:, 0], k[:, 0], v[:, 0], cache, window=3, global_tokens=[0])
    # the same tokens as the cache's: the step equals the forward
    full = sliding_window_attention(torch.cat([q, q[:, :1]], 1), torch.cat([k, k[:, :1]], 1),
                                    torch.cat([v, v[:, :1]], 1), window=3, global_tokens=[0])
    cache = sliding_window_cache(k, v, window=3, global_tokens=[0])
    o, _ = sliding_window_step(q[:, 0], k[:, 0], v[:, 0], cache, window=3, global_tokens=[0])
    torch.testing.assert_close(o, full[:, -1])


def test_unchecked_arguments_are_checked():
    q = torch.randn(1, 4, 1, 2)
    with pytest.raises(ValueError, match="scale"):
        softmax_attention(q, q, q, scale=float("nan"))
    with pytest.raises(TypeError, match="causal"):
        softmax_attention(q, q, q, causal="yes")
    h, w, t = torch.randn(3, 2), torch.randn(5, 2), torch.tensor([0, 1, 2])
    for bad in (None, 1.5):
        with pytest.raises(TypeError, match="ignore_index must be an int"):
            linear_cross_entropy(h, w, t, ignore_index=bad)


def test_fp16_loss_gradient_keeps_its_digits_in_a_large_batch():
    """The mean's 1 / N was applied in fp16 before the loss scale arrived: at N = 2^18 the gradient's rows
    fell under fp16's normal range (2% of them exactly 0, 1.5% error). Now 1 / N meets the scale first."""
    N, d, V, S = 2**18, 8, 32, 4096.0
    g = _g(0)
    h = torch.randn(N, d, generator=g).half()
    W = (torch.randn(V, d, generator=g) * 0.3).half()
    t = torch.randint(0, V, (N,), generator=g)

    def grads(dtype):
        hh, ww = h.to(dtype).clone().requires_grad_(), W.to(dtype).clone().requires_grad_()
        loss = linear_cross_entropy(hh * 0.1, ww, t, chunk_rows=N)  # small activations: 1/N x h far under fp16's range
        loss.backward(torch.tensor(S, dtype=loss.dtype))
        return hh.grad.double() / S, ww.grad.double() / S

    (got_h, got_w), (ref_h, ref_w) = grads(torch.float16), grads(torch.float64)
    assert (got_h == 0).float().mean() < 1e-3
    assert (got_h - ref_h).norm() / ref_h.norm() < 2e-3
    assert (got_w - ref_w).norm() / ref_w.norm() < 2e-3
