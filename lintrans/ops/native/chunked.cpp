// The chunked form of causal linear attention, fused, for the CPU: the same algebra as
// ChunkedAttention in lintrans/ops/linear/chunked.py (read that first: names and steps match), one
// (batch, head) pair per OpenMP task, its chunks walked in order by one thread with every
// temporary a chunk's worth and the matmuls as direct BLAS calls.
//
// Per chunk of c tokens (fq, fk its features [c, F], vb its values with a column of ones [c, E]):
//   A = tril(fq fk^T) (times 2^(b_i - b_j) with a decay),  y = fq S (times 2^b_i) + A vb,
//   S <- 2^b_last S + (fk 2^(b_last - b_j))^T vb.
// The ones column is never a product's output column: a 65-wide output costs BLAS ~19% more than a
// 64-wide one, so products write the Dv value columns and loops add the ones column's part (row sums
// of A, dot products with the state's last column z).
// Backward walks the chunks in reverse, carrying dS, the gradient reaching the state after the
// chunk; the states before the chunks are recomputed from one saved state every `ckpt` chunks, in a
// pass that loads the stretch's chunks (features mapped) and keeps them for the reverse walk.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"
#include "simd_math.h"
#include "chunk_common.h"

namespace {

using namespace lintrans_cpu;
using namespace lintrans_simd;

enum Phi : int64_t { kNone = 0, kElu = 1, kRelu = 2, kSoftplus = 3 };

// y = phi(x) for a row of n (the switch outside the loops, so that each loop vectorizes, on AVX2
// only with -fno-trapping-math: see FLAGS in __init__.py; simd_math.h declares libmvec's exp and log1p)
template <typename T>
void phi_row(int64_t kind, const T* x, T* y, int64_t n) {
  switch (kind) {
    case kElu:
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) y[i] = x[i] > 0 ? x[i] + 1 : vexp(std::min(x[i], T(0)));
      break;
    case kRelu:
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) y[i] = x[i] > 0 ? x[i] : T(0);
      break;
    case kSoftplus:  // torch's threshold: x above 20 is returned as is
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) y[i] = x[i] > 20 ? x[i] : vlog1p(vexp(std::min(x[i], T(20))));
      break;
    default:
      std::memcpy(y, x, n * sizeof(T));
  }
}

// out = g * phi'(x), phi' from phi's output y, as OUTPUT_DERIVATIVES in feature_maps.py
template <typename T>
void dphi_row(int64_t kind, const T* g, const T* y, T* out, int64_t n) {
  switch (kind) {
    case kElu:  // not std::min(y, 1): its reference to a temporary stops GCC vectorizing the loop
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) out[i] = y[i] > T(1) ? g[i] : g[i] * y[i];
      break;
    case kRelu:
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) out[i] = y[i] > 0 ? g[i] : T(0);
      break;
    case kSoftplus:
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) out[i] = -g[i] * vexpm1(-y[i]);
      break;
    default:
      std::memcpy(out, g, n * sizeof(T));
  }
}

}  // namespace

// Field for field the ctypes.Structure in lintrans/ops/native/chunked.py (sizes compared at first use).
struct ChunkedArgs {
  const void *q, *k, *v, *ld, *S0;  // q, k [B, T, H, F]; v [B, T, H, Dv]; ld [B|1, T, H] or null; S0 [B, H, F, E]
  void *o, *den, *states, *S_end;   // o [B, T, H, Dv], den [B, T, H] (normalize), states [B, H, ncp, F, E]
  const void *dout, *dS_end;        // backward: do (strides sdo), dS_end [B, H, F, E]
  void *dq, *dk, *dv, *dld, *dS0;   // dq, dk [B, T, H, F], dv [B, T, H, Dv], dld [B, T, H] (contiguous)
  int64_t B, T, H, F, Dv;
  int64_t sq[3], sk[3], sv[3], sld[3], sdo[3];  // strides of the B, T, H dimensions (the last is 1)
  int64_t chunk, ckpt, phi, normalize, need_dld, threads;
  double scale, eps;
};
LINTRANS_EXPORT_SIZEOF(ChunkedArgs)

