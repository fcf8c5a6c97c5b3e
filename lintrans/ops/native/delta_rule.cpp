// The chunked delta rule, fused, for the CPU: the algebra of _Chunked in lintrans/ops/delta/chunked.py
// (read that first: names and steps match). Each OpenMP thread takes a contiguous range of (batch,
// head) pairs and walks each one's chunks in order; every temporary is a chunk's worth and the
// products are direct BLAS calls.
//
// Per chunk of cl tokens (rows gathered into contiguous buffers), with S the state entering it,
// b the in-chunk cumulative log-decays (double), E_ij = exp(b_i - b_j) (j <= i), Gam_i = exp(b_i),
// kap_j = exp(b_last - b_j), gam = exp(b_last):
//   A = strict_lower(beta_i (k_i . k_j) E_ij),  Ti = (I + A)^-1
//   U = Ti (beta (v - Gam k S))   (= U~ - W S of the WY form, without forming W or U~)
//   o = (lower(q k^T) * E) U + (Gam q) S;  S <- gam S + (kap k)^T U
// Forward saves the state entering every chunk and U (a head's rows contiguous, read in place by
// backward, which also reads do in place); backward walks the chunks in reverse,
// recomputing each chunk's Ti, and carries dS, the gradient reaching the state after the chunk. With
// dRu = Ti^T dU its products shrink: W's gradient path is -(beta Gam k)^T dRu into dS, -dRu S^T into k,
// and dA = -strict_lower(dRu U^T).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"
#include "simd_math.h"
#include "chunk_common.h"

// Field for field the ctypes.Structure DeltaArgs in lintrans/ops/native/delta_rule.py.
struct DeltaArgs {
  const void *q, *k, *v, *beta, *ld, *S0;  // q, k [B, T, H, Dk]; v [B, T, H, Dv]; beta, ld [B|1, T, H]; S0 [B, H, Dk, Dv]
  void *o, *u, *states, *S_end;            // o [B, T, H, Dv]; u (U's rows) [B, H, T, Dv]; states [B, H, nck, Dk, Dv]
  const void *dout, *dS_end;               // backward: do [B, T, H, Dv] (strides sdo), dS_end [B, H, Dk, Dv]
  void *dq, *dk, *dv, *dbeta, *dld, *dS0;  // dq, dk [B, T, H, Dk], dv [B, T, H, Dv], dbeta, dld [B, T, H]
  int64_t B, T, H, Dk, Dv;
  int64_t sq[3], sk[3], sv[3], sbeta[3], sld[3], sdo[3];  // strides of B, T, H (the last dimension's is 1)
  int64_t chunk, l2, threads;  // l2: q and k are L2-normalised here (x / sqrt(x.x + 1e-6))
  double scale;                 // q's scale, after the normalisation
};
LINTRANS_EXPORT_SIZEOF(DeltaArgs)

// Field for field DeltaStepArgs in lintrans/ops/native/delta_rule.py: one decoding step, every tensor contiguous.
struct DeltaStepArgs {
  const void *q, *k, *v, *beta, *ld, *S;  // q, k [B, H, Dk]; v [B, H, Dv]; beta [B, H]; ld [B, H], [H] or null; S [B, H, Dk, Dv]
  void *o, *S_out;                        // o [B, H, Dv]; the new S
  int64_t B, H, Dk, Dv, ld_batch, l2, threads;  // ld_batch: ld is [B, H] (else [H])
  double scale;
};
LINTRANS_EXPORT_SIZEOF(DeltaStepArgs)

