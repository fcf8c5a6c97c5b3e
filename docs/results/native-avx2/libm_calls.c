/* Counts the kernels' calls into glibc's math functions, scalar (expf, exp2f, ...) and vector (libmvec's
   _ZGV* variants), by interposition: LD_PRELOAD=./libm_calls.so puts these definitions before libm's
   and libmvec's, each counts and forwards to the real one (dlsym(RTLD_NEXT)). lm_reset() / lm_count()
   are read through ctypes by scalar_calls.py.
   cc -O2 -shared -fPIC -mavx512f -o libm_calls.so libm_calls.c -ldl
   (-mavx512f only types the 512-bit wrappers; they run only where the kernels call them.) */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <immintrin.h>
#include <stdatomic.h>

enum { SCALAR = 0, VECTOR = 1 };
static atomic_long counts[2];
static atomic_long lanes;  /* elements the vector calls covered */

/* libmvec is loaded as a dependency of the kernels' library, dlopen'ed locally: not in the global scope
   that RTLD_NEXT searches, so its functions are looked up in it directly */
static void* find(const char* name) {
  void* f = dlsym(RTLD_NEXT, name);
  if (!f) f = dlsym(dlopen("libmvec.so.1", RTLD_NOW | RTLD_NOLOAD) ?: dlopen("libmvec.so.1", RTLD_NOW), name);
  return f;
}

void lm_reset(void) { counts[0] = counts[1] = 0; lanes = 0; }
long lm_count(int which) { return which == 2 ? (long)lanes : (long)counts[which]; }

#define SCALAR_FN(T, name)                                                  \
  T name(T x) {                                                             \
    static T (*real)(T);                                                    \
    if (!real) real = (T(*)(T))find(#name);                     \
    atomic_fetch_add_explicit(&counts[SCALAR], 1, memory_order_relaxed);    \
    return real(x);                                                         \
  }
SCALAR_FN(float, expf) SCALAR_FN(double, exp) SCALAR_FN(float, exp2f) SCALAR_FN(double, exp2)
SCALAR_FN(float, log1pf) SCALAR_FN(double, log1p) SCALAR_FN(float, expm1f) SCALAR_FN(double, expm1)
SCALAR_FN(float, log2f) SCALAR_FN(double, log2)

#define VECTOR_FN(V, n, name)                                               \
  V name(V x) {                                                             \
    static V (*real)(V);                                                    \
    if (!real) real = (V(*)(V))find(#name);                     \
    atomic_fetch_add_explicit(&counts[VECTOR], 1, memory_order_relaxed);    \
    atomic_fetch_add_explicit(&lanes, n, memory_order_relaxed);             \
    return real(x);                                                         \
  }
#define FAMILY(f, d)                                                                                 \
  VECTOR_FN(__m128, 4, _ZGVbN4v_##f) VECTOR_FN(__m256, 8, _ZGVdN8v_##f) VECTOR_FN(__m512, 16, _ZGVeN16v_##f) \
  VECTOR_FN(__m128d, 2, _ZGVbN2v_##d) VECTOR_FN(__m256d, 4, _ZGVdN4v_##d) VECTOR_FN(__m512d, 8, _ZGVeN8v_##d)
FAMILY(expf, exp) FAMILY(exp2f, exp2) FAMILY(log1pf, log1p) FAMILY(expm1f, expm1)