// Field for field StepArgs in lintrans/ops/native/chunked.py: one decoding step, every tensor contiguous.
struct StepArgs {
  const void *q, *k, *v, *ld, *S, *z;  // q, k [B, H, F]; v [B, H, Dv]; ld [B, H] or [H] or null; S [B, H, F, Dv]; z [B, H, F]
  void *o, *S_out, *z_out;             // o [B, H, Dv]; the new S and z
  int64_t B, H, F, Dv, ld_batch, phi, normalize, threads;  // ld_batch: ld is [B, H] (else [H])
  double scale, eps;
};
LINTRANS_EXPORT_SIZEOF(StepArgs)

namespace {

// out[0:n] = sum over rows i < m of w_i x[i * ld : i * ld + n], w_i = w[i * ldw] (1 where w is null),
// row by row so that the loop over n vectorizes
template <typename T>
inline void column_sums(const T* x, int64_t m, int64_t n, int64_t ld, T* out, const T* w = nullptr,
                        int64_t ldw = 0) {
  std::fill_n(out, n, T(0));
  for (int64_t i = 0; i < m; ++i) {
    const T wi = w ? w[i * ldw] : T(1);
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) out[j] += wi * x[i * ld + j];
  }
}

// The end of a row's masked loop over 0 .. i, rounded up to whole vectors (of up to 16) where the row
// has the room: columns past i are zeroed after the loop, so a vector loop with no scalar remainder
// (one libm call per element) may compute them too.
inline int64_t whole_vectors(int64_t i, int64_t n) { return std::min(n, (i + 16) / 16 * 16); }

// One chunk's inputs, loaded into contiguous buffers: features, values with their ones column and,
// with a decay, the in-chunk cumulative log2-decays bc (<= 0), and from them the decays to the
// chunk's start eb = 2^bc and to its end el = 2^(bc_last - bc), each in one vector loop.
template <typename T>
struct Chunk {
  int64_t c, F, E;
  Buf<T> fq, fk, vb, bc, eb, el;
  Chunk(int64_t c, int64_t F, int64_t E)
      : c(c), F(F), E(E), fq(c * F), fk(c * F), vb(c * E), bc(c), eb(c), el(c) {}

  // rows t0 .. t0 + cl of head h; both passes walk the chunks forward, so the rows kAhead further on
  // (into the next chunk) are asked for as these are read
  void load(const ChunkedArgs& a, int64_t b, int64_t h, int64_t t0, int64_t cl) {
    const T* k = static_cast<const T*>(a.k) + b * a.sk[0] + h * a.sk[2];
    const T* v = static_cast<const T*>(a.v) + b * a.sv[0] + h * a.sv[2];
    const T* q = static_cast<const T*>(a.q) + b * a.sq[0] + h * a.sq[2];
    for (int64_t i = 0; i < cl; ++i) {
      const int64_t t = t0 + i, tn = t + kAhead;
      if (tn < a.T) {
        prefetch_row(q + tn * a.sq[1], F);
        prefetch_row(k + tn * a.sk[1], F);
        prefetch_row(v + tn * a.sv[1], a.Dv);
      }
      phi_row(a.phi, q + t * a.sq[1], &fq[i * F], F);
      phi_row(a.phi, k + t * a.sk[1], &fk[i * F], F);
      std::memcpy(&vb[i * E], v + t * a.sv[1], a.Dv * sizeof(T));
      vb[i * E + a.Dv] = 1;
    }
    if (a.ld) {
      const T* ld = static_cast<const T*>(a.ld) + b * a.sld[0] + h * a.sld[2];
      T acc = 0;
      for (int64_t i = 0; i < cl; ++i) {
        acc += ld[(t0 + i) * a.sld[1]];
        bc[i] = acc * T(kLog2e);
      }
      const T last = bc[cl - 1];
      T *b_ = bc.data(), *eb_ = eb.data(), *el_ = el.data();
#pragma omp simd
      for (int64_t i = 0; i < cl; ++i) {
        eb_[i] = vexp2(b_[i]);
        el_[i] = vexp2(last - b_[i]);
      }
    }
  }

  // A [cl, cl] (row stride c) = fq fk^T, causal, decayed by 2^(bc_i - bc_j)
  void scores(T* A, int64_t cl, bool gated) const {
    tril_of_product<T>(cl, F, fq.data(), F, fk.data(), F, A, c);
    for (int64_t i = 0; i < cl; ++i) {
      T* row = A + i * c;
      if (gated) {
        const T bi = bc[i];
        const T* b_ = bc.data();
        const int64_t jn = whole_vectors(i, cl);
#pragma omp simd
        for (int64_t j = 0; j < jn; ++j) row[j] *= vexp2(std::min(bi - b_[j], T(0)));
      }
      for (int64_t j = i + 1; j < cl; ++j) row[j] = 0;
    }
  }