namespace {

using namespace lintrans_cpu;
using namespace lintrans_simd;

// Ti [cl, cl] (row stride c) = (I + A)^-1 for A strictly lower (row stride c), by forward substitution:
// row i of the inverse is e_i - sum_{j<i} A_ij (row j), and row j is zero right of column j. One inverse
// then serves forward's solve and backward's transposed solve as plain products, which BLAS runs
// faster than its triangular solves at this size.
#if defined(__AVX2__) && defined(__FMA__)
// The same for float with rows of W vectors (8 W >= cl, within the row stride c): each row a sum over
// the rows before it at full width (their entries right of the diagonal are zero), split in two
// chains where registers allow, so that a row waits on half as many dependent FMAs
template <int W>
void unit_lower_inverse_rows(int64_t cl, int64_t c, const float* A, float* Ti) {
  constexpr int kChains = W <= 4 ? 2 : 1;
  for (int64_t i = 0; i < cl; ++i) {
    __m256 s[kChains][W];
#pragma GCC unroll 2
    for (int h = 0; h < kChains; ++h)
#pragma GCC unroll 8
      for (int w = 0; w < W; ++w) s[h][w] = _mm256_setzero_ps();
    const float* ai = A + i * c;
    int64_t j = 0;
    for (; j + kChains <= i; j += kChains) {
#pragma GCC unroll 2
      for (int h = 0; h < kChains; ++h) {
        const __m256 x = _mm256_set1_ps(ai[j + h]);
        const float* tj = Ti + (j + h) * c;
#pragma GCC unroll 8
        for (int w = 0; w < W; ++w) s[h][w] = _mm256_fnmadd_ps(x, _mm256_loadu_ps(tj + 8 * w), s[h][w]);
      }
    }
    if (j < i) {
      const __m256 x = _mm256_set1_ps(ai[j]);
#pragma GCC unroll 8
      for (int w = 0; w < W; ++w) s[0][w] = _mm256_fnmadd_ps(x, _mm256_loadu_ps(Ti + j * c + 8 * w), s[0][w]);
    }
    float* ti = Ti + i * c;
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w)
      _mm256_storeu_ps(ti + 8 * w, kChains == 2 ? _mm256_add_ps(s[0][w], s[kChains - 1][w]) : s[0][w]);
    ti[i] = 1.0f;
  }
}
#endif

template <typename T>
void unit_lower_inverse(int64_t cl, int64_t c, const T* A, T* Ti) {
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float>) {
    const int64_t w = (cl + 7) / 8;
    if (8 * w <= c) {
      switch (w) {
        case 1: return unit_lower_inverse_rows<1>(cl, c, A, Ti);
        case 2: return unit_lower_inverse_rows<2>(cl, c, A, Ti);
        case 3: return unit_lower_inverse_rows<3>(cl, c, A, Ti);
        case 4: return unit_lower_inverse_rows<4>(cl, c, A, Ti);
        case 8: return unit_lower_inverse_rows<8>(cl, c, A, Ti);
        default: break;
      }
    }
  }
#endif
  for (int64_t i = 0; i < cl; ++i) {
    T* __restrict ti = Ti + i * c;
    std::fill(ti, ti + cl, T(0));
    ti[i] = T(1);
    for (int64_t j = 0; j < i; ++j) {
      const T aij = A[i * c + j];
      const T* __restrict tj = Ti + j * c;
#pragma omp simd
      for (int64_t l = 0; l <= j; ++l) ti[l] -= aij * tj[l];
    }
  }
}

template <typename T>
struct Work {
  int64_t c, Dk, Dv;
  std::vector<T> q, k, v, beta, Gam, kap, E, A, Ti, Kk, P, R, kh, qG, KS;
  std::vector<T> rq, rk;  // each row's 1 / sqrt(x.x + 1e-6) with l2 (backward maps gradients through it)
  std::vector<double> b;
  // backward
  std::vector<T> dU, dRu, dRw, dP, dq, dk, dv, dbeta, dqi, dkh, bgk, db;
  Work(int64_t c, int64_t Dk, int64_t Dv, bool backward)
      : c(c), Dk(Dk), Dv(Dv), q(c * Dk), k(c * Dk), v(c * Dv), beta(c), Gam(c), kap(c), E(c * c), A(c * c),
        Ti(c * c), Kk(c * c), P(c * c), R(c * Dv), kh(c * Dk), qG(c * Dk), KS(c * Dv), rq(c), rk(c),
        b(c) {
    if (!backward) return;
    for (auto* x : {&dU, &dRu, &dv}) x->resize(c * Dv);
    for (auto* x : {&dRw, &dq, &dk, &dqi, &dkh, &bgk}) x->resize(c * Dk);
    dP.resize(c * c);
    dbeta.resize(c);
    db.resize(c);
  }
};

template <typename T>
inline const T* row(const void* base, const int64_t* s, int64_t b, int64_t t, int64_t h) {
  return static_cast<const T*>(base) + b * s[0] + t * s[1] + h * s[2];
}

