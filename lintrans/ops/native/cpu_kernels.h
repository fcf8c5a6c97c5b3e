// What the kernels share: the conventions of their exported functions; for the BLAS-calling ones
// (chunked.cpp, sliding_window.cpp) torch's own BLAS (libtorch_cpu exports MKL's sgemm_/dgemm_), a
// row-major gemm over it, one BLAS thread per worker, and the split of (batch, head) pairs between
// the OpenMP threads.
//
// Conventions of every kernel file (a new one follows them; binding.py is the Python side):
// - its entry points take one argument struct, field for field a ctypes.Structure of the same name in
//   its binding module, and export that struct's size with LINTRANS_EXPORT_SIZEOF(Name), which
//   binding.call compares with ctypes.sizeof(Name) before the first call (a mismatch raises);
// - they are extern "C" functions returning int, a Status code: kOk, or kOutOfMemory when an
//   allocation failed (binding.call raises MemoryError), kFailed for any other C++ exception. No
//   exception may leave an OpenMP region (that is std::terminate): each region's body runs inside
//   Status::run, which catches, and the function returns the status after the region;
// - named lt_<kernel>_<pass>_f32 / _f64, one per dtype.
#pragma once

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "small_gemm.h"

#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif

#define LINTRANS_EXPORT_SIZEOF(S) \
  extern "C" int64_t lt_sizeof_##S() { return int64_t(sizeof(S)); }

extern "C" {
void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
            const int*, const float*, const int*, const float*, float*, const int*);
void dgemm_(const char*, const char*, const int*, const int*, const int*, const double*, const double*,
            const int*, const double*, const int*, const double*, double*, const int*);
// MKL (torch's BLAS on x86) threads a call made outside an active parallel region itself, which
// for matrices this small is ruinous: each worker asks for one thread (weak: other BLAS lack it)
int MKL_Set_Num_Threads_Local(int) __attribute__((weak));
}

namespace lintrans_cpu {

enum StatusCode : int { kOk = 0, kOutOfMemory = 1, kFailed = 2 };

// Test hook (lt_debug_fail_allocations in status.cpp): the next n region bodies throw std::bad_alloc
// as their first allocation would, so that tests reach the out-of-memory path
inline std::atomic<int>& failing_allocations() {
  static std::atomic<int> n{0};
  return n;
}

// The outcome of a kernel's parallel region(s): each thread's body runs inside run(), which turns an
// exception into a code instead of letting it reach the region's end (std::terminate).
struct Status {
  std::atomic<int> code{kOk};
  template <typename F>
  void run(F&& body) noexcept {
    try {
      std::atomic<int>& fail = failing_allocations();
      if (fail.load(std::memory_order_relaxed) > 0 && fail.fetch_sub(1) > 0) throw std::bad_alloc();
      body();
    } catch (const std::bad_alloc&) {
      set(kOutOfMemory);
    } catch (...) {
      set(kFailed);
    }
  }
  void set(int c) noexcept {
    int ok = kOk;
    code.compare_exchange_strong(ok, c);
  }
  int get() const noexcept { return code.load(); }
};

constexpr double kLog2e = 1.4426950408889634;

// Buffers on 64-byte boundaries: a vector loop over a buffer's rows then needs no scalar iterations to
// reach an aligned address (with a libm call in the loop, each would be a scalar call)
template <typename T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <typename U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, std::size_t) noexcept { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const Aligned64<U>&) const { return true; }
  template <typename U>
  bool operator!=(const Aligned64<U>&) const { return false; }
};
template <typename T>
using Buf = std::vector<T, Aligned64<T>>;

inline void blas_gemm(const char* ta, const char* tb, const int* m, const int* n, const int* k, const float* al,
                      const float* a, const int* lda, const float* b, const int* ldb, const float* be, float* c,
                      const int* ldc) {
  sgemm_(ta, tb, m, n, k, al, a, lda, b, ldb, be, c, ldc);
}
inline void blas_gemm(const char* ta, const char* tb, const int* m, const int* n, const int* k, const double* al,
                      const double* a, const int* lda, const double* b, const int* ldb, const double* be,
                      double* c, const int* ldc) {
  dgemm_(ta, tb, m, n, k, al, a, lda, b, ldb, be, c, ldc);
}

// Whether small_gemm.h's loop took this product (float, on AVX2 builds without AVX-512, the sizes it
// takes), skipping what `tri` says is zero or unwanted
template <typename T>
inline bool small_gemm(small_sgemm::Tri tri, bool tA, bool tB, int64_t M, int64_t N, int64_t K, T alpha,
                       const T* A, int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc) {
#ifdef LINTRANS_SMALL_SGEMM
  if constexpr (std::is_same_v<T, float>) {
    if (!small_sgemm::applies(M, N, K, tri)) return false;
    small_sgemm::gemm(tA, tB, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, tri);
    return true;
  }
#endif
  return false;
}

