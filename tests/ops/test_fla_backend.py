"""``linear_attention(..., backend="fla")``: the clear errors where it cannot run (checked here, on the
CPU), our side of the dispatch against the float64 reference with a stand-in for fla's kernel that
follows its documented contract, and the real kernels against ours where CUDA and fla exist."""
import importlib.util
import sys

import pytest
import torch

from lintrans.nn.feature_maps import ReBased
from lintrans.ops import fla_backend, linear_attention, linear_attention_reference
from lintrans.ops.feature_maps import resolve_feature_map

from qkv import random_qkv

HAS_FLA = importlib.util.find_spec("fla") is not None


def test_unknown_backend():
    q, k, v = random_qkv(1, 4, 1, 2, 2)
    with pytest.raises(ValueError, match="backend must be 'torch' or 'fla', got 'triton'"):
        linear_attention(q, k, v, backend="triton")


def test_fla_needs_cuda_tensors():
    q, k, v = random_qkv(1, 4, 1, 2, 2, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"backend='fla' runs on CUDA tensors only, got q on cpu"):
        linear_attention(q, k, v, backend="fla")


def test_fla_computes_the_chunked_form_only():
    q, k, v = random_qkv(1, 4, 1, 2, 2, dtype=torch.float32)
    with pytest.raises(ValueError, match="chunked form only; form must be 'chunked', got 'attention'"):
        linear_attention(q, k, v, backend="fla", form="attention")


def test_fla_refuses_float64_and_missing_fla(monkeypatch):
    monkeypatch.setattr(fla_backend, "DEVICES", frozenset({"cpu"}))  # past the device check, on this CPU
    q, k, v = random_qkv(1, 4, 1, 2, 2)
    with pytest.raises(ValueError, match="does not take float64"):
        linear_attention(q, k, v, backend="fla")
    monkeypatch.setitem(sys.modules, "fla", None)  # as if it were not installed: importing it raises
    q, k, v = (t.float() for t in (q, k, v))
    with pytest.raises(ValueError, match=r"needs flash-linear-attention \(pip install flash-linear-attention\)"):
        linear_attention(q, k, v, backend="fla")


DECAYS = [None, "fixed", "gate", "fixed-trained"]  # in this order fla autotunes least on a GPU


def _log_decay(decay, B, T, H, g):
    """None, a per-token gate [B, T, H] or a fixed decay [H] (fla's g_gamma), each as a leaf; the gate and
    "fixed-trained" ask for their gradient (a trained fixed decay goes to fla as a per-token g)."""
    if decay is None:
        return None
    ld = -torch.rand(B, T, H, generator=g) if decay == "gate" else -torch.rand(H, generator=g)
    return ld.requires_grad_(decay in ("gate", "fixed-trained"))


