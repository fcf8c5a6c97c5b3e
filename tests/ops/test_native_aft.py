"""Causal AFT-simple on both CPU paths: the fused kernel (lintrans/ops/native/aft.cpp) and the
PyTorch paths it falls back to, each against the float64 reference (outputs and gradients), with
awkward shapes, non-contiguous inputs and keys large enough to overflow a naive exp."""
import importlib

import pytest
import torch

from lintrans.ops.aft import aft, aft_reference
from lintrans.ops import native
from lintrans.ops.native import aft as native_aft

from native_paths import assert_compiled_equals_eager, assert_same_for_every_thread_count
from native_paths import needs_native, on_path, took
from native_paths import counted as _counted

aft_module = importlib.import_module("lintrans.ops.aft")  # the package attribute `aft` is the function


def counted(monkeypatch):
    return _counted(monkeypatch, native_aft)


@pytest.fixture(params=["pytorch", "native"])
def path(request, monkeypatch):
    """The test runs on both CPU paths; yields the path's name and the fused kernel's calls."""
    return on_path(request.param, monkeypatch, native_aft)


def inputs(B, T, H, D, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, T, H, D, generator=g, dtype=dtype) for _ in range(3)]


def outputs_and_grads(q, k, v, dout):
    """aft's output and the gradients of (o * dout).sum() for q, k, v (leaves made here)."""
    xs = [x.detach().requires_grad_() for x in (q, k, v)]
    o = aft(*xs, variant="simple")
    return [o, *torch.autograd.grad((o * dout).sum(), xs)]


def reference(q, k, v, dout):
    """The float64 reference's output and gradients, as outputs_and_grads."""
    xs = [x.detach().double().requires_grad_() for x in (q, k, v)]
    o = aft_reference(*xs, variant="simple")
    return [o, *torch.autograd.grad((o * dout.double()).sum(), xs)]