// y = s x / sqrt(x.x + 1e-6) with l2 (r = the 1 / sqrt), else y = s x
template <typename T>
inline void load_row(const T* x, T* y, int64_t n, int64_t l2, T s, T& r) {
  if (l2) {
    r = T(1) / std::sqrt(dot(x, x, n) + T(1e-6));
  } else {
    r = T(1);
  }
  const T m = s * r;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) y[j] = m * x[j];
}

// dx from dy for y = s x r (load_row): with l2, s r (dy - u (u . dy)), u = x r; else s dy
template <typename T>
inline void unload_grad(const T* x, const T* dy, T* dx, int64_t n, int64_t l2, T s, T r) {
  if (!l2) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) dx[j] = s * dy[j];
    return;
  }
  const T d = dot(x, dy, n);
  const T sr = s * r, c = sr * r * r * d;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) dx[j] = sr * dy[j] - c * x[j];
}

// Gather the chunk's rows and build everything of it that does not depend on the state:
// b, E, Gam, kap, Kk, A, Ti, kh = kap k, qG = Gam q, P = lower(q k^T) E. reverse: backward's walk,
// which takes the chunk before this one next (and reads do's rows too).
template <typename T>
void prepare_chunk(const DeltaArgs& a, Work<T>& w, int64_t bi, int64_t h, int64_t t0, int64_t cl, bool gated,
                   bool reverse) {
  const int64_t Dk = a.Dk, Dv = a.Dv, c = w.c;
  const T scale = T(a.scale);
  for (int64_t i = 0; i < cl; ++i) {
    // rows of a head lie H * D apart: ask for the row read kAhead rows after this one
    const int64_t tn = row_ahead(t0, i, cl, c, reverse);
    if (tn >= 0 && tn < a.T) {
      prefetch_row(row<T>(a.q, a.sq, bi, tn, h), Dk);
      prefetch_row(row<T>(a.k, a.sk, bi, tn, h), Dk);
      prefetch_row(row<T>(a.v, a.sv, bi, tn, h), Dv);
      if (reverse) prefetch_row(row<T>(a.dout, a.sdo, bi, tn, h), Dv);
    }
    load_row(row<T>(a.q, a.sq, bi, t0 + i, h), &w.q[i * Dk], Dk, a.l2, scale, w.rq[i]);
    load_row(row<T>(a.k, a.sk, bi, t0 + i, h), &w.k[i * Dk], Dk, a.l2, T(1), w.rk[i]);
    std::memcpy(&w.v[i * Dv], row<T>(a.v, a.sv, bi, t0 + i, h), Dv * sizeof(T));
    w.beta[i] = *row<T>(a.beta, a.sbeta, bi, t0 + i, h);
  }
  if (gated) {
    double acc = 0;
    for (int64_t i = 0; i < cl; ++i) w.b[i] = acc += double(*row<T>(a.ld, a.sld, bi, t0 + i, h));
    const double last = w.b[cl - 1];
    for (int64_t i = 0; i < cl; ++i) {
      w.Gam[i] = T(std::exp(w.b[i]));
      w.kap[i] = T(std::exp(last - w.b[i]));
      const double bi_ = w.b[i];
      T* Ei = &w.E[i * c];
#pragma omp simd
      for (int64_t j = 0; j <= i; ++j) Ei[j] = T(bi_ - w.b[j]);  // <= 0: differences in double
#pragma omp simd
      for (int64_t j = 0; j <= i; ++j) Ei[j] = vexp(Ei[j]);
    }
  }
  // Kk = k k^T (lower part), A = strict_lower(beta_i Kk E), Ti = (I + A)^-1
  tril_of_product<T>(cl, Dk, w.k.data(), Dk, w.k.data(), Dk, w.Kk.data(), c);
  for (int64_t i = 0; i < cl; ++i) {
    const T bi_ = w.beta[i];
    T* Ai = &w.A[i * c];
    const T* Ki = &w.Kk[i * c];
    if (gated) {
      const T* Ei = &w.E[i * c];
#pragma omp simd
      for (int64_t j = 0; j < i; ++j) Ai[j] = bi_ * Ki[j] * Ei[j];
    } else {
#pragma omp simd
      for (int64_t j = 0; j < i; ++j) Ai[j] = bi_ * Ki[j];
    }
  }
  unit_lower_inverse<T>(cl, c, w.A.data(), w.Ti.data());
  for (int64_t i = 0; i < cl; ++i) {
    const T ka = gated ? w.kap[i] : T(1), ga = gated ? w.Gam[i] : T(1);
#pragma omp simd
    for (int64_t j = 0; j < Dk; ++j) {
      w.kh[i * Dk + j] = ka * w.k[i * Dk + j];
      w.qG[i * Dk + j] = ga * w.q[i * Dk + j];
    }
  }
  tril_of_product<T>(cl, Dk, w.q.data(), Dk, w.k.data(), Dk, w.P.data(), c);
  for (int64_t i = 0; i < cl; ++i) {
    T* Pi = &w.P[i * c];
    if (gated) {
      const T* Ei = &w.E[i * c];
#pragma omp simd
      for (int64_t j = 0; j <= i; ++j) Pi[j] *= Ei[j];
    }
    std::fill(Pi + i + 1, Pi + cl, T(0));
  }
}

