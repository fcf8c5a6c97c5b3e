"""Running a test on both CPU paths: the fused kernels (lintrans/ops/native) and the PyTorch code
they fall back to, counting the kernel's calls so that a test can check which path it took."""
import pytest

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
