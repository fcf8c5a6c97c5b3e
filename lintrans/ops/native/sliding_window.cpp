// Causal sliding-window softmax attention, fused, for the CPU: the algebra of _SlidingWindowCausal in
// lintrans/ops/sliding_window.py (read that first), with the same thread layout as chunked.cpp.
//
// Query t sees the keys t - window + 1 .. t (and none before 0). Queries go in blocks of C rows; a
// block's band lies in the keys j0 .. t0 + cl - 1 (j0 = max(0, t0 - window + 1)), its key window,
// which the matmuls read in place from [B, T, H, D] (row stride H * D: no copies). Scores are base 2
// (exp2 is cheaper than exp); forward keeps the output and each row's logsumexp, backward recomputes
// the probabilities from them and adds each block's key and value gradients into dk and dv.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_kernels.h"
#include "simd_math.h"

// Field for field the ctypes.Structure in lintrans/ops/native/sliding_window.py (sizes compared at first use).
struct SlidingWindowArgs {
  const void *q, *k, *v;  // q, k [B, T, H, Dk], v [B, T, H, Dv] (strides sq, sk, sv; the last is 1)
  void *o, *lse;          // o [B, T, H, Dv] contiguous; lse [B, H, T] (base 2) contiguous
  const void* dout;       // backward: do [B, T, H, Dv] (strides sdo)
  void *dq, *dk, *dv;     // contiguous (blocks add into dk and dv, each row zeroed when first reached)
  int64_t B, T, H, Dk, Dv;
  int64_t sq[3], sk[3], sv[3], sdo[3];  // strides of the B, T, H dimensions
  int64_t block, window, threads;
  double scale;
};
LINTRANS_EXPORT_SIZEOF(SlidingWindowArgs)