// U [cl, Dv] = Ti (beta (v - Gam k S)): the values the chunk writes, given the state S entering it
template <typename T>
void values_written(Work<T>& w, int64_t cl, const T* S, T* U, bool gated) {
  const int64_t Dk = w.Dk, Dv = w.Dv;
  gemm<T>(false, false, cl, Dv, Dk, w.k.data(), Dk, S, Dv, 0, w.KS.data(), Dv);
  for (int64_t i = 0; i < cl; ++i) {
    const T bv = w.beta[i], bg = -bv * (gated ? w.Gam[i] : T(1));
    T* Ri = &w.R[i * Dv];
    const T *vi = &w.v[i * Dv], *ks = &w.KS[i * Dv];
#pragma omp simd
    for (int64_t j = 0; j < Dv; ++j) Ri[j] = bv * vi[j] + bg * ks[j];
  }
  tril_times<T>(cl, Dv, w.Ti.data(), w.c, w.R.data(), Dv, 0, U, Dv);
}

// S <- gam S + kh^T U
template <typename T>
void advance(Work<T>& w, int64_t cl, const T* U, T* S, bool gated) {
  const int64_t Dk = w.Dk, Dv = w.Dv;
  if (gated) {
    const T gam = T(std::exp(w.b[cl - 1]));
#pragma omp simd
    for (int64_t j = 0; j < Dk * Dv; ++j) S[j] *= gam;
  }
  gemm<T>(true, false, Dk, Dv, cl, w.kh.data(), Dk, U, Dv, 1, S, Dv);
}

template <typename T>
int forward(const DeltaArgs& a) {
  const int64_t Dk = a.Dk, Dv = a.Dv, KV = Dk * Dv, c = a.chunk, nck = (a.T + c - 1) / c;
  const bool gated = a.ld != nullptr;
  Status status;
#pragma omp parallel num_threads(a.threads)
  status.run([&] {
    SequentialBlas one_thread;
    const HeadRange r(a.B * a.H);
    Work<T> w(c, Dk, Dv, false);
    std::vector<T> S(KV);
    const int64_t ldo = a.H * Dv;  // o's rows of one head, written in place
    for (int64_t bh = r.lo; bh < r.hi; ++bh) {
      const int64_t bi = bh / a.H, h = bh % a.H;
      std::memcpy(S.data(), static_cast<const T*>(a.S0) + bh * KV, KV * sizeof(T));
      for (int64_t m = 0; m < nck; ++m) {
        const int64_t t0 = m * c, cl = std::min(c, a.T - t0);
        std::memcpy(static_cast<T*>(a.states) + (bh * nck + m) * KV, S.data(), KV * sizeof(T));
        prepare_chunk(a, w, bi, h, t0, cl, gated, false);
        T* U = static_cast<T*>(a.u) + (bh * a.T + t0) * Dv;  // kept for backward, a head's rows contiguous
        values_written(w, cl, S.data(), U, gated);
        // o = P U + qG S
        T* o = static_cast<T*>(a.o) + ((bi * a.T + t0) * a.H + h) * Dv;
        tril_times<T>(cl, Dv, w.P.data(), c, U, Dv, 0, o, ldo);
        gemm<T>(false, false, cl, Dv, Dk, w.qG.data(), Dk, S.data(), Dv, 1, o, ldo);
        advance(w, cl, U, S.data(), gated);
      }
      std::memcpy(static_cast<T*>(a.S_end) + bh * KV, S.data(), KV * sizeof(T));
    }
  });
  return status.get();
}

