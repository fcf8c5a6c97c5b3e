"""AFT (full/simple/local/conv) against the plain float64 reference: outputs, gradients, decoding, errors."""
import importlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lintrans.ops.aft import (
    CHUNK,
    AFTWindowState,
    aft,
    aft_last_row,
    aft_reference,
    aft_simple_state,
    aft_simple_step,
    aft_window_state,
    aft_window_step,
)
from lintrans.ops.sliding_window import sliding_window_attention

aft_module = importlib.import_module("lintrans.ops.aft")  # the package attribute `aft` is the function


@pytest.fixture
def pytorch_simple(monkeypatch):
    """Causal AFT-simple on its PyTorch paths (the CPU takes the fused kernel, when it can be had,
    first: tests/ops/test_native_aft.py runs both)."""
    monkeypatch.setenv("LINTRANS_NATIVE", "0")


def inputs(B, T, H, D, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, T, H, D, generator=g, dtype=dtype) for _ in range(3)]


def assert_matches_reference(q, k, v, pos_bias, **kw):
    """aft against aft_reference: outputs, and gradients for q, k, v and the bias (when there is one)."""
    args = [q, k, v] + ([pos_bias] if pos_bias is not None else [])
    for x in args:
        x.requires_grad_(True)
    o, ref = aft(q, k, v, pos_bias=pos_bias, **kw), aft_reference(q, k, v, pos_bias=pos_bias, **kw)
    torch.testing.assert_close(o, ref, rtol=1e-10, atol=1e-10)
    dout = torch.randn(q.shape, dtype=torch.float64)
    got = torch.autograd.grad((o * dout).sum(), args)
    want = torch.autograd.grad((ref * dout).sum(), args)
    for name, a, b in zip("qkvw", got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=f"grad of {name}")


def bias_for(variant, T, H, per_head=False, kernel=5, seed=1):
    """(pos_bias, window) for a variant; full/local biases are larger than T on purpose (T_max > T)."""
    g = torch.Generator().manual_seed(seed)
    if variant == "simple":
        return None, None
    if variant == "conv":
        return torch.randn(H, kernel, generator=g, dtype=torch.float64), None
    shape = (H, T + 3, T + 3) if per_head else (T + 3, T + 3)
    return torch.randn(*shape, generator=g, dtype=torch.float64), (3 if variant == "local" else None)


