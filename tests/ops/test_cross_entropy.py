"""linear_cross_entropy: the LM-head loss without logits equals the plain path, values and gradients."""
import pytest
import torch
import torch.nn.functional as F

from lintrans.ops import linear_cross_entropy, linear_cross_entropy_reference


def case(N, d, V, dtype=torch.float64, ignore=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, d, generator=g, dtype=dtype).requires_grad_()
    w = torch.randn(V, d, generator=g, dtype=dtype).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g)
    for i in ignore:
        t[i] = -1
    return h, w, t


def grads(loss, *xs):
    return torch.autograd.grad(loss, xs)


# chunk_rows 1, a chunk that does not divide N, one chunk bigger than N; N = 1; d odd
@pytest.mark.parametrize("N, d, V, chunk", [(1, 3, 5, 4), (7, 5, 11, 3), (16, 8, 13, 1), (9, 6, 7, 64)])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_loss_and_gradients_match_reference(N, d, V, chunk, reduction):
    h, w, t = case(N, d, V, ignore=(0,) if N > 2 else ())
    got = linear_cross_entropy(h, w, t, chunk_rows=chunk, reduction=reduction)
    ref = linear_cross_entropy_reference(h, w, t, reduction=reduction)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    # a non-unit upstream gradient must scale both results
    for a, b in zip(grads(2.5 * got, h, w), grads(2.5 * ref, h, w)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_reference_is_the_plain_path():
    h, w, t = case(6, 4, 9, ignore=(2,))
    torch.testing.assert_close(
        linear_cross_entropy_reference(h, w, t), F.cross_entropy(h @ w.t(), t, ignore_index=-1)
    )


def test_gradcheck():
    h, w, t = case(5, 3, 4, ignore=(1,))
    assert torch.autograd.gradcheck(lambda h, w: linear_cross_entropy(h, w, t, chunk_rows=2), (h, w))


def test_reduction_none_per_row_and_ignored_rows_zero():
    h, w, t = case(6, 4, 9, ignore=(3,))
    with torch.no_grad():
        got = linear_cross_entropy(h, w, t, chunk_rows=4, reduction="none")
    ref = F.cross_entropy(h.detach() @ w.detach().t(), t, ignore_index=-1, reduction="none")
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    assert got[3] == 0


def test_float32_keeps_float32_and_matches_float64():
    h, w, t = case(40, 16, 300, dtype=torch.float32)
    w.data.mul_(0.1)
    got = linear_cross_entropy(h, w, t, chunk_rows=16)
    assert got.dtype == torch.float32
    gh, gw = grads(got, h, w)
    assert gh.dtype == gw.dtype == torch.float32
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = linear_cross_entropy_reference(h64, w64, t)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    for a, b in zip((gh, gw), grads(ref, h64, w64)):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-6)


def test_large_logits_stay_finite():
    h, w, t = case(4, 3, 6)
    with torch.no_grad():
        h.mul_(300.0)  # logits in the thousands: a naive exp overflows
    got = linear_cross_entropy(h, w, t, chunk_rows=3)
    ref = linear_cross_entropy_reference(h, w, t)
    assert torch.isfinite(got)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-8)


def test_all_rows_ignored_gives_nan_like_cross_entropy():
    h, w, t = case(3, 2, 4, ignore=(0, 1, 2))
    assert torch.isnan(linear_cross_entropy(h, w, t)) and torch.isnan(linear_cross_entropy_reference(h, w, t))
    # and, like F.cross_entropy, a zero gradient: one fully padded micro-batch must not put nan in the weights
    ours = grads(linear_cross_entropy(h, w, t), h, w)
    ref = grads(linear_cross_entropy_reference(h, w, t), h, w)
    for a, b in zip(ours, ref):
        assert torch.equal(a, torch.zeros_like(a)) and torch.equal(b, torch.zeros_like(b))


def test_no_gradient_work_under_no_grad(monkeypatch):
    """An evaluation (torch.no_grad) with a head that requires grad computes the loss only."""
    h, w, t = case(5, 3, 7)
    w.requires_grad_()
    made = []
    real = torch.zeros

    def zeros(*a, **kw):  # grad_w is the only [V, d] tensor the op makes with zeros
        out = real(*a, **kw)
        made.append(tuple(out.shape))
        return out

    monkeypatch.setattr(torch, "zeros", zeros)
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, t)
    assert (7, 3) not in made
    torch.testing.assert_close(loss, linear_cross_entropy_reference(h, w, t))


def test_bf16_autocast_close_to_float32():
    h, w, t = case(32, 16, 50, dtype=torch.float32)
    ref = linear_cross_entropy(h, w, t)
    got = linear_cross_entropy(h.bfloat16(), w.bfloat16(), t)
    assert got.dtype == torch.float32  # the loss is accumulated in float32
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)


# error bound relative to the largest gradient entry: a few units of the format's rounding (2^-8, 2^-11)
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
def test_low_precision_gradients_close_to_float64(dtype, tol):
    # the low-precision path normalises before casting (fp16 overflows at 65504); several chunks, ignored rows
    h, w, t = case(24, 16, 300, ignore=(3, 17), seed=2)
    hl, wl = h.detach().to(dtype).requires_grad_(), w.detach().to(dtype).requires_grad_()
    got = grads(linear_cross_entropy(hl, wl, t, chunk_rows=10), hl, wl)
    h, w = hl.detach().double().requires_grad_(), wl.detach().double().requires_grad_()  # the same rounded inputs
    ref = grads(linear_cross_entropy_reference(h, w, t), h, w)
    for a, b in zip(got, ref):
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), b, rtol=0, atol=tol * b.abs().max().item())
    assert got[0][3].abs().max() == 0 and got[0][17].abs().max() == 0  # ignored rows get no gradient


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        (dict(h=torch.zeros(3, 4, 1)), ValueError, "h must have 2 dimensions"),
        (dict(w=torch.zeros(5, 3)), ValueError, "share d"),
        (dict(w=torch.zeros(5, 4, dtype=torch.float64)), TypeError, "share one dtype"),
        (dict(t=torch.zeros(3)), TypeError, "targets must be an int64"),
        (dict(t=torch.zeros(2, dtype=torch.long)), ValueError, r"targets must have shape \[N\]"),
        (dict(t=torch.tensor([0, 5, 1])), ValueError, r"targets must lie in \[0, 5\)"),
        (dict(chunk_rows=0), ValueError, "chunk_rows must be an int >= 1"),
        (dict(reduction="avg"), ValueError, "reduction must be"),
    ],
)
def test_bad_input(kwargs, err, match):
    h = kwargs.pop("h", torch.zeros(3, 4))
    w = kwargs.pop("w", torch.zeros(5, 4))
    t = kwargs.pop("t", torch.tensor([0, 4, -1]))
    with pytest.raises(err, match=match):
        linear_cross_entropy(h, w, t, **kwargs)


def test_reduction_none_refuses_backward_clearly():
    h, w, t = case(3, 2, 4)
    loss = linear_cross_entropy(h, w, t, reduction="none")
    with pytest.raises(RuntimeError, match="reduction='none'"):
        loss.sum().backward()
