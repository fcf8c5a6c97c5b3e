// Causal AFT-simple, fused, for the CPU: the function of _SimpleCausal in lintrans/ops/aft.py, per
// channel (b, h, d) of q, k, v [B, T, H, D]:
//   o_t = sigmoid(q_t) r_t,  r_t = N_t / D_t,  N_t = sum_{j<=t} e^{k_j} v_j,  D_t = sum_{j<=t} e^{k_j}.
// Forward is one pass along T carrying N' = N e^{-M}, D' = D e^{-M} against a reference M, one of
// the keys so far, moved to the newest key (the sums rescaled by e^{M_old - M_new}) whenever that one
// exceeds M by more than SHIFT: the flash-attention trick along time, lazily, so that the sums are
// rescaled a handful of times per sequence rather than at every new maximum (each rescale rounds the
// whole sum once). Every term is at most e^SHIFT and D' >= 1 from the first finite key on (the
// largest key so far weighs at least e^0), whatever the keys. The sums, and every quantity carried
// along T, are double precision: a float32 running sum over thousands of terms would lose digits
// (torch's CPU cumsum accumulates in double too). For backward, forward saves only (M, N', D') every
// `every` steps, from which backward recomputes what it needs a stretch at a time (T-sized saved
// tensors would cost their writes, their reads and, past glibc's mmap threshold, their page faults
// on every call).
// Backward is one reverse pass; with g_t = do_t sigmoid(q_t), the gradient reaching N_t is g_t / D_t
// and the one reaching D_t is -g_t r_t / D_t. Carried relative to D_j, with L_t = log D_t:
//   R'_j = sum_{t>=j} g_t e^{L_j - L_t} = g_j + c_{j+1} R'_{j+1},  c_t = e^{L_{t-1} - L_t} = D_{t-1} / D_t,
//   Q'_j likewise with g_t r_t,  dv_j = a_j R'_j,  dk_j = a_j (v_j R'_j - Q'_j),  a_j = e^{k_j} / D_j,
//   dq_t = do_t r_t sigmoid'(q_t);
// D is nondecreasing and D_j >= e^{k_j}: a and c lie in [0, 1].
//
// Work is split by channel: each thread owns a range of tiles (TILE channels of one row's H * D, or
// of one head when the heads are not side by side) and walks t in order over all of them, so its
// reads stream along memory and its loops vectorize over the channels. A channel's arithmetic does
// not depend on which thread owns its tile: the thread count does not change the result.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_kernels.h"
#include "simd_math.h"

// Field for field the ctypes.Structure in lintrans/ops/native/aft.py (sizes compared at first use).
struct AftArgs {
  const void *q, *k, *v;  // [B, T, H, D], strides sq, sk, sv of the B, T, H dimensions (the last is 1)
  void* o;                // [B, T, H, D] contiguous
  void* ckpt;             // double [ncp, 3, B * H * D]: (M, N', D') before each step t = p * every, p >= 1; or null
  const void* dout;       // backward: do (strides sdo)
  void *dq, *dk, *dv;     // backward: [B, T, H, D] contiguous
  int64_t B, T, H, D;
  int64_t sq[3], sk[3], sv[3], sdo[3];
  int64_t every, threads;
};
LINTRANS_EXPORT_SIZEOF(AftArgs)

