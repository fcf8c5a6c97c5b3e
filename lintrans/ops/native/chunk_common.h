// What the chunked kernels (chunked.cpp, delta_rule.cpp) share: walking a head's rows with a steady
// prefetch, and products with a causal (lower triangular) [cl, cl] matrix.
#pragma once

#include <cstdint>

#include "cpu_kernels.h"

namespace lintrans_cpu {

// Rows of one head lie H * D apart in [B, T, H, D]. Each row walk asks for the row kAhead rows
// further on as it reads one, so that a steady few misses are in flight: asking for a whole chunk at
// once overflows the miss queue, and its lines, 4 KiB-aliased, evict each other from L1 before use.
constexpr int64_t kAhead = 32;

template <typename T>
inline void prefetch_row(const T* x, int64_t n) {
  for (int64_t i = 0; i < n * int64_t(sizeof(T)); i += 64) __builtin_prefetch(reinterpret_cast<const char*>(x) + i);
}

// The row a walk reads kAhead rows after row t0 + i of a chunk of cl rows (chunks of c rows, each read
// forward): t0 + i + kAhead going forward; in backward's reverse walk, past this chunk's end, r rows
// into the chunks before it. It may lie outside [0, T): callers skip it then.
inline int64_t row_ahead(int64_t t0, int64_t i, int64_t cl, int64_t c, bool reverse) {
  if (!reverse || i + kAhead < cl) return t0 + i + kAhead;
  const int64_t r = i + kAhead - cl;
  return t0 - c * (1 + r / c) + r % c;
}

// The in-chunk products with a causal [cl, cl] matrix L. Through the BLAS, in two row blocks split at
// h: the upper right block of L (rows < h, columns >= h) is zero, so the products skip it, a quarter
// of their work (BLAS at 32 rows runs nearly as fast per FLOP as at 64); chunks under 32 rows go
// whole. Through small_gemm.h's loop (float on AVX2 builds) each tile of rows skips its own zeros,
// nearly half the work.
inline int64_t split_of(int64_t cl) { return cl >= 32 ? cl / 2 : 0; }

// L [cl, cl] (row stride ldl) = lower part of X Y^T (X, Y [cl, K]); entries above the diagonal are
// left as they were or written (callers zero everything above the diagonal)
template <typename T>
void tril_of_product(int64_t cl, int64_t K, const T* X, int64_t ldx, const T* Y, int64_t ldy, T* L, int64_t ldl) {
  if (small_gemm<T>(small_sgemm::Tri::kLowerC, false, true, cl, cl, K, 1, X, ldx, Y, ldy, 0, L, ldl)) return;
  const int64_t h = split_of(cl);
  if (h) gemm<T>(false, true, h, h, K, X, ldx, Y, ldy, 0, L, ldl);
  gemm<T>(false, true, cl - h, cl, K, X + h * ldx, ldx, Y, ldy, 0, L + h * ldl, ldl);
}

// C [cl, N] = L B + beta C, L causal [cl, cl]
template <typename T>
void tril_times(int64_t cl, int64_t N, const T* L, int64_t ldl, const T* B, int64_t ldb, T beta, T* C, int64_t ldc) {
  if (small_gemm<T>(small_sgemm::Tri::kLowerA, false, false, cl, N, cl, 1, L, ldl, B, ldb, beta, C, ldc)) return;
  const int64_t h = split_of(cl);
  if (h) gemm<T>(false, false, h, N, h, L, ldl, B, ldb, beta, C, ldc);
  gemm<T>(false, false, cl - h, N, cl, L + h * ldl, ldl, B, ldb, beta, C + h * ldc, ldc);
}

// C [cl, N] = L^T B + beta C, L causal [cl, cl]: rows >= h of C take only L's rows >= h
template <typename T>
void tril_t_times(int64_t cl, int64_t N, const T* L, int64_t ldl, const T* B, int64_t ldb, T beta, T* C,
                  int64_t ldc) {
  if (small_gemm<T>(small_sgemm::Tri::kUpperA, true, false, cl, N, cl, 1, L, ldl, B, ldb, beta, C, ldc)) return;
  const int64_t h = split_of(cl);
  if (h) gemm<T>(true, false, h, N, cl, L, ldl, B, ldb, beta, C, ldc);
  gemm<T>(true, false, cl - h, N, cl - h, L + h * ldl + h, ldl, B + h * ldb, ldb, beta, C + h * ldc, ldc);
}

}  // namespace lintrans_cpu
