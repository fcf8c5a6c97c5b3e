"""bench ops: the delta-rule series compute what they are named after, transformers' peer computes
the same function as our gated-delta series, and --forward-only times a step without gradients."""
import pytest
import torch

from lintrans.bench.ops import DELTA_OP, GATED_DELTA_OP, delta_gates, delta_ops, make_op_step
from lintrans.ops import delta_rule_reference


def _qkv(T=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, T, 2, 8, generator=g) for _ in range(3)]


@pytest.mark.parametrize("name,gated", [(DELTA_OP, False), (GATED_DELTA_OP, True)])
def test_delta_series_compute_the_delta_rule(name, gated):
    q, k, v = _qkv()
    beta, log_decay = delta_gates(q)
    want, _ = delta_rule_reference(q, k, v, beta, log_decay=log_decay if gated else None)
    torch.testing.assert_close(delta_ops()[name](q, k, v).double(), want, rtol=1e-4, atol=1e-5)


def test_transformers_peer_is_the_same_function():
    pytest.importorskip("transformers")
    from lintrans.bench.peers import TRANSFORMERS_DELTA_SERIES, peer_ops

    q, k, v = _qkv()
    peer = peer_ops()[TRANSFORMERS_DELTA_SERIES](q, k, v)
    torch.testing.assert_close(peer, delta_ops()[GATED_DELTA_OP](q, k, v), rtol=1e-4, atol=1e-5)


def test_forward_only_step_records_no_graph():
    seen = []

    def op(q, k, v):
        seen.append((torch.is_grad_enabled(), q.requires_grad))
        return q * k + v

    make_op_step(op, 5, H=1, D=2, backward=False)()
    make_op_step(op, 5, H=1, D=2)()
    assert seen == [(False, False), (True, True)]


@pytest.mark.parametrize("name", [GATED_DELTA_OP, "linear chunked gated"])
def test_gate_gradients_do_not_pile_up_over_timed_steps(name):
    """The gate logits are leaves shared by the gated series: each step's backward leaves its own
    gradient in them, not the sum over the steps timed before (more work per step than a layer's)."""
    from lintrans.bench import ops as bench_ops

    series = {**delta_ops(), **bench_ops.op_series(64, "elu")}
    step = make_op_step(series[name], 40, H=2, D=8)
    step()
    (leaf,) = [x for key, x in bench_ops._GATE_LOGITS.items() if key[0] == (1, 40, 2) and x.requires_grad]
    once = leaf.grad.clone()
    step()
    step()
    torch.testing.assert_close(leaf.grad, once)
