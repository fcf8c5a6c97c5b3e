// The unit-lower inverse of delta_rule.cpp (a: a copy of unit_lower_inverse as of commit 1d57203, so that it
// builds without torch) against fixed-width rows (b), for a 32 x 32 chunk. g++ -O3 -march=native -fopenmp-simd inv.cpp
#include <chrono>
#include <cstdio>
#include <vector>
#include <algorithm>
#include <cstdint>
template <typename T>
__attribute__((noinline)) void inv_a(int64_t cl, int64_t c, const T* A, T* Ti) {
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
// full-width rows: tj is zero right of j, so a fixed width W >= cl (multiple of 16) loop does the same
template <typename T, int W>
__attribute__((noinline)) void inv_b(int64_t cl, int64_t c, const T* A, T* Ti) {
  for (int64_t i = 0; i < cl; ++i) {
    T acc[W] = {};
    acc[i] = T(1);
    for (int64_t j = 0; j < i; ++j) {
      const T aij = A[i * c + j];
      const T* __restrict tj = Ti + j * c;
#pragma omp simd
      for (int l = 0; l < W; ++l) acc[l] -= aij * tj[l];
    }
    std::copy(acc, acc + W, Ti + i * c);
  }
}
int main(){
  const int c=32; std::vector<float> A(c*c), T1(c*c), T2(c*c);
  for(int i=0;i<c*c;++i) A[i]=((i*37)%11-5)*0.01f;
  int R=200000;
  for(int rep=0;rep<2;++rep){
  auto t=std::chrono::steady_clock::now();
  for(int r=0;r<R;++r) inv_a<float>(c,c,A.data(),T1.data());
  double s=std::chrono::duration<double>(std::chrono::steady_clock::now()-t).count();
  printf("a: %.3f us\n", s/R*1e6);
  t=std::chrono::steady_clock::now();
  for(int r=0;r<R;++r) inv_b<float,32>(c,c,A.data(),T2.data());
  s=std::chrono::duration<double>(std::chrono::steady_clock::now()-t).count();
  double md=0; for(int i=0;i<c;++i) for(int j=0;j<=i;++j) md=std::max(md,(double)std::abs(T1[i*c+j]-T2[i*c+j]));
  printf("b: %.3f us  maxdiff %g\n", s/R*1e6, md);
  }
}
