// The small products of the fused kernels, torch's MKL (sgemm_) against small_gemm.h's loop, one thread, GFLOP/s.
// Build: g++ -O3 -march=native -std=c++17 products.cpp -L$TORCH_LIB -ltorch_cpu -lc10 -Wl,-rpath,$TORCH_LIB
// Run: OMP_NUM_THREADS=1 taskset -c 0 ./a.out
#include "../../../lintrans/ops/native/small_gemm.h"
#include <chrono>
#include <cstdio>
#include <vector>
#include <cmath>
extern "C" void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
            const int*, const float*, const int*, const float*, float*, const int*);
static void bl(bool tA,bool tB,int m,int n,int k,float al,const float*A,int lda,const float*B,int ldb,float be,float*C,int ldc){
  const char a=tA?'T':'N', b=tB?'T':'N'; sgemm_(&b,&a,&n,&m,&k,&al,B,&ldb,A,&lda,&be,C,&ldc);}
int main(){
  int shapes[][5]={{32,64,64,0,0},{32,64,64,0,1},{64,64,32,1,0},{32,32,64,0,1},{32,64,32,0,0},{32,64,32,1,0}};
  for(auto&s:shapes){int m=s[0],n=s[1],k=s[2];bool tA=s[3],tB=s[4];
   std::vector<float>A(64*64),B(64*64),C(64*64),D(64*64);for(int i=0;i<4096;++i){A[i]=(i%7)*.1f;B[i]=(i%5)*.2f;}
   int lda=tA?m:k, ldb=tB?k:n; int R=100000; double fl=2.0*m*n*k*R/1e9;
   for(int rep=0;rep<2;++rep){
   auto t=std::chrono::steady_clock::now(); for(int r=0;r<R;++r) bl(tA,tB,m,n,k,1,A.data(),lda,B.data(),ldb,0,C.data(),n);
   double s1=std::chrono::duration<double>(std::chrono::steady_clock::now()-t).count();
   t=std::chrono::steady_clock::now(); for(int r=0;r<R;++r) lintrans_cpu::small_sgemm::gemm(tA,tB,m,n,k,1,A.data(),lda,B.data(),ldb,0,D.data(),n);
   double s2=std::chrono::duration<double>(std::chrono::steady_clock::now()-t).count();
   double e=0;for(int i=0;i<m*n;++i)e=std::max(e,(double)std::fabs(C[i]-D[i]));
   printf("%dx%dx%d tA%d tB%d  blas %.1f  small %.1f GFLOP/s err %g\n",m,n,k,tA,tB,fl/s1,fl/s2,e);}}
}
