"""The delta rule (DeltaNet, Gated DeltaNet): every form against the float64 token-by-token reference,
gates (per-token and fixed), states in and out, gradients (against autograd through the reference and by
gradcheck), awkward shapes, low precisions, extreme gates and long sequences, decoding, bad input."""
import math

import pytest
import torch

from lintrans.ops import DELTA_FORMS, delta_rule, delta_rule_reference, delta_rule_step
from lintrans.ops.delta.reference import l2_normalized

F64 = torch.float64
EPS32 = torch.finfo(torch.float32).eps

# (B, T, H, Dk, Dv, chunk): T=1, T not a multiple of the chunk, chunk > T, chunk 1 and 7, Dk != Dv,
# D not a power of two, several chunks of 64
SHAPES = [
    (1, 1, 1, 4, 4, 64),
    (2, 37, 3, 5, 7, 8),
    (1, 16, 2, 8, 3, 64),
    (1, 9, 1, 3, 2, 1),
    (2, 23, 2, 6, 5, 7),
    (1, 150, 1, 12, 10, 64),
]


@pytest.fixture(params=["recurrent", "chunked", "chunked-torch"])
def form(request, monkeypatch):
    """Every form; the chunked one on both CPU paths: the fused kernel where it is built and applies, and
    the PyTorch code it falls back to (``LINTRANS_NATIVE=0``)."""
    if request.param == "chunked-torch":
        monkeypatch.setenv("LINTRANS_NATIVE", "0")
    return request.param.split("-")[0]


@pytest.fixture(params=["native", "torch"])
def chunked_path(request, monkeypatch):
    """For the tests of the default (chunked) form: both CPU paths, as in ``form``."""
    if request.param == "torch":
        monkeypatch.setenv("LINTRANS_NATIVE", "0")
    return request.param


def gen(seed):
    return torch.Generator().manual_seed(seed)


def inputs(B, T, H, Dk, Dv, *, seed=0, beta_hi=1.0, dtype=F64):
    """q, k, v [B, T, H, D] standard normal and beta [B, T, H] uniform in [0, beta_hi]."""
    g = gen(seed)
    q, k = (torch.randn(B, T, H, Dk, generator=g, dtype=F64) for _ in range(2))
    v = torch.randn(B, T, H, Dv, generator=g, dtype=F64)
    beta = torch.rand(B, T, H, generator=g, dtype=F64) * beta_hi
    return tuple(x.to(dtype) for x in (q, k, v, beta))


def gates(shape, low=-2.0, seed=1, dtype=F64):
    """log-decays in (low, 0]: a mix of near-1 and strong gates."""
    return (torch.rand(shape, generator=gen(seed), dtype=F64) * low).to(dtype)


def state(B, H, Dk, Dv, seed=2, dtype=F64):
    return torch.randn(B, H, Dk, Dv, generator=gen(seed), dtype=F64).to(dtype)


def gate_for(kind, B, T, H, **kw):
    return None if kind == "none" else gates((H,) if kind == "fixed" else (B, T, H), **kw)


def assert_close(x, y, tol, what=""):
    err = (x.double() - y.double()).abs().max().item()
    assert err <= tol, f"{what}: max abs error {err:.3g} > {tol:.3g}"


# ------------------------------------------------------------------------------------------ forward


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("gate", ["none", "token", "fixed"])
def test_forms_equal_reference(form, shape, gate):
    B, T, H, Dk, Dv, c = shape
    q, k, v, beta = inputs(B, T, H, Dk, Dv)
    ld = gate_for(gate, B, T, H)
    S0 = state(B, H, Dk, Dv)
    o, S = delta_rule(q, k, v, beta, log_decay=ld, form=form, chunk_size=c, initial_state=S0,
                      output_final_state=True)
    ref, S_ref = delta_rule_reference(q, k, v, beta, log_decay=ld, initial_state=S0)
    assert o.shape == (B, T, H, Dv) and o.dtype == F64
    assert S.shape == (B, H, Dk, Dv) and S.dtype == F64
    assert_close(o, ref, 1e-10, "o")
    assert_close(S, S_ref, 1e-10, "S")


