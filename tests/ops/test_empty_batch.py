"""An empty batch (B = 0) is a valid input everywhere: every op returns empty outputs of the right
shapes (and gradients), as PyTorch's own ops do, instead of dividing by zero or reducing an empty tensor."""
import pytest
import torch

from lintrans.ops import (aft, bigbird_attention, cosformer_attention, delta_rule, linear_attention, lsh_attention,
                          shared_qk_attention, sliding_window_attention)

T, H, D = 6, 2, 4


def qkv():
    return [torch.randn(0, T, H, D, requires_grad=True) for _ in range(3)]


CASES = {
    "linear chunked": lambda q, k, v: linear_attention(q, k, v, form="chunked")[0],
    "linear chunked gated": lambda q, k, v: linear_attention(q, k, v, log_decay=-torch.ones(0, T, H))[0],
    **{f"linear {form}": (lambda form: lambda q, k, v: linear_attention(q, k, v, form=form)[0])(form)
       for form in ("attention_loop", "state_loop", "attention", "attention_blocked", "state_parallel")},
    "cosformer": lambda q, k, v: cosformer_attention(q, k, v)[0],
    "sliding window": lambda q, k, v: sliding_window_attention(q, k, v, window=3),
    "aft simple": lambda q, k, v: aft(q, k, v, variant="simple"),
    "aft full": lambda q, k, v: aft(q, k, v, variant="full", pos_bias=torch.zeros(T, T)),
    "aft local": lambda q, k, v: aft(q, k, v, variant="local", pos_bias=torch.zeros(T, T), window=2),
    "delta rule": lambda q, k, v: delta_rule(q, k, v, torch.ones(0, T, H), log_decay=-torch.ones(0, T, H))[0],
    "lsh": lambda q, k, v: lsh_attention(q, v, n_buckets=2, chunk_size=2)[0],
    "bigbird": lambda q, k, v: bigbird_attention(q, k, v, block_size=2),
}


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("name", list(CASES))
def test_empty_batch(name, native, monkeypatch):
    if not native:
        monkeypatch.setenv("LINTRANS_NATIVE", "0")
    q, k, v = qkv()
    o = CASES[name](q, k, v)
    assert o.shape == (0, T, H, D)
    grads = torch.autograd.grad(o.sum(), (q, k, v), allow_unused=True)
    assert all(g is None or g.shape == q.shape for g in grads)


def test_no_heads_is_an_empty_output_too():
    """H = 0 as well (a reshape to -1 cannot infer a size from 0 elements)."""
    qk = torch.randn(2, T, 0, D)
    assert lsh_attention(qk, qk, n_buckets=2)[0].shape == (2, T, 0, D)


@pytest.mark.parametrize("dims", [(0, 4), (4, 0)], ids=["Dk=0", "Dv=0"])
@pytest.mark.parametrize("name", ["linear chunked", "delta rule", "sliding window", "bigbird", "lsh", "shared qk"])
def test_a_zero_head_dimension_is_a_clear_error(name, dims):
    Dk, Dv = dims
    q, k, v = torch.randn(1, T, H, Dk), torch.randn(1, T, H, Dk), torch.randn(1, T, H, Dv)
    ones = torch.ones(1, T, H)
    call = {"linear chunked": lambda: linear_attention(q, k, v),
            "delta rule": lambda: delta_rule(q, k, v, ones),
            "sliding window": lambda: sliding_window_attention(q, k, v, window=3),
            "bigbird": lambda: bigbird_attention(q, k, v, block_size=2),
            "lsh": lambda: lsh_attention(q, v, n_buckets=2),
            "shared qk": lambda: shared_qk_attention(q, v)}[name]
    with pytest.raises(ValueError, match="head dimensions"):
        call()
