"""The delta rule on a real CUDA device (skipped without one): both forms and the decoding step against
the float64 reference on the CPU (outputs, final states, every gradient), 16-bit inputs, and
flash-linear-attention's Triton ``chunk_delta_rule`` / ``chunk_gated_delta_rule`` where ``fla`` imports."""
import pytest
import torch

from lintrans.ops import delta_rule, delta_rule_reference, delta_rule_step

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.usefixtures("exact_float32")]

DEVICE = "cuda"


def _case(B, T, H, Dk, Dv, gate, seed=0):
    """float64 q, k, v, beta in [0, 1.5] (past 1: negative eigenvalues), a log-decay and a state."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, Dk, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, T, H, Dv, generator=g, dtype=torch.float64)
    beta = 1.5 * torch.rand(B, T, H, generator=g, dtype=torch.float64)
    ld = {None: None, "token": -torch.rand(B, T, H, generator=g, dtype=torch.float64),
          "fixed": -torch.rand(H, generator=g, dtype=torch.float64)}[gate]
    S0 = torch.randn(B, H, Dk, Dv, generator=g, dtype=torch.float64) * 0.5
    return q, k, v, beta, ld, S0


def _run(fn, tensors):
    """fn(*leaves) -> (o, S); returns [o, S, every leaf's gradient] after a backward of a loss of both."""
    leaves = [t.clone().requires_grad_() for t in tensors]
    o, S = fn(*leaves)
    (o.square().sum() + (S * S.detach().sin()).sum()).backward()
    return [o, S, *(t.grad for t in leaves)]


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
@pytest.mark.parametrize("gate", [None, "token", "fixed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("T", [1, 37])
def test_delta_rule_on_cuda_equals_the_reference(form, gate, dtype, T):
    """T=37 is not a multiple of the chunk (16); Dk=5 != Dv=7; gradients of q, k, v, beta, log_decay, S0."""
    q, k, v, beta, ld, S0 = _case(2, T, 3, 5, 7, gate)
    ts = [t for t in (q, k, v, beta, ld, S0) if t is not None]

    def split(xs):
        return xs[:4], (xs[4] if ld is not None else None), xs[-1]

    def ref(*xs):
        (q_, k_, v_, b_), ld_, S0_ = split(xs)
        return delta_rule_reference(q_, k_, v_, b_, log_decay=ld_, initial_state=S0_)

    def dev(*xs):
        (q_, k_, v_, b_), ld_, S0_ = split(xs)
        o, S = delta_rule(q_, k_, v_, b_, log_decay=ld_, initial_state=S0_, form=form, chunk_size=16,
                          output_final_state=True)
        assert o.device.type == DEVICE and o.dtype == dtype and S.dtype == dtype
        return o, S

    want = _run(ref, ts)
    got = _run(dev, [t.to(DEVICE, dtype) for t in ts])
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-9, atol=1e-9)
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a.detach().cpu().double(), b.detach(), **tol, msg=lambda m: f"result {i}: {m}")


@pytest.mark.parametrize("gate", [None, "token"])
def test_delta_rule_step_on_cuda_equals_the_reference(gate):
    """Decoding a token at a time on CUDA, from a state, gives the reference's outputs and final state."""
    q, k, v, beta, ld, S0 = _case(2, 9, 3, 6, 4, gate)
    o_ref, S_ref = delta_rule_reference(q, k, v, beta, log_decay=ld, initial_state=S0)
    S = S0.to(DEVICE)
    for t in range(q.shape[1]):
        o, S = delta_rule_step(*(x[:, t].to(DEVICE) for x in (q, k, v, beta)), S,
                               log_decay=None if ld is None else ld[:, t].to(DEVICE))
        torch.testing.assert_close(o.cpu(), o_ref[:, t], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(S.cpu(), S_ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_inputs_on_cuda_are_computed_in_float32(dtype):
    """16-bit q, k, v, beta: the output in that dtype, the state in float32, both equal to the float32
    run on the same (rounded) values up to the output's rounding."""
    q, k, v, beta, ld, _ = _case(1, 100, 2, 32, 32, "token")
    low = [x.to(DEVICE, dtype) for x in (q, k, v, beta)]
    o, S = delta_rule(*low, log_decay=ld.to(DEVICE, torch.float32), output_final_state=True)
    o32, S32 = delta_rule(*(x.float() for x in low), log_decay=ld.to(DEVICE, torch.float32), output_final_state=True)
    assert o.dtype == dtype and S.dtype == torch.float32
    torch.testing.assert_close(S, S32, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o.float(), o32, rtol=1e-2, atol=1e-2 * o32.abs().max().item())


def _fla_chunk(gated):
    """fla's ``chunk_gated_delta_rule`` (gated) or ``chunk_delta_rule`` (DeltaNet, no gate), or a skip."""
    try:
        if gated:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn
        else:
            from fla.ops.delta_rule import chunk_delta_rule as fn
    except Exception as e:  # not installed, or its import fails (Triton)
        pytest.skip(f"flash-linear-attention is not importable here ({type(e).__name__}: {e})")
    return fn


@pytest.mark.parametrize("gate", [None, "token"])
@pytest.mark.parametrize("T", [1, 100])
@pytest.mark.parametrize("backward", [False, True])
def test_fla_delta_rule_kernels_match_ours_on_cuda(gate, T, backward):
    """fla's Triton kernels against ours on the same CUDA tensors: outputs and final states, and with
    ``backward`` the gradients of q, k, v, beta, the gate and the state. With a gate, fla's
    ``chunk_gated_delta_rule`` in float32, tolerances allowing TF32 (Triton's float32 dot products round
    inputs to 10-bit mantissas); without, ``chunk_delta_rule``, which takes 16-bit inputs only, in bf16.
    Tolerances are relative to each quantity's size. fla refuses gated
    backward passes where its Triton miscompiles them (Hopper with Triton < 3.7.1) and TileLang is not
    installed: that case is skipped with fla's reason, not failed."""
    fla_chunk = _fla_chunk(gate is not None)
    B, H, D = 2, 2, 64
    q, k, v, beta, ld, S0 = _case(B, T, H, D, D, "token")
    beta = beta / 1.5  # fla's default: beta in [0, 1]
    ts = [t.to(DEVICE, torch.float32) for t in (q, k, v, beta) + ((ld,) if gate else ()) + (S0,)]
    # fla 0.6.0's chunk_delta_rule refuses float32 ("use bfloat16"): it gets bf16 q, k, v, beta, ours
    # the same rounded values in float32, and the tolerance is bf16's
    low = gate is None
    if low:
        ts = [t.bfloat16() for t in ts[:4]] + ts[4:]
    tol = 5e-2 if low else 2e-2

    def theirs(q_, k_, v_, b_, *rest):
        S0_ = rest[-1]
        kw = dict(initial_state=S0_, output_final_state=True, use_qk_l2norm_in_kernel=True)
        return fla_chunk(q_, k_, v_, rest[0], b_, **kw) if gate else fla_chunk(q_, k_, v_, b_, **kw)

    def ours(q_, k_, v_, b_, *rest):
        return delta_rule(q_, k_, v_, b_, log_decay=rest[0] if gate else None, initial_state=rest[-1],
                          output_final_state=True)

    ours_ts = [t.float() for t in ts]
    if backward:
        try:
            got = _run(theirs, ts)
        except RuntimeError as e:
            if "produces incorrect results" in str(e):
                pytest.skip(f"fla refuses this backward here: {e}")
            raise
        want = _run(ours, ours_ts)
    else:
        with torch.no_grad():
            got, want = list(theirs(*ts)), list(ours(*ours_ts))
    assert len(got) == len(want) == (len(ts) + 2 if backward else 2)
    names = ("o", "S", "dq", "dk", "dv", "dbeta") + (("dg",) if gate else ()) + ("dS0",)
    for name, a, b in zip(names, got, want):
        err = (a.float() - b.float()).abs().max().item()
        assert err <= tol * max(1.0, b.abs().max().item()), f"{name}: max abs error {err:.3g}"


@pytest.mark.parametrize("gate", [None, "token", "fixed"])
@pytest.mark.parametrize("T", [1, 100])
def test_fla_backend_matches_the_torch_backend_on_cuda(gate, T):
    """``delta_rule(..., backend="fla")`` against ``backend="torch"`` on the same CUDA tensors: outputs,
    final states and the gradients of q, k, v, beta, the gate (a fixed [H] one too) and the state, with
    the TF32 tolerance of the kernel tests above. Skipped where fla does not import or refuses the
    backward (Hopper with Triton < 3.7.1 and no TileLang)."""
    _fla_chunk(True)  # skips without fla
    q, k, v, beta, ld, S0 = _case(2, T, 2, 64, 64, gate)
    beta = beta / 1.5
    ts = [t.to(DEVICE, torch.float32) for t in (q, k, v, beta) + ((ld,) if gate else ()) + (S0,)]

    def with_backend(backend):
        def fn(q_, k_, v_, b_, *rest):
            return delta_rule(q_, k_, v_, b_, log_decay=rest[0] if gate else None, initial_state=rest[-1],
                              output_final_state=True, backend=backend)
        return fn
    try:
        got = _run(with_backend("fla"), ts)
    except RuntimeError as e:
        if "produces incorrect results" in str(e):
            pytest.skip(f"fla refuses this backward here: {e}")
        raise
    want = _run(with_backend("torch"), ts)
    names = ("o", "S", "dq", "dk", "dv", "dbeta") + (("dg",) if gate else ()) + ("dS0",)
    assert len(got) == len(want) == len(names)
    for name, a, b in zip(names, got, want):
        err = (a.float() - b.float()).abs().max().item()
        assert err <= 2e-2 * max(1.0, b.abs().max().item()), f"{name}: max abs error {err:.3g}"