namespace {

using namespace lintrans_cpu;
using namespace lintrans_simd;

// One block's view of one head: where its rows start, and the band of each row in its key window.
template <typename T>
struct Block {
  const SlidingWindowArgs& a;
  int64_t b, h, t0, cl, j0, L;
  Block(const SlidingWindowArgs& a, int64_t bh, int64_t t0)
      : a(a), b(bh / a.H), h(bh % a.H), t0(t0), cl(std::min(a.block, a.T - t0)),
        j0(window_start(a, t0, cl)), L(t0 + cl - j0) {}
  // the band's first key, moved back (where there are keys) to a window of whole 16s, which BLAS
  // packs faster than a ragged edge (the extra keys are outside every row's band)
  static int64_t window_start(const SlidingWindowArgs& a, int64_t t0, int64_t cl) {
    const int64_t L = t0 + cl - std::max<int64_t>(0, t0 - a.window + 1);
    return std::max<int64_t>(0, t0 + cl - (L + 15) / 16 * 16);
  }
  const T* q() const { return static_cast<const T*>(a.q) + b * a.sq[0] + h * a.sq[2] + t0 * a.sq[1]; }
  const T* k() const { return static_cast<const T*>(a.k) + b * a.sk[0] + h * a.sk[2] + j0 * a.sk[1]; }
  const T* v() const { return static_cast<const T*>(a.v) + b * a.sv[0] + h * a.sv[2] + j0 * a.sv[1]; }
  const T* dout() const { return static_cast<const T*>(a.dout) + b * a.sdo[0] + h * a.sdo[2] + t0 * a.sdo[1]; }
  int64_t row(int64_t t) const { return (b * a.T + t) * a.H + h; }  // index of (b, t, h) in [B, T, H]
  // row i's band in the window: columns lo(i) .. hi(i) inclusive
  int64_t lo(int64_t i) const { return std::max<int64_t>(0, t0 + i - a.window + 1 - j0); }
  int64_t hi(int64_t i) const { return t0 + i - j0; }
  // the band widened to whole vectors (of up to 16) within the window: the exp loops run over this
  // and mask, so that no column takes a scalar remainder (a libm call per element)
  int64_t lo16(int64_t i) const { return lo(i) / 16 * 16; }
  int64_t hi16(int64_t i) const { return std::min(L, (hi(i) + 16) / 16 * 16); }
  // base-2 scores S [cl, L] (row stride L) of the block against its window
  void scores(T* S) const {
    gemm<T>(false, true, cl, L, a.Dk, T(a.scale * kLog2e), q(), a.sq[1], k(), a.sk[1], 0, S, L);
  }
};

template <typename T>
int forward(const SlidingWindowArgs& a) {
  const int64_t C = a.block, Lmax = std::min((C + a.window - 1 + 15) / 16 * 16, a.T);
  Status status;
#pragma omp parallel num_threads(a.threads)
  status.run([&] {
    SequentialBlas one_thread;
    const HeadRange r(a.B * a.H);
    Buf<T> S(C * Lmax), inv(C);
    for (int64_t t0 = 0; t0 < a.T; t0 += C) {
      for (int64_t bh = r.lo; bh < r.hi; ++bh) {
        const Block<T> blk(a, bh, t0);
        const int64_t L = blk.L;
        blk.scores(S.data());
        T* lse = static_cast<T*>(a.lse) + bh * a.T + t0;
        for (int64_t i = 0; i < blk.cl; ++i) {
          T* s = &S[i * L];
          const int64_t lo = blk.lo(i), hi = blk.hi(i);
          T mx = s[lo];
#pragma omp simd reduction(max : mx)
          for (int64_t l = lo; l <= hi; ++l) mx = s[l] > mx ? s[l] : mx;
          T sum = 0;
          const int64_t a0 = blk.lo16(i), a1 = blk.hi16(i);
#pragma omp simd reduction(+ : sum)
          for (int64_t l = a0; l < a1; ++l) {
            const T e = vexp2(std::min(s[l] - mx, T(0)));
            const T p = l >= lo && l <= hi ? e : T(0);
            s[l] = p;
            sum += p;
          }
          for (int64_t l = 0; l < a0; ++l) s[l] = 0;
          for (int64_t l = a1; l < L; ++l) s[l] = 0;
          inv[i] = T(1) / sum;
          lse[i] = mx + std::log2(sum);
        }
        // O = P V with P unnormalized, then each row divided by its sum (D, not L, multiplies)
        T* o = static_cast<T*>(a.o) + blk.row(t0) * a.Dv;
        gemm<T>(false, false, blk.cl, a.Dv, L, 1, S.data(), L, blk.v(), a.sv[1], 0, o, a.H * a.Dv);
        for (int64_t i = 0; i < blk.cl; ++i) {
          T* oi = o + i * a.H * a.Dv;
#pragma omp simd
          for (int64_t e = 0; e < a.Dv; ++e) oi[e] *= inv[i];
        }
      }
    }
  });
  return status.get();
}

template <typename T>
int backward(const SlidingWindowArgs& a) {
  const int64_t C = a.block, Lmax = std::min((C + a.window - 1 + 15) / 16 * 16, a.T);
  const T scale = T(a.scale);
  Status status;
#pragma omp parallel num_threads(a.threads)
  status.run([&] {
    SequentialBlas one_thread;
    const HeadRange r(a.B * a.H);
    Buf<T> P(C * Lmax), dP(C * Lmax);
    for (int64_t t0 = 0; t0 < a.T; t0 += C) {
      for (int64_t bh = r.lo; bh < r.hi; ++bh) {
        const Block<T> blk(a, bh, t0);
        const int64_t L = blk.L, cl = blk.cl;
        blk.scores(P.data());
        gemm<T>(false, true, cl, L, a.Dv, 1, blk.dout(), a.sdo[1], blk.v(), a.sv[1], 0, dP.data(), L);
        const T* lse = static_cast<const T*>(a.lse) + bh * a.T + t0;
        for (int64_t i = 0; i < cl; ++i) {
          // the probabilities again, and dS = P (dP - rowsum(dO O)) in dP
          T* p = &P[i * L];
          T* ds = &dP[i * L];
          const T* g = blk.dout() + i * a.sdo[1];
          const T* o = static_cast<const T*>(a.o) + blk.row(t0 + i) * a.Dv;
          const T delta = dot(g, o, a.Dv);
          const int64_t lo = blk.lo(i), hi = blk.hi(i), a0 = blk.lo16(i), a1 = blk.hi16(i);
          const T m = lse[i];
          for (int64_t l = 0; l < a0; ++l) p[l] = ds[l] = 0;
#pragma omp simd
          for (int64_t l = a0; l < a1; ++l) {
            const T e = vexp2(std::min(p[l] - m, T(0)));
            const bool in = l >= lo && l <= hi;
            p[l] = in ? e : T(0);
            ds[l] = in ? e * (ds[l] - delta) : T(0);
          }
          for (int64_t l = a1; l < L; ++l) p[l] = ds[l] = 0;
        }
        const int64_t ldk = a.H * a.Dk, ldv = a.H * a.Dv;
        T* dq = static_cast<T*>(a.dq) + blk.row(t0) * a.Dk;
        T* dk = static_cast<T*>(a.dk) + blk.row(blk.j0) * a.Dk;
        T* dv = static_cast<T*>(a.dv) + blk.row(blk.j0) * a.Dv;
        // the block's own key rows enter a window here for the first time: zeroed here, in cache,
        // rather than all of dk and dv up front
        for (int64_t i = L - cl; i < L; ++i) {
          std::fill_n(dk + i * ldk, a.Dk, T(0));
          std::fill_n(dv + i * ldv, a.Dv, T(0));
        }
        gemm<T>(false, false, cl, a.Dk, L, scale, dP.data(), L, blk.k(), a.sk[1], 0, dq, ldk);
        gemm<T>(true, false, L, a.Dk, cl, scale, dP.data(), L, blk.q(), a.sq[1], 1, dk, ldk);
        gemm<T>(true, false, L, a.Dv, cl, 1, P.data(), L, blk.dout(), a.sdo[1], 1, dv, ldv);
      }
    }
  });
  return status.get();
}

}  // namespace

extern "C" {
int lt_sliding_window_forward_f32(const SlidingWindowArgs* a) { return forward<float>(*a); }
int lt_sliding_window_forward_f64(const SlidingWindowArgs* a) { return forward<double>(*a); }
int lt_sliding_window_backward_f32(const SlidingWindowArgs* a) { return backward<float>(*a); }
int lt_sliding_window_backward_f64(const SlidingWindowArgs* a) { return backward<double>(*a); }
}
