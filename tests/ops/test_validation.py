"""Input checks every op shares: a tensor that looks transposed ([B, H, T, D]) is flagged."""
import warnings

import pytest
import torch

from lintrans.ops import (aft, bigbird_attention, cosformer_attention, delta_rule, linear_attention, lsh_attention,
                          sliding_window_attention, softmax_attention, taylor_attention)
from lintrans.ops.validation import HEAD_FIRST_MIN_H, looks_head_first

OPS = {
    "linear": lambda q, k, v: linear_attention(q, k, v),
    "softmax": lambda q, k, v: softmax_attention(q, k, v),
    "sliding-window": lambda q, k, v: sliding_window_attention(q, k, v, window=2),
    "cosformer": lambda q, k, v: cosformer_attention(q, k, v),
    "lsh": lambda q, k, v: lsh_attention(q, v, n_buckets=2),
    "delta": lambda q, k, v: delta_rule(q, k, v, torch.full(q.shape[:3], 0.5)),
    "bigbird": lambda q, k, v: bigbird_attention(q, k, v, block_size=1),
    "aft": lambda q, k, v: aft(q, k, v, variant="simple"),
    "taylor": lambda q, k, v: taylor_attention(q, k, v),
}


def qkv(T, H, D=4):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, T, H, D, generator=g) for _ in range(3)]


@pytest.mark.parametrize("op", OPS)
def test_a_head_first_tensor_warns_once_naming_the_layout(op):
    with pytest.warns(UserWarning, match=r"read as \[B, T, H, D\] with T = 2 and H = 64.*\[B, H, T, D\]") as seen:
        OPS[op](*qkv(2, HEAD_FIRST_MIN_H))
    assert len([w for w in seen if "[B, H, T, D]" in str(w.message)]) == 1
    assert seen[0].filename == __file__  # it points at the user's call, not inside lintrans


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("T, H", [(1, 8), (3, 16), (2, HEAD_FIRST_MIN_H - 1), (HEAD_FIRST_MIN_H, HEAD_FIRST_MIN_H)])
def test_short_sequences_with_ordinary_head_counts_do_not_warn(op, T, H):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        OPS[op](*qkv(T, H))


def test_looks_head_first():
    assert looks_head_first(8, 1024) and not looks_head_first(1024, 8)
    assert not looks_head_first(1, 12)  # a one-token prompt to a 12-head model
    assert not looks_head_first(64, 64)


def test_tensors_lintrans_builds_itself_do_not_warn():
    """A model with 64 heads reading a 2-token prompt: its heads are [B, T, H, D] by construction."""
    from lintrans.models import GPT, GPTConfig

    model = GPT(GPTConfig(n_layer=1, n_head=HEAD_FIRST_MIN_H, n_embd=2 * HEAD_FIRST_MIN_H, block_size=8,
                          vocab_size=16, attention="linear"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.tensor([[1, 2]]))
