// The test hook of cpu_kernels.h's Status: the next n parallel-region bodies of any kernel fail as an
// allocation would (std::bad_alloc), so that tests can check the MemoryError path.
#include "chunk_common.h"
#include "cpu_kernels.h"

extern "C" void lt_debug_fail_allocations(int n) { lintrans_cpu::failing_allocations().store(n); }

// Test hooks of cpu_kernels.h's gemm: the float product every kernel calls (small_gemm.h's loop where
// this build has it, else the BLAS), on row-major arrays; and whether this build has the loop (last)
extern "C" void lt_debug_gemm_f32(int tA, int tB, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                                  int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  lintrans_cpu::gemm<float>(tA != 0, tB != 0, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
// ... and the chunked kernels' products with a causal [cl, cl] matrix (chunk_common.h), float: kind 0
// L = lower part of X Y^T (X = a, Y = b, L = c, K = n), 1 C = L B + beta C, 2 C = L^T B + beta C (L = a)
extern "C" void lt_debug_tri_f32(int kind, int64_t cl, int64_t n, const float* a, int64_t lda, const float* b,
                                 int64_t ldb, float beta, float* c, int64_t ldc) {
  using namespace lintrans_cpu;
  if (kind == 0) tril_of_product<float>(cl, n, a, lda, b, ldb, c, ldc);
  if (kind == 1) tril_times<float>(cl, n, a, lda, b, ldb, beta, c, ldc);
  if (kind == 2) tril_t_times<float>(cl, n, a, lda, b, ldb, beta, c, ldc);
}
extern "C" int lt_debug_small_sgemm() {
#ifdef LINTRANS_SMALL_SGEMM
  return 1;
#else
  return 0;
#endif
}