template <typename T>
int backward(const DeltaArgs& a) {
  const int64_t Dk = a.Dk, Dv = a.Dv, KV = Dk * Dv, c = a.chunk, nck = (a.T + c - 1) / c;
  const bool gated = a.ld != nullptr;
  Status status;
#pragma omp parallel num_threads(a.threads)
  status.run([&] {
    SequentialBlas one_thread;
    const HeadRange r(a.B * a.H);
    Work<T> w(c, Dk, Dv, true);
    std::vector<T> dS(KV);
    for (int64_t bh = r.lo; bh < r.hi; ++bh) {
      const int64_t bi = bh / a.H, h = bh % a.H;
      std::memcpy(dS.data(), static_cast<const T*>(a.dS_end) + bh * KV, KV * sizeof(T));
      for (int64_t m = nck - 1; m >= 0; --m) {
        const int64_t t0 = m * c, cl = std::min(c, a.T - t0);
        const T* S = static_cast<const T*>(a.states) + (bh * nck + m) * KV;
        prepare_chunk(a, w, bi, h, t0, cl, gated, true);
        const int64_t first = (bi * a.T + t0) * a.H + h;
        // forward's U and the incoming do, read in place (BLAS packs them): U's rows are contiguous, do's
        // rows of one head lie sdo[1] apart
        const T* U = static_cast<const T*>(a.u) + (bh * a.T + t0) * Dv;
        const T* dO = row<T>(a.dout, a.sdo, bi, t0, h);
        const int64_t ldo = a.sdo[1];
        const T gam = gated ? T(std::exp(w.b[cl - 1])) : T(1);
        // dU = P^T dO + kh dS;  dRu = Ti^T dU
        tril_t_times<T>(cl, Dv, w.P.data(), c, dO, ldo, 0, w.dU.data(), Dv);
        gemm<T>(false, false, cl, Dv, Dk, w.kh.data(), Dk, dS.data(), Dv, 1, w.dU.data(), Dv);
        tril_t_times<T>(cl, Dv, w.Ti.data(), c, w.dU.data(), Dv, 0, w.dRu.data(), Dv);
        // what needs dS after the chunk, before it is updated in place: dkh = U dS^T (the state's
        // update) and S . dS (gam's share of b)
        gemm<T>(false, true, cl, Dk, Dv, U, Dv, dS.data(), Dv, 0, w.dkh.data(), Dk);
        const T sd = gated ? dot(S, dS.data(), KV) : T(0);
        // dS before the chunk = gam dS + qG^T dO - (beta Gam k)^T dRu
        for (int64_t i = 0; i < cl; ++i) {
          const T bg = w.beta[i] * (gated ? w.Gam[i] : T(1));
#pragma omp simd
          for (int64_t j = 0; j < Dk; ++j) w.bgk[i * Dk + j] = bg * w.k[i * Dk + j];
        }
        gemm<T>(true, false, Dk, Dv, cl, w.qG.data(), Dk, dO, ldo, gam, dS.data(), Dv);
        gemm<T>(true, false, Dk, Dv, cl, T(-1), w.bgk.data(), Dk, w.dRu.data(), Dv, 1, dS.data(), Dv);
        // dP = lower(dO U^T), and b's share through P; then dQK = dP E
        tril_of_product<T>(cl, Dv, dO, ldo, U, Dv, w.dP.data(), c);
        std::fill(w.db.begin(), w.db.begin() + cl, T(0));
        for (int64_t i = 0; i < cl; ++i) {
          T* dPi = &w.dP[i * c];
          std::fill(dPi + i + 1, dPi + cl, T(0));
          if (gated) {
            const T *Ei = &w.E[i * c], *Pi = &w.P[i * c];
            T zs = 0;
            for (int64_t j = 0; j <= i; ++j) {  // Z = dP * P: d/d(b_i - b_j)
              const T z = dPi[j] * Pi[j];
              zs += z;
              w.db[j] -= z;
              dPi[j] *= Ei[j];
            }
            w.db[i] += zs;
          }
        }
        // dqi = dO S^T (the gradient of qG), dRw = -dRu S^T (of beta Gam k through W)
        gemm<T>(false, true, cl, Dk, Dv, dO, ldo, S, Dv, 0, w.dqi.data(), Dk);
        gemm<T>(false, true, cl, Dk, Dv, T(-1), w.dRu.data(), Dv, S, Dv, 0, w.dRw.data(), Dk);
        tril_times<T>(cl, Dk, w.dP.data(), c, w.k.data(), Dk, 0, w.dq.data(), Dk);
        tril_t_times<T>(cl, Dk, w.dP.data(), c, w.q.data(), Dk, 0, w.dk.data(), Dk);
        for (int64_t i = 0; i < cl; ++i) {
          const T g = gated ? w.Gam[i] : T(1);
          T dot = 0;
#pragma omp simd reduction(+ : dot)
          for (int64_t j = 0; j < Dk; ++j) {
            dot += w.dqi[i * Dk + j] * w.qG[i * Dk + j];
            w.dq[i * Dk + j] += g * w.dqi[i * Dk + j];
          }
          if (gated) w.db[i] += dot;
        }
        // -dA = strict_lower(dRu U^T), into dP's place
        tril_of_product<T>(cl, Dv, w.dRu.data(), Dv, U, Dv, w.dP.data(), c);
        for (int64_t i = 0; i < cl; ++i) {
          const T bi_ = w.beta[i];
          const T *dRw = &w.dRw[i * Dk], *dRu = &w.dRu[i * Dv], *ki = &w.k[i * Dk], *vi = &w.v[i * Dv];
          const T rw = dot(dRw, ki, Dk), ru = dot(dRu, vi, Dv);
          const T g = gated ? w.Gam[i] : T(1);
#pragma omp simd
          for (int64_t j = 0; j < Dk; ++j) w.dk[i * Dk + j] += bi_ * g * dRw[j];
#pragma omp simd
          for (int64_t j = 0; j < Dv; ++j) w.dv[i * Dv + j] = bi_ * dRu[j];
          T* dAi = &w.dP[i * c];
          const T* Ki = &w.Kk[i * c];
          T dbA = 0;
          if (gated) {
            const T* Ei = &w.E[i * c];
            T zs = 0;
            for (int64_t j = 0; j < i; ++j) {
              const T dae = -dAi[j] * Ei[j];
              dbA += dae * Ki[j];
              const T z = dae * bi_ * Ki[j];
              zs += z;
              w.db[j] -= z;
              dAi[j] = bi_ * dae;  // dKk
            }
            w.db[i] += zs + bi_ * g * rw;
          } else {
#pragma omp simd reduction(+ : dbA)
            for (int64_t j = 0; j < i; ++j) {
              const T da = -dAi[j];
              dbA += da * Ki[j];
              dAi[j] = bi_ * da;
            }
          }
          std::fill(dAi + i, dAi + cl, T(0));
          w.dbeta[i] = g * rw + ru + dbA;
        }
        // dk += (dKk + dKk^T) k, one product with the symmetric sum
        for (int64_t i = 0; i < cl; ++i)
          for (int64_t j = 0; j < i; ++j) w.dP[j * c + i] = w.dP[i * c + j];
        gemm<T>(false, false, cl, Dk, cl, w.dP.data(), c, w.k.data(), Dk, 1, w.dk.data(), Dk);
        // the state's update: dk += kap dkh; b's share through kap and gam
        T ysum = 0;
        for (int64_t i = 0; i < cl; ++i) {
          const T ka = gated ? w.kap[i] : T(1);
          T y = 0;
#pragma omp simd reduction(+ : y)
          for (int64_t j = 0; j < Dk; ++j) {
            y += w.dkh[i * Dk + j] * w.kh[i * Dk + j];
            w.dk[i * Dk + j] += ka * w.dkh[i * Dk + j];
          }
          if (gated) {
            w.db[i] -= y;
            ysum += y;
          }
        }
        if (gated) w.db[cl - 1] += ysum + gam * sd;
        // scatter; d log_decay_t = sum of db_i over the chunk's rows i >= t (b is their cumulative sum)
        T acc = 0;
        for (int64_t i = cl - 1; i >= 0; --i) {
          const int64_t t = t0 + i, o = first + i * a.H;
          unload_grad(row<T>(a.q, a.sq, bi, t, h), &w.dq[i * Dk], static_cast<T*>(a.dq) + o * Dk, Dk, a.l2,
                      T(a.scale), w.rq[i]);
          unload_grad(row<T>(a.k, a.sk, bi, t, h), &w.dk[i * Dk], static_cast<T*>(a.dk) + o * Dk, Dk, a.l2, T(1),
                      w.rk[i]);
          std::memcpy(static_cast<T*>(a.dv) + o * Dv, &w.dv[i * Dv], Dv * sizeof(T));
          static_cast<T*>(a.dbeta)[o] = w.dbeta[i];
          if (gated) static_cast<T*>(a.dld)[o] = acc += w.db[i];
        }
      }
      std::memcpy(static_cast<T*>(a.dS0) + bh * KV, dS.data(), KV * sizeof(T));
    }
  });
  return status.get();
}

