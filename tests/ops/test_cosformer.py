"""cosFormer against its explicit O(T^2) float64 double sum: outputs, gradients, split calls, decoding, errors."""
import pytest
import torch
from qkv import random_qkv

from lintrans.ops.cosformer import (
    CosformerState,
    cosformer_attention,
    cosformer_attention_reference,
    cosformer_step,
)


inputs = random_qkv


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("max_len", [None, 100])
@pytest.mark.parametrize("T, chunk", [(1, 64), (7, 4), (45, 16), (64, 64)])
def test_outputs_match_reference(T, chunk, max_len, causal):
    q, k, v = inputs(2, T, 3, 5, 3)  # odd D, Dk != Dv, T not a multiple of the chunk
    o, state = cosformer_attention(q, k, v, causal=causal, max_len=max_len, chunk_size=chunk)
    assert o.shape == (2, T, 3, 3) and o.dtype == torch.float64 and state is None
    want = cosformer_attention_reference(q, k, v, causal=causal, max_len=max_len)
    torch.testing.assert_close(o, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal", [True, False])
def test_gradients_match_reference(causal):
    q, k, v = inputs(1, 23, 2, 4, 6, seed=1)
    for x in (q, k, v):
        x.requires_grad_(True)
    dout = torch.randn(1, 23, 2, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    got = torch.autograd.grad((cosformer_attention(q, k, v, causal=causal, chunk_size=8)[0] * dout).sum(), (q, k, v))
    want = torch.autograd.grad((cosformer_attention_reference(q, k, v, causal=causal) * dout).sum(), (q, k, v))
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=f"grad of {name}")


def test_the_cosine_reweights_by_distance():
    # equal q, k everywhere: the weight of key j for the last query falls with the distance
    T = 16
    q = k = torch.ones(1, T, 1, 2, dtype=torch.float64)
    v = torch.eye(T, dtype=torch.float64)[None, :, None, :]  # value j is the one-hot e_j
    o, _ = cosformer_attention(q, k, v, causal=True)
    w = o[0, -1, 0]  # the normalised weights of the last query
    assert torch.all(w[1:] > w[:-1]) and torch.isclose(w.sum(), torch.tensor(1.0, dtype=torch.float64))


def test_split_calls_and_steps_equal_one_call():
    q, k, v = inputs(2, 30, 2, 4, 3, seed=3)
    full, _ = cosformer_attention(q, k, v, max_len=64, chunk_size=8)
    a, st = cosformer_attention(q[:, :11], k[:, :11], v[:, :11], max_len=64, output_final_state=True, chunk_size=8)
    assert isinstance(st, CosformerState) and st.offset == 11
    b, st = cosformer_attention(q[:, 11:20], k[:, 11:20], v[:, 11:20], max_len=64, initial_state=st,
                                output_final_state=True)
    outs = [a, b]
    for t in range(20, 30):  # decoding, constant-size state
        o, st = cosformer_step(q[:, t], k[:, t], v[:, t], st, max_len=64)
        outs.append(o[:, None])
        assert st.S.shape == (2, 2, 8, 3) and st.offset == t + 1
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(full, cosformer_attention_reference(q, k, v, max_len=64), rtol=1e-10, atol=1e-10)


def test_low_precision_inputs_keep_their_dtype():
    q, k, v = inputs(1, 20, 2, 8, 8, dtype=torch.float32)
    o, _ = cosformer_attention(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert o.dtype == torch.bfloat16
    torch.testing.assert_close(o.float(), cosformer_attention_reference(q, k, v).float(), rtol=0.05, atol=0.05)


def test_chunk_size_auto_is_taken():
    q, k, v = inputs(1, 12, 2, 4, 4)
    for causal in (True, False):
        torch.testing.assert_close(cosformer_attention(q, k, v, causal=causal, chunk_size="auto")[0],
                                   cosformer_attention(q, k, v, causal=causal)[0])


@pytest.mark.parametrize("kw, err, match", [
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(max_len=0), ValueError, "max_len must be an int >= 1"),
    (dict(max_len=10), ValueError, r"max_len \(10\) must cover every position"),
    (dict(eps=-1.0), ValueError, "eps must be a number >= 0"),
    (dict(output_final_state=True), ValueError, "need a fixed max_len"),
    (dict(causal=False, max_len=64, output_final_state=True), ValueError, "need causal=True"),
    (dict(max_len=64, initial_state=(1, 2)), TypeError, "initial_state must be a CosformerState"),
    (dict(max_len=64, output_final_state="yes"), TypeError, "output_final_state must be a bool"),
    (dict(causal=False, chunk_size=0), ValueError, "chunk_size must be an int >= 1"),
])
def test_bad_arguments(kw, err, match):
    q, k, v = inputs(1, 12, 2, 4, 4)
    with pytest.raises(err, match=match):
        cosformer_attention(q, k, v, **kw)


def test_step_needs_a_fixed_max_len_that_covers_the_position():
    q, k, v = (x[:, 0] for x in inputs(1, 1, 2, 4, 4))
    with pytest.raises(ValueError, match="needs a fixed max_len"):
        cosformer_step(q, k, v, max_len=None)
    _, st = cosformer_step(q, k, v, max_len=1)
    with pytest.raises(ValueError, match="must cover every position"):
        cosformer_step(q, k, v, st, max_len=1)