namespace {

using A = double;  // what is carried along T

using lintrans_cpu::Buf;
using lintrans_cpu::Status;

using lintrans_simd::vexp;

constexpr int64_t TILE = 64;
// how far a key may exceed the reference before the sums move to it: e^30 ~ 1e13 per term keeps them
// far from overflow
constexpr double SHIFT = 30;

// A run of n channels of one (b, h) (h = 0 when the heads lie side by side and count as channels),
// from channel d0; its carried sums sit at `off` in the owning thread's buffers.
struct Tile {
  int64_t b, h, d0, n, off;
};

// The tiles of one thread: the tiles of every (b, h) in order, split evenly by count.
std::vector<Tile> thread_tiles(const AftArgs& a) {
  const int64_t per = (a.D + TILE - 1) / TILE, total = a.B * a.H * per;
  const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
  std::vector<Tile> tiles;
  int64_t off = 0;
  for (int64_t i = total * t / nt; i < total * (t + 1) / nt; ++i) {
    const int64_t bh = i / per, d0 = (i % per) * TILE, n = std::min(TILE, a.D - d0);
    tiles.push_back({bh / a.H, bh % a.H, d0, n, off});
    off += n;
  }
  return tiles;
}

inline int64_t channels(const std::vector<Tile>& tiles) {
  return tiles.empty() ? 0 : tiles.back().off + tiles.back().n;
}

inline int64_t tile_threads(const AftArgs& a) {
  const int64_t tiles = a.B * a.H * ((a.D + TILE - 1) / TILE);
  return std::max<int64_t>(1, std::min(a.threads, tiles));
}

template <typename T>
inline const T* row(const void* x, const int64_t* s, const Tile& w, int64_t t) {
  return static_cast<const T*>(x) + w.b * s[0] + t * s[1] + w.h * s[2] + w.d0;
}

// the channel index of a tile's first channel, (b, h, d0) flattened
inline int64_t channel(const AftArgs& a, const Tile& w) { return (w.b * a.H + w.h) * a.D + w.d0; }

// offset of (b, t, h, d0) in a contiguous [B, T, H, D] tensor
inline int64_t at(const AftArgs& a, const Tile& w, int64_t t) { return ((w.b * a.T + t) * a.H + w.h) * a.D + w.d0; }

// One step of the forward pass over a tile's n channels, given the carried M, N', D'. Out: write o
// (from q); else what backward needs of the step (its recomputation of a stretch): r_t,
// a_t = e^{k_t} / D_t = w_t / D'_t and c_t = D_{t-1} / D_t = keep_t D'_{t-1} / D'_t, w_t the step's
// weight of k_t and keep_t its rescale of the old sums (1 unless the reference moves).
template <typename T, bool Out>
inline void forward_step(int64_t n, const T* q, const T* k, const T* v, T* M, A* N, A* Dn, T* o, A* r, A* a, A* c) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    // one exp: e^{-x} rescales the sums when k moves the reference, else e^x is k's weight (0 for a
    // key of -inf); the choices as arithmetic on up = 0 or 1 (exact), which GCC vectorizes where it
    // would not a select between float and double
    const T x = k[i] - M[i];
    const bool move = x > T(SHIFT);
    const T up = move ? T(1) : T(0), dn = 1 - up;
    const T e = vexp(x * (dn - up)), keep = up * e + dn, w = up + dn * e;
    M[i] = move ? k[i] : M[i];
    const A old = Dn[i] * A(keep);
    N[i] = N[i] * A(keep) + A(w) * A(v[i]);
    Dn[i] = old + A(w);
    if (Out) {
      o[i] = T(N[i]) / (T(Dn[i]) * (1 + vexp(-q[i])));
    } else {
      const A inv = 1 / Dn[i];
      r[i] = N[i] * inv;
      a[i] = A(w) * inv;
      c[i] = old * inv;
    }
  }
}

// The carried sums of a thread's channels: the reference M (a key: the storage type holds it
// exactly), N', D'
template <typename T>
struct Carry {
  Buf<T> M;
  Buf<A> N, Dn;
  explicit Carry(int64_t n) : M(n), N(n), Dn(n) { reset(); }

  // before the first step: empty sums, and a reference below any key, so that the first finite key
  // moves it (rescaling the empty sums by e^{-inf} = 0) and keys of -inf weigh 0 (no inf - inf)
  void reset() {
    std::fill(M.begin(), M.end(), std::numeric_limits<T>::lowest());
    std::fill(N.begin(), N.end(), A(0));
    std::fill(Dn.begin(), Dn.end(), A(0));
  }

  // to or from checkpoint p: (M, N', D') as [3, B * H * D] doubles
  void store(const AftArgs& a, const std::vector<Tile>& tiles, int64_t p, bool save) {
    const int64_t C = a.B * a.H * a.D;
    A* base = static_cast<A*>(a.ckpt) + p * 3 * C;
    for (const Tile& w : tiles) {
      A *cm = base + channel(a, w), *cn = cm + C, *cd = cn + C;
      T* m = &M[w.off];
      if (save) {
        std::copy(m, m + w.n, cm);
        std::copy(&N[w.off], &N[w.off] + w.n, cn);
        std::copy(&Dn[w.off], &Dn[w.off] + w.n, cd);
      } else {
        for (int64_t i = 0; i < w.n; ++i) m[i] = T(cm[i]);
        std::copy(cn, cn + w.n, &N[w.off]);
        std::copy(cd, cd + w.n, &Dn[w.off]);
      }
    }
  }
};

