"""An empty batch (B = 0) is a valid input everywhere: every op returns empty outputs of the right
shapes (and gradients), as PyTorch's own ops do, instead of dividing by zero or reducing an empty tensor."""
import pytest
import torch

from lintrans.ops import (aft, cosformer_attention, delta_rule, linear_attention, sliding_window_attention)

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