def test_no_initial_state_and_no_final_state(form):
    q, k, v, beta = inputs(2, 19, 2, 6, 4)
    o, S = delta_rule(q, k, v, beta, form=form, chunk_size=8)
    assert S is None
    ref, _ = delta_rule_reference(q, k, v, beta)
    assert_close(o, ref, 1e-10)
    # and a zero initial state is the same as none
    o0, _ = delta_rule(q, k, v, beta, form=form, chunk_size=8, initial_state=torch.zeros(2, 2, 6, 4, dtype=F64))
    assert_close(o0, o, 1e-12)


def test_the_definition_by_hand(chunked_path):
    """One head, two tokens, written out: the reference is the rule the docs state, not just our forms."""
    q, k, v, beta = inputs(1, 2, 1, 3, 2, seed=5)
    ld = gates((1, 2, 1), seed=6)
    S0 = state(1, 1, 3, 2, seed=7)
    qn, kn = l2_normalized(q[0, :, 0]), l2_normalized(k[0, :, 0])
    S = S0[0, 0]
    outs = []
    for t in range(2):
        a = ld[0, t, 0].exp()
        S = a * S + torch.outer(kn[t], beta[0, t, 0] * (v[0, t, 0] - a * S.T @ kn[t]))
        outs.append(3 ** -0.5 * S.T @ qn[t])
    for form in DELTA_FORMS:
        o, S_out = delta_rule(q, k, v, beta, log_decay=ld, form=form, initial_state=S0, output_final_state=True)
        assert_close(o[0, :, 0], torch.stack(outs), 1e-12, form)
        assert_close(S_out[0, 0], S, 1e-12, form)


@pytest.mark.parametrize("gate", ["none", "token"])
def test_l2_normalize_false_and_scale(form, gate):
    B, T, H, Dk, Dv = 2, 29, 2, 5, 6
    q, k, v, beta = inputs(B, T, H, Dk, Dv)
    # without normalisation beta |k|^2 must stay in [0, 2] for the recurrence to stay bounded
    k = k / (k.norm(dim=-1, keepdim=True) * 1.1)
    ld = gate_for(gate, B, T, H)
    o, S = delta_rule(q, k, v, beta, log_decay=ld, form=form, chunk_size=8, l2_normalize=False, scale=0.37,
                      output_final_state=True)
    ref, S_ref = delta_rule_reference(q, k, v, beta, log_decay=ld, l2_normalize=False, scale=0.37)
    assert_close(o, ref, 1e-10, "o")
    assert_close(S, S_ref, 1e-10, "S")
    # and normalisation does change the result here (the flag is not ignored)
    o_norm, _ = delta_rule(q, k, v, beta, log_decay=ld, form=form, chunk_size=8, scale=0.37)
    assert (o_norm - o).abs().max() > 1e-3


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_beta_above_one(form, chunk):
    """beta in (1, 2]: negative eigenvalues (1 - beta) along k; still exact and bounded."""
    B, T, H, Dk, Dv = 1, 70, 2, 4, 3
    q, k, v, _ = inputs(B, T, H, Dk, Dv)
    beta = 1 + torch.rand(B, T, H, generator=gen(9), dtype=F64)
    beta[0, :5] = 2.0  # the closed end
    ld = gates((B, T, H), low=-0.5)
    o, S = delta_rule(q, k, v, beta, log_decay=ld, form=form, chunk_size=chunk, output_final_state=True)
    ref, S_ref = delta_rule_reference(q, k, v, beta, log_decay=ld)
    assert_close(o, ref, 1e-9, "o")
    assert_close(S, S_ref, 1e-9, "S")


@pytest.mark.parametrize("gate", ["none", "token", "fixed"])
@pytest.mark.parametrize("split", [1, 13, 32])
def test_split_sequence_equals_one_call(form, gate, split):
    B, T, H, Dk, Dv = 2, 45, 2, 5, 3
    q, k, v, beta = inputs(B, T, H, Dk, Dv)
    ld = gate_for(gate, B, T, H)
    S0 = state(B, H, Dk, Dv)
    o, S = delta_rule(q, k, v, beta, log_decay=ld, form=form, chunk_size=16, initial_state=S0,
                      output_final_state=True)

    def part(sl):
        return (x[:, sl] for x in (q, k, v, beta)), (None if ld is None else ld if ld.dim() == 1 else ld[:, sl])

    (q1, k1, v1, b1), ld1 = part(slice(0, split))
    (q2, k2, v2, b2), ld2 = part(slice(split, T))
    o1, S1 = delta_rule(q1, k1, v1, b1, log_decay=ld1, form=form, chunk_size=16, initial_state=S0,
                        output_final_state=True)
    o2, S2 = delta_rule(q2, k2, v2, b2, log_decay=ld2, form=form, chunk_size=16, initial_state=S1,
                        output_final_state=True)
    assert_close(torch.cat([o1, o2], dim=1), o, 1e-11, "o")
    assert_close(S2, S, 1e-11, "S")