  // S <- 2^b_last S + kd^T vb, kd = fk decayed to the chunk's end (written to kd); zs: F scratch
  void advance(T* S, T* kd, T* zs, int64_t cl, bool gated) const {
    const int64_t Dv = E - 1;
    const T* keys = fk.data();
    if (gated) {
      const T last = bc[cl - 1], g = vexp2(last);
      for (int64_t x = 0; x < F * E; ++x) S[x] *= g;
      for (int64_t i = 0; i < cl; ++i) {
        const T d = el[i];
        for (int64_t f = 0; f < F; ++f) kd[i * F + f] = fk[i * F + f] * d;
      }
      keys = kd;
    }
    gemm<T>(true, false, F, Dv, cl, keys, F, vb.data(), E, 1, S, E);
    column_sums(keys, cl, F, F, zs);  // z += the keys' column sums
    for (int64_t f = 0; f < F; ++f) S[f * E + Dv] += zs[f];
  }
};

template <typename T>
struct Buffers {
  Buf<T> A, dA, y, dq, dk, dv, kd, z;
  Buffers(int64_t c, int64_t F, int64_t E)
      : A(c * c), dA(c * c), y(c * E), dq(c * F), dk(c * F), dv(c * E), kd(c * F), z(F) {}
};

// One chunk of one head: its output rows, and S advanced past it.
template <typename T>
void forward_chunk(const ChunkedArgs& a, Buffers<T>& w, Chunk<T>& ch, int64_t b, int64_t h, int64_t t0, int64_t cl,
                   T* S) {
  const int64_t F = a.F, E = a.Dv + 1;
  const bool gated = a.ld != nullptr;
  ch.load(a, b, h, t0, cl);
  ch.scores(w.A.data(), cl, gated);
  const int64_t Dv = a.Dv;
  T* z = w.z.data();  // the state's ones column, contiguous
  for (int64_t f = 0; f < F; ++f) z[f] = S[f * E + Dv];
  gemm<T>(false, false, cl, Dv, F, ch.fq.data(), F, S, E, 0, w.y.data(), E);
  for (int64_t i = 0; i < cl; ++i) {
    w.y[i * E + Dv] = dot(&ch.fq[i * F], z, F);
  }
  if (gated)
    for (int64_t i = 0; i < cl; ++i) {
      const T d = ch.eb[i];
      for (int64_t e = 0; e < E; ++e) w.y[i * E + e] *= d;
    }
  tril_times<T>(cl, Dv, w.A.data(), ch.c, ch.vb.data(), E, 1, w.y.data(), E);
  for (int64_t i = 0; i < cl; ++i) {  // A times the ones column: A's row sums (its masked part is 0)
    const T* Ai = &w.A[i * ch.c];
    T acc = 0;
#pragma omp simd reduction(+ : acc)
    for (int64_t j = 0; j < cl; ++j) acc += Ai[j];
    w.y[i * E + Dv] += acc;
  }
  const T s = T(a.scale);
  for (int64_t i = 0; i < cl; ++i) {
    const int64_t row = (b * a.T + t0 + i) * a.H + h;
    T* yi = &w.y[i * E];
    if (a.normalize) {
      const T d = yi[a.Dv] * s + T(a.eps);
      static_cast<T*>(a.den)[row] = d;
#pragma omp simd
      for (int64_t e = 0; e < a.Dv; ++e) yi[e] = yi[e] * s / d;
    } else {
#pragma omp simd
      for (int64_t e = 0; e < a.Dv; ++e) yi[e] *= s;
    }
    store_row(static_cast<T*>(a.o) + row * a.Dv, yi, a.Dv);
  }
  ch.advance(S, w.kd.data(), w.z.data(), cl, gated);
}

