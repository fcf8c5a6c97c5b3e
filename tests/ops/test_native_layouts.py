"""Every fused CPU kernel against its float64 reference on layouts autograd and users hand over that
the kernels' bindings must copy or tolerate: a single token whose size-1 dimensions carry odd
strides (torch calls such a tensor contiguous), a default device other than the CPU, and windows
far beyond T. Each case failed before its fix (BLAS skipped products on a leading dimension below
the row length; outputs were allocated on the default device; a window wrapped in int64)."""
import pytest
import torch

from lintrans.ops import delta_rule, linear_attention
from lintrans.ops.aft import aft, aft_reference
from lintrans.ops.delta.reference import delta_rule_reference
from lintrans.ops.linear.reference import linear_attention_reference
from lintrans.ops.sliding_window import sliding_window_attention, sliding_window_attention_reference

from native_paths import needs_native

pytestmark = needs_native
F64 = torch.float64


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _beta(q):
    return torch.rand(q.shape[:3], generator=_gen(9), dtype=q.dtype, device=q.device)


# (op, its reference): each takes q, k, v [B, T, H, D] and returns o [B, T, H, Dv]
OPS = {
    "chunked linear": (lambda q, k, v: linear_attention(q, k, v, form="chunked")[0],
                       lambda q, k, v: linear_attention_reference(q, k, v)[0]),
    "delta rule": (lambda q, k, v: delta_rule(q, k, v, _beta(q))[0],
                   lambda q, k, v: delta_rule_reference(q, k, v, _beta(q))[0]),
    "sliding window": (lambda q, k, v: sliding_window_attention(q, k, v, window=4),
                       lambda q, k, v: sliding_window_attention_reference(q, k, v, window=4)),
    "aft simple": (lambda q, k, v: aft(q, k, v, variant="simple"),
                   lambda q, k, v: aft_reference(q, k, v, variant="simple")),
}


@pytest.mark.parametrize("name", OPS)
def test_one_token_with_size1_strides_below_the_row_length(name):
    """T = 1 (and B = H = 1): v as a permuted view (strides (1, 1, 1, 1)) and the gradient reaching o
    from an einsum (the same strides), which torch passes on as "contiguous"."""
    op, ref = OPS[name]
    q, k = (torch.randn(1, 1, 1, 4, generator=_gen(i), dtype=F64).requires_grad_() for i in (1, 2))
    v = torch.randn(4, 1, 1, 1, generator=_gen(3), dtype=F64).permute(1, 2, 3, 0).requires_grad_()
    assert v.stride() == (1, 1, 1, 1) and v.is_contiguous()
    w = torch.randn(1, 4, generator=_gen(4), dtype=F64)
    got, want = op(q, k, v), ref(q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    g_got = torch.autograd.grad(torch.einsum("bthd,hd->", got, w), (q, k, v))
    g_want = torch.autograd.grad(torch.einsum("bthd,hd->", want, w), (q, k, v))
    for n, a, b in zip("qkv", g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m: f"d{n}: {m}")


@pytest.mark.parametrize("name", OPS)
def test_cpu_inputs_stay_on_the_cpu_whatever_the_default_device(name):
    """torch.set_default_device("meta") (or "cuda") must not move a kernel's output buffers off the
    CPU: the kernel writes through host pointers (this crashed the process)."""
    op, _ = OPS[name]
    q, k, v = (torch.randn(1, 9, 2, 4, generator=_gen(i)) for i in range(3))
    want = op(q, k, v)
    torch.set_default_device("meta")
    try:
        got = op(q, k, v)
    finally:
        torch.set_default_device(None)
    assert got.device.type == "cpu"
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("window", [70, 2**63 - 1, 2**64, 2**64 + 1])
def test_sliding_window_wider_than_the_sequence_is_full_causal_attention(window):
    """Any window >= T is full causal attention; ints beyond int64 wrapped in the binding (2**64 + 1
    ran as a window of 1, 2**64 gave NaN)."""
    q, k, v = (torch.randn(1, 70, 2, 5, generator=_gen(i), dtype=F64) for i in range(3))
    torch.testing.assert_close(sliding_window_attention(q, k, v, window=window),
                               sliding_window_attention_reference(q, k, v, window=70), rtol=1e-12, atol=1e-12)


def _t_stride_past_int(x):
    """The same values with a size-1 T dimension whose stride does not fit in a C int (never stepped
    along, so any value is a valid layout): BLAS took it as a leading dimension, rejected it and skipped
    the product, leaving the output unwritten."""
    return x.reshape(-1).clone().as_strided(x.shape, (x.shape[2] * x.shape[3], 2**31 + 16, x.shape[3], 1))


@needs_native
def test_a_t_stride_past_int_reaches_blas_as_a_copy(monkeypatch):
    from lintrans.ops import delta_rule, sliding_window_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 2, 16, generator=g) for _ in range(3))
    beta, do = torch.rand(1, 1, 2, generator=g), torch.randn(1, 1, 2, 16, generator=g)

    def run():
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        o = sliding_window_attention(qq, _t_stride_past_int(kk), _t_stride_past_int(vv), window=4)
        o.backward(_t_stride_past_int(do))
        vd = v.clone().requires_grad_()
        od, _ = delta_rule(q, k, vd, beta)
        od.backward(_t_stride_past_int(do))
        return o, qq.grad, kk.grad, vv.grad, od, vd.grad

    native_out = run()
    monkeypatch.setenv("LINTRANS_NATIVE", "0")
    for a, b in zip(native_out, run()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_huge_window_covers_every_key_on_every_path(monkeypatch):
    """The PyTorch path compared positions with the raw window: NaN at 2^63, OverflowError beyond; the
    kernel clamps it. Any window past 2T + 1 reaches every key its dilation allows (the reference's)."""
    q, k, v = (torch.randn(1, 8, 2, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    monkeypatch.setenv("LINTRANS_NATIVE", "0")
    for causal in (True, False):
        for dilation in (1, 2):
            want = sliding_window_attention_reference(q, k, v, window=17, dilation=dilation, causal=causal)
            for window in (2**63, 10**30):
                got = sliding_window_attention(q, k, v, window=window, dilation=dilation, causal=causal)
                torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