def test_forms_agree_on_chunk_size(chunked_path):
    """The chunk size changes the order of the sums, never the result."""
    q, k, v, beta = inputs(1, 50, 2, 6, 6)
    ld = gates((1, 50, 2))
    outs = [delta_rule(q, k, v, beta, log_decay=ld, form="chunked", chunk_size=c)[0] for c in (1, 7, 16, 64)]
    rec = delta_rule(q, k, v, beta, log_decay=ld, form="recurrent")[0]
    for o in outs:
        assert_close(o, rec, 1e-11)


# ------------------------------------------------------------------------------------------ gradients


def _grads(fn, tensors):
    outs = fn(*tensors)
    o, S = outs
    g = gen(11)
    loss = (o * torch.randn(o.shape, generator=g, dtype=F64)).sum() + (S * torch.randn(S.shape, generator=g,
                                                                                        dtype=F64)).sum()
    return torch.autograd.grad(loss, tensors, allow_unused=True)


NAMES = ["q", "k", "v", "beta", "log_decay", "initial_state"]


@pytest.mark.parametrize("shape", SHAPES[1:])
@pytest.mark.parametrize("gate", ["none", "token", "fixed"])
def test_gradients_equal_reference(form, shape, gate):
    B, T, H, Dk, Dv, c = shape
    q, k, v, beta = inputs(B, T, H, Dk, Dv, beta_hi=1.5)
    ld = gate_for(gate, B, T, H)
    S0 = state(B, H, Dk, Dv)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, beta)]
    ld_leaf = None if ld is None else ld.clone().requires_grad_()
    S0_leaf = S0.clone().requires_grad_()
    tensors = leaves + ([ld_leaf] if ld is not None else []) + [S0_leaf]

    def unpack(ts):
        q_, k_, v_, b_ = ts[:4]
        return q_, k_, v_, b_, (ts[4] if ld is not None else None), ts[-1]

    def ours(*ts):
        q_, k_, v_, b_, ld_, s_ = unpack(ts)
        return delta_rule(q_, k_, v_, b_, log_decay=ld_, form=form, chunk_size=c, initial_state=s_,
                          output_final_state=True)

    def ref(*ts):
        q_, k_, v_, b_, ld_, s_ = unpack(ts)
        return delta_rule_reference(q_, k_, v_, b_, log_decay=ld_, initial_state=s_)

    got, want = _grads(ours, tensors), _grads(ref, tensors)
    names = NAMES[:4] + (["log_decay"] if ld is not None else []) + ["initial_state"]
    for name, a, b in zip(names, got, want):
        assert a is not None, name
        assert a.shape == b.shape, name
        scale = max(1.0, b.abs().max().item())
        assert_close(a, b, 1e-9 * scale, f"d{name}")


@pytest.mark.parametrize("gate", ["token", "fixed"])
def test_gradients_with_only_the_output(gate, chunked_path):
    """No final state asked for: the state's gradient path is absent, the rest still exact."""
    B, T, H, Dk, Dv = 1, 20, 2, 3, 4
    q, k, v, beta = (x.requires_grad_() for x in inputs(B, T, H, Dk, Dv))
    ld = gate_for(gate, B, T, H).requires_grad_()
    o, _ = delta_rule(q, k, v, beta, log_decay=ld, chunk_size=6)
    w = torch.randn(o.shape, generator=gen(3), dtype=F64)
    got = torch.autograd.grad((o * w).sum(), (q, k, v, beta, ld))
    ref, _ = delta_rule_reference(q, k, v, beta, log_decay=ld)
    want = torch.autograd.grad((ref * w).sum(), (q, k, v, beta, ld))
    for name, a, b in zip(NAMES, got, want):
        assert_close(a, b, 1e-10 * max(1.0, b.abs().max().item()), f"d{name}")


