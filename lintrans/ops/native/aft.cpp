// Causal AFT-simple, fused, for the CPU: the function of _SimpleCausal in lintrans/ops/aft.py, per
// channel (b, h, d) of q, k, v [B, T, H, D]:
//   o_t = sigmoid(q_t) r_t,  r_t = N_t / D_t,  N_t = sum_{j<=t} e^{k_j} v_j,  D_t = sum_{j<=t} e^{k_j}.
// Forward is one pass along T carrying N' = N e^{-M}, D' = D e^{-M} against the running max M of
// the keys (rescaled by e^{M_old - M_new} when it moves, the flash-attention trick along time), so
// every exponent is <= 0 and D' >= 1 whatever the keys. It saves r_t and L_t = log D_t = M + log D'.
// Backward is one reverse pass; with g_t = do_t sigmoid(q_t), the gradient reaching N_t is g_t / D_t
// and the one reaching D_t is -g_t r_t / D_t. Carried relative to D_j:
//   R'_j = sum_{t>=j} g_t e^{L_j - L_t} = g_j + e^{L_j - L_{j+1}} R'_{j+1},  Q'_j likewise with g_t r_t,
//   dv_j = e^{k_j - L_j} R'_j,  dk_j = e^{k_j - L_j} (v_j R'_j - Q'_j),  dq_t = do_t r_t sigmoid'(q_t);
// L is nondecreasing and D_j >= e^{k_j}, so again every exponent is <= 0.
//
// Work is split by channel: each thread owns a range of tiles (TILE channels of one row's H * D, or
// of one head when the heads are not side by side) and walks t in order over all of them, so its
// reads stream along memory and its loops vectorize over the channels. A channel's arithmetic does
// not depend on which thread owns its tile: the thread count does not change the result.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

extern "C" {
// glibc's vector math (libmvec): declared SIMD-callable, so that `omp simd` loops vectorize them
float expf(float) noexcept __attribute__((simd("notinbranch")));
double exp(double) noexcept __attribute__((simd("notinbranch")));
float logf(float) noexcept __attribute__((simd("notinbranch")));
double log(double) noexcept __attribute__((simd("notinbranch")));
}

// Field for field the ctypes.Structure in lintrans/ops/native/aft.py.
struct AftArgs {
  const void *q, *k, *v;     // [B, T, H, D], strides sq, sk, sv of the B, T, H dimensions (the last is 1)
  void *o, *r, *L;           // o, r, L [B, T, H, D] contiguous; r, L (saved for backward) may be null
  const void* dout;          // backward: do (strides sdo)
  void *dq, *dk, *dv;        // backward: [B, T, H, D] contiguous
  int64_t B, T, H, D;
  int64_t sq[3], sk[3], sv[3], sdo[3];
  int64_t threads;
};

namespace {

inline float vexp(float x) { return expf(x); }
inline double vexp(double x) { return exp(x); }
inline float vlog(float x) { return logf(x); }
inline double vlog(double x) { return log(x); }

constexpr int64_t TILE = 64;

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

inline int64_t tile_threads(const AftArgs& a) {
  const int64_t tiles = a.B * a.H * ((a.D + TILE - 1) / TILE);
  return std::max<int64_t>(1, std::min(a.threads, tiles));
}

template <typename T>
inline const T* row(const void* x, const int64_t* s, const Tile& w, int64_t t) {
  return static_cast<const T*>(x) + w.b * s[0] + t * s[1] + w.h * s[2] + w.d0;
}

// offset of (b, t, h, d0) in a contiguous [B, T, H, D] tensor
inline int64_t at(const AftArgs& a, const Tile& w, int64_t t) { return ((w.b * a.T + t) * a.H + w.h) * a.D + w.d0; }

// One step of the forward pass over a tile's n channels; Save: also write r and L.
template <typename T, bool Save>
inline void forward_step(int64_t n, bool first, const T* q, const T* k, const T* v, T* M, T* N, T* Dn, T* o, T* r,
                         T* L) {
  if (first) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      M[i] = k[i];
      N[i] = v[i];
      Dn[i] = 1;
      o[i] = v[i] / (1 + vexp(-q[i]));
      if (Save) {
        r[i] = v[i];
        L[i] = k[i];
      }
    }
    return;
  }
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    // one exp: e^{-|k - M|} is the old sums' rescale when k is the new max, else k's weight
    const T x = k[i] - M[i], e = vexp(-std::abs(x));
    const bool up = x > 0;
    const T keep = up ? e : T(1), w = up ? T(1) : e;
    M[i] = up ? k[i] : M[i];
    N[i] = N[i] * keep + w * v[i];
    Dn[i] = Dn[i] * keep + w;
    const T ri = N[i] / Dn[i];
    o[i] = ri / (1 + vexp(-q[i]));
    if (Save) {
      r[i] = ri;
      L[i] = M[i] + vlog(Dn[i]);
    }
  }
}

