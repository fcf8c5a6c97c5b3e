"""The float product every fused kernel calls (cpu_kernels.h's gemm): small_gemm.h's register-blocked
loop on AVX2 builds without AVX-512, the BLAS elsewhere and past its sizes. Checked against a float64
product within the rounding bound of any summation order, so the test holds for either path."""
import ctypes

import pytest
import torch

from lintrans._platform import cpu_vector_features
from lintrans.ops import native

from native_paths import needs_native

F32 = ctypes.POINTER(ctypes.c_float)
I64 = ctypes.c_int64


def _gemm():
    fn = native.library().lt_debug_gemm_f32
    fn.restype = None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, I64, I64, I64, ctypes.c_float, F32, I64, F32, I64, ctypes.c_float,
                   F32, I64]
    return fn


def _ptr(t):
    return ctypes.cast(t.data_ptr(), F32)


def _product(tA, tB, M, N, K, alpha, beta, pad, c_fill=None, seed=0):
    """C after the call, and the float64 result with its rounding bound; operands stored with leading
    dimensions ``pad`` past their widths, C's padding checked untouched."""
    g = torch.Generator().manual_seed(seed)
    a_rows, a_cols = (K, M) if tA else (M, K)
    b_rows, b_cols = (N, K) if tB else (K, N)
    A = torch.rand(a_rows, a_cols + pad, generator=g) * 2 - 1
    B = torch.rand(b_rows, b_cols + pad, generator=g) * 2 - 1
    C = torch.rand(M, N + pad, generator=g) * 2 - 1 if c_fill is None else torch.full((M, N + pad), c_fill)
    C0 = C.clone()
    opA = (A[:, :a_cols].T if tA else A[:, :a_cols]).double()
    opB = (B[:, :b_cols].T if tB else B[:, :b_cols]).double()
    c_in = torch.zeros(M, N, dtype=torch.float64) if beta == 0 else C0[:, :N].double()
    want = alpha * (opA @ opB) + beta * c_in
    # |fl(x) - x| <= gamma_(K+2) (|alpha| |A||B| + |beta| |C|) whatever order the K terms are summed in
    bound = (K + 2) * 2.0 ** -23 * (abs(alpha) * (opA.abs() @ opB.abs()) + abs(beta) * c_in.abs()) + 1e-30
    _gemm()(int(tA), int(tB), M, N, K, alpha, _ptr(A), A.shape[1], _ptr(B), B.shape[1], beta, _ptr(C), C.shape[1])
    torch.testing.assert_close(C[:, N:], C0[:, N:], rtol=0, atol=0, equal_nan=True, msg="wrote past N columns")
    return C[:, :N].double(), want, bound


SHAPES = [(1, 1, 1), (5, 16, 8), (6, 16, 64), (7, 17, 9), (13, 15, 33), (32, 64, 64), (64, 64, 32), (32, 32, 64),
          (11, 40, 257), (70, 23, 300), (3, 8, 7)]


@needs_native
@pytest.mark.parametrize("tA", [False, True])
@pytest.mark.parametrize("tB", [False, True])
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_gemm_matches_a_float64_product(tA, tB, M, N, K):
    for alpha, beta, pad in ((1.0, 0.0, 0), (-1.0, 1.0, 3), (0.37, -2.5, 17)):
        got, want, bound = _product(tA, tB, M, N, K, alpha, beta, pad, seed=M * 1000 + N * 10 + K)
        err = (got - want).abs()
        worst = err.argmax()
        assert bool((err <= bound).all()), f"max error {err.max():.3g}, bound there {bound[worst // N, worst % N]:.3g}"


@needs_native
@pytest.mark.parametrize("K", [0, 5, 64])
def test_beta_zero_never_reads_c(K):
    """BLAS's rule, which the kernels rely on for fresh buffers: beta = 0 overwrites C, NaN included."""
    got, want, bound = _product(False, True, 9, 20, K, 1.0, 0.0, 2, c_fill=float("nan"))
    assert bool(torch.isfinite(got).all())
    assert bool(((got - want).abs() <= bound).all())


@needs_native
def test_sizes_past_the_loops_take_the_blas():
    got, want, bound = _product(True, False, 520, 33, 40, 1.0, 0.5, 1)
    assert bool(((got - want).abs() <= bound).all())


@needs_native
def test_avx2_builds_without_avx512_take_the_loop():
    features = cpu_vector_features().split()
    if (native.march() != "native" or native.gemm_choice() != "auto" or "avx512f" in features
            or not {"avx2", "fma"} <= set(features)):
        pytest.skip("the loop is built for -march=native on CPUs with AVX2 and FMA but not AVX-512")
    assert native.library().lt_debug_small_sgemm() == 1


def _tri():
    fn = native.library().lt_debug_tri_f32
    fn.restype = None
    fn.argtypes = [ctypes.c_int, I64, I64, F32, I64, F32, I64, ctypes.c_float, F32, I64]
    return fn


@needs_native
@pytest.mark.parametrize("cl", [1, 2, 5, 6, 7, 13, 16, 31, 32, 33, 64, 100])
@pytest.mark.parametrize("n", [1, 16, 24, 64])
def test_products_with_a_causal_matrix(cl, n):
    """The chunked kernels' in-chunk products, which skip the zero half of the causal matrix: against
    float64 products, within the rounding bound of any order. L has zeros above its diagonal (the
    kernels' contract); of tril_of_product only the lower triangle counts."""
    g = torch.Generator().manual_seed(cl * 100 + n)
    pad = 3
    L = torch.tril(torch.rand(cl, cl + pad, generator=g) * 2 - 1)
    L[:, cl:] = float("nan")  # the padding is never read
    B = torch.rand(cl, n + pad, generator=g) * 2 - 1
    C0 = torch.rand(cl, n + pad, generator=g) * 2 - 1
    eps = 2.0 ** -23
    for kind, beta in ((1, 0.0), (1, 0.5), (2, 0.0), (2, -1.0)):
        C = C0.clone()
        _tri()(kind, cl, n, _ptr(L), L.shape[1], _ptr(B), B.shape[1], beta, _ptr(C), C.shape[1])
        opL = L[:, :cl].double().nan_to_num() if kind == 1 else L[:, :cl].double().nan_to_num().T
        Bd, Cd = B[:, :n].double(), C0[:, :n].double()
        want = opL @ Bd + beta * Cd
        bound = (cl + 2) * eps * (opL.abs() @ Bd.abs() + abs(beta) * Cd.abs()) + 1e-30
        assert bool(((C[:, :n].double() - want).abs() <= bound).all()), (kind, beta)
        torch.testing.assert_close(C[:, n:], C0[:, n:], rtol=0, atol=0)
    # kind 0: L = lower(X Y^T), X, Y [cl, n]
    X, Y = B, torch.rand(cl, n + pad, generator=g) * 2 - 1
    out = torch.full((cl, cl + pad), 7.0)
    _tri()(0, cl, n, _ptr(X), X.shape[1], _ptr(Y), Y.shape[1], 0.0, _ptr(out), out.shape[1])
    Xd, Yd = X[:, :n].double(), Y[:, :n].double()
    want, bound = Xd @ Yd.T, (n + 2) * eps * (Xd.abs() @ Yd.abs().T) + 1e-30
    lower = torch.tril(torch.ones(cl, cl, dtype=torch.bool))
    assert bool(((out[:, :cl].double() - want).abs() <= bound)[lower].all())
    assert bool((out[:, cl:] == 7.0).all())
