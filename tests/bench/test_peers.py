"""Peers compute the same op as ours (skipped where the optional peer is not installed)."""
import math

import pytest
import torch

from lintrans.bench.peers import (
    FLA_GATED_SERIES, FLA_SERIES, POWER2_SERIES, RETENTION_SERIES, peer_ops, power2_feature_map, power2_linear_attention,
)
from lintrans.ops import linear_attention


def _qkv(B, T, H, D, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, T, H, D, generator=g, dtype=dtype).requires_grad_() for _ in range(3)]


def test_fast_transformers_matches_our_op():
    pytest.importorskip("fast_transformers.causal_product")
    fn = peer_ops("elu")["fast-transformers causal_product"]
    q, k, v = _qkv(2, 37, 3, 8)
    torch.testing.assert_close(fn(q, k, v), linear_attention(q, k, v, feature_map="elu")[0], rtol=1e-4, atol=1e-5)


def test_power2_features_give_squared_scaled_scores():
    # runs everywhere: the feature map that stands in for retention's degree-2 power
    q, k = (torch.randn(5, 12, dtype=torch.float64) for _ in range(2))
    expected = (q @ k.T / math.sqrt(12)) ** 2
    torch.testing.assert_close(power2_feature_map(q) @ power2_feature_map(k).T, expected)


def test_power2_linear_attention_matches_reference_form():
    q, k, v = _qkv(1, 45, 2, 6, dtype=torch.float64)
    ref = linear_attention(q, k, v, feature_map=power2_feature_map, form="attention", eps=0.0)[0]
    torch.testing.assert_close(power2_linear_attention(q, k, v, chunk_size=16), ref)


@pytest.mark.parametrize("T", [128, 100])  # 100: retention pads to its chunk
def test_retention_reference_matches_our_power2_op(T):
    pytest.importorskip("retention.reference")
    peers = peer_ops()
    fn, ours = peers[RETENTION_SERIES], peers[POWER2_SERIES]
    q, k, v = _qkv(1, T, 2, 32, seed=1)
    o_peer, o_ours = fn(q, k, v), ours(q, k, v)
    torch.testing.assert_close(o_peer, o_ours, rtol=1e-4, atol=1e-4)
    g = torch.randn_like(o_ours)
    for a, b in zip(torch.autograd.grad(o_peer, (q, k, v), g), torch.autograd.grad(o_ours, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_ops_selection_keeps_companions_with_their_peer():
    from lintrans.bench.ops import select_series

    series = {"softmax (SDPA)": 0, "linear chunked": 1, RETENTION_SERIES: 2, POWER2_SERIES: 3}
    assert list(select_series(series, ["chunked", "softmax"])) == ["softmax (SDPA)", "linear chunked"]
    assert list(select_series(series, ["retention"])) == [RETENTION_SERIES, POWER2_SERIES]
    assert list(select_series(series, ["power 2"])) == [RETENTION_SERIES, POWER2_SERIES]
    assert list(select_series(series, [POWER2_SERIES])) == [POWER2_SERIES]  # its full name picks it
    with pytest.raises(ValueError, match="unknown op series"):
        select_series(series, ["power-2 features"])  # part of a companion's own name does not


def test_fla_series_only_on_cuda_and_compute_our_ops(stand_in_fla):
    """With fla importable (here the documented recurrence standing in), its series join on CUDA only,
    and compute what ``linear chunked`` and ``linear chunked gated`` compute."""
    from lintrans.bench.ops import GATED_OP, op_series

    assert FLA_SERIES not in peer_ops("elu", "cpu")
    ours = op_series(8, device="cpu")
    fla = peer_ops("elu", "cuda:0")
    q, k, v = (t.detach() for t in _qkv(1, 19, 2, 4))
    for peer, own in ((FLA_SERIES, "linear chunked"), (FLA_GATED_SERIES, GATED_OP)):
        torch.testing.assert_close(fla[peer](q, k, v), ours[own].make(19)(q, k, v), rtol=1e-4, atol=1e-5)
