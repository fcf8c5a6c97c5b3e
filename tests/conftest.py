import os
import sys
import tempfile
import types
from pathlib import Path

import pytest
import torch


def pytest_configure(config):
    """The suite's own cache folder, so that nothing it measures (chunk_size="auto" timings, benchmark
    probes) lands in the user's cache where later runs would read it. The built kernels and tokenized
    corpora of the user's cache are reused (linked), not rebuilt."""
    if os.environ.get("LINTRANS_TEST_CACHE_KEPT"):  # the user asked for the real cache
        return
    from lintrans._platform import cache_dir

    real = cache_dir()
    tmp = Path(tempfile.mkdtemp(prefix="lintrans-test-cache-"))
    for name in ("data",):
        (real / name).mkdir(parents=True, exist_ok=True)
        (tmp / name).symlink_to(real / name, target_is_directory=True)
    os.environ.setdefault("LINTRANS_NATIVE_DIR", str(real / "native"))
    os.environ["LINTRANS_CACHE_DIR"] = str(tmp)
    config._lintrans_test_cache = tmp


def pytest_unconfigure(config):
    tmp = getattr(config, "_lintrans_test_cache", None)
    if tmp is not None:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)  # the data link goes, not what it points to


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def exact_float32():
    """TF32 off, so float32 on a GPU is compared as float32 (the CUDA test modules use it)."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _install_fla_stand_in(monkeypatch, module: str, name: str, fn) -> None:
    """sys.modules gets an ``fla`` package whose ``module.name`` is ``fn``, and fla_backend lets the CPU through."""
    stand_in = types.ModuleType(module)
    setattr(stand_in, name, fn)
    for key, mod in (("fla", types.ModuleType("fla")), ("fla.ops", types.ModuleType("fla.ops")), (module, stand_in)):
        monkeypatch.setitem(sys.modules, key, mod)
    from lintrans.ops import fla_backend

    monkeypatch.setattr(fla_backend, "DEVICES", frozenset({"cpu"}))


FLA_CALLS = []  # the stand-in's (g shape or None, g_gamma shape or None) per call, for dispatch tests


def _documented_chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                                 output_final_state=False):
    """fla's documented contract, step by step: S_t = exp(g_t) S_{t-1} + k_t v_t^T, o_t = scale q_t S_t;
    q, k [B, T, H, K], v [B, T, H, V], g [B, T, H] or None, g_gamma [H] (a fixed g_t; no gradient,
    as fla gives none) or None, states [B, H, K, V]."""
    B, T, H, K = q.shape
    assert g is None or g_gamma is None, "fla takes one of g and g_gamma"
    FLA_CALLS.append((None if g is None else tuple(g.shape), None if g_gamma is None else tuple(g_gamma.shape)))
    if g_gamma is not None:
        g = g_gamma.detach().expand(B, T, H)
    S = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state
    outs = []
    for t in range(T):
        if g is not None:
            S = S * g[:, t].exp()[..., None, None]
        S = S + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(outs, dim=1), (S if output_final_state else None)


@pytest.fixture
def stand_in_fla(monkeypatch):
    """fla replaced by the documented recurrence, and the CPU let through: what runs is our side. Returns
    the list of what each call passed as g and g_gamma (their shapes, or None)."""
    _install_fla_stand_in(monkeypatch, "fla.ops.simple_gla", "chunk_simple_gla", _documented_chunk_simple_gla)
    FLA_CALLS.clear()
    return FLA_CALLS  # what the stand-in was given: (g's shape, g_gamma's shape) per call


# what the delta-rule stand-in was given: (g's shape and dtype, the other inputs' dtypes, l2, scale)
FLA_DELTA_CALLS = []


def _documented_chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                       use_qk_l2norm_in_kernel=False):
    """fla's contract, token by token: q, k [B, T, H, K] (L2-normalised first with the flag), v [B, T, H, V],
    g [B, T, H] (log decay), beta [B, T, H], states [B, H, K, V];
    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T, o_t = scale S_t^T q_t."""
    FLA_DELTA_CALLS.append((tuple(g.shape), g.dtype, {x.dtype for x in (q, k, v, beta)}, use_qk_l2norm_in_kernel,
                            scale))
    B, T, H, K = q.shape
    if use_qk_l2norm_in_kernel:
        q, k = (x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    S = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None]
        err = v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t])
        S = S + k[:, t, :, :, None] * (beta[:, t, :, None] * err)[:, :, None, :]
        outs.append(scale * torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(outs, dim=1), (S if output_final_state else None)


@pytest.fixture
def stand_in_fla_delta(monkeypatch):
    """fla's chunk_gated_delta_rule replaced by its documented recurrence, and the CPU let through."""
    _install_fla_stand_in(monkeypatch, "fla.ops.gated_delta_rule", "chunk_gated_delta_rule",
                          _documented_chunk_gated_delta_rule)
    FLA_DELTA_CALLS.clear()
    return FLA_DELTA_CALLS