template <typename T>
int forward(const ChunkedArgs& a) {
  const int64_t F = a.F, E = a.Dv + 1, FE = F * E, c = a.chunk, nck = (a.T + c - 1) / c;
  const int64_t ncp = (nck + a.ckpt - 1) / a.ckpt;
  Status status;
#pragma omp parallel num_threads(a.threads)
  status.run([&] {
    SequentialBlas one_thread;
    const HeadRange r(a.B * a.H);
    Buffers<T> w(c, F, E);
    Chunk<T> ch(c, F, E);
    Buf<T> S((r.hi - r.lo) * FE);  // each head's state
    std::copy_n(static_cast<const T*>(a.S0) + r.lo * FE, S.size(), S.data());  // not memcpy: an empty range has no buffer
    for (int64_t m = 0; m < nck; ++m) {
      const int64_t t0 = m * c, cl = std::min(c, a.T - t0);
      for (int64_t bh = r.lo; bh < r.hi; ++bh) {
        T* Sh = &S[(bh - r.lo) * FE];
        if (m % a.ckpt == 0)
          std::memcpy(static_cast<T*>(a.states) + (bh * ncp + m / a.ckpt) * FE, Sh, FE * sizeof(T));
        forward_chunk(a, w, ch, bh / a.H, bh % a.H, t0, cl, Sh);
      }
    }
    std::copy_n(S.data(), S.size(), static_cast<T*>(a.S_end) + r.lo * FE);
    store_fence();
  });
  return status.get();
}

// The gradients of one chunk of one head, given Sm (the state before it) and Sn (after it); dS, the
// gradient reaching the state after the chunk, becomes the gradient reaching the state before it.
template <typename T>
void backward_chunk(const ChunkedArgs& a, Buffers<T>& w, const Chunk<T>& ch, int64_t b, int64_t h, int64_t t0,
                    int64_t cl, const T* Sm, const T* Sn, T* dS) {
  const int64_t F = a.F, E = a.Dv + 1, Dv = a.Dv, c = a.chunk;
  const bool gated = a.ld != nullptr;
  T *A = w.A.data(), *dA = w.dA.data(), *dy = w.y.data(), *dq = w.dq.data(), *dk = w.dk.data();
  T *dv = w.dv.data(), *kd = w.kd.data();
  ch.scores(A, cl, gated);
  // dy from do: o = y / d with d = y_z + eps, so dy = do / d and dy_z = -sum(dy o); then the scale
  const T s = T(a.scale);
  const T* dout = static_cast<const T*>(a.dout) + b * a.sdo[0] + h * a.sdo[2];
  for (int64_t i = 0; i < cl; ++i) {
    const int64_t t = t0 + i, row = (b * a.T + t) * a.H + h;
    const T* g = dout + t * a.sdo[1];
    T* dyi = &dy[i * E];
    // the rows this reverse walk reads kAhead rows on
    const int64_t tn = row_ahead(t0, i, cl, c, true);
    if (tn >= 0) {
      prefetch_row(dout + tn * a.sdo[1], Dv);
      if (a.normalize) prefetch_row(static_cast<const T*>(a.o) + ((b * a.T + tn) * a.H + h) * Dv, Dv);
    }
    if (a.normalize) {
      const T d = static_cast<const T*>(a.den)[row];
      const T* o = static_cast<const T*>(a.o) + row * Dv;
      T z = 0;
#pragma omp simd reduction(+ : z)
      for (int64_t e = 0; e < Dv; ++e) {
        dyi[e] = g[e] / d;
        z += dyi[e] * o[e];
      }
      dyi[Dv] = -z;
    } else {
      for (int64_t e = 0; e < Dv; ++e) dyi[e] = g[e];
      dyi[Dv] = 0;
    }
    for (int64_t e = 0; e < E; ++e) dyi[e] *= s;
  }
  tril_of_product<T>(cl, E, dy, E, ch.vb.data(), E, dA, c);  // d(scores), its causal part
  tril_t_times<T>(cl, Dv, A, c, dy, E, 0, dv, E);  // dv: the value columns only
  T last = 0;
  if (gated) {  // from here on dy is the gradient of the state's part of y before its decay 2^b_i
    last = ch.bc[cl - 1];
    for (int64_t i = 0; i < cl; ++i) {
      const T d = ch.eb[i], dk_ = ch.el[i];
      for (int64_t e = 0; e < E; ++e) dy[i * E + e] *= d;
      for (int64_t f = 0; f < F; ++f) kd[i * F + f] = ch.fk[i * F + f] * dk_;
    }
  }
  gemm<T>(false, false, cl, Dv, F, gated ? kd : ch.fk.data(), F, dS, E, 1, dv, E);
  gemm<T>(false, true, cl, F, E, dy, E, Sm, E, 0, dq, F);
  gemm<T>(false, true, cl, F, E, ch.vb.data(), E, dS, E, 0, dk, F);  // d kd
  for (int64_t i = 0; i < cl; ++i) {
    T* row = &dA[i * c];
    if (gated) {
      const T bi = ch.bc[i];
      const T* b_ = ch.bc.data();
      const int64_t jn = whole_vectors(i, cl);
#pragma omp simd
      for (int64_t j = 0; j < jn; ++j) row[j] *= vexp2(std::min(bi - b_[j], T(0)));
      const T d = ch.el[i];
      for (int64_t f = 0; f < F; ++f) dk[i * F + f] *= d;
    }
    for (int64_t j = i + 1; j < cl; ++j) row[j] = 0;
  }
  tril_times<T>(cl, F, dA, c, ch.fk.data(), F, 1, dq, F);
  tril_t_times<T>(cl, F, dA, c, ch.fq.data(), F, 1, dk, F);
  if (gated && a.need_dld) {
    // b_i enters as fq_i e^{b_i} and fk_i e^{-b_i}, b_last besides as e^{b_last} on the whole state
    // after the chunk; ld_t's gradient sums db_i over i >= t, plus b_last's
    T acc = dot(dS, Sn, F * E);
    T* dld = static_cast<T*>(a.dld) + b * a.T * a.H + h;
    for (int64_t i = cl - 1; i >= 0; --i) {
      acc += dot(&ch.fq[i * F], &dq[i * F], F) - dot(&ch.fk[i * F], &dk[i * F], F);
      dld[(t0 + i) * a.H] = acc;
    }
  }
  if (gated) {
    const T g = vexp2(last);
    for (int64_t x = 0; x < F * E; ++x) dS[x] *= g;
  }
  gemm<T>(true, false, F, Dv, cl, ch.fq.data(), F, dy, E, 1, dS, E);
  T* zc = w.z.data();
  column_sums(ch.fq.data(), cl, F, F, zc, dy + Dv, E);  // dS's ones column: fq^T dy_z
  for (int64_t f = 0; f < F; ++f) dS[f * E + Dv] += zc[f];
  for (int64_t i = 0; i < cl; ++i) {
    const int64_t row = (b * a.T + t0 + i) * a.H + h;
    dphi_row(a.phi, &dq[i * F], &ch.fq[i * F], &dq[i * F], F);
    dphi_row(a.phi, &dk[i * F], &ch.fk[i * F], &dk[i * F], F);
    store_row(static_cast<T*>(a.dq) + row * F, &dq[i * F], F);
    store_row(static_cast<T*>(a.dk) + row * F, &dk[i * F], F);
    store_row(static_cast<T*>(a.dv) + row * Dv, &dv[i * E], Dv);
  }
}