def assert_close_all(got, want, rtol, atol):
    for name, a, b in zip(["o", "dq", "dk", "dv"], got, want):
        torch.testing.assert_close(a.double(), b, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("B, T, H, D", [
    (1, 1, 1, 1),     # T = 1
    (2, 1, 2, 3),     # T = 1, B > 1
    (1, 37, 3, 5),    # odd D
    (3, 70, 2, 4),
    (2, 50, 3, 40),   # heads side by side: 120 channels a row, two tiles
    (1, 20, 2, 150),  # several tiles a head
])
def test_matches_reference(path, B, T, H, D):
    q, k, v = inputs(B, T, H, D, seed=T + D)
    dout = torch.randn(B, T, H, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert_close_all(outputs_and_grads(q, k * 4, v, dout), reference(q, k * 4, v, dout), 1e-10, 1e-10)
    assert took(path)


def test_non_contiguous_inputs_match_reference(path):
    """q from [B, H, T, D] (heads not side by side), k a slice of a wider projection, v with a
    strided last dimension (copied), and a gradient of o.sum() (expanded, stride 0)."""
    B, T, H, D = 2, 45, 3, 70
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64).transpose(1, 2)
    k = (3 * torch.randn(B, T, H, 2 * D, generator=g, dtype=torch.float64))[..., D:]
    v = torch.randn(B, T, D, H, generator=g, dtype=torch.float64).transpose(-1, -2)
    assert not (q.is_contiguous() or k.is_contiguous() or v.stride(-1) == 1)
    dout = torch.ones(B, T, H, D, dtype=torch.float64)
    assert_close_all(outputs_and_grads(q, k, v, dout), reference(q, k, v, dout), 1e-10, 1e-10)
    xs = [x.detach().requires_grad_() for x in (q, k, v)]
    aft(*xs, variant="simple").sum().backward()  # the gradient arrives expanded
    for x, want in zip(xs, reference(q, k, v, dout)[1:]):
        torch.testing.assert_close(x.grad, want, rtol=1e-10, atol=1e-10)
    assert took(path)


def test_values_shared_along_time(path):
    """v expanded along T (stride 0 there): read in place."""
    q, k, v = inputs(2, 30, 2, 6, seed=4)
    v = v[:, :1].expand(-1, 30, -1, -1)
    dout = torch.randn(2, 30, 2, 6, dtype=torch.float64)
    assert_close_all(outputs_and_grads(q, k, v, dout), reference(q, k, v, dout), 1e-10, 1e-10)


def test_huge_keys_stay_finite_and_accurate(path):
    """float32 keys around +-300 with a huge one late (rows before it must not underflow to 0/0):
    outputs and gradients against the float64 reference (the PyTorch path, its log-cumsum-exp scans here,
    within 1e-3: its dk loses more to float32 at keys this large)."""
    q, k, v = inputs(2, 40, 2, 4, dtype=torch.float32, seed=5)
    k = k * 100
    k[:, 30] = 500.0
    dout = torch.randn(2, 40, 2, 4)
    got = outputs_and_grads(q, k, v, dout)
    assert all(torch.isfinite(x).all() for x in got)
    tol = 1e-4 if path[0] == "native" else 1e-3
    assert_close_all(got, reference(q, k, v, dout), tol, tol)
    assert took(path)


def test_keys_drifting_to_huge_values(path):
    """Keys that climb to +400 and others that fall to -400 over 1000 tokens (float32: exp overflows
    past 88): outputs and gradients against the float64 reference."""
    T = 1000
    q, k, v = inputs(1, T, 2, 4, dtype=torch.float32, seed=10)
    drift = torch.linspace(0, 400, T)[None, :, None, None]
    k = k + torch.cat([drift, -drift], dim=2)
    dout = torch.randn(1, T, 2, 4)
    got = outputs_and_grads(q, k, v, dout)
    assert all(torch.isfinite(x).all() for x in got)
    assert_close_all(got, reference(q, k, v, dout), 1e-3, 1e-4)


def test_float64_keys_beyond_any_exp(path):
    """float64 keys of size 1e4 (exp overflows past 709): exact to float64 rounding."""
    q, k, v = inputs(2, 25, 2, 3, seed=12)
    k = k * 1e4
    dout = torch.randn(2, 25, 2, 3, dtype=torch.float64)
    assert_close_all(outputs_and_grads(q, k, v, dout), reference(q, k, v, dout), 1e-9, 1e-10)


def test_keys_of_minus_infinity_weigh_nothing(path):
    """Keys of -inf (a mask) at the start and inside: rows with a finite key so far equal the
    reference, outputs and gradients, and those keys get no gradient (NaN where no key is finite
    yet, as in the reference)."""
    q, k, v = inputs(2, 12, 2, 3, seed=15)
    k[:, :2, 0] = float("-inf")  # head 0: the first two keys masked
    k[:, 5, :, 1] = float("-inf")
    dout = torch.randn(2, 12, 2, 3, dtype=torch.float64)
    got, want = outputs_and_grads(q, k, v, dout), reference(q, k, v, dout)
    live = torch.ones(2, 12, 2, 3, dtype=torch.bool)
    live[:, :2, 0] = False
    assert torch.isnan(want[0][~live]).all() and torch.isnan(got[0][~live]).all()
    for name, a, b in zip(["o", "dq", "dv"], got[:2] + got[3:], want[:2] + want[3:]):
        torch.testing.assert_close(a[live], b[live], rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")
    masked = torch.isinf(k) & live
    torch.testing.assert_close(got[2][~torch.isinf(k)], want[2][~torch.isinf(k)], rtol=1e-10, atol=1e-10)
    assert (got[2][masked] == 0).all() and (got[3][masked] == 0).all()


def test_long_sequence_float32_precision(path):
    """float32 over 16384 tokens (sums of thousands of terms: accumulated in float32 they would be
    off by ~1e-5) against float64, outputs and gradients, to a few float32 roundings."""
    q, k, v = inputs(1, 16384, 2, 8, dtype=torch.float32, seed=6)
    dout = torch.randn(1, 16384, 2, 8)
    got = outputs_and_grads(q, k * 3, v, dout)
    # the same path in float64 as the reference (aft_reference's loops are slow at this length)
    want = outputs_and_grads(q.double(), k.double() * 3, v.double(), dout.double())
    assert_close_all(got, want, 2e-6, 5e-6)


def test_half_precision_runs_in_float32(path):
    q, k, v = inputs(1, 10, 2, 4, dtype=torch.bfloat16)
    o = aft(q, k, v, variant="simple")
    assert o.dtype == torch.bfloat16
    torch.testing.assert_close(o.double(), aft_reference(q, k, v, variant="simple"), rtol=2e-2, atol=2e-2)
    assert took(path)


@needs_native
def test_without_gradients_nothing_is_saved(monkeypatch):
    """No input needs a gradient (or grad mode is off): the kernel runs without saving its
    checkpoints, and gives the same output."""
    saves = []
    forward = native_aft.forward
    monkeypatch.setattr(native_aft, "forward", lambda *a, save: saves.append(save) or forward(*a, save=save))
    q, k, v = inputs(2, 33, 2, 5, dtype=torch.float32)
    plain = aft(q, k, v, variant="simple")
    with torch.no_grad():
        off = aft(q, k, v.requires_grad_(), variant="simple")
    on = aft(q, k, v, variant="simple")
    assert saves == [False, False, True] and on.requires_grad
    assert torch.equal(plain, on) and torch.equal(off, on)


@needs_native
@pytest.mark.parametrize("every", [1, 4])
@pytest.mark.parametrize("T", [1, 3, 4, 5, 12, 37])
def test_stretches_between_checkpoints(monkeypatch, every, T):
    """Backward recomputes the steps between saved sums, a stretch at a time: T shorter than a
    stretch, a multiple of it, one more, a tail; keys that move the running max."""
    monkeypatch.setattr(native_aft, "CHECKPOINT_STEPS", every)
    calls = counted(monkeypatch)
    q, k, v = inputs(2, T, 3, 5, seed=T)
    k = k * 20
    dout = torch.randn(2, T, 3, 5, dtype=torch.float64)
    assert_close_all(outputs_and_grads(q, k, v, dout), reference(q, k, v, dout), 1e-10, 1e-10)
    assert calls == [1]


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_supported_calls_take_the_kernel(monkeypatch, dtype):
    calls = counted(monkeypatch)
    q, k, v = inputs(1, 9, 2, 4, dtype=dtype)
    aft(q, k, v, variant="simple")
    aft(q, k, v, variant="simple", causal=False)  # not causal: one softmax, no kernel
    aft(q, k, v, variant="conv", pos_bias=torch.zeros(2, 3, dtype=dtype))
    assert calls == [1]
    monkeypatch.setenv("LINTRANS_NATIVE", "0")
    aft(q, k, v, variant="simple")
    assert calls == [1]


@needs_native
def test_kernel_gradcheck():
    q, k, v = (x.requires_grad_() for x in inputs(2, 6, 2, 3, seed=13))
    assert torch.autograd.gradcheck(lambda q, k, v: aft(q, k * 3, v, variant="simple"), (q, k, v))


@needs_native
def test_threads_do_not_change_the_result():
    """A channel's arithmetic does not depend on which thread owns it: bitwise equal for 1 to 5
    threads (12 tiles of channels: 3 batches of a 200-channel row)."""
    q, k, v = (x.float().requires_grad_() for x in inputs(3, 40, 5, 40))
    assert_same_for_every_thread_count(lambda q, k, v: aft(q, k * 3, v, variant="simple"), (q, k, v), (1, 2, 3, 5))

def test_without_the_library_the_pytorch_paths_run(monkeypatch):
    """A library that could not be built (warned about once, in ops/native): the same results."""
    calls = counted(monkeypatch)
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_tried", True)
    q, k, v = inputs(2, 9, 2, 3, seed=14)
    dout = torch.randn(2, 9, 2, 3, dtype=torch.float64)
    assert_close_all(outputs_and_grads(q, k, v, dout), reference(q, k, v, dout), 1e-10, 1e-10)
    assert calls == []


@needs_native
def test_torch_compile_runs_the_kernel_eagerly(monkeypatch):
    """torch.compile around the op: the ctypes call runs eagerly (a graph break), same gradients."""
    q, k, v = (x.float().requires_grad_() for x in inputs(1, 9, 2, 4))
    loss = lambda q, k, v: aft(q, k, v, variant="simple").square().sum()  # noqa: E731
    assert_compiled_equals_eager(loss, (q, k, v), counted(monkeypatch))
