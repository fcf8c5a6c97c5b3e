"""The fused CPU causal sliding window (lintrans/ops/native/sliding_window.cpp): which calls take it,
that it equals the float64 reference and the PyTorch blocks in float32, and that threads do not
change its result. Outputs and gradients against the reference on awkward shapes, on both paths:
tests/ops/test_sliding_window.py (the causal fast-path tests)."""
import pytest
import torch

from lintrans.ops import native
from lintrans.ops.native import sliding_window as native_sw
from lintrans.ops.sliding_window import sliding_window_attention, sliding_window_attention_reference

from native_paths import counted as _counted
from native_paths import assert_compiled_equals_eager, assert_same_for_every_thread_count, needs_native
from qkv import random_qkv


def counted(monkeypatch):
    return _counted(monkeypatch, native_sw)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_supported_calls_take_the_kernel(monkeypatch, dtype):
    calls = counted(monkeypatch)
    q, k, v = random_qkv(1, 9, 2, 4, 3, dtype=dtype)
    sliding_window_attention(q, k, v, window=3)
    assert calls == [1]


@needs_native
def test_other_calls_keep_the_pytorch_paths(monkeypatch):
    calls = counted(monkeypatch)
    q, k, v = random_qkv(1, 9, 2, 4, 3, dtype=torch.float32)
    sliding_window_attention(q, k, v, window=3, dilation=2)
    sliding_window_attention(q, k, v, window=3, global_tokens=[0])
    sliding_window_attention(q, k, v, window=3, causal=False)
    monkeypatch.setenv("LINTRANS_NATIVE", "0")
    sliding_window_attention(q, k, v, window=3)
    assert calls == []
    monkeypatch.delenv("LINTRANS_NATIVE")
    sliding_window_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), window=3)  # float32 copies, the kernel
    assert calls == [1] or not native.available()


@needs_native
def test_float32_kernel_equals_reference_and_blocks(monkeypatch):
    """float32, several blocks and a partial one, a window reaching across blocks, Dk != Dv, views
    of one projection, and an upstream gradient that is a broadcast (stride 0) as ``o.sum()`` gives."""
    B, T, H, Dk, Dv = 2, 150, 3, 8, 5
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(B, T, H, 2 * Dk + Dv, generator=g)
    dout = torch.randn(B, T, H, Dv, generator=g)

    def run(fn, dtype, grad):
        x = qkv.to(dtype).requires_grad_()
        o = fn(x[..., :Dk], x[..., Dk : 2 * Dk], x[..., 2 * Dk :], window=70, scale=0.3)
        loss = o.sum() if grad is None else (o * grad.to(dtype)).sum()
        return [o, *torch.autograd.grad(loss, x)]

    calls = counted(monkeypatch)
    for grad in (dout, None):
        got = run(sliding_window_attention, torch.float32, grad)
        want = run(sliding_window_attention_reference, torch.float64, grad)
        with monkeypatch.context() as m:
            m.setenv("LINTRANS_NATIVE", "0")
            blocks = run(sliding_window_attention, torch.float32, grad)
        for a, b, r in zip(got, blocks, want):
            torch.testing.assert_close(a, r.float(), rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert len(calls) == 2


@needs_native
def test_threads_do_not_change_the_result():
    """One thread walks each head's blocks in order, whatever the number of threads: bitwise equal."""
    q, k, v = (x.float().requires_grad_() for x in random_qkv(2, 150, 3, 8, 8))
    assert_same_for_every_thread_count(lambda q, k, v: sliding_window_attention(q, k, v, window=40), (q, k, v))

@needs_native
@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
def test_torch_compile_runs_the_kernel_eagerly(monkeypatch):
    q, k, v = (x.float().requires_grad_() for x in random_qkv(1, 9, 2, 4, 3))
    loss = lambda q, k, v: sliding_window_attention(q, k, v, window=4).square().sum()  # noqa: E731
    assert_compiled_equals_eager(loss, (q, k, v), counted(monkeypatch))