@pytest.mark.parametrize("upstream", ["broadcast over T", "broadcast everywhere", "transposed"])
def test_gradients_of_strided_upstream(upstream, chunked_path):
    """The gradient reaching o as autograd hands it over: expanded along T (stride 0 there) by a sum
    over T, expanded everywhere by ``o.sum()``, or a transposed view. The kernel reads do's rows in
    place where BLAS can, so each layout must give the reference's gradients."""
    B, T, H, Dk, Dv = 2, 21, 2, 5, 4
    q, k, v, beta = (x.requires_grad_() for x in inputs(B, T, H, Dk, Dv))
    ld = gate_for("token", B, T, H).requires_grad_()
    w = torch.randn(B, H, Dv, generator=gen(3), dtype=F64)

    def loss(o):
        if upstream == "broadcast over T":
            return (o.sum(1) * w).sum()
        if upstream == "broadcast everywhere":
            return o.sum()
        return (o.transpose(1, 2) * torch.randn(B, H, T, Dv, generator=gen(4), dtype=F64)).sum()

    o, _ = delta_rule(q, k, v, beta, log_decay=ld, chunk_size=8)
    got = torch.autograd.grad(loss(o), (q, k, v, beta, ld))
    ref, _ = delta_rule_reference(q, k, v, beta, log_decay=ld)
    want = torch.autograd.grad(loss(ref), (q, k, v, beta, ld))
    for name, a, b in zip(NAMES, got, want):
        assert_close(a, b, 1e-10 * max(1.0, b.abs().max().item()), f"d{name}")


@pytest.mark.parametrize("gate", ["none", "token", "fixed"])
@pytest.mark.parametrize("l2", [True, False])
def test_gradcheck_chunked(gate, l2, chunked_path):
    B, T, H, Dk, Dv, c = 1, 6, 2, 3, 2, 4
    q, k, v, _ = inputs(B, T, H, Dk, Dv, seed=4)
    if not l2:
        k = k / (k.norm(dim=-1, keepdim=True) * 1.2)
    # away from the ends of [0, 2] and from 0 for log_decay, so the finite differences stay valid
    beta = 0.2 + 1.5 * torch.rand(B, T, H, generator=gen(5), dtype=F64)
    ld = None if gate == "none" else -(0.1 + torch.rand((H,) if gate == "fixed" else (B, T, H), generator=gen(6),
                                                        dtype=F64))
    S0 = state(B, H, Dk, Dv)
    tensors = [x.clone().requires_grad_() for x in (q, k, v, beta, S0)]
    if ld is not None:
        tensors.append(ld.clone().requires_grad_())

    def fn(q_, k_, v_, b_, s_, *ld_):
        return delta_rule(q_, k_, v_, b_, log_decay=ld_[0] if ld_ else None, chunk_size=c, l2_normalize=l2,
                          initial_state=s_, output_final_state=True)

    assert torch.autograd.gradcheck(fn, tensors, eps=1e-6, atol=1e-7, rtol=1e-5)


def test_gradient_is_not_zero_everywhere(chunked_path):
    """A guard on the comparisons above: the gradients compared are not all trivially zero."""
    q, k, v, beta = (x.requires_grad_() for x in inputs(1, 10, 1, 4, 4))
    ld = gates((1, 10, 1)).requires_grad_()
    o, S = delta_rule(q, k, v, beta, log_decay=ld, chunk_size=4, output_final_state=True)
    grads = torch.autograd.grad(o.sum() + S.sum(), (q, k, v, beta, ld))
    for name, gr in zip(NAMES, grads):
        assert gr.abs().max() > 1e-3, name


# ------------------------------------------------------------------------------------------ precisions


def _jitter_sensitivity(fn, args, ref, g, rounds):
    """Each output's largest change (against ref) when the float64 inputs get relative perturbations of
    float32's size: how far float32 rounding of the inputs alone moves the case."""
    worst = [0.0] * len(ref)
    for _ in range(rounds):
        jittered = [a if a is None else a * (1 + EPS32 * (2 * torch.rand(a.shape, generator=g, dtype=F64) - 1))
                    for a in args]
        for i, (x, r) in enumerate(zip(fn(*jittered), ref)):
            worst[i] = max(worst[i], (x - r).abs().max().item())
    return worst


def _float32_tolerance(fn, args, ref):
    """float32 rounding of the inputs, pushed through the float64 computation: the case's own sensitivity
    to perturbations of float32 size, times a margin for the arithmetic's own rounding."""
    worst = max(_jitter_sensitivity(fn, args, ref, gen(21), 3))
    mag = max(ref[0].abs().max().item(), ref[1].abs().max().item())
    return 64 * max(worst, EPS32 * mag)


