// A register-blocked single-precision product for the kernels' small matrices (a chunk by a head
// dimension), used instead of the BLAS where the build targets AVX2 + FMA without AVX-512. Why: on
// such CPUs torch's MKL runs these products at about 50 GFLOP/s a core, against about 80 for this
// loop (docs/native-kernels.md has the measurement); with AVX-512 MKL's own kernels are faster, so
// those builds keep the BLAS. Row-major C[M, N] = alpha op(A) op(B) + beta C, BLAS's semantics
// (beta = 0 never reads C). Tiles of 6 rows by 16 columns: 12 accumulators, two loads of op(B) and
// six broadcasts of op(A) per step of k. op(B) is read in place where its rows are contiguous, close
// together and the tile is whole, and otherwise copied (transposed, zero-padded) into a panel on the
// stack.
#pragma once

#include <algorithm>
#include <cstdint>

namespace lintrans_cpu {
namespace small_sgemm {
// What a product may skip because an operand, or the part of C wanted, is triangular (the chunked
// kernels' in-chunk products, chunk_common.h): kLowerA, op(A) lower triangular (row i needs k <= i);
// kUpperA, op(A) upper (row i needs k >= i); kLowerC, only C's lower triangle wanted (row i needs
// columns <= i). Row tiles take the k range their rows need, so entries a tile reads past its rows'
// diagonals must be zero; with kLowerC a tile that meets the diagonal also writes entries above it.
enum class Tri { kNone, kLowerA, kUpperA, kLowerC };
}  // namespace small_sgemm
}  // namespace lintrans_cpu

// LINTRANS_BLAS_ONLY: the build asked for the BLAS everywhere (LINTRANS_NATIVE_GEMM=blas)
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__) && !defined(LINTRANS_BLAS_ONLY)
#define LINTRANS_SMALL_SGEMM 1
#include <immintrin.h>

namespace lintrans_cpu {
namespace small_sgemm {

constexpr int64_t kMR = 6, kNR = 16, kKC = 256;
constexpr int64_t kMaxSize = 512;

// op(B) rows further apart than this are copied into the panel rather than read in place: rows 16 KiB
// apart ([B, T, H, D] views) share a few L1 sets, and each row tile would fetch them again from L2
constexpr int64_t kMaxInPlaceStride = 256;

// Products with every size up to kMaxSize take this path (past it the BLAS's cache blocking pays),
// but not those narrower than a tile can fill: under 4 rows a tile has too few accumulators to hide
// the FMA's latency, and under 8 columns most of a 16-column tile is padding. A triangular shape also
// needs K <= kKC: its k ranges are taken within one block of k.
inline bool applies(int64_t M, int64_t N, int64_t K, Tri tri) {
  return std::max({M, N, K}) <= kMaxSize && M >= 4 && N >= 8 && (tri == Tri::kNone || K <= kKC);
}

// R rows of op(A) (element (i, p) at a[i * ars + p * acs]) times a kc x 16 panel of op(B) (row p at
// b + p * ldb), into out: alpha * acc + beta * out, all 16 columns (whole) or the first n (edge)
template <int R>
inline void tile(int64_t kc, const float* a, int64_t ars, int64_t acs, const float* b, int64_t ldb, float alpha,
                 float beta, float* out, int64_t ldo, int64_t n) {
  __m256 c0[R], c1[R];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) c0[i] = c1[i] = _mm256_setzero_ps();
  for (int64_t p = 0; p < kc; ++p) {
    const __m256 b0 = _mm256_loadu_ps(b + p * ldb), b1 = _mm256_loadu_ps(b + p * ldb + 8);
    const float* ap = a + p * acs;
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m256 x = _mm256_broadcast_ss(ap + i * ars);
      c0[i] = _mm256_fmadd_ps(x, b0, c0[i]);
      c1[i] = _mm256_fmadd_ps(x, b1, c1[i]);
    }
  }
  const __m256 va = _mm256_set1_ps(alpha), vb = _mm256_set1_ps(beta);
  // every loop over the rows unrolled: a loop that indexes the accumulators keeps them in memory
  if (n == kNR) {
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      float* o = out + i * ldo;
      __m256 r0 = _mm256_mul_ps(va, c0[i]), r1 = _mm256_mul_ps(va, c1[i]);
      if (beta != 0.0f) {
        r0 = _mm256_fmadd_ps(vb, _mm256_loadu_ps(o), r0);
        r1 = _mm256_fmadd_ps(vb, _mm256_loadu_ps(o + 8), r1);
      }
      _mm256_storeu_ps(o, r0);
      _mm256_storeu_ps(o + 8, r1);
    }
    return;
  }
  alignas(32) float t[kNR];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    _mm256_store_ps(t, _mm256_mul_ps(va, c0[i]));
    _mm256_store_ps(t + 8, _mm256_mul_ps(va, c1[i]));
    float* o = out + i * ldo;
    for (int64_t j = 0; j < n; ++j) o[j] = beta != 0.0f ? t[j] + beta * o[j] : t[j];
  }
}

