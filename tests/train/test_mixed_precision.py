"""Mixed precision (``train.precision = bf16 | fp16``): autocast runs the projections and the MLP in
16 bits, while linear attention keeps its state and normaliser in float32. Checked with CPU bf16
autocast (fp16 autocast needs CUDA; see docs/gpu.md): every form, the decoding step, the
context-parallel op and the other autograd Functions of lintrans, and a few training steps."""
import os
import socket

import pytest
import torch
import torch.distributed as dist

from lintrans.ops import FORMS, context_parallel_linear_attention, linear_attention, linear_attention_reference
from lintrans.ops.linear import api as linear_api
from lintrans.ops.cross_entropy import linear_cross_entropy
from lintrans.ops.feature_maps import elu_plus_one
from lintrans.ops.linear import linear_attention_step

BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


def _leaves(*shapes, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).to(dtype).requires_grad_() for s in shapes]


def _run(fn, leaves, autocast: bool):
    """fn(*leaves) -> tensors; returns them and the leaves' gradients of a weighted sum of them."""
    xs = [t.detach().clone().requires_grad_() for t in leaves]
    with torch.autocast(**BF16, enabled=autocast):
        outs = fn(*xs)
    g = torch.Generator().manual_seed(1)
    sum(((o.float() * torch.randn(o.shape, generator=g)).sum() for o in outs)).backward()
    return outs, [x.grad for x in xs]


def _same(a, b):
    for x, y in zip(a, b):
        assert x.dtype == y.dtype
        torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("gated", [False, True])
def test_every_form_ignores_autocast(form, gated):
    """float32 inputs under bf16 autocast give exactly what they give without it: outputs, states and
    gradients (autocast would otherwise turn the forms' matmuls, state sums included, to bf16)."""
    B, T, H = 2, 11, 2
    leaves = _leaves((B, T, H, 4), (B, T, H, 4), (B, T, H, 5), (B, T, H))

    def fn(q, k, v, a):
        o, (S, z) = linear_attention(q, k, v, form=form, chunk_size=4, output_final_state=True,
                                     log_decay=-torch.sigmoid(a) if gated else None)
        return o, S, z

    (o, S, z), grads = _run(fn, leaves, True)
    assert S.dtype == z.dtype == torch.float32
    ref, ref_grads = _run(fn, leaves, False)
    _same((o, S, z), ref)
    _same(grads[:3] + grads[3:] * gated, ref_grads[:3] + ref_grads[3:] * gated)


def test_decoding_step_keeps_its_state_in_float32():
    leaves = _leaves((2, 3, 4), (2, 3, 4), (2, 3, 5), (2, 3, 4, 5), (2, 3, 4))

    def fn(q, k, v, S, z):
        o, (S, z) = linear_attention_step(q, k, v, (S, z.abs()), log_decay=torch.full((3,), -0.1))
        return o, S, z

    got, grads = _run(fn, leaves, True)
    assert got[1].dtype == got[2].dtype == torch.float32
    want, want_grads = _run(fn, leaves, False)
    _same(got, want)
    _same(grads, want_grads)


