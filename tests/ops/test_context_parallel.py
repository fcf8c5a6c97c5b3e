"""Context-parallel linear attention: 2 and 4 gloo processes against one process, outputs, final
state and gradients (q, k, v, log_decay, initial_state, feature-map parameters), float64."""
import itertools

import pytest
import torch
import torch.distributed as dist

from lintrans.nn.feature_maps import ReBased
from gloo import group_of_one, join, spawn
from lintrans.ops import context_parallel_linear_attention, linear_attention

B, H, DK, DV = 2, 2, 3, 4
TOL = dict(rtol=1e-9, atol=1e-10)


def _inputs(T, gate, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = {name: torch.randn(B, T, H, d, dtype=torch.float64, generator=g) for name, d in
         (("q", DK), ("k", DK), ("v", DV))}
    if gate == "token":
        x["log_decay"] = -2 * torch.rand(B, T, H, dtype=torch.float64, generator=g)
    elif gate == "fixed":
        x["log_decay"] = -torch.rand(H, dtype=torch.float64, generator=g)
    return x


def _check(rank, R, lengths, *, feature_map, normalize, gate, initial_state, form="chunked"):
    """One case on this rank: the slice of the one-process run (computed here too) and the CP op."""
    T = sum(lengths)
    start = sum(lengths[:rank])
    sl = slice(start, start + lengths[rank])
    x = _inputs(T, gate)
    g = torch.Generator().manual_seed(1)
    fm = feature_map
    if feature_map == "rebased":
        torch.manual_seed(2)
        fm = ReBased(DK).double()
        with torch.no_grad():  # off its identity start, so the parameters matter
            for p in fm.parameters():
                p.add_(0.3 * torch.randn(p.shape, dtype=p.dtype, generator=g))
    F = fm(torch.zeros(1, DK, dtype=torch.float64)).shape[-1] if callable(fm) else {"elu": DK, "based": 10}[fm]
    S0 = (torch.randn(B, H, F, DV, dtype=torch.float64, generator=g),
          torch.rand(B, H, F, dtype=torch.float64, generator=g) + 0.5) if initial_state else None
    w_o = torch.randn(B, T, H, DV, dtype=torch.float64, generator=g)
    w_S, w_z = torch.randn(B, H, F, DV, dtype=torch.float64, generator=g), torch.randn(B, H, F, dtype=torch.float64, generator=g)
    kw = dict(feature_map=fm, normalize=normalize, scale=0.7, chunk_size=4, form=form, output_final_state=True)

    def run(op, inputs, weight, state_weight, **extra):
        leaves = {k: t.clone().requires_grad_() for k, t in inputs.items()}
        init = None if S0 is None else tuple(t.clone().requires_grad_() for t in S0)
        if hasattr(fm, "zero_grad"):
            fm.zero_grad()
        o, (S, z) = op(leaves["q"], leaves["k"], leaves["v"], log_decay=leaves.get("log_decay"),
                       initial_state=init, **kw, **extra)
        ((o * weight).sum() + state_weight * ((S * w_S).sum() + (z * w_z).sum())).backward()
        grads = {k: t.grad for k, t in leaves.items()}
        if init is not None:
            grads["S0"], grads["z0"] = init[0].grad, init[1].grad
        if hasattr(fm, "parameters"):
            grads.update({f"phi.{n}": p.grad.clone() for n, p in fm.named_parameters()})
        return o, S, z, grads

    o1, S1, z1, g1 = run(linear_attention, x, w_o, 1.0)
    local = {k: (t[:, sl] if t.dim() == 3 + (k != "log_decay") else t) for k, t in x.items()}
    # the final state is on every rank: each counts it 1/R, so the ranks' losses add up to the one-process loss
    o, S, z, grads = run(context_parallel_linear_attention, local, w_o[:, sl], 1.0 / R)
    torch.testing.assert_close(o, o1[:, sl], **TOL)
    torch.testing.assert_close(S, S1, **TOL)
    torch.testing.assert_close(z, z1, **TOL)
    for name, grad in grads.items():
        want = g1[name]
        if name in ("q", "k", "v") or (name == "log_decay" and gate == "token"):
            want = want[:, sl]
        else:  # held whole by every rank: the ranks' parts add up to the one-process gradient
            grad = grad.clone()
            dist.all_reduce(grad)
        torch.testing.assert_close(grad, want, **TOL, msg=lambda m: f"gradient of {name} on rank {rank}: {m}")


CASES = [
    dict(feature_map=fm, normalize=norm, gate=gate, initial_state=init)
    for fm, norm, gate, init in itertools.product(("elu", "based"), (True, False), (None, "token", "fixed"), (False, True))
]
EXTRA = [  # a learnable feature map, another form, unequal slices (rank r holds 3 + 2r tokens)
    dict(feature_map="rebased", normalize=True, gate="token", initial_state=True),
    dict(feature_map="elu", normalize=True, gate="token", initial_state=True, form="attention"),
]


def _worker(rank, R, port, T_r):
    join(rank, R, port)
    torch.set_num_threads(1)
    try:
        for case in CASES + EXTRA:
            try:
                _check(rank, R, [T_r] * R, **case)
            except AssertionError as e:
                raise AssertionError(f"case {case}: {e}") from None
        for gate in (None, "token", "fixed"):
            _check(rank, R, [3 + 2 * r for r in range(R)], feature_map="elu", normalize=True, gate=gate,
                   initial_state=True)
        # bf16 inputs: the ranks apply a named map in float32, as linear_attention does (in bf16 the
        # final state was 2e-3 off the one-process one)
        x, sl = _inputs(8 * R, None), slice(8 * rank, 8 * rank + 8)
        q, k, v = (x[n].to(torch.bfloat16) for n in ("q", "k", "v"))
        for fm in ("elu", "based"):
            _, (S1, _) = linear_attention(q, k, v, feature_map=fm, output_final_state=True)
            _, (S, _) = context_parallel_linear_attention(q[:, sl], k[:, sl], v[:, sl], feature_map=fm,
                                                          output_final_state=True)
            assert ((S - S1).abs().max() / S1.abs().max()).item() < 1e-5, fm
        q = torch.randn(1, 2, 1, 2)
        with pytest.raises(TypeError, match="group must be a torch.distributed ProcessGroup"):
            context_parallel_linear_attention(q, q, q, group="world")
        with pytest.raises(ValueError, match="log_decay must have shape"):
            context_parallel_linear_attention(q, q, q, log_decay=torch.zeros(3))
        dist.barrier()  # no rank tears its connections down while another still uses them
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("R,T_r", [(2, 7), (4, 3)])
def test_matches_one_process(R, T_r):
    """T_r = 7 with chunk 4: a partial chunk on every rank; T_r = 3: every rank's slice within one chunk."""
    spawn(_worker, R, T_r)


def test_one_rank_is_the_plain_op():
    """A group of one (a single process with a process group) is linear_attention itself."""
    with group_of_one():
        x = _inputs(9, "token")
        S0 = (torch.randn(B, H, DK, DV, dtype=torch.float64), torch.rand(B, H, DK, dtype=torch.float64))
        a = context_parallel_linear_attention(x["q"], x["k"], x["v"], log_decay=x["log_decay"], initial_state=S0,
                                              output_final_state=True)
        b = linear_attention(x["q"], x["k"], x["v"], log_decay=x["log_decay"], initial_state=S0, output_final_state=True)
        torch.testing.assert_close(a, b, **TOL)


def test_needs_a_process_group():
    q = torch.randn(1, 4, 1, 2)
    with pytest.raises(RuntimeError, match="needs an initialised torch.distributed process group"):
        context_parallel_linear_attention(q, q, q)
