// Small-product throughput of the BLAS lintrans calls (torch's MKL) against a plain register-blocked loop, and a
// 1024^3 product for the peak. Build: g++ -O3 -march=native -fopenmp-simd mb.cpp -L$TORCH_LIB -ltorch_cpu -lc10 -Wl,-rpath,$TORCH_LIB
#include <chrono>
#include <cstdio>
#include <vector>
#include <cstring>
extern "C" void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
            const int*, const float*, const int*, const float*, float*, const int*);
// row-major C[m,n] = A[m,k] B[k,n] via column-major trick: C^T = B^T A^T
static void gemm_nn(int m,int n,int k,const float*A,int lda,const float*B,int ldb,float beta,float*C,int ldc){
  float one=1; sgemm_("N","N",&n,&m,&k,&one,B,&ldb,A,&lda,&beta,C,&ldc);
}
template<int N, int K>
static void mk_nn(int m, const float* __restrict A, const float* __restrict B, float* __restrict C) {
  // C[m,N] = A[m,K] B[K,N]; rows two at a time
  for (int i = 0; i < m; i += 2) {
    float acc0[N] = {0}, acc1[N] = {0};
    const float* a0 = A + i*K; const float* a1 = a0 + K;
    for (int k = 0; k < K; ++k) {
      const float x0 = a0[k], x1 = a1[k];
      const float* b = B + k*N;
#pragma omp simd
      for (int j = 0; j < N; ++j) { acc0[j] += x0*b[j]; acc1[j] += x1*b[j]; }
    }
    std::memcpy(C+i*N, acc0, sizeof acc0); std::memcpy(C+(i+1)*N, acc1, sizeof acc1);
  }
}
int main(){
  int m=32,n=64,k=64; std::vector<float> A(m*k,1.01f),B(k*n,0.5f),C(m*n);
  int R=200000;
  for(int rep=0;rep<2;++rep){
  auto t=std::chrono::steady_clock::now();
  for(int r=0;r<R;++r) gemm_nn(m,n,k,A.data(),k,B.data(),n,0.f,C.data(),n);
  double s=std::chrono::duration<double>(std::chrono::steady_clock::now()-t).count();
  printf("mkl 32x64x64: %.3f us/call  %.1f GFLOP/s\n", s/R*1e6, 2.0*m*n*k*R/s/1e9);
  t=std::chrono::steady_clock::now();
  for(int r=0;r<R;++r) mk_nn<64,64>(m,A.data(),B.data(),C.data());
  s=std::chrono::duration<double>(std::chrono::steady_clock::now()-t).count();
  printf("hand 32x64x64: %.3f us/call  %.1f GFLOP/s  %f\n", s/R*1e6, 2.0*m*n*k*R/s/1e9, C[5]);
  // big
  int M=1024; std::vector<float> X(M*M,1.f),Y(M*M,1.f),Z(M*M);
  t=std::chrono::steady_clock::now(); for(int r=0;r<5;++r) gemm_nn(M,M,M,X.data(),M,Y.data(),M,0.f,Z.data(),M);
  s=std::chrono::duration<double>(std::chrono::steady_clock::now()-t).count();
  printf("mkl 1024^3: %.1f GFLOP/s\n", 2.0*M*M*M*5/s/1e9);
  }
}