def _leaves(q, k, v, ld):
    """Fresh leaves for one backend's call: q, k, v with gradients, and the decay (or None) as it was asked."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    return q, k, v, None if ld is None else ld.detach().clone().requires_grad_(ld.requires_grad)


@pytest.mark.parametrize("feature_map", ["elu", "identity", "based", "rebased"])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("T", [1, 11])
def test_dispatch_matches_the_reference(stand_in_fla, feature_map, normalize, decay, T):
    """Feature map, normaliser column, scale, decay, initial state and final (S, z) around the kernel,
    with Dk != Dv: outputs and states equal the float64 definition, gradients those of our backend."""
    B, H, Dk, Dv = 2, 2, 3, 4
    q, k, v = (t.float() for t in random_qkv(B, T, H, Dk, Dv))
    if feature_map == "identity" and normalize:
        # identity features of random sign put denominators q . z near zero, where the gradient is
        # huge and its float32 value depends on the BLAS's summation order: positive q and k keep
        # every denominator a sum of positive terms
        q, k = q.abs(), k.abs()
    fm = ReBased(Dk) if feature_map == "rebased" else feature_map
    phi = resolve_feature_map(fm)[1]
    g = torch.Generator().manual_seed(3)
    ld = _log_decay(decay, B, T, H, g)
    # the initial state is one a prefix of 3 tokens leaves (S = sum phi(k) v^T, z = sum phi(k)), so
    # q . z is a sum of the kernel's values as in use, not a random projection that can be near zero
    k0, v0 = torch.randn(B, 3, H, Dk, generator=g), torch.randn(B, 3, H, Dv, generator=g)
    with torch.no_grad():
        fk0 = phi(k0.abs() if feature_map == "identity" and normalize else k0)  # [B, 3, H, F]
    S0 = (torch.einsum("bthf,bthv->bhfv", fk0, v0), fk0.sum(1))
    kw = dict(feature_map=fm, normalize=normalize, scale=0.7, initial_state=S0)
    grads = {}
    for backend in ("fla", "torch"):
        *leaves, ld_leaf = _leaves(q, k, v, ld)
        o, (S, z) = linear_attention(*leaves, backend=backend, output_final_state=True, log_decay=ld_leaf, **kw)
        (o.square().sum() + S.sum() + z.sum()).backward()
        grads[backend] = [t.grad for t in leaves + [ld_leaf] if t is not None and t.requires_grad]
        if backend == "fla":
            assert o.dtype == torch.float32 and S.dtype == z.dtype == torch.float32
            o_ref, (S_ref, z_ref) = linear_attention_reference(q, k, v, log_decay=ld, **kw)
            torch.testing.assert_close(o.double(), o_ref, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(S.double(), S_ref, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(z.double(), z_ref, rtol=1e-4, atol=1e-5)
    assert len(grads["fla"]) == 3 + (decay in ("gate", "fixed-trained"))
    for a, b in zip(grads["fla"], grads["torch"], strict=True):
        # float32 sums carry errors relative to their largest terms, not to the result: without the
        # normaliser the gradients grow with T, so an entry near zero may differ by ~eps * max|grad|
        torch.testing.assert_close(a, b, rtol=1e-4, atol=max(1e-4, 1e-5 * b.abs().max().item()))


@pytest.mark.parametrize("miscompiles", [False, True])
def test_a_fixed_decay_goes_to_fla_as_g_gamma_only_without_a_gradient(stand_in_fla, monkeypatch, miscompiles):
    """g_gamma [H] for a fixed decay that needs no gradient (fla returns none for it); g [B, T, H] for a
    per-token one, a trained fixed one, and, where Triton miscompiles fla's gated backward (Hopper with
    an older Triton), any fixed one that a backward may follow: fla then runs it in TileLang or refuses,
    where its unguarded g_gamma backward would compute wrong gradients."""
    monkeypatch.setattr(fla_backend, "_triton_miscompiles_gated_backward", lambda: miscompiles)
    B, T, H = 1, 5, 2
    q, k, v = (t.float() for t in random_qkv(B, T, H, 3, 4))
    fixed, gate = -torch.rand(H), -torch.rand(B, T, H)
    g_gamma, g = (None, (H,)), ((B, T, H), None)

    def sent(ld, *, train=False, grad=True):
        stand_in_fla.clear()
        with torch.set_grad_enabled(grad):
            linear_attention(q.requires_grad_(train), k, v, backend="fla", log_decay=ld)
        return stand_in_fla[-1]

    assert sent(fixed) == g_gamma  # no gradient asked of anything
    assert sent(fixed, train=True) == (g if miscompiles else g_gamma)  # a backward may follow
    assert sent(fixed.clone().requires_grad_()) == g
    assert sent(fixed.clone().requires_grad_(), train=True, grad=False) == g_gamma  # inference of a trained decay
    assert sent(gate) == g and sent(gate, train=True) == g
    assert sent(None) == (None, None)


def test_dispatch_without_state_or_normaliser(stand_in_fla):
    """Neither the normaliser nor z asked for: v goes in as it is, and no state comes back."""
    q, k, v = (t.float() for t in random_qkv(1, 6, 2, 3, 5))
    o, state = linear_attention(q, k, v, backend="fla", normalize=False, feature_map="relu")
    assert state is None
    ref, _ = linear_attention_reference(q, k, v, normalize=False, feature_map="relu")
    torch.testing.assert_close(o.double(), ref, rtol=1e-5, atol=1e-6)


def _cuda_case(T, decay, seed):
    """q, k, v, the decay (as ``_log_decay`` asks, scaled by 0.1) and an initial (S, z) on CUDA: B=2, H=3,
    Dk=32, Dv=48."""
    B, H, Dk, Dv = 2, 3, 32, 48
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, d, generator=g).cuda() for d in (Dk, Dk, Dv))
    ld = _log_decay(decay, B, T, H, g)
    ld = None if ld is None else (ld.detach() * 0.1).cuda().requires_grad_(ld.requires_grad)
    S0 = (torch.randn(B, H, Dk, Dv, generator=g).cuda() * 0.1, torch.rand(B, H, Dk, generator=g).cuda() + 0.5)
    return q, k, v, ld, S0


def _assert_close_tf32(name, a, b):
    """fla against the torch backend: 2e-2 relative and of b's largest value (Triton's TF32 dot products)."""
    torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item(), msg=lambda m: f"{name}: {m}")


@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_FLA),
                    reason="needs a CUDA device and flash-linear-attention")
@pytest.mark.parametrize("feature_map", ["elu", "identity"])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("T", [1, 100, 256])
def test_fla_kernels_match_ours_on_cuda(feature_map, normalize, decay, T):
    """The real kernels against the torch backend: outputs and final states, then the gradients of q, k,
    v and a trained decay. Tolerances allow TF32 (Triton's float32 dot products round inputs to 10-bit
    mantissas). Where fla itself refuses a backward pass (a decay sent as g on Hopper with Triton <
    3.7.1, its issue #640, and TileLang not installed), the forward has been compared and the case is
    skipped with fla's reason."""
    q, k, v, ld, S0 = _cuda_case(T, decay, seed=0)
    if feature_map == "identity" and normalize:  # denominators of one sign, as in the dispatch test above
        q, k = q.abs(), k.abs()
    kw = dict(feature_map=feature_map, normalize=normalize, scale=q.shape[-1] ** -0.5, initial_state=S0,
              output_final_state=True)
    results, refused = {}, None
    for backend in ("torch", "fla"):
        *leaves, ld_leaf = _leaves(q, k, v, ld)
        o, (S, z) = linear_attention(*leaves, backend=backend, log_decay=ld_leaf, **kw)
        results[backend] = [o.detach(), S.detach(), z.detach()]
        try:
            (o.square().sum() + S.sum() + z.sum()).backward()
        except RuntimeError as e:
            if backend != "fla" or "#640" not in str(e):
                raise
            refused = str(e)
            continue
        results[backend] += [t.grad for t in leaves + [ld_leaf] if t is not None and t.requires_grad]
    names = ("o", "S", "z", "dq", "dk", "dv", "dlog_decay")
    for name, a, b in zip(names, results["fla"], results["torch"]):
        _assert_close_tf32(name, a, b)
    if refused:
        pytest.skip(f"forward equal; fla refused the backward pass: {refused}")
    assert len(results["fla"]) == len(results["torch"])


@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_FLA),
                    reason="needs a CUDA device and flash-linear-attention")
@pytest.mark.parametrize("decay", ["fixed", "gate"])
@pytest.mark.parametrize("T", [1, 100, 256])
def test_fla_forward_without_gradients_matches_ours_on_cuda(decay, T):
    """Inference (no gradient): a fixed decay goes to fla as ``g_gamma`` here, whatever the machine, and a
    gate as ``g``; outputs and final states against the torch backend, the tolerance TF32's."""
    q, k, v, ld, S0 = _cuda_case(T, decay, seed=1)
    with torch.no_grad():
        got, want = (linear_attention(q, k, v, backend=b, log_decay=ld, feature_map="elu", scale=q.shape[-1] ** -0.5,
                                      initial_state=S0, output_final_state=True) for b in ("fla", "torch"))
    for name, a, b in zip(("o", "S", "z"), (got[0], *got[1]), (want[0], *want[1])):
        _assert_close_tf32(name, a, b)
