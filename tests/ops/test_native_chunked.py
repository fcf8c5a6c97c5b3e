"""The fused CPU chunked kernel (lintrans/ops/native): when it runs, that it equals the float64
reference and the PyTorch blocks, and that the library falls back when it cannot be built."""
import warnings

import pytest
import torch

from lintrans.ops import linear_attention, linear_attention_reference, linear_attention_step
from lintrans.ops import native
from lintrans.ops.native import chunked as native_chunked

from native_paths import counted as _counted
from native_paths import assert_compiled_equals_eager, assert_same_for_every_thread_count, needs_native
from qkv import random_qkv


def counted(monkeypatch):
    return _counted(monkeypatch, native_chunked)


@needs_native
@pytest.mark.parametrize("feature_map", ["elu", "relu", "softplus", "identity", None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_supported_calls_take_the_kernel(monkeypatch, feature_map, dtype):
    calls = counted(monkeypatch)
    q, k, v = random_qkv(1, 9, 2, 4, 3, dtype=dtype)
    linear_attention(q, k, v, feature_map=feature_map, chunk_size=4)
    assert calls == [1]


@needs_native
def test_other_calls_keep_the_pytorch_blocks(monkeypatch):
    calls = counted(monkeypatch)
    q, k, v = random_qkv(1, 9, 2, 4, 3, dtype=torch.float32)
    linear_attention(q, k, v, feature_map="based", chunk_size=4)  # not a map the kernel knows
    monkeypatch.setenv("LINTRANS_NATIVE", "0")
    linear_attention(q, k, v, chunk_size=4)
    assert calls == []


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("decay", [False, True])
def test_16_bit_inputs_take_the_kernel_on_float32_copies(monkeypatch, dtype, decay):
    """CPU autocast hands the op 16-bit q, k, v: the kernel runs on float32 copies (the PyTorch blocks,
    which compute in float32 too, ran instead at about half the speed); the output comes back in the
    inputs' dtype and equals the blocks', gradients too."""
    q, k, v = (x.to(dtype) for x in random_qkv(2, 37, 2, 8, 5, dtype=torch.float32))
    ld = -torch.rand(2, 37, 2) if decay else None
    w = torch.randn(2, 37, 2, 5)

    def run():
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        o, (S, _) = linear_attention(*leaves, chunk_size=8, log_decay=ld, output_final_state=True)
        (o.float() * w).sum().backward()
        return o, S, [x.grad for x in leaves]

    calls = counted(monkeypatch)
    o, S, grads = run()
    assert calls == [1] and o.dtype == dtype and S.dtype == torch.float32
    assert all(g.dtype == dtype for g in grads)
    with monkeypatch.context() as m:
        m.setenv("LINTRANS_NATIVE", "0")
        o_ref, S_ref, grads_ref = run()
    assert calls == [1]
    torch.testing.assert_close(o, o_ref, rtol=0, atol=float(o_ref.abs().max()) * 2 ** -7)  # one 16-bit rounding
    torch.testing.assert_close(S, S_ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=float(b.abs().max()) * 2 ** -7)


@needs_native
@pytest.mark.parametrize("decay", [None, "per-token", "fixed"])
@pytest.mark.parametrize("chunk", [8, 37, 64])
def test_kernel_equals_reference_and_blocks(monkeypatch, decay, chunk):
    """float32, several stretches between saved states, a tail chunk, Dk != Dv, an initial state,
    non-contiguous q, k, v (views into one projection, as the GPT passes them), scale and eps; chunks
    of 37 and 64 rows take the split in-chunk products (an odd split at 37, whole tails of 9 and 19)."""
    monkeypatch.setattr(native_chunked, "CHECKPOINT_CHUNKS", 2)
    B, T, H, Dk, Dv = 2, 83, 3, 5, 7
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(B, T, H, 2 * Dk + Dv, generator=g)
    ld = {None: None, "per-token": -torch.rand(B, T, H, generator=g),
          "fixed": -torch.rand(H, generator=g)}[decay]
    S0, z0 = torch.randn(B, H, Dk, Dv, generator=g), torch.rand(B, H, Dk, generator=g) + 0.5
    w, wS = torch.randn(B, T, H, Dv, generator=g), torch.randn(B, H, Dk, Dv, generator=g)

    def run(fn, dtype, **kw):
        x = qkv.to(dtype).requires_grad_()
        extra = [t.to(dtype).requires_grad_() for t in (S0, z0)] + ([] if ld is None else [ld.to(dtype).requires_grad_()])
        q, k, v = x[..., :Dk], x[..., Dk : 2 * Dk], x[..., 2 * Dk :]
        o, (S, z) = fn(q, k, v, scale=0.8, eps=1e-5, initial_state=tuple(extra[:2]),
                       log_decay=extra[2] if ld is not None else None, **kw)
        grads = torch.autograd.grad((o * w.to(dtype)).sum() + (S * wS.to(dtype)).sum() + z.sum(), [x] + extra)
        return [o, S, z, *grads]

    calls = counted(monkeypatch)
    got = run(linear_attention, torch.float32, chunk_size=chunk, output_final_state=True)
    assert calls == [1]
    want = run(linear_attention_reference, torch.float64)
    monkeypatch.setenv("LINTRANS_NATIVE", "0")
    blocks = run(linear_attention, torch.float32, chunk_size=chunk, output_final_state=True)
    for a, b, r in zip(got, blocks, want):
        torch.testing.assert_close(a, r.float(), rtol=1e-4, atol=1e-4)
        # a fixed decay's gradient (~60) sums every position's term in float32, in a different order
        # in each: both lie within 2e-6 of the float64 one, apart from each other by up to 1.3e-5
        torch.testing.assert_close(a, b, rtol=3e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("T, chunk", [(7, 3), (40, 33)])  # 33: the split in-chunk products, in float64
def test_kernel_gradcheck(T, chunk):
    q, k, v = (x.requires_grad_() for x in random_qkv(1, T, 2, 3, 2))
    ld = (-torch.rand(1, T, 2, dtype=torch.float64)).requires_grad_()
    fn = lambda q, k, v, ld: linear_attention(q, k, v, chunk_size=chunk, log_decay=ld, feature_map="softplus")[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v, ld))


@needs_native
def test_threads_do_not_change_the_result():
    """One thread walks each head's chunks in order, whatever the number of threads: bitwise equal."""
    q, k, v = (x.float().requires_grad_() for x in random_qkv(2, 50, 3, 8, 8))
    assert_same_for_every_thread_count(lambda q, k, v: linear_attention(q, k, v, chunk_size=8)[0], (q, k, v))

def test_failed_build_warns_once_and_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "false")  # a compiler that always fails
    monkeypatch.setenv("LINTRANS_NATIVE", "1")  # the kernels asked for, even where the suite runs with them off
    monkeypatch.setenv("LINTRANS_NATIVE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_tried", False)
    with pytest.warns(RuntimeWarning, match="native CPU kernels unavailable"):
        assert native.library() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.library() is None  # tried once: no second warning, no second build
        q, k, v = random_qkv(1, 5, 1, 3, 2)
        o, _ = linear_attention(q, k, v, chunk_size=2)
    torch.testing.assert_close(o, linear_attention_reference(q, k, v)[0])
    assert [p.name for p in tmp_path.iterdir()] == [native.LOCK_NAME]  # no half-written library left behind


def test_a_plain_process_does_not_load_the_compiler():
    """torch._dynamo takes as long to import as torch itself: importing lintrans and running its
    kernels must not load it (the kernels' graph break for torch.compile is made only once it is)."""
    import subprocess
    import sys

    code = ("import sys, torch, lintrans.ops, lintrans.nn, lintrans.models\n"
            "from lintrans.ops import linear_attention, delta_rule, aft\n"
            "q = torch.randn(1, 9, 2, 4, requires_grad=True)\n"
            "linear_attention(q, q, q, chunk_size=4)[0].sum().backward()\n"
            "delta_rule(q, q, q, torch.rand(1, 9, 2))[0].sum().backward()\n"
            "aft(q, q, q, variant='simple').sum().backward()\n"
            "print('torch._dynamo' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


@needs_native
@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
def test_torch_compile_runs_the_kernel_eagerly(monkeypatch):
    q, k, v = (x.float().requires_grad_() for x in random_qkv(1, 9, 2, 4, 3))
    loss = lambda q, k, v: linear_attention(q, k, v, chunk_size=4)[0].square().sum()  # noqa: E731
    assert_compiled_equals_eager(loss, (q, k, v), counted(monkeypatch))


def _step_inputs(B, H, Dk, Dv, dtype, decay, gen):
    q, k = (torch.randn(B, H, Dk, dtype=dtype, generator=gen) for _ in range(2))
    v = torch.randn(B, H, Dv, dtype=dtype, generator=gen)
    state = (torch.randn(B, H, Dk, Dv, dtype=dtype, generator=gen), torch.rand(B, H, Dk, dtype=dtype, generator=gen) + 1)
    ld = {None: None, "per-batch": -torch.rand(B, H, dtype=dtype, generator=gen),
          "per-head": -torch.rand(H, dtype=dtype, generator=gen)}[decay]
    return q, k, v, state, ld


def _step_calls(monkeypatch):
    calls = []
    step = native_chunked.step
    monkeypatch.setattr(native_chunked, "step", lambda *a, **kw: calls.append(1) or step(*a, **kw))
    return calls


@needs_native
@pytest.mark.parametrize("feature_map", ["elu", "relu", "softplus", "identity", None])
@pytest.mark.parametrize("decay", [None, "per-batch", "per-head"])
@pytest.mark.parametrize("normalize", [True, False])
def test_decoding_step_kernel_equals_the_pytorch_step(monkeypatch, feature_map, decay, normalize):
    """The fused decoding step (no gradients recorded) against the PyTorch step, in float64, Dk != Dv;
    the state it was given is left as it was."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, state, ld = _step_inputs(2, 3, 5, 7, torch.float64, decay, gen)
    before = tuple(s.clone() for s in state)
    calls = _step_calls(monkeypatch)
    kw = dict(feature_map=feature_map, normalize=normalize, scale=0.4, eps=1e-3, log_decay=ld)
    with torch.no_grad():
        o, (S, z) = linear_attention_step(q, k, v, state, **kw)
    assert calls == [1]
    monkeypatch.setenv("LINTRANS_NATIVE", "0")
    o_ref, (S_ref, z_ref) = linear_attention_step(q, k, v, state, **kw)
    assert calls == [1]
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(S, S_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(z, z_ref, rtol=1e-12, atol=1e-12)
    assert all(torch.equal(a, b) for a, b in zip(state, before))


@needs_native
def test_decoding_step_kernel_float32_large_batch_and_strided_state(monkeypatch):
    """A batch large enough for the kernel to use threads, a state given as expanded (stride-0) views:
    against the float64 PyTorch step; the result is the same for any number of threads."""
    gen = torch.Generator().manual_seed(4)
    q, k, v, _, ld = _step_inputs(4, 8, 32, 64, torch.float64, "per-batch", gen)
    S = torch.randn(1, 8, 32, 64, dtype=torch.float64, generator=gen).expand(4, -1, -1, -1)
    z = (torch.rand(1, 8, 32, dtype=torch.float64, generator=gen) + 1).expand(4, -1, -1)
    calls = _step_calls(monkeypatch)
    f32 = lambda *xs: tuple(x.float() for x in xs)  # noqa: E731
    outs = []
    before = torch.get_num_threads()
    try:
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            with torch.no_grad():
                outs.append(linear_attention_step(*f32(q, k, v), f32(S, z), log_decay=ld.float(), scale=0.2))
    finally:
        torch.set_num_threads(before)
    assert calls == [1, 1, 1]
    for o, (S1, z1) in outs[1:]:
        assert torch.equal(o, outs[0][0]) and torch.equal(S1, outs[0][1][0]) and torch.equal(z1, outs[0][1][1])
    monkeypatch.setenv("LINTRANS_NATIVE", "0")
    o_ref, (S_ref, z_ref) = linear_attention_step(q, k, v, (S, z), log_decay=ld, scale=0.2)
    o, (S1, z1) = outs[0]
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(S1.double(), S_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(z1.double(), z_ref, rtol=1e-5, atol=1e-5)


@needs_native
def test_decoding_steps_that_record_gradients_or_cannot_be_fused_keep_pytorch(monkeypatch):
    gen = torch.Generator().manual_seed(5)
    q, k, v, state, _ = _step_inputs(1, 2, 4, 4, torch.float32, None, gen)
    calls = _step_calls(monkeypatch)
    linear_attention_step(q.requires_grad_(), k, v, state)  # autograd records
    with torch.no_grad():
        linear_attention_step(q, k, v, None)  # no state yet
        _, wide = linear_attention_step(q, k, v, None, feature_map="based")  # no kernel code (and its own width)
        linear_attention_step(q, k, v, wide, feature_map="based")
        linear_attention_step(q.bfloat16(), k.bfloat16(), v.bfloat16(), state)  # 16-bit inputs
    assert calls == []


@needs_native
def test_decoding_steps_write_host_memory_whatever_the_default_device(monkeypatch):
    """The fused steps' outputs were made on the default device: under set_default_device('meta') the kernel
    wrote through a pointer to nothing (a segfault)."""
    from lintrans.ops import delta_rule_step

    gen = torch.Generator().manual_seed(6)
    q, k, v, state, _ = _step_inputs(1, 2, 4, 4, torch.float32, None, gen)
    beta = torch.rand(1, 2, generator=gen)
    calls = _step_calls(monkeypatch)
    want = linear_attention_step(q, k, v, state)[0], delta_rule_step(q, k, v, beta, state[0])[0]
    with torch.no_grad(), torch.device("meta"):
        got = linear_attention_step(q, k, v, state)[0], delta_rule_step(q, k, v, beta, state[0])[0]
    assert calls == [1, 1] and all(g.device.type == "cpu" for g in got)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@needs_native
def test_decoding_steps_compile_as_one_graph():
    """While torch.compile traces, the steps take the PyTorch ops (one graph), not the kernel (a graph break)."""
    gen = torch.Generator().manual_seed(7)
    q, k, v, state, _ = _step_inputs(1, 2, 4, 4, torch.float32, None, gen)
    step = torch.compile(lambda q, k, v, S, z: linear_attention_step(q, k, v, (S, z))[0], backend="eager",
                         fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(step(q, k, v, *state), linear_attention_step(q, k, v, state)[0])