template <typename T>
void forward(const AftArgs& a) {
  const bool save = a.r != nullptr;
#pragma omp parallel num_threads(tile_threads(a))
  {
    const std::vector<Tile> tiles = thread_tiles(a);
    const int64_t n = tiles.empty() ? 0 : tiles.back().off + tiles.back().n;
    std::vector<T> M(n), N(n), Dn(n);  // per channel: running max, N', D'
    T *o = static_cast<T*>(a.o), *r = static_cast<T*>(a.r), *L = static_cast<T*>(a.L);
    for (int64_t t = 0; t < a.T; ++t) {
      for (const Tile& w : tiles) {
        const T *q = row<T>(a.q, a.sq, w, t), *k = row<T>(a.k, a.sk, w, t), *v = row<T>(a.v, a.sv, w, t);
        const int64_t x = at(a, w, t);
        if (save)
          forward_step<T, true>(w.n, t == 0, q, k, v, &M[w.off], &N[w.off], &Dn[w.off], o + x, r + x, L + x);
        else
          forward_step<T, false>(w.n, t == 0, q, k, v, &M[w.off], &N[w.off], &Dn[w.off], o + x, nullptr, nullptr);
      }
    }
  }
}

template <typename T>
void backward(const AftArgs& a) {
#pragma omp parallel num_threads(tile_threads(a))
  {
    const std::vector<Tile> tiles = thread_tiles(a);
    const int64_t n = tiles.empty() ? 0 : tiles.back().off + tiles.back().n;
    std::vector<T> Rc(n, T(0)), Qc(n, T(0)), Ln(n);  // per channel: R', Q' and L of the step after
    const T *r = static_cast<const T*>(a.r), *L = static_cast<const T*>(a.L);
    T *dq = static_cast<T*>(a.dq), *dk = static_cast<T*>(a.dk), *dv = static_cast<T*>(a.dv);
    for (const Tile& w : tiles)  // at the last step nothing is carried: any finite L will do
      std::copy(L + at(a, w, a.T - 1), L + at(a, w, a.T - 1) + w.n, &Ln[w.off]);
    for (int64_t t = a.T - 1; t >= 0; --t) {
      for (const Tile& w : tiles) {
        const T *q = row<T>(a.q, a.sq, w, t), *k = row<T>(a.k, a.sk, w, t), *v = row<T>(a.v, a.sv, w, t);
        const T* g = row<T>(a.dout, a.sdo, w, t);
        const int64_t x = at(a, w, t);
        const T *rt = r + x, *Lt = L + x;
        T *R = &Rc[w.off], *Q = &Qc[w.off], *Lnext = &Ln[w.off], *dqt = dq + x, *dkt = dk + x, *dvt = dv + x;
#pragma omp simd
        for (int64_t i = 0; i < w.n; ++i) {
          const T s = 1 / (1 + vexp(-q[i])), gs = g[i] * s, c = vexp(Lt[i] - Lnext[i]);
          const T Ri = gs + c * R[i], Qi = gs * rt[i] + c * Q[i], e = vexp(k[i] - Lt[i]);
          dvt[i] = e * Ri;
          dkt[i] = e * (v[i] * Ri - Qi);
          dqt[i] = g[i] * rt[i] * s * (1 - s);
          R[i] = Ri;
          Q[i] = Qi;
          Lnext[i] = Lt[i];
        }
      }
    }
  }
}

}  // namespace

extern "C" {
void lt_aft_simple_forward_f32(const AftArgs* a) { forward<float>(*a); }
void lt_aft_simple_forward_f64(const AftArgs* a) { forward<double>(*a); }
void lt_aft_simple_backward_f32(const AftArgs* a) { backward<float>(*a); }
void lt_aft_simple_backward_f64(const AftArgs* a) { backward<double>(*a); }
}