// One token of the recurrence, for decoding (delta_rule_step in lintrans/ops/delta/api.py, without autograd):
// per (batch, head), with q, k L2-normalised (l2) and q scaled, g = exp(ld) (1 without a decay),
// u = beta (v - g S^T k), S' = g S + k u^T, o = S'^T q. One call instead of that function's many small torch ops.
template <typename T>
int step(const DeltaStepArgs& a) {
  const int64_t Dk = a.Dk, Dv = a.Dv, KV = Dk * Dv, n = a.B * a.H;
  Status status;
#pragma omp parallel num_threads(step_threads(n, KV, a.threads))
  status.run([&] {
    std::vector<T> qs(Dk), ks(Dk), u(Dv);
    const HeadRange r(n);
    for (int64_t bh = r.lo; bh < r.hi; ++bh) {
      T rq, rk;
      load_row(static_cast<const T*>(a.q) + bh * Dk, qs.data(), Dk, a.l2, T(a.scale), rq);
      load_row(static_cast<const T*>(a.k) + bh * Dk, ks.data(), Dk, a.l2, T(1), rk);
      const T* v = static_cast<const T*>(a.v) + bh * Dv;
      const T* S = static_cast<const T*>(a.S) + bh * KV;
      T* So = static_cast<T*>(a.S_out) + bh * KV;
      T* o = static_cast<T*>(a.o) + bh * Dv;
      const T g = step_decay<T>(a.ld, a.ld_batch, bh, a.H);
      const T beta = static_cast<const T*>(a.beta)[bh];
      std::fill_n(u.data(), Dv, T(0));
      for (int64_t i = 0; i < Dk; ++i) {  // u = S^T k, row by row
        const T ki = ks[i];
        const T* Si = S + i * Dv;
#pragma omp simd
        for (int64_t j = 0; j < Dv; ++j) u[j] += ki * Si[j];
      }
#pragma omp simd
      for (int64_t j = 0; j < Dv; ++j) u[j] = beta * (v[j] - g * u[j]);
      std::fill_n(o, Dv, T(0));
      for (int64_t i = 0; i < Dk; ++i) {
        const T ki = ks[i], qi = qs[i];
        const T* Si = S + i * Dv;
        T* Soi = So + i * Dv;
#pragma omp simd
        for (int64_t j = 0; j < Dv; ++j) {
          Soi[j] = g * Si[j] + ki * u[j];
          o[j] += qi * Soi[j];
        }
      }
    }
  });
  return status.get();
}

}  // namespace

extern "C" {
int lt_delta_step_f32(const DeltaStepArgs* a) { return step<float>(*a); }
int lt_delta_step_f64(const DeltaStepArgs* a) { return step<double>(*a); }
int lt_delta_forward_f32(const DeltaArgs* a) { return forward<float>(*a); }
int lt_delta_forward_f64(const DeltaArgs* a) { return forward<double>(*a); }
int lt_delta_backward_f32(const DeltaArgs* a) { return backward<float>(*a); }
int lt_delta_backward_f64(const DeltaArgs* a) { return backward<double>(*a); }
}
