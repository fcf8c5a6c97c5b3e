"""Context-parallel delta rule: 2 and 4 gloo processes against one process, outputs, final state and
gradients (q, k, v, beta, log_decay, initial_state), float64."""

import pytest
import torch
import torch.distributed as dist

from gloo import group_of_one, join, spawn
from lintrans.ops import context_parallel_delta_rule, delta_rule

B, H, DK, DV = 2, 2, 3, 4
TOL = dict(rtol=1e-9, atol=1e-10)


def _inputs(T, gate, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = {name: torch.randn(B, T, H, d, dtype=torch.float64, generator=g) for name, d in
         (("q", DK), ("k", DK), ("v", DV))}
    x["beta"] = 2 * torch.rand(B, T, H, dtype=torch.float64, generator=g)
    if gate == "token":
        x["log_decay"] = -torch.rand(B, T, H, dtype=torch.float64, generator=g)
    elif gate == "fixed":
        x["log_decay"] = -torch.rand(H, dtype=torch.float64, generator=g)
    return x


def _check(rank, R, lengths, *, gate, initial_state, form="chunked", final_state=True):
    T = sum(lengths)
    start = sum(lengths[:rank])
    sl = slice(start, start + lengths[rank])
    x = _inputs(T, gate)
    g = torch.Generator().manual_seed(1)
    S0 = torch.randn(B, H, DK, DV, dtype=torch.float64, generator=g) if initial_state else None
    w_o = torch.randn(B, T, H, DV, dtype=torch.float64, generator=g)
    w_S = torch.randn(B, H, DK, DV, dtype=torch.float64, generator=g)

    def run(op, inputs, weight, state_weight):
        leaves = {k: t.clone().requires_grad_() for k, t in inputs.items()}
        init = None if S0 is None else S0.clone().requires_grad_()
        o, S = op(leaves["q"], leaves["k"], leaves["v"], leaves["beta"], log_decay=leaves.get("log_decay"),
                  initial_state=init, form=form, chunk_size=4, output_final_state=final_state)
        loss = (o * weight).sum()
        (loss + state_weight * (S * w_S).sum() if final_state else loss).backward()
        grads = {k: t.grad for k, t in leaves.items()}
        if init is not None:
            grads["S0"] = init.grad
        return o, S, grads

    o1, S1, g1 = run(delta_rule, x, w_o, 1.0)
    local = {k: (t[:, sl] if t.dim() >= 3 else t) for k, t in x.items()}
    # the final state is on every rank: each counts it 1/R, so the ranks' losses add up to the one-process loss
    o, S, grads = run(context_parallel_delta_rule, local, w_o[:, sl], 1.0 / R)
    torch.testing.assert_close(o, o1[:, sl], **TOL)
    if final_state:
        torch.testing.assert_close(S, S1, **TOL)
    for name, grad in grads.items():
        want = g1[name]
        if name in ("q", "k", "v", "beta") or (name == "log_decay" and gate == "token"):
            want = want[:, sl]
        else:  # held whole by every rank: the ranks' parts add up to the one-process gradient
            grad = grad.clone()
            dist.all_reduce(grad)
        torch.testing.assert_close(grad, want, **TOL, msg=lambda m: f"gradient of {name} on rank {rank}: {m}")


def _worker(rank, R, port, T_r):
    join(rank, R, port)
    torch.set_num_threads(1)
    try:
        for gate in (None, "token", "fixed"):
            for init in (False, True):
                try:
                    _check(rank, R, [T_r] * R, gate=gate, initial_state=init)
                except AssertionError as e:
                    raise AssertionError(f"gate {gate}, initial state {init}: {e}") from None
        _check(rank, R, [3 + 2 * r for r in range(R)], gate="token", initial_state=True)  # unequal slices
        _check(rank, R, [T_r] * R, gate="token", initial_state=True, form="recurrent")
        # a loss on the outputs alone, as a layer's: rank 0's outputs do not depend on the other ranks,
        # yet its backward must join the all-gather's reduce-scatter (the others waited in it)
        for init in (False, True):
            _check(rank, R, [T_r] * R, gate="token", initial_state=init, final_state=False)
        q = torch.randn(1, 2, 1, 2)
        with pytest.raises(ValueError, match="initial_state must have shape"):
            context_parallel_delta_rule(q, q, q, torch.ones(1, 2, 1), initial_state=torch.zeros(1, 1, 3, 2))
        dist.barrier()  # no rank tears its connections down while another still uses them
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("R,T_r", [(2, 7), (4, 3)])
def test_matches_one_process(R, T_r):
    """T_r = 7 with chunk 4: a partial chunk on every rank; T_r = 3: every rank's slice within one chunk."""
    spawn(_worker, R, T_r)


def test_one_rank_is_the_plain_op():
    with group_of_one():
        x = _inputs(9, "token")
        S0 = torch.randn(B, H, DK, DV, dtype=torch.float64)
        a = context_parallel_delta_rule(x["q"], x["k"], x["v"], x["beta"], log_decay=x["log_decay"],
                                        initial_state=S0, output_final_state=True)
        b = delta_rule(x["q"], x["k"], x["v"], x["beta"], log_decay=x["log_decay"], initial_state=S0,
                       output_final_state=True)
        torch.testing.assert_close(a, b, **TOL)


def test_low_precision_inputs_on_one_rank():
    """bf16 q, k, v, beta as a mixed-precision layer passes them: computed in float32 like the plain op."""
    with group_of_one():
        x = {n: t.to(torch.bfloat16) for n, t in _inputs(9, "token").items()}
        a = context_parallel_delta_rule(x["q"], x["k"], x["v"], x["beta"], log_decay=x["log_decay"],
                                        output_final_state=True)
        b = delta_rule(x["q"], x["k"], x["v"], x["beta"], log_decay=x["log_decay"], output_final_state=True)
        assert a[0].dtype == torch.bfloat16 and a[1].dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