CASES = [
    ("simple", False), ("full", False), ("full", True), ("local", False), ("local", True), ("conv", False),
]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("variant, per_head", CASES)
@pytest.mark.parametrize("B, T, H, D", [(2, 1, 2, 3), (1, 6, 3, 5), (2, CHUNK + 5, 2, 4)])
def test_outputs_match_reference(variant, per_head, causal, B, T, H, D):
    q, k, v = inputs(B, T, H, D)
    pos_bias, window = bias_for(variant, T, H, per_head)
    o = aft(q, k, v, variant=variant, pos_bias=pos_bias, window=window, causal=causal)
    ref = aft_reference(q, k, v, variant=variant, pos_bias=pos_bias, window=window, causal=causal)
    assert o.shape == (B, T, H, D) and o.dtype == q.dtype
    torch.testing.assert_close(o, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("variant, per_head", CASES)
def test_gradients_match_reference(variant, per_head, causal):
    T = CHUNK + 3  # crosses a chunk boundary of the causal path
    q, k, v = inputs(1, T, 2, 3, seed=3)
    pos_bias, window = bias_for(variant, T, 2, per_head, kernel=4 if causal else 5)
    assert_matches_reference(q, k, v, pos_bias, variant=variant, window=window, causal=causal)


@pytest.mark.parametrize("variant, per_head", CASES[1:])
def test_causal_chunked_path_matches_reference(variant, per_head, monkeypatch):
    """The per-row-reference path that large keys take, forced on ordinary inputs: outputs and grads."""
    monkeypatch.setitem(aft_module.UNDERFLOW_GAP, torch.float64, 0.0)
    T = 2 * CHUNK + 3
    q, k, v = inputs(2, T, 2, 3, seed=7)
    pos_bias, window = bias_for(variant, T, 2, per_head)
    assert_matches_reference(q, k, v, pos_bias, variant=variant, window=window)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("variant, per_head", CASES[3:])
def test_banded_path_matches_reference(variant, per_head, causal, monkeypatch):
    """local/conv through the O(T*W*D) band (long-sequence path) forced on short inputs: outputs and grads."""
    monkeypatch.setattr(aft_module, "BANDED_RATIO", 0.0)
    T = 23
    q, k, v = inputs(2, T, 2, 3, seed=8)
    pos_bias, window = bias_for(variant, T, 2, per_head)
    assert_matches_reference(q, k, v, pos_bias, variant=variant, window=window, causal=causal)


def test_reference_is_the_paper_formula():
    """The reference's softmax form against sum exp(k + w) v / sum exp(k + w), written out, for one row."""
    q, k, v = inputs(1, 4, 1, 2)
    w = torch.randn(4, 4, dtype=torch.float64)
    t = 2
    weights = torch.exp(k[0, : t + 1, 0] + w[t, : t + 1, None])  # [t+1, D]
    want = torch.sigmoid(q[0, t, 0]) * (weights * v[0, : t + 1, 0]).sum(0) / weights.sum(0)
    got = aft_reference(q, k, v, variant="full", pos_bias=w)[0, t, 0]
    torch.testing.assert_close(got, want)


def test_local_bias_is_zero_not_minus_infinity_outside_the_window():
    """With window 1 only the diagonal is biased; earlier keys still count (with bias 0)."""
    q, k, v = inputs(1, 5, 1, 2)
    w = torch.full((5, 5), 7.0, dtype=torch.float64)
    local = aft(q, k, v, variant="local", pos_bias=w, window=1)
    diag_only = aft(q, k, v, variant="full", pos_bias=torch.diag(torch.diag(w)))
    torch.testing.assert_close(local, diag_only)
    assert not torch.allclose(local, torch.sigmoid(q) * v)  # not just the token itself


def test_conv_is_local_with_a_relative_bias():
    q, k, v = inputs(2, 9, 2, 3)
    kernel = torch.randn(2, 4, dtype=torch.float64)
    t = torch.arange(9)
    rel = t[:, None] - t[None, :]
    dense = torch.where((rel >= 0) & (rel < 4), kernel[:, rel.clamp(0, 3)], torch.zeros(()))  # [H,T,T]
    torch.testing.assert_close(
        aft(q, k, v, variant="conv", pos_bias=kernel), aft(q, k, v, variant="full", pos_bias=dense)
    )


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("variant", ["simple", "full", "local", "conv"])
def test_large_keys_stay_finite_and_accurate(variant, causal):
    """float32 keys around +-300: naive exp overflows; rows before a huge key must not underflow to 0/0."""
    q, k, v = inputs(2, 40, 2, 4, dtype=torch.float32, seed=5)
    k = k * 100
    k[:, 30] = 500.0  # a huge key late in the sequence
    pos_bias, window = bias_for(variant, 40, 2)
    pos_bias = None if pos_bias is None else pos_bias.float() * 10
    kw = dict(variant=variant, pos_bias=pos_bias, window=window, causal=causal)
    o = aft(q, k, v, **kw)
    assert torch.isfinite(o).all()
    bias64 = None if pos_bias is None else pos_bias.double()
    ref = aft_reference(q.double(), k.double(), v.double(), **{**kw, "pos_bias": bias64})
    torch.testing.assert_close(o.double(), ref, rtol=1e-4, atol=1e-4)
    k.requires_grad_(True)
    (g,) = torch.autograd.grad(aft(q, k, v, **kw).sum(), k)
    assert torch.isfinite(g).all()


@pytest.mark.parametrize("banded", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_local_bias_of_minus_infinity_outside_the_window_is_ignored(causal, banded, monkeypatch):
    """Outside the window the bias is 0 whatever pos_bias holds there: a -inf entry (a masked key)
    must not turn into NaN (-inf * 0)."""
    if banded:
        monkeypatch.setattr(aft_module, "BANDED_RATIO", 0.0)
    q, k, v = inputs(1, 7, 2, 3, seed=4)
    w = torch.randn(2, 7, 7, dtype=torch.float64)
    w[:, :, 1] = float("-inf")  # key 1, outside the window of every row from 3 on (window 2)
    kw = dict(variant="local", pos_bias=w, window=2, causal=causal)
    o = aft(q, k, v, **kw)
    torch.testing.assert_close(o, aft_reference(q, k, v, **kw))
    assert torch.isfinite(o[:, 3:]).all()
    if causal:
        kw.pop("causal")
        torch.testing.assert_close(aft_last_row(q[:, -1], k, v, **kw), o[:, -1])


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("variant", ["local", "conv"])
def test_banded_rows_before_a_huge_late_key_keep_float32_accuracy(variant, causal, monkeypatch, pytorch_simple):
    """Each row's band logits are taken relative to its own band's largest key: a shift by the
    sequence's largest key (1e4, last) would push the earlier rows' keys to -1e4 and cost the bias its
    digits (errors of 2e-4 there)."""
    monkeypatch.setattr(aft_module, "BANDED_RATIO", 0.0)
    q, k, v = inputs(1, 40, 2, 4, dtype=torch.float32, seed=7)
    k[:, -1] += 1e4
    pos_bias, window = bias_for(variant, 40, 2, per_head=True)
    kw = dict(variant=variant, pos_bias=pos_bias.float(), window=window, causal=causal)
    ref = aft_reference(q.double(), k.double(), v.double(), **{**kw, "pos_bias": pos_bias})
    torch.testing.assert_close(aft(q, k, v, **kw).double(), ref, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("variant", ["local", "conv"])
def test_banded_path_takes_minus_infinity_keys(variant, causal, monkeypatch):
    """A band of -inf keys only has no finite largest key to take logits relative to: no NaN."""
    monkeypatch.setattr(aft_module, "BANDED_RATIO", 0.0)
    q, k, v = inputs(1, 12, 2, 3, seed=9)
    k[:, 4:8] = float("-inf")
    pos_bias, window = bias_for(variant, 12, 2, per_head=True, kernel=3)
    kw = dict(variant=variant, pos_bias=pos_bias, window=None if variant == "conv" else 2, causal=causal)
    torch.testing.assert_close(aft(q, k, v, **kw), aft_reference(q, k, v, **kw))


@pytest.mark.parametrize("variant", ["local", "conv"])
def test_decoding_with_keys_of_size_1e4_keeps_float32_accuracy(variant):
    """The window step and the last row form k - (a nearby key) before adding the bias, as the forward does."""
    q, k, v = inputs(1, 30, 2, 4, dtype=torch.float32, seed=8)
    k = k * 3 + 1e4
    pos_bias, window = bias_for(variant, 30, 2, per_head=True)
    kw = dict(variant=variant, pos_bias=pos_bias.float(), window=window)
    ref = aft_reference(q.double(), k.double(), v.double(), **{**kw, "pos_bias": pos_bias})
    state, outs = aft_window_state(k[:, :5], v[:, :5], **kw), []
    for t in range(5, 30):
        o, state = aft_window_step(q[:, t], k[:, t], v[:, t], state, **kw)
        outs.append(o)
    torch.testing.assert_close(torch.stack(outs, 1).double(), ref[:, 5:], rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(aft_last_row(q[:, -1], k, v, **kw).double(), ref[:, -1], rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("variant", ["simple", "local"])
def test_float32_keys_of_size_1e4_keep_the_values_digits(variant, monkeypatch, pytorch_simple):
    """k + log(1 + |v|) in float32 loses log's digits at |k| = 1e4 (ulp 1e-3): the log-space scans
    run in float64 and the banded keys are shifted near 0, so the error stays at float32's level."""
    monkeypatch.setattr(aft_module, "BANDED_RATIO", 0.0)
    q, k, v = inputs(1, 50, 2, 4, dtype=torch.float32, seed=6)
    k = k * 3 + 1e4
    k[:, 0] = -1e9  # a masked-looking first key: row 0's mean is still v_0
    pos_bias, window = bias_for(variant, 50, 2)
    kw = dict(variant=variant, pos_bias=None if pos_bias is None else pos_bias.float(), window=window)
    o = aft(q, k, v, **kw)
    ref = aft_reference(q.double(), k.double(), v.double(), **{**kw, "pos_bias": None if pos_bias is None
                                                             else pos_bias.double()})
    torch.testing.assert_close(o.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T", [1, 2 * aft_module.SIMPLE_CHUNK, 2 * aft_module.SIMPLE_CHUNK + 3])
@pytest.mark.parametrize("path", ["chunks", "scans over T"])
def test_simple_causal_paths_match_reference(T, path, monkeypatch, pytorch_simple):
    """Both paths of causal AFT-simple, each forced: outputs and gradients, T across chunk boundaries."""
    monkeypatch.setattr(aft_module, "_simple_reference", lambda k: None)  # not the two plain cumsums
    if path == "chunks":
        monkeypatch.setattr(aft_module, "_log_sums", None)  # fails if called
    else:
        monkeypatch.setitem(aft_module.UNDERFLOW_GAP, torch.float64, 0.0)
    q, k, v = inputs(2, T, 2, 3, seed=9)
    assert_matches_reference(q, k, v, None, variant="simple", causal=True)


def test_simple_causal_keys_drifting_to_huge_values_take_the_chunks(monkeypatch, pytorch_simple):
    """Keys that climb to +400 and others that fall to -400 (float32: exp overflows past 88), 0.4 per
    token: the chunked path (no scan over T), finite and accurate, gradients finite."""
    monkeypatch.setattr(aft_module, "_log_sums", None)
    T = 1000
    q, k, v = inputs(1, T, 2, 4, dtype=torch.float32, seed=10)
    drift = torch.linspace(0, 400, T)[None, :, None, None]
    k = k + torch.cat([drift, -drift], dim=2)
    o = aft(q, k, v, variant="simple")
    assert torch.isfinite(o).all()
    ref = aft_reference(q.double(), k.double(), v.double(), variant="simple")
    torch.testing.assert_close(o.double(), ref, rtol=1e-4, atol=1e-4)
    k.requires_grad_(True)
    (g,) = torch.autograd.grad(aft(q, k, v, variant="simple").sum(), k)
    assert torch.isfinite(g).all()


def test_simple_causal_long_sequence_float32_precision(pytorch_simple):
    q, k, v = inputs(1, 2048, 1, 8, dtype=torch.float32, seed=6)
    o = aft(q, k * 3, v, variant="simple")
    ref = aft(q.double(), k.double() * 3, v.double(), variant="simple")
    torch.testing.assert_close(o.double(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("T,block", [(1, 4), (7, 7), (8, 7), (300, 7), (300, 64), (300, 1000)])
def test_simple_causal_cumsum_blocks_match_the_reference(T, block, B, monkeypatch, pytorch_simple):
    """The two-cumsum path, block by block (T a multiple of the block, one more, a tail, one block):
    outputs and gradients of q, k and v against the float64 reference; the other paths fail if taken."""
    monkeypatch.setattr(aft_module, "_aft_simple_causal", None)
    q, k, v = inputs(B, T, 3, 5, seed=9)
    monkeypatch.setattr(aft_module, "SIMPLE_BLOCK_ELEMENTS", block * B * 3 * 5)
    assert_matches_reference(q, k * 4, v, None, variant="simple", causal=True)


def test_simple_causal_cumsum_gradient_with_float32_inputs(monkeypatch, pytorch_simple):
    """float32 through the blocks: gradients close to float64's."""
    monkeypatch.setattr(aft_module, "SIMPLE_BLOCK_ELEMENTS", 16 * 2 * 4)
    q, k, v = inputs(1, 100, 2, 4, dtype=torch.float32, seed=11)
    grads = []
    for dt in (torch.float32, torch.float64):
        xs = [x.to(dt).requires_grad_() for x in (q, k, v)]
        grads.append(torch.autograd.grad(aft(*xs, variant="simple").square().sum(), xs))
    for a, b in zip(*grads):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)


def test_half_precision_inputs_accumulate_in_float32():
    q, k, v = inputs(1, 10, 2, 4, dtype=torch.bfloat16)
    o = aft(q, k, v, variant="simple")
    assert o.dtype == torch.bfloat16
    torch.testing.assert_close(o.double(), aft_reference(q, k, v, variant="simple"), rtol=2e-2, atol=2e-2)


def test_simple_step_equals_forward_and_state_is_constant_size():
    q, k, v = inputs(2, 11, 3, 4)
    k = k * 50  # the running max has to move
    full = aft(q, k, v, variant="simple")
    state, outs = None, []
    for t in range(11):
        o, state = aft_simple_step(q[:, t], k[:, t], v[:, t], state)
        outs.append(o)
        assert all(s.shape == (2, 3, 4) for s in state)
    torch.testing.assert_close(torch.stack(outs, 1), full, rtol=1e-10, atol=1e-10)
    # prefill then continue
    state = aft_simple_state(k[:, :6], v[:, :6])
    outs = []
    for t in range(6, 11):
        o, state = aft_simple_step(q[:, t], k[:, t], v[:, t], state)
        outs.append(o)
    torch.testing.assert_close(torch.stack(outs, 1), full[:, 6:], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("variant, per_head, window", [("local", True, 4), ("local", False, 1), ("conv", True, None)])
@pytest.mark.parametrize("prompt", [1, 3, 8])
def test_window_step_equals_forward_with_constant_state(variant, per_head, window, prompt):
    T, H = 14, 2
    q, k, v = inputs(2, T, H, 3, seed=9)
    k = k * 30  # keys leaving the window move the running max
    pos_bias, _ = bias_for(variant, T, H, per_head, kernel=3)
    kw = dict(variant=variant, pos_bias=pos_bias, window=window)
    full = aft(q, k, v, **kw)
    state = aft_window_state(k[:, :prompt], v[:, :prompt], **kw)
    outs = []
    for t in range(prompt, T):
        o, state = aft_window_step(q[:, t], k[:, t], v[:, t], state, **kw)
        outs.append(o)
        assert isinstance(state, AFTWindowState) and state.ring_k.shape == (2, H, window or 3, 3)
    torch.testing.assert_close(torch.stack(outs, 1), full[:, prompt:], rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="AFTWindowState"):
        aft_window_step(q[:, 0], k[:, 0], v[:, 0], (state.num,), **kw)
    with pytest.raises(ValueError, match="'local' or 'conv'"):
        aft_window_state(k, v, variant="full", pos_bias=pos_bias)


@pytest.mark.parametrize("variant", ["simple", "full", "local", "conv"])
def test_last_row_equals_forward(variant):
    T, H = 9, 2
    q, k, v = inputs(2, T, H, 3)
    pos_bias, window = bias_for(variant, T, H, per_head=True)
    kw = dict(variant=variant, pos_bias=pos_bias, window=window)
    full = aft(q, k, v, **kw)
    for L in (1, 4, T):
        row = aft_last_row(q[:, L - 1], k[:, :L], v[:, :L], **kw)
        torch.testing.assert_close(row, full[:, L - 1], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "kw, err, match",
    [
        (dict(variant="fancy"), ValueError, "variant must be one of"),
        (dict(variant="full"), ValueError, "needs pos_bias"),
        (dict(variant="simple", pos_bias=torch.zeros(6, 6)), ValueError, "must be None for variant 'simple'"),
        (dict(variant="full", pos_bias=torch.zeros(4, 4)), ValueError, "T_max >= T=6"),
        (dict(variant="full", pos_bias=torch.zeros(6, 7)), ValueError, r"\[T_max, T_max\]"),
        (dict(variant="full", pos_bias=torch.zeros(3, 6, 6)), ValueError, "H=2"),
        (dict(variant="full", pos_bias=torch.zeros(6)), ValueError, "pos_bias for variant 'full'"),
        (dict(variant="full", pos_bias=torch.zeros(6, 6, dtype=torch.long)), TypeError, "floating"),
        (dict(variant="local", pos_bias=torch.zeros(6, 6)), TypeError, "window must be an int >= 1"),
        (dict(variant="local", pos_bias=torch.zeros(6, 6), window=0), ValueError, "window must be an int >= 1"),
        (dict(variant="full", pos_bias=torch.zeros(6, 6), window=2), ValueError, "only used by variant 'local'"),
        (dict(variant="conv", pos_bias=torch.zeros(3, 4)), ValueError, r"\[H, kernel\] with H=2"),
        (dict(variant="conv", pos_bias=torch.zeros(2, 0)), ValueError, "kernel >= 1"),
        (dict(variant="conv", pos_bias=torch.zeros(2, 4), causal=False), ValueError, "odd width"),
        (dict(variant="simple", causal=1), TypeError, "causal must be a bool"),
    ],
)
def test_bad_arguments(kw, err, match):
    q, k, v = inputs(1, 6, 2, 4, dtype=torch.float32)
    with pytest.raises(err, match=match):
        aft(q, k, v, **kw)


def test_bad_shapes_and_state():
    q, k, v = inputs(1, 6, 2, 4, dtype=torch.float32)
    with pytest.raises(ValueError, match="same last dimension"):
        aft(q, k, v[..., :3], variant="simple")
    # the decoding helpers too: with Dv = 1 they would broadcast silently
    for make in (lambda: aft_simple_state(k, v[..., :1]),
                 lambda: aft_window_state(k, v[..., :1], variant="local", pos_bias=torch.zeros(6, 6), window=2),
                 lambda: aft_last_row(q[:, -1], k, v[..., :1], variant="simple"),
                 lambda: aft_window_step(q[:, 0], k[:, 0], v[:, 0, :, :1],
                                         aft_window_state(k, v, variant="local", pos_bias=torch.zeros(7, 7), window=2),
                                         variant="local", pos_bias=torch.zeros(7, 7), window=2)):
        with pytest.raises(ValueError, match="same last dimension"):
            make()
    with pytest.raises(TypeError, match="q must have k and v's dtype"):
        aft_last_row(q[:, -1].double(), k, v, variant="simple")
    with pytest.raises(ValueError, match="variant 'conv' needs pos_bias"):
        aft_window_step(q[:, 0], k[:, 0], v[:, 0], None, variant="conv", pos_bias=None)
    with pytest.raises(ValueError, match="state num must be"):
        aft_simple_step(q[:, 0], k[:, 0], v[:, 0], (torch.zeros(1, 2, 3),) * 3)
    with pytest.raises(TypeError, match="triple"):
        aft_simple_step(q[:, 0], k[:, 0], v[:, 0], torch.zeros(1, 2, 4))


# -- memory: no quadratic intermediates (AFT here, and Longformer's band, sharing the probe) ------


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op allocates (forward and backward) while active; views of
    an op's inputs allocate nothing and are not counted."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = tree_leaves((args, kwargs))
        shared = {x.untyped_storage().data_ptr() for x in inputs if isinstance(x, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in shared:
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize("scale", [1.0, 100.0])  # 100: the chunked per-row-reference path
def test_full_never_builds_a_T_T_D_tensor(scale):
    T, H, D = 256, 2, 16
    q, k, v = inputs(1, T, H, D, dtype=torch.float32)
    pos_bias = torch.randn(T, T, requires_grad=True)
    k.requires_grad_(True)
    with LargestTensor() as probe:
        aft(q, k * scale, v, variant="full", pos_bias=pos_bias).sum().backward()
    assert probe.numel <= T * T * H, probe.numel  # a [H, T, T] bias is the most; [T, T, D] never


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("variant", ["local", "conv"])
def test_local_and_conv_banded_path_is_linear_in_memory(variant, causal):
    """Long T: only the band of keys per query is biased, O(T * band * D), no [T, T] bias matrix."""
    T, H, D = 512, 2, 4
    q, k, v = inputs(1, T, H, D, dtype=torch.float32)
    pos_bias = torch.randn(T, T) if variant == "local" else torch.randn(H, 5, requires_grad=True)
    k.requires_grad_(True)
    window = 3 if variant == "local" else None
    with LargestTensor() as probe:
        aft(q, k, v, variant=variant, pos_bias=pos_bias, window=window, causal=causal).sum().backward()
    assert probe.numel <= T * 5 * H * D, probe.numel


def test_simple_is_linear_in_memory():
    T = 1024
    q, k, v = inputs(1, T, 1, 8, dtype=torch.float32)
    k.requires_grad_(True)
    for causal in (True, False):
        with LargestTensor() as probe:
            aft(q, k, v, variant="simple", causal=causal).sum().backward()
        assert probe.numel <= T * 8, probe.numel


def test_sliding_window_never_builds_T_by_T_scores():
    T = 1024
    q, k, v = inputs(1, T, 1, 8, dtype=torch.float32)
    q.requires_grad_(True)
    for causal in (True, False):
        with LargestTensor() as probe:
            o = sliding_window_attention(q, k, v, window=16, dilation=2, causal=causal, global_tokens=[0, 5])
            o.sum().backward()
        assert probe.numel <= T * T // 8, probe.numel
