"""AFT decoding's fast paths: the local/conv ring written in place (``inplace``) and scored in slot
order with the bias reordered to match, and the last row of aft-full in the cache's layout. Each is
checked against the full forward (or a bias that picks out one key) and against the copying step."""
import pytest
import torch

from lintrans.models import GPTConfig
from lintrans.nn import get_attention
from lintrans.ops.aft import aft, aft_last_row, aft_reference, aft_window_state, aft_window_step

B, H, D = 2, 2, 3
# (variant, window or kernel, per-head bias): widths 1, 2 and odd ones
CASES = [("conv", 1, True), ("conv", 2, True), ("conv", 5, True),
         ("local", 1, False), ("local", 2, True), ("local", 3, False), ("local", 5, True)]


def inputs(T, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, T, H, D, generator=g, dtype=dtype) for _ in range(3)]


def kwargs(variant, W, per_head, T, seed=1):
    """The variant's arguments with a random bias (a zero bias would hide its order), local's for
    positions up to T (one step past T - 1)."""
    g = torch.Generator().manual_seed(seed)
    if variant == "conv":
        return dict(variant="conv", pos_bias=torch.randn(H, W, generator=g, dtype=torch.float64) * 2)
    shape = (H, T + 1, T + 1) if per_head else (T + 1, T + 1)
    return dict(variant="local", pos_bias=torch.randn(*shape, generator=g, dtype=torch.float64) * 2, window=W)


def decode(q, k, v, prompt, inplace, **kw):
    """Outputs for positions prompt..T-1 stepped one token at a time, and the last state."""
    state = aft_window_state(k[:, :prompt], v[:, :prompt], **kw)
    outs = []
    for t in range(prompt, q.shape[1]):
        o, state = aft_window_step(q[:, t], k[:, t], v[:, t], state, inplace=inplace, **kw)
        outs.append(o)
    return torch.stack(outs, 1), state


@pytest.mark.parametrize("variant, W, per_head", CASES)
@pytest.mark.parametrize("prompt", [1, 6])
def test_inplace_equals_copy_and_forward_over_many_wraps(variant, W, per_head, prompt):
    T = 6 * W + 9  # the ring wraps six times and more
    q, k, v = inputs(T)
    k = k * 5  # keys leaving the window move the running max
    kw = kwargs(variant, W, per_head, T)
    with torch.no_grad():
        full = aft(q, k, v, **kw)
        copied, s_copy = decode(q, k, v, prompt, inplace=False, **kw)
        written, s_in = decode(q, k, v, prompt, inplace=True, **kw)
    torch.testing.assert_close(written, full[:, prompt:], rtol=1e-10, atol=1e-10)
    assert torch.equal(written, copied)
    for a, b in zip(s_in, s_copy):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.parametrize("variant, W, per_head", CASES)