@pytest.mark.parametrize("gate", ["none", "token"])
def test_float32_within_its_tolerance(form, gate):
    B, T, H, Dk, Dv = 2, 100, 2, 16, 12
    q, k, v, beta = inputs(B, T, H, Dk, Dv, beta_hi=1.5)
    ld = gate_for(gate, B, T, H, low=-0.3)
    S0 = state(B, H, Dk, Dv)

    def f64(q_, k_, v_, b_, ld_, s_):
        return delta_rule_reference(q_, k_, v_, b_, log_decay=ld_, initial_state=s_)

    args = [q, k, v, beta, ld, S0]
    ref = f64(*args)
    tol = _float32_tolerance(f64, args, ref)
    assert tol < 1e-3  # a well-conditioned case: the tolerance is a float32 one
    f32 = [None if a is None else a.float() for a in args]
    o, S = delta_rule(*f32[:4], log_decay=f32[4], form=form, chunk_size=16, initial_state=f32[5],
                      output_final_state=True)
    assert o.dtype == torch.float32 and S.dtype == torch.float32
    assert_close(o, ref[0], tol, "o")
    assert_close(S, ref[1], tol, "S")


@pytest.mark.parametrize("chunk", [8, 24, 32, 64])
@pytest.mark.parametrize("gate", ["none", "token"])
def test_float32_gradients_by_chunk(chunk, gate, chunked_path):
    """float32 outputs and gradients at chunk sizes whose rows the CPU kernel's fast paths treat apart
    (8 to 64 wide, a last chunk of another width, Dk not a power of two), against float64 within the
    case's own float32 sensitivity: the gradients of float64 inputs jittered at float32's size."""
    B, T, H, Dk, Dv = 1, 100, 2, 20, 12
    q, k, v, beta = inputs(B, T, H, Dk, Dv, seed=chunk)
    ld = gate_for(gate, B, T, H, low=-0.3)
    do = torch.randn(B, T, H, Dv, generator=gen(chunk + 1), dtype=F64)
    args = [q, k, v, beta] + ([] if ld is None else [ld])

    def grads(xs, dtype, fn):
        xs = [x.to(dtype).requires_grad_() for x in xs]
        o, _ = fn(*xs[:4], log_decay=xs[4] if len(xs) > 4 else None)
        return [o.detach(), *torch.autograd.grad(o, xs, do.to(dtype))]

    ref = grads(args, F64, delta_rule_reference)
    worst = _jitter_sensitivity(lambda *xs: grads(xs, F64, delta_rule_reference), args, ref, gen(chunk + 2), 2)
    got = grads(args, torch.float32, lambda *a, **kw: delta_rule(*a, **kw, chunk_size=chunk))
    for i, (x, r) in enumerate(zip(got, ref)):
        assert x.dtype == torch.float32
        assert_close(x, r, 64 * max(worst[i], EPS32 * r.abs().max().item()), f"output {i} (0: o)")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(dtype, form):
    B, T, H, Dk, Dv = 1, 40, 2, 8, 8
    q, k, v, beta = (x.to(dtype) for x in inputs(B, T, H, Dk, Dv))
    ld = gates((B, T, H), low=-0.5).to(dtype)
    S0 = state(B, H, Dk, Dv)  # float32 or float64 states are accepted with low-precision inputs
    o, S = delta_rule(q, k, v, beta, log_decay=ld, form=form, chunk_size=16, initial_state=S0.float(),
                      output_final_state=True)
    assert o.dtype == dtype and S.dtype == torch.float32
    ref, S_ref = delta_rule_reference(q, k, v, beta, log_decay=ld, initial_state=S0)
    # computed in float32 from the rounded inputs: only the output's final rounding is low precision
    u = torch.finfo(dtype).eps
    assert_close(o, ref, 2 * u * ref.abs().max().item() + 1e-4, "o")
    assert_close(S, S_ref, 1e-4 * max(1.0, S_ref.abs().max().item()), "S")


# ------------------------------------------------------------------------------------------ extremes