template <typename T>
int forward(const AftArgs& a) {
  Status status;
#pragma omp parallel num_threads(tile_threads(a))
  status.run([&] {
    const std::vector<Tile> tiles = thread_tiles(a);
    Carry<T> s(channels(tiles));
    T* o = static_cast<T*>(a.o);
    for (int64_t t = 0; t < a.T; ++t) {
      if (a.ckpt && t > 0 && t % a.every == 0) s.store(a, tiles, t / a.every, true);
      for (const Tile& w : tiles) {
        const T *q = row<T>(a.q, a.sq, w, t), *k = row<T>(a.k, a.sk, w, t), *v = row<T>(a.v, a.sv, w, t);
        forward_step<T, true>(w.n, q, k, v, &s.M[w.off], &s.N[w.off], &s.Dn[w.off], o + at(a, w, t), nullptr, nullptr,
                              nullptr);
      }
    }
  });
  return status.get();
}

// Backward walks the stretches of `every` steps from the last: each stretch's r, a and c recomputed
// from its checkpoint into buffers that stay in cache, then its steps in reverse.
template <typename T>
int backward(const AftArgs& a) {
  Status status;
#pragma omp parallel num_threads(tile_threads(a))
  status.run([&] {
    const std::vector<Tile> tiles = thread_tiles(a);
    const int64_t n = channels(tiles), E = a.every;
    Carry<T> s(n);
    Buf<A> r(E * n), ea(E * n), c(E * n);              // a stretch's r, a and c, step by step
    Buf<A> Rc(n, A(0)), Qc(n, A(0)), Cn(n, A(0));  // per channel: R', Q' and c of the step after
    T *dq = static_cast<T*>(a.dq), *dk = static_cast<T*>(a.dk), *dv = static_cast<T*>(a.dv);
    for (int64_t p = (a.T - 1) / E; p >= 0; --p) {
      const int64_t t0 = p * E, t1 = std::min(a.T, t0 + E);
      if (p > 0)
        s.store(a, tiles, p, false);
      else
        s.reset();
      for (int64_t t = t0; t < t1; ++t)
        for (const Tile& w : tiles) {
          const T *k = row<T>(a.k, a.sk, w, t), *v = row<T>(a.v, a.sv, w, t);
          const int64_t x = (t - t0) * n + w.off;
          forward_step<T, false>(w.n, nullptr, k, v, &s.M[w.off], &s.N[w.off], &s.Dn[w.off], nullptr, &r[x], &ea[x],
                                 &c[x]);
        }
      for (int64_t t = t1 - 1; t >= t0; --t) {
        for (const Tile& w : tiles) {
          const T *q = row<T>(a.q, a.sq, w, t), *v = row<T>(a.v, a.sv, w, t), *g = row<T>(a.dout, a.sdo, w, t);
          const int64_t x = at(a, w, t), y = (t - t0) * n + w.off;
          const A *rt = &r[y], *at_ = &ea[y], *ct = &c[y];
          A *R = &Rc[w.off], *Q = &Qc[w.off], *C = &Cn[w.off];
          T *dqt = dq + x, *dkt = dk + x, *dvt = dv + x;
#pragma omp simd
          for (int64_t i = 0; i < w.n; ++i) {
            const T sg = 1 / (1 + vexp(-q[i]));
            const A gs = A(g[i] * sg), Ri = gs + C[i] * R[i], Qi = gs * rt[i] + C[i] * Q[i];
            dvt[i] = T(at_[i] * Ri);
            dkt[i] = T(at_[i] * (v[i] * Ri - Qi));
            dqt[i] = T(g[i] * rt[i]) * sg * (1 - sg);
            R[i] = Ri;
            Q[i] = Qi;
            C[i] = ct[i];
          }
        }
      }
    }
  });
  return status.get();
}

}  // namespace

extern "C" {
int lt_aft_simple_forward_f32(const AftArgs* a) { return forward<float>(*a); }
int lt_aft_simple_forward_f64(const AftArgs* a) { return forward<double>(*a); }
int lt_aft_simple_backward_f32(const AftArgs* a) { return backward<float>(*a); }
int lt_aft_simple_backward_f64(const AftArgs* a) { return backward<double>(*a); }
}