def test_the_bias_reaches_the_right_key(variant, W, per_head):
    """A bias of 60 on one offset i and 0 elsewhere, every key 0: the output is v at t - i, whatever
    slot of the ring that key sits in (a misordered bias picks another key)."""
    T = 4 * W + 3
    q, _, v = inputs(T)
    k = torch.zeros_like(v)
    for i in range(W):
        if variant == "conv":
            kw = dict(variant="conv", pos_bias=torch.zeros(H, W, dtype=torch.float64).index_fill(1, torch.tensor([i]), 60.0))
        else:
            t = torch.arange(T)
            bias = torch.zeros(T, T, dtype=torch.float64)
            bias[t[i:], t[i:] - i] = 60.0
            kw = dict(variant="local", pos_bias=bias.repeat(H, 1, 1) if per_head else bias, window=W)
        with torch.no_grad():
            out, _ = decode(q, k, v, 1, inplace=True, **kw)
        rows = slice(max(1, i), T)  # positions with a key i back
        expected = torch.sigmoid(q[:, rows]) * v[:, rows.start - i : T - i]
        torch.testing.assert_close(out[:, rows.start - 1 :], expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("variant, W, per_head", [CASES[2], CASES[5]])
def test_a_copying_step_leaves_the_callers_state_and_an_inplace_one_writes_it(variant, W, per_head):
    T = 4 * W + 3
    q, k, v = inputs(T)
    kw = kwargs(variant, W, per_head, T)
    with torch.no_grad():
        state = aft_window_state(k[:, :3], v[:, :3], **kw)
        before = [x.clone() if isinstance(x, torch.Tensor) else x for x in state]
        first, _ = aft_window_step(q[:, 3], k[:, 3], v[:, 3], state, inplace=False, **kw)
        again, written = aft_window_step(q[:, 3], k[:, 3], v[:, 3], state, inplace=False, **kw)
        for a, b in zip(state, before):
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
        assert torch.equal(first, again)
        _, stepped = aft_window_step(q[:, 4], k[:, 4], v[:, 4], written, inplace=True, **kw)
    assert stepped.ring_k is written.ring_k and stepped.ring_v is written.ring_v  # no copy where none is needed


@pytest.mark.parametrize("how", ["expanded", "inference", "ring requires grad"])
def test_inplace_steps_aside_for_a_state_it_must_not_write(how):
    """A batch-1 state broadcast to two rows, an inference tensor outside inference mode, a ring that
    autograd saved: inplace=True copies, and the caller's state stays as it was."""
    W, T = 3, 14
    q, k, v = inputs(T)
    kw = kwargs("conv", W, True, T)
    prompt = 5
    if how == "expanded":
        k, v = k[:1].expand(B, -1, -1, -1), v[:1].expand(B, -1, -1, -1)
        state = aft_window_state(k[:1, :prompt], v[:1, :prompt], **kw)
        state = type(state)(*(x.expand(B, *x.shape[1:]) for x in state[:-1]), state.pos)
    elif how == "inference":
        with torch.inference_mode():
            state = aft_window_state(k[:, :prompt], v[:, :prompt], **kw)
    else:
        state = aft_window_state(k[:, :prompt].clone().requires_grad_(), v[:, :prompt], **kw)
    before = [x.clone() for x in state[:-1]]
    with torch.no_grad():
        full = aft(q, k, v, **kw)
        outs = []
        s = state
        for t in range(prompt, T):
            o, s = aft_window_step(q[:, t], k[:, t], v[:, t], s, inplace=True, **kw)
            outs.append(o)
    torch.testing.assert_close(torch.stack(outs, 1), full[:, prompt:], rtol=1e-10, atol=1e-10)
    for a, b in zip(state[:-1], before):
        assert torch.equal(a, b)


@pytest.mark.parametrize("variant, W, per_head", [CASES[1], CASES[2], CASES[3], CASES[6]])
@pytest.mark.parametrize("grads", ["q k v", "q", "pos_bias"])
def test_gradients_through_inplace_steps(variant, W, per_head, grads):
    """Steps asked to write in place while autograd records, then one step under no_grad (which may
    write in place: it must not touch what the earlier steps saved), then backward: the gradients
    of the full forward."""
    T, prompt = 4 * W + 5, 2
    q, k, v = inputs(T)
    kw = kwargs(variant, W, per_head, T)
    leaves = [x.requires_grad_() for x, name in ((q, "q"), (k, "k"), (v, "v"), (kw["pos_bias"], "pos_bias"))
              if name in grads.split()]
    weight = torch.randn(B, T - prompt, H, D, dtype=torch.float64)
    full = aft(q, k, v, **kw)[:, prompt:]
    expected = torch.autograd.grad((full * weight).sum(), leaves)
    out, state = decode(q, k, v, prompt, inplace=True, **kw)
    with torch.no_grad():
        aft_window_step(q[:, -1], k[:, -1], v[:, -1], state, inplace=True, **kw)
    got = torch.autograd.grad((out * weight).sum(), leaves)
    torch.testing.assert_close(out, full, rtol=1e-10, atol=1e-10)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("variant, W, per_head", [CASES[1], CASES[4]])
def test_extreme_keys(variant, W, per_head):
    """Keys that jump between levels 1e4 apart (the reference each row subtracts moves across the
    ring's wraps; the bias still counts), and keys of -inf (masked tokens) for longer than the window:
    the forward's band then holds only -inf keys, whose reference is taken as 0 (``_finite``), not -inf."""
    T = 30
    q, k, v = inputs(T)
    k = k * 3 + 1e4 * (torch.arange(T) // 4 % 3)[None, :, None, None]
    k[:, 12:25, :, :2] = float("-inf")  # keys 0..11 are finite: every row has a term
    kw = kwargs(variant, W, per_head, T)
    ref = aft_reference(q, k, v, **kw)
    with torch.no_grad():
        full = aft(q, k, v, **kw)  # the banded path at this length
        written, _ = decode(q, k, v, 1, inplace=True, **kw)
        copied, _ = decode(q, k, v, 1, inplace=False, **kw)
    assert torch.equal(written, copied)
    torch.testing.assert_close(full, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(written, ref[:, 1:], rtol=1e-10, atol=1e-10)
    full_kw = dict(variant="full", pos_bias=torch.randn(H, T, T, dtype=torch.float64))
    for L in (13, 20, T):  # the last row in the cache's layout, over -inf keys too
        row = aft_last_row(q[:, L - 1], k[:, :L], v[:, :L], **full_kw)
        torch.testing.assert_close(row, aft_reference(q[:, :L], k[:, :L], v[:, :L], **full_kw)[:, -1],
                                   rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name, options", [("aft-local", {"window": 3}), ("aft-conv", {"kernel": 3}), ("aft-full", {})])
def test_a_layer_decoding_several_tokens_without_use_cache_leaves_the_cache(name, options):
    """Tokens after the first of one call write the call's own copy in place: the caller's cache is
    never written, and a second call gives the same output."""
    torch.manual_seed(0)
    config = GPTConfig(n_layer=1, n_head=H, n_embd=H * 4, block_size=16, vocab_size=16, attention=name,
                       attention_options=options, dropout=0.0)
    layer = get_attention(name)(config).double()
    with torch.no_grad():
        layer.pos_bias.normal_()
        x = torch.randn(B, 14, H * 4, dtype=torch.float64)
        full, _ = layer(x)
        _, cache = layer(x[:, :5], use_cache=True)
        first, _ = layer(x[:, 5:], cache=cache, use_cache=False)
        again, _ = layer(x[:, 5:], cache=cache, use_cache=False)
        kept, cache = layer(x[:, 5:], cache=cache, use_cache=True)
    torch.testing.assert_close(first, full[:, 5:], rtol=1e-10, atol=1e-10)
    assert torch.equal(again, first) and torch.equal(kept, first)
