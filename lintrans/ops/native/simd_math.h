// glibc's vector math (libmvec) for the kernels' `omp simd` loops: declared SIMD-callable, so that
// GCC vectorizes loops that call them (glibc declares them so only under -ffast-math, which these
// kernels do not use), and overloads that pick the float or double one. exp has vector versions
// since glibc 2.22, exp2, expm1 and log1p since 2.35: with an older glibc, exp2 goes through exp and
// the other two stay scalar (the loops that call them then run scalar, with the same results).
#pragma once

#include <cmath>

#if defined(__GLIBC__) && defined(__GLIBC_PREREQ)
#if __GLIBC_PREREQ(2, 35)
#define LINTRANS_MVEC_235 1
#endif
#endif

extern "C" {
float expf(float) noexcept __attribute__((simd("notinbranch")));
double exp(double) noexcept __attribute__((simd("notinbranch")));
#ifdef LINTRANS_MVEC_235
float exp2f(float) noexcept __attribute__((simd("notinbranch")));
double exp2(double) noexcept __attribute__((simd("notinbranch")));
float log1pf(float) noexcept __attribute__((simd("notinbranch")));
double log1p(double) noexcept __attribute__((simd("notinbranch")));
float expm1f(float) noexcept __attribute__((simd("notinbranch")));
double expm1(double) noexcept __attribute__((simd("notinbranch")));
#endif
}

namespace lintrans_simd {
inline float vexp(float x) { return expf(x); }
inline double vexp(double x) { return exp(x); }
#ifdef LINTRANS_MVEC_235
inline float vexp2(float x) { return exp2f(x); }
inline double vexp2(double x) { return exp2(x); }
#else
inline float vexp2(float x) { return expf(x * 0.69314718055994531f); }
inline double vexp2(double x) { return exp(x * 0.69314718055994531); }
#endif
inline float vlog1p(float x) { return log1pf(x); }
inline double vlog1p(double x) { return log1p(x); }
inline float vexpm1(float x) { return expm1f(x); }
inline double vexpm1(double x) { return expm1(x); }
}  // namespace lintrans_simd
