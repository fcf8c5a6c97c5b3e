"""Running a test on both CPU paths: the fused kernels (lintrans/ops/native) and the PyTorch code
they fall back to, counting the kernel's calls so that a test can check which path it took."""
import pytest
import torch

from lintrans.ops import native

needs_native = pytest.mark.skipif(not native.available(), reason="native kernels unavailable (no C++ compiler?)")


def counted(monkeypatch, bindings):
    """The calls of ``bindings.forward`` (a module of lintrans.ops.native) from now on."""
    calls = []
    forward = bindings.forward
    monkeypatch.setattr(bindings, "forward", lambda *a, **kw: calls.append(1) or forward(*a, **kw))
    return calls


def on_path(name, monkeypatch, bindings):
    """Set up the path ``name`` ("native" or another: the PyTorch code); (name, the kernel's calls)."""
    if name != "native":
        monkeypatch.setenv("LINTRANS_NATIVE", "0")
    elif not native.available():
        pytest.skip("native kernels unavailable (no C++ compiler?)")
    return name, counted(monkeypatch, bindings)


def took(path):
    """Whether the test took the path it was set up for."""
    name, calls = path
    return (len(calls) > 0) == (name == "native")


def assert_same_for_every_thread_count(op, inputs, threads=(1, 2, 4)):
    """op(*inputs) and the gradients of its squared sum are bitwise equal whatever the number of
    torch threads: each kernel gives a row, head or channel to one thread and keeps its order."""
    before = torch.get_num_threads()
    outs = []
    try:
        for n in threads:
            torch.set_num_threads(n)
            o = op(*inputs)
            outs.append([o, *torch.autograd.grad(o.square().sum(), inputs)])
    finally:
        torch.set_num_threads(before)
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)


def assert_compiled_equals_eager(loss, inputs, calls):
    """torch.compile cannot trace a ctypes call: around ``loss`` it must break the graph there
    cleanly (the kernel still runs: ``calls`` fills) and give the eager gradients."""
    compiled = torch.compile(loss, backend="eager")
    got = torch.autograd.grad(compiled(*inputs), inputs)
    assert calls
    want = torch.autograd.grad(loss(*inputs), inputs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
