"""The kernels' large outputs get madvise(MADV_HUGEPAGE) on their 2 MiB-aligned interior, small ones
none, and LINTRANS_HUGEPAGES=0 turns it off. The system call is replaced by a recorder: whether Linux
then backs the range with huge pages depends on its settings, which a test must not depend on."""
import sys

import pytest
import torch

from lintrans.ops import aft, linear_attention, sliding_window_attention
from lintrans.ops.native import binding

from native_paths import needs_native

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise advice is Linux only")


class _Recorder:
    def __init__(self):
        self.calls = []

    def madvise(self, addr, length, advice):
        self.calls.append((addr.value, length.value, advice))
        return 0


@pytest.fixture
def advised(monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr(binding, "_libc", lambda: recorder)
    monkeypatch.delenv("LINTRANS_HUGEPAGES", raising=False)
    return recorder.calls


def test_a_large_output_is_advised_on_its_aligned_interior(advised):
    t = binding.empty((3 * binding.ADVISE_FROM_BYTES // 4 + 5,), torch.zeros(1))  # float32, not a round size
    assert t.dtype == torch.float32 and t.shape == (3 * binding.ADVISE_FROM_BYTES // 4 + 5,)
    [(start, length, advice)] = advised
    huge = binding.HUGE_PAGE
    assert advice == binding.MADV_HUGEPAGE == 14
    assert start % huge == 0 and length % huge == 0 and length > 0
    assert t.data_ptr() <= start < t.data_ptr() + huge  # the first aligned address inside
    assert start + length <= t.data_ptr() + t.nbytes < start + length + huge  # the last one inside


def test_small_outputs_and_the_switch_leave_memory_alone(advised, monkeypatch):
    binding.empty((binding.ADVISE_FROM_BYTES // 8 - 1,), torch.zeros(1, dtype=torch.float64))
    assert advised == []
    monkeypatch.setenv("LINTRANS_HUGEPAGES", "0")
    binding.empty((binding.ADVISE_FROM_BYTES,), torch.zeros(1))
    assert advised == []


@needs_native
@pytest.mark.parametrize("op", ["chunked", "aft", "sliding window"])
def test_each_kernel_allocates_its_outputs_through_it(advised, op):
    """At T = 8192, H = 8, D = 64 each output and gradient is 16 MiB: forward and backward advise them."""
    q, k, v = (torch.randn(1, 8192, 8, 64, requires_grad=True) for _ in range(3))
    run = {"chunked": lambda: linear_attention(q, k, v)[0],
           "aft": lambda: aft(q, k, v, variant="simple"),
           "sliding window": lambda: sliding_window_attention(q, k, v, window=64, causal=True)}[op]
    o = run()
    o = o[0] if isinstance(o, tuple) else o
    forward = len(advised)
    o.backward(torch.ones_like(o))
    assert forward >= 1 and len(advised) - forward >= 3  # o; then dq, dk, dv
    assert all(length >= binding.HUGE_PAGE for _, length, _ in advised)