@pytest.mark.parametrize("chunk", [7, 64])
def test_gates_of_minus_fifty(chunk, chunked_path):
    """Gates that wipe the state (-50) next to gates that keep it (0): exact, finite, in both forms."""
    B, T, H, Dk, Dv = 1, 100, 2, 4, 3
    q, k, v, beta = inputs(B, T, H, Dk, Dv)
    ld = torch.where(torch.rand(B, T, H, generator=gen(8)) < 0.3, -50.0, 0.0).to(F64)
    ld[0, 10:60, 0] = -50.0  # a long run: cumulative log-decays within a chunk reach -2500
    S0 = state(B, H, Dk, Dv)
    ref, S_ref = delta_rule_reference(q, k, v, beta, log_decay=ld, initial_state=S0)
    for form in DELTA_FORMS:
        for dtype in (F64, torch.float32):
            o, S = delta_rule(q.to(dtype), k.to(dtype), v.to(dtype), beta.to(dtype), log_decay=ld.to(dtype),
                              form=form, chunk_size=chunk, initial_state=S0.to(dtype), output_final_state=True)
            tol = 1e-11 if dtype == F64 else 1e-4
            assert torch.isfinite(o).all() and torch.isfinite(S).all()
            assert_close(o, ref, tol, f"o {form} {dtype}")
            assert_close(S, S_ref, tol, f"S {form} {dtype}")


def test_gates_of_minus_fifty_gradients_are_finite_and_exact(chunked_path):
    B, T, H, Dk, Dv = 1, 30, 1, 3, 3
    q, k, v, beta = (x.requires_grad_() for x in inputs(B, T, H, Dk, Dv))
    ld = torch.full((B, T, H), -50.0, dtype=F64)
    ld[0, ::3] = -0.1
    ld.requires_grad_()
    o, S = delta_rule(q, k, v, beta, log_decay=ld, chunk_size=16, output_final_state=True)
    got = torch.autograd.grad(o.sum() + S.sum(), (q, k, v, beta, ld))
    ref, S_ref = delta_rule_reference(q, k, v, beta, log_decay=ld)
    want = torch.autograd.grad(ref.sum() + S_ref.sum(), (q, k, v, beta, ld))
    for name, a, b in zip(NAMES, got, want):
        assert torch.isfinite(a).all(), name
        assert_close(a, b, 1e-10 * max(1.0, b.abs().max().item()), f"d{name}")