template <int R>
inline void tile_of(Tri tri, int64_t i, int64_t kc, const float* a, int64_t ars, int64_t acs, const float* b,
                    int64_t ldb, float alpha, float beta, float* C, int64_t ldc, int64_t n) {
  const int64_t k0 = tri == Tri::kUpperA ? std::min(i, kc) : 0, k1 = tri == Tri::kLowerA ? std::min(i + R, kc) : kc;
  tile<R>(k1 - k0, a + i * ars + k0 * acs, ars, acs, b + k0 * ldb, ldb, alpha, beta, C + i * ldc, ldc, n);
}

// C's rows from i0 (a multiple of kMR) on, in tiles of kMR rows and one of the rest
inline void rows(Tri tri, int64_t i0, int64_t m, int64_t kc, const float* a, int64_t ars, int64_t acs,
                 const float* b, int64_t ldb, float alpha, float beta, float* C, int64_t ldc, int64_t n) {
  int64_t i = i0;
  for (; i + kMR <= m; i += kMR) tile_of<6>(tri, i, kc, a, ars, acs, b, ldb, alpha, beta, C, ldc, n);
  switch (m - i) {
    case 5: tile_of<5>(tri, i, kc, a, ars, acs, b, ldb, alpha, beta, C, ldc, n); break;
    case 4: tile_of<4>(tri, i, kc, a, ars, acs, b, ldb, alpha, beta, C, ldc, n); break;
    case 3: tile_of<3>(tri, i, kc, a, ars, acs, b, ldb, alpha, beta, C, ldc, n); break;
    case 2: tile_of<2>(tri, i, kc, a, ars, acs, b, ldb, alpha, beta, C, ldc, n); break;
    case 1: tile_of<1>(tri, i, kc, a, ars, acs, b, ldb, alpha, beta, C, ldc, n); break;
    default: break;
  }
}

// dst[q, 0:8] = src[0:8, q] for q < 8 (rows of src ls apart, of dst ld apart)
inline void transpose8(const float* src, int64_t ls, float* dst, int64_t ld) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * ls);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * ld, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * ld, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}

// panel[q, c] = op(B)[p + q, j + c] for q < kc and c < n, zero for c >= n (n <= 16)
inline void pack(bool tB, const float* B, int64_t ldb, int64_t p, int64_t j, int64_t kc, int64_t n, float* panel) {
  if (!tB) {
    for (int64_t q = 0; q < kc; ++q) {
      const float* src = B + (p + q) * ldb + j;
      float* dst = panel + q * kNR;
      if (n == kNR) {
        _mm256_storeu_ps(dst, _mm256_loadu_ps(src));
        _mm256_storeu_ps(dst + 8, _mm256_loadu_ps(src + 8));
      } else {
        for (int64_t c = 0; c < kNR; ++c) dst[c] = c < n ? src[c] : 0.0f;
      }
    }
    return;
  }
  // op(B)[p + q, j + c] = B[j + c, p + q]: rows of B become columns of the panel, 8 by 8 where whole
  const float* src = B + j * ldb + p;
  int64_t c = 0;
  const int64_t k8 = kc - kc % 8;
  for (; c + 8 <= n; c += 8) {
    for (int64_t q = 0; q < k8; q += 8) transpose8(src + c * ldb + q, ldb, panel + q * kNR + c, kNR);
    for (int64_t i = 0; i < 8; ++i)
      for (int64_t q = k8; q < kc; ++q) panel[q * kNR + c + i] = src[(c + i) * ldb + q];
  }
  for (int64_t q = 0; q < kc; ++q)
    for (int64_t i = c; i < kNR; ++i) panel[q * kNR + i] = i < n ? src[i * ldb + q] : 0.0f;
}

// Row-major C[M, N] = alpha op(A) op(B) + beta C, for the sizes applies() takes
inline void gemm(bool tA, bool tB, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                 const float* B, int64_t ldb, float beta, float* C, int64_t ldc, Tri tri = Tri::kNone) {
  if (M <= 0 || N <= 0) return;
  const int64_t ars = tA ? 1 : lda, acs = tA ? lda : 1;
  alignas(32) float panel[kKC * kNR];
  for (int64_t j = 0; j < N; j += kNR) {
    const int64_t n = std::min(kNR, N - j);
    // with kLowerC the rows above the panel's first column are not wanted: from the tile holding it
    const int64_t i0 = tri == Tri::kLowerC ? std::min(j, M) / kMR * kMR : 0;
    // k in blocks of at most kKC (the panel's rows); the first block applies beta, the rest add
    for (int64_t p = 0, first = 1; p < K || first; p += kKC, first = 0) {
      const int64_t kc = std::min(kKC, K - p);
      const float bet = first ? beta : 1.0f;
      const float* b;
      int64_t ldp;
      if (!tB && n == kNR && ldb <= kMaxInPlaceStride) {
        b = B + p * ldb + j;
        ldp = ldb;
      } else {
        pack(tB, B, ldb, p, j, kc, n, panel);
        b = panel;
        ldp = kNR;
      }
      rows(tri, i0, M, kc, A + p * acs, ars, acs, b, ldp, alpha, bet, C + j, ldc, n);
    }
  }
}

}  // namespace small_sgemm
}  // namespace lintrans_cpu
#endif