@pytest.mark.parametrize("form", ["chunked", "attention", "state_parallel"])
def test_bf16_inputs_accumulate_in_float32(form):
    """What a GPT layer hands the op under autocast (bf16 q, k, v from its projection): the state comes
    back in float32 and equals float64 sums of the same features (a bf16 sum of 300 terms would be
    off by ~1e-1 here), and the output is off only by its own rounding to bf16. Every form applies
    a named feature map to q and k in float32: the reference does the same."""
    q, k, v = (t.detach() for t in _leaves((1, 300, 2, 8), (1, 300, 2, 8), (1, 300, 2, 8), dtype=torch.bfloat16))
    ld = -torch.rand(1, 300, 2) * 0.05
    with torch.autocast(**BF16):
        o, (S, z) = linear_attention(q, k, v, form=form, chunk_size=32, log_decay=ld, output_final_state=True)
    assert o.dtype == torch.bfloat16 and S.dtype == z.dtype == torch.float32
    o_ref, (S_ref, z_ref) = linear_attention_reference(q.float(), k.float(), v, log_decay=ld)
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-2, atol=1e-2)  # bf16 has 8 bits: 2^-8 = 4e-3
    torch.testing.assert_close(S.double(), S_ref, rtol=1e-5, atol=1e-4)  # |S| ~ 20: float32 sums
    torch.testing.assert_close(z.double(), z_ref, rtol=1e-5, atol=1e-4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_context_parallel_op_ignores_autocast():
    """Its local state sums and their combination run outside autocast too (one rank: the whole
    op's arithmetic, with an all-gather of one)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        leaves = _leaves((2, 9, 2, 4), (2, 9, 2, 4), (2, 9, 2, 3), (2, 9, 2), (2, 2, 4, 3))

        def fn(q, k, v, a, S0):
            o, (S, z) = context_parallel_linear_attention(
                q, k, v, log_decay=-torch.sigmoid(a), initial_state=(S0, S0[..., 0].abs()), chunk_size=4,
                output_final_state=True)
            return o, S, z

        got, grads = _run(fn, leaves, True)
        assert got[1].dtype == torch.float32
        want, want_grads = _run(fn, leaves, False)
        _same(got, want)
        _same(grads, want_grads)
    finally:
        dist.destroy_process_group()


def test_elu_plus_one_under_autocast():
    """_EluPlusOne is element-wise: autocast leaves float32 alone, and bf16 in gives bf16 out."""
    (x,) = _leaves((64,))
    got, grads = _run(lambda x: (elu_plus_one(x),), [x], True)
    want, want_grads = _run(lambda x: (elu_plus_one(x),), [x], False)
    _same(got, want)
    _same(grads, want_grads)
    (xb,) = _leaves((64,), dtype=torch.bfloat16)
    (yb,), (gb,) = _run(lambda x: (elu_plus_one(x),), [xb], True)
    (y,), (g,) = _run(lambda x: (elu_plus_one(x),), [xb.detach().float()], False)
    assert yb.dtype == gb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.float(), y, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(gb.float(), g, rtol=1e-2, atol=1e-2)


def test_linear_cross_entropy_called_under_autocast():
    """float32 inputs under autocast: the loss and gradients of the float32 path (its matmuls write
    into float32 buffers), finite and equal to the plain call."""
    h, w = _leaves((40, 16), (70, 16))
    t = torch.randint(0, 70, (40,))
    got, grads = _run(lambda h, w: (linear_cross_entropy(h, w, t, chunk_rows=16),), [h, w], True)
    want, want_grads = _run(lambda h, w: (linear_cross_entropy(h, w, t, chunk_rows=16),), [h, w], False)
    assert torch.isfinite(got[0]) and all(torch.isfinite(g).all() for g in grads)
    torch.testing.assert_close(got[0], want[0], rtol=1e-2, atol=1e-2)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2 * b.abs().max().item())


@pytest.mark.parametrize("attention", ["linear", "gated-linear", "retention"])
def test_bf16_training_keeps_the_state_in_float32(tiny_config, monkeypatch, attention):
    """A few steps of ``lintrans train`` with ``train.precision=bf16``: the chunked op receives bf16
    values (autocast is on; q and k too, turned to float32 features first for the identity map), or
    their float32 copies where the CPU kernel runs, starts from and returns float32 states, and the
    losses follow the float32 run's."""
    from lintrans.train.loop import train

    seen = []
    original = linear_api.ChunkedAttention

    class Recording:
        @staticmethod
        def apply(q, k, v, ld, S0, cfg):
            o, S = original.apply(q, k, v, ld, S0, cfg)
            seen.append((v.dtype, S0.dtype, cfg.dtype, S.dtype, None if ld is None else ld.dtype, cfg.native))
            return o, S

    monkeypatch.setattr(linear_api, "ChunkedAttention", Recording)
    settings = {"model.attention": attention, "train.max_steps": 4, "train.eval_interval": 100}
    bf16 = train(tiny_config("bf16", **settings, **{"train.precision": "bf16"}))
    assert seen and all(s[0] == (torch.bfloat16 if s[5] is None else torch.float32) for s in seen)
    assert all(s[1:4] == (torch.float32,) * 3 for s in seen)
    assert all(s[4] in (None, torch.float32) for s in seen)
    seen.clear()
    fp32 = train(tiny_config("fp32", **settings, **{"train.precision": "fp32"}))
    assert seen and all(s[0] == torch.float32 for s in seen)
    for step, loss in fp32.losses.items():
        assert abs(bf16.losses[step] - loss) < 0.05 * loss, (step, bf16.losses, fp32.losses)