def test_long_sequence_chunked(chunked_path):
    """T = 65536 in float32: finite, and on the last tokens equal to the reference run on a tail alone
    (the gates across the tail's first part forget everything earlier: below float64's resolution)."""
    B, T, H, D, tail, last = 1, 65536, 1, 8, 500, 100
    q, k, v, beta = inputs(B, T, H, D, D, dtype=torch.float32)
    ld = gates((B, T, H), low=-1.0, dtype=torch.float32)
    ld[0, ::1000] = -50.0
    o, S = delta_rule(q, k, v, beta, log_decay=ld, chunk_size=64, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert ld[0, T - tail:T - last].double().sum() < -150  # exp(-150): the earlier state cannot matter
    ref, S_ref = delta_rule_reference(*(x[:, T - tail:] for x in (q, k, v, beta)), log_decay=ld[:, T - tail:])
    assert_close(o[:, T - last:], ref[:, tail - last:], 1e-4, "o")
    assert_close(S, S_ref, 1e-4, "S")
    # and without a decay the state stays bounded (l2-normalised keys, beta <= 1: no expansion)
    o, S = delta_rule(q, k, v, beta, chunk_size=64, output_final_state=True)
    assert torch.isfinite(o).all() and S.abs().max() < 100
    _, S_prefix = delta_rule(*(x[:, : T - 50] for x in (q, k, v, beta)), chunk_size=64, output_final_state=True)
    o2, S2 = delta_rule(*(x[:, T - 50:] for x in (q, k, v, beta)), form="recurrent", initial_state=S_prefix,
                        output_final_state=True)
    assert_close(o2, o[:, T - 50:], 1e-4, "o (state passed to the recurrent form)")
    assert_close(S2, S, 1e-4, "S (state passed to the recurrent form)")


# ------------------------------------------------------------------------------------------ decoding


@pytest.mark.parametrize("gate", ["none", "token", "fixed"])
@pytest.mark.parametrize("l2", [True, False])
def test_steps_equal_the_full_op(gate, l2, chunked_path):
    B, T, H, Dk, Dv = 2, 12, 3, 5, 4
    q, k, v, beta = inputs(B, T, H, Dk, Dv)
    if not l2:
        k = k / (k.norm(dim=-1, keepdim=True) * 1.1)
    ld = gate_for(gate, B, T, H)
    S0 = state(B, H, Dk, Dv)
    o, S_full = delta_rule(q, k, v, beta, log_decay=ld, chunk_size=5, l2_normalize=l2, scale=0.5,
                           initial_state=S0, output_final_state=True)
    S = S0
    for t in range(T):
        ld_t = None if ld is None else ld if ld.dim() == 1 else ld[:, t]
        o_t, S = delta_rule_step(q[:, t], k[:, t], v[:, t], beta[:, t], S, log_decay=ld_t, l2_normalize=l2,
                                 scale=0.5)
        assert o_t.shape == (B, H, Dv)
        assert_close(o_t, o[:, t], 1e-12, f"token {t}")
    assert_close(S, S_full, 1e-12, "S")


def test_decoding_step_takes_the_fused_kernel_unless_autograd_records(chunked_path, monkeypatch):
    """test_steps_equal_the_full_op runs each step on the path set up here: this checks which path that is
    (the fused step where the kernels run and nothing records gradients), and that the kernel's step,
    given a float32 state, equals the PyTorch step's and leaves the state as it was."""
    from lintrans.ops.native import delta_rule as native_delta

    calls = []
    fused = native_delta.step
    monkeypatch.setattr(native_delta, "step", lambda *a, **kw: calls.append(1) or fused(*a, **kw))
    q, k, v, beta = (x[:, 0].float() for x in inputs(3, 1, 4, 6, 5))
    S0 = state(3, 4, 6, 5).float()
    before = S0.clone()
    ld = -torch.rand(3, 4, generator=gen(1))
    o, S = delta_rule_step(q, k, v, beta, S0, log_decay=ld, scale=0.3)
    assert torch.equal(S0, before)
    assert calls == ([1] if chunked_path == "native" and native_delta.takes(q) else [])
    monkeypatch.setenv("LINTRANS_NATIVE", "0")
    o_ref, S_ref = delta_rule_step(q, k, v, beta, S0, log_decay=ld, scale=0.3)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(S, S_ref, rtol=1e-5, atol=1e-6)
    monkeypatch.delenv("LINTRANS_NATIVE")
    calls.clear()
    delta_rule_step(q.requires_grad_(), k, v, beta, S0)  # autograd records: the PyTorch step
    assert calls == []


def test_step_without_state_and_dtypes():
    q, k, v, beta = inputs(1, 1, 2, 4, 3)
    o, S = delta_rule_step(q[:, 0], k[:, 0], v[:, 0], beta[:, 0])
    ref, S_ref = delta_rule_reference(q, k, v, beta)
    assert_close(o, ref[:, 0], 1e-12)
    assert_close(S, S_ref, 1e-12)
    o, S = delta_rule_step(*(x[:, 0].to(torch.bfloat16) for x in (q, k, v, beta)))
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32


# ------------------------------------------------------------------------------------------ bad input


def _good(B=2, T=5, H=3, Dk=4, Dv=2):
    q, k, v, beta = inputs(B, T, H, Dk, Dv, dtype=torch.float32)
    return q, k, v, beta


BAD = [
    # (what to change, the exception, a word the message must name)
    (dict(beta=torch.rand(2, 5, 2)), ValueError, "beta"),
    (dict(beta=torch.rand(2, 5, 3, 1)), ValueError, "beta"),
    (dict(beta=[0.5]), TypeError, "beta"),
    (dict(beta=torch.ones(2, 5, 3, dtype=torch.long)), TypeError, "beta"),
    (dict(beta=torch.full((2, 5, 3), 2.5)), ValueError, "beta"),
    (dict(beta=torch.full((2, 5, 3), -0.1)), ValueError, "beta"),
    (dict(beta=torch.full((2, 5, 3), float("nan"))), ValueError, "beta"),
    (dict(beta=torch.full((2, 5, 3), float("inf"))), ValueError, "beta"),
    (dict(log_decay=torch.zeros(2, 5)), ValueError, "log_decay"),
    (dict(log_decay=torch.zeros(4)), ValueError, "log_decay"),
    (dict(log_decay=torch.zeros(2, 4, 3)), ValueError, "log_decay"),
    (dict(log_decay=torch.full((2, 5, 3), 0.1)), ValueError, "log_decay"),
    (dict(log_decay=torch.full((3,), float("nan"))), ValueError, "log_decay"),
    (dict(log_decay=torch.full((2, 5, 3), -float("inf"))), ValueError, "log_decay"),
    (dict(log_decay=-1.0), TypeError, "log_decay"),
    (dict(initial_state=torch.zeros(2, 3, 4, 3)), ValueError, "initial_state"),
    (dict(initial_state=torch.zeros(2, 3, 4)), ValueError, "initial_state"),
    (dict(initial_state=torch.zeros(2, 3, 2, 4)), ValueError, "initial_state"),
    (dict(initial_state=torch.zeros(2, 3, 4, 2, dtype=torch.long)), TypeError, "initial_state"),
    (dict(initial_state="S"), TypeError, "initial_state"),
    (dict(form="parallel"), ValueError, "form"),
    (dict(form=None), ValueError, "form"),
    (dict(chunk_size=0), ValueError, "chunk_size"),
    (dict(chunk_size=-3), ValueError, "chunk_size"),
    (dict(chunk_size=2.5), TypeError, "chunk_size"),
    (dict(l2_normalize=1), TypeError, "l2_normalize"),
    (dict(l2_normalize="yes"), TypeError, "l2_normalize"),
    (dict(scale="1"), TypeError, "scale"),
    (dict(output_final_state="yes"), TypeError, "output_final_state"),
]


def test_empty_batch_with_a_gate(chunked_path):
    """B = 0: nothing to compute, and no value check trips over an empty log_decay."""
    q, k, v, beta = inputs(0, 5, 2, 3, 4)
    o, S = delta_rule(q, k, v, beta, log_decay=gates((0, 5, 2)), output_final_state=True)
    assert o.shape == (0, 5, 2, 4) and S.shape == (0, 2, 3, 4)


@pytest.mark.parametrize("change,exc,word", BAD, ids=[f"{next(iter(c))}-{i}" for i, (c, _, _) in enumerate(BAD)])
def test_bad_input(change, exc, word):
    q, k, v, beta = _good()
    kw = dict(change)
    beta = kw.pop("beta", beta)
    with pytest.raises(exc, match=word):
        delta_rule(q, k, v, beta, **kw)


def test_good_input_passes():
    """The baseline the bad cases change one thing of: it runs."""
    q, k, v, beta = _good()
    delta_rule(q, k, v, beta, log_decay=torch.zeros(3), initial_state=torch.zeros(2, 3, 4, 2), chunk_size=2)
    delta_rule(q, k, v, beta, log_decay=-torch.ones(2, 5, 3), form="recurrent")
    beta_ends = beta.clone()
    beta_ends[0, 0, 0], beta_ends[0, 0, 1] = 0.0, 2.0
    delta_rule(q, k, v, beta_ends)


STEP_BAD = [
    (dict(beta=torch.rand(2, 5, 3)), ValueError, "beta"),
    (dict(beta=torch.full((2, 3), 3.0)), ValueError, "beta"),
    (dict(beta=torch.full((2, 3), float("nan"))), ValueError, "beta"),
    (dict(log_decay=torch.zeros(2, 5, 3)), ValueError, "log_decay"),
    (dict(log_decay=torch.full((2, 3), 1.0)), ValueError, "log_decay"),
    (dict(log_decay=torch.full((3,), float("nan"))), ValueError, "log_decay"),
    (dict(state=torch.zeros(2, 3, 2, 4)), ValueError, "state"),
    (dict(state=torch.zeros(3, 4, 2)), ValueError, "state"),
    (dict(l2_normalize=0), TypeError, "l2_normalize"),
]


@pytest.mark.parametrize("change,exc,word", STEP_BAD, ids=[f"{next(iter(c))}-{i}" for i, (c, _, _) in
                                                           enumerate(STEP_BAD)])
def test_step_bad_input(change, exc, word):
    q, k, v, beta = (x[:, 0] for x in _good())
    kw = dict(change)
    beta = kw.pop("beta", beta)
    with pytest.raises(exc, match=word):
        delta_rule_step(q, k, v, beta, **kw)
    delta_rule_step(q, k, v, torch.rand(2, 3), torch.zeros(2, 3, 4, 2), log_decay=torch.zeros(3))


def test_scale_default_is_inverse_sqrt_dk():
    q, k, v, beta = inputs(1, 8, 1, 9, 2)
    o_default, _ = delta_rule(q, k, v, beta)
    o_explicit, _ = delta_rule(q, k, v, beta, scale=1 / math.sqrt(9))
    assert_close(o_default, o_explicit, 1e-14)
    o_other, _ = delta_rule(q, k, v, beta, scale=1.0)
    assert_close(o_other, 3 * o_default, 1e-12)
