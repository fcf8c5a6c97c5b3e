// The test hook of cpu_kernels.h's Status: the next n parallel-region bodies of any kernel fail as an
// allocation would (std::bad_alloc), so that tests can check the MemoryError path.
#include "cpu_kernels.h"

extern "C" void lt_debug_fail_allocations(int n) { lintrans_cpu::failing_allocations().store(n); }

// Test hooks of cpu_kernels.h's gemm: the float product every kernel calls (small_gemm.h's loop where
// this build has it, else the BLAS), on row-major arrays, and which of the two small products take
extern "C" void lt_debug_gemm_f32(int tA, int tB, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                                  int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  lintrans_cpu::gemm<float>(tA != 0, tB != 0, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
extern "C" int lt_debug_small_sgemm() {
#ifdef LINTRANS_SMALL_SGEMM
  return 1;
#else
  return 0;
#endif
}