template <typename T>
int backward(const ChunkedArgs& a) {
  const int64_t F = a.F, E = a.Dv + 1, FE = F * E, c = a.chunk, nck = (a.T + c - 1) / c;
  const int64_t ncp = (nck + a.ckpt - 1) / a.ckpt;
  const bool gated = a.ld != nullptr;
  Status status;
#pragma omp parallel num_threads(a.threads)
  status.run([&] {
    SequentialBlas one_thread;
    const HeadRange r(a.B * a.H);
    const int64_t nh = r.hi - r.lo;
    Buffers<T> w(c, F, E);
    Buf<T> X(nh * (a.ckpt + 1) * FE), dS(nh * FE);  // per head: the states of a stretch; dS
    // per head, the loaded chunks of a stretch: read and mapped once, for both of its passes
    std::vector<Chunk<T>> held(nh * a.ckpt, Chunk<T>(c, F, E));
    std::copy_n(static_cast<const T*>(a.dS_end) + r.lo * FE, dS.size(), dS.data());
    for (int64_t p = ncp - 1; p >= 0; --p) {
      const int64_t m0 = p * a.ckpt, m1 = std::min(m0 + a.ckpt, nck);
      // the state before each chunk of this stretch (and after its last), from the saved one
      for (int64_t bh = r.lo; bh < r.hi; ++bh)
        std::memcpy(&X[(bh - r.lo) * (a.ckpt + 1) * FE], static_cast<const T*>(a.states) + (bh * ncp + p) * FE,
                    FE * sizeof(T));
      for (int64_t m = m0; m < m1; ++m) {
        const int64_t t0 = m * c, cl = std::min(c, a.T - t0);
        for (int64_t bh = r.lo; bh < r.hi; ++bh) {
          T* Xm = &X[((bh - r.lo) * (a.ckpt + 1) + m - m0) * FE];
          std::memcpy(Xm + FE, Xm, FE * sizeof(T));
          Chunk<T>& ch = held[(bh - r.lo) * a.ckpt + m - m0];
          ch.load(a, bh / a.H, bh % a.H, t0, cl);
          ch.advance(Xm + FE, w.kd.data(), w.z.data(), cl, gated);
        }
      }
      for (int64_t m = m1 - 1; m >= m0; --m) {
        const int64_t t0 = m * c, cl = std::min(c, a.T - t0);
        for (int64_t bh = r.lo; bh < r.hi; ++bh) {
          const T* Xm = &X[((bh - r.lo) * (a.ckpt + 1) + m - m0) * FE];
          backward_chunk(a, w, held[(bh - r.lo) * a.ckpt + m - m0], bh / a.H, bh % a.H, t0, cl, Xm, Xm + FE,
                         &dS[(bh - r.lo) * FE]);
        }
      }
    }
    std::copy_n(dS.data(), dS.size(), static_cast<T*>(a.dS0) + r.lo * FE);
    store_fence();
  });
  return status.get();
}

