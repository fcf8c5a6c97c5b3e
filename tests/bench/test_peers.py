"""Peers compute the same op as ours (skipped where the optional peer is not installed)."""
import pytest
import torch

from lintrans.bench.peers import peer_ops
from lintrans.ops import linear_attention


def test_fast_transformers_matches_our_op():
    pytest.importorskip("fast_transformers.causal_product")
    fn = peer_ops("elu")["fast-transformers causal_product"]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 37, 3, 8, generator=g) for _ in range(3))
    torch.testing.assert_close(fn(q, k, v), linear_attention(q, k, v, feature_map="elu")[0], rtol=1e-4, atol=1e-5)