// Row-major C[M, N] = alpha op(A) op(B) + beta C, op(A) [M, K]: BLAS is column-major, so it computes C^T.
// Small float products on AVX2 builds without AVX-512 take small_gemm.h's loop instead.
// BLAS takes int sizes: one past INT_MAX would be rejected (BLAS prints an error and skips the product,
// leaving C unwritten), so it throws instead, which the kernel's Status turns into an error.
template <typename T>
void gemm(bool tA, bool tB, int64_t M, int64_t N, int64_t K, T alpha, const T* A, int64_t lda, const T* B,
          int64_t ldb, T beta, T* C, int64_t ldc) {
  if (small_gemm(small_sgemm::Tri::kNone, tA, tB, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)) return;
  if (std::max({M, N, K, lda, ldb, ldc}) > int64_t(INT_MAX)) throw std::length_error("BLAS size past INT_MAX");
  const int m = int(M), n = int(N), k = int(K), la = int(lda), lb = int(ldb), lc = int(ldc);
  const char a = tA ? 'T' : 'N', b = tB ? 'T' : 'N';
  blas_gemm(&b, &a, &n, &m, &k, &alpha, B, &lb, A, &la, &beta, C, &lc);
}

// The same with alpha = 1
template <typename T>
void gemm(bool tA, bool tB, int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb,
          T beta, T* C, int64_t ldc) {
  gemm<T>(tA, tB, M, N, K, T(1), A, lda, B, ldb, beta, C, ldc);
}

// sum_j a[j] b[j]. Written out for float with AVX2: GCC left some `omp simd` reductions of this form
// scalar where the loop around them was versioned (the gated copy of delta_rule.cpp's backward).
template <typename T>
inline T dot(const T* a, const T* b, int64_t n) {
  T s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < n; ++j) s += a[j] * b[j];
  return s;
}
#if defined(__AVX2__) && defined(__FMA__)
template <>
inline float dot<float>(const float* a, const float* b, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j + 8), _mm256_loadu_ps(b + j + 8), s1);
  }
  if (j + 8 <= n) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), s0);
    j += 8;
  }
  const __m256 s = _mm256_add_ps(s0, s1);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  float r = _mm_cvtss_f32(h);
  for (; j < n; ++j) r += a[j] * b[j];
  return r;
}
#endif

// dst[0:n] = src[0:n] for an output row the call writes once and does not read back: where dst
// is 64-byte aligned and n whole cache lines, by non-temporal stores, which skip reading each line
// of fresh output memory in before overwriting it (callers end their writes with store_fence())
template <typename T>
inline void store_row(T* dst, const T* src, int64_t n) {
#if defined(__AVX512F__) || defined(__AVX__)
  constexpr int64_t L = 64 / sizeof(T);
  if (reinterpret_cast<uintptr_t>(dst) % 64 == 0 && n % L == 0) {
    for (int64_t i = 0; i < n; i += L) {
#ifdef __AVX512F__
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), _mm512_loadu_si512(src + i));
#else  // a line as two 32-byte halves
      auto* d = reinterpret_cast<__m256i*>(dst + i);
      const auto* s = reinterpret_cast<const __m256i*>(src + i);
      _mm256_stream_si256(d, _mm256_loadu_si256(s));
      _mm256_stream_si256(d + 1, _mm256_loadu_si256(s + 1));
#endif
    }
    return;
  }
#endif
  std::memcpy(dst, src, n * sizeof(T));
}

inline void store_fence() {
#if defined(__AVX512F__) || defined(__AVX__)
  _mm_sfence();
#endif
}

// One BLAS thread for the calling thread while in scope
struct SequentialBlas {
  int before = 0;
  SequentialBlas() {
    if (MKL_Set_Num_Threads_Local) before = MKL_Set_Num_Threads_Local(1);
  }
  ~SequentialBlas() {
    if (MKL_Set_Num_Threads_Local) MKL_Set_Num_Threads_Local(before);
  }
};

// The calling thread's contiguous range of (batch, head) pairs: a chunk's rows of those heads lie
// side by side in [B, T, H, D], so a thread that walks all of its heads at each position reads
// memory in order (one head at a time would jump H * D elements per row).
// Threads for a one-token step over n (batch, head) pairs of per_pair state entries each: a decoding step of a
// small model is a few microseconds of work, so one thread unless the batch is large
inline int64_t step_threads(int64_t n, int64_t per_pair, int64_t threads) {
  return n * per_pair >= (int64_t(1) << 16) ? threads : 1;
}

// A one-token step's decay for (batch, head) pair bh: exp(ld), ld [B, H] (ld_batch) or [H]; 1 without one
template <typename T>
inline T step_decay(const void* ld, int64_t ld_batch, int64_t bh, int64_t H) {
  return ld ? T(std::exp(static_cast<const T*>(ld)[ld_batch ? bh : bh % H])) : T(1);
}

struct HeadRange {
  int64_t lo, hi;
  explicit HeadRange(int64_t BH) {
    const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
    lo = BH * t / n;
    hi = BH * (t + 1) / n;
  }
};

}  // namespace lintrans_cpu