// One token of the recurrence, for decoding (linear_attention_step in lintrans/ops/linear/step.py, without
// autograd): per (batch, head), with g = exp(ld) (1 without a decay), S' = g S + phi(k) v^T,
// z' = g z + phi(k), o = (scale phi(q))^T S' / ((scale phi(q)) . z' + eps) (no division unless normalize).
// One call instead of that function's many small torch ops, whose dispatch a token otherwise pays.
template <typename T>
int step(const StepArgs& a) {
  const int64_t F = a.F, Dv = a.Dv, FE = F * Dv, n = a.B * a.H;
  Status status;
#pragma omp parallel num_threads(step_threads(n, FE, a.threads))
  status.run([&] {
    std::vector<T> fq(F), fk(F);
    const T scale = T(a.scale);
    const HeadRange r(n);
    for (int64_t bh = r.lo; bh < r.hi; ++bh) {
      phi_row(a.phi, static_cast<const T*>(a.q) + bh * F, fq.data(), F);
      phi_row(a.phi, static_cast<const T*>(a.k) + bh * F, fk.data(), F);
      const T* v = static_cast<const T*>(a.v) + bh * Dv;
      const T* S = static_cast<const T*>(a.S) + bh * FE;
      const T* z = static_cast<const T*>(a.z) + bh * F;
      T* So = static_cast<T*>(a.S_out) + bh * FE;
      T* zo = static_cast<T*>(a.z_out) + bh * F;
      T* o = static_cast<T*>(a.o) + bh * Dv;
      const T g = step_decay<T>(a.ld, a.ld_batch, bh, a.H);
      T den = 0;
      std::fill_n(o, Dv, T(0));
      for (int64_t f = 0; f < F; ++f) {
        const T kf = fk[f], qf = scale * fq[f];
        zo[f] = g * z[f] + kf;
        den += qf * zo[f];
        const T* Sf = S + f * Dv;
        T* Sof = So + f * Dv;
#pragma omp simd
        for (int64_t j = 0; j < Dv; ++j) {
          Sof[j] = g * Sf[j] + kf * v[j];
          o[j] += qf * Sof[j];
        }
      }
      if (a.normalize) {
        const T r = T(1) / (den + T(a.eps));
#pragma omp simd
        for (int64_t j = 0; j < Dv; ++j) o[j] *= r;
      }
    }
  });
  return status.get();
}

}  // namespace

extern "C" {
int lt_linear_step_f32(const StepArgs* a) { return step<float>(*a); }
int lt_linear_step_f64(const StepArgs* a) { return step<double>(*a); }
int lt_chunked_forward_f32(const ChunkedArgs* a) { return forward<float>(*a); }
int lt_chunked_forward_f64(const ChunkedArgs* a) { return forward<double>(*a); }
int lt_chunked_backward_f32(const ChunkedArgs* a) { return backward<float>(*a); }
int lt_chunked_backward_f64(const ChunkedArgs* a) { return backward<double>(*a); }
}
