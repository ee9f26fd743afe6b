#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
__global__ void Racy(float* out) {
  __shared__ float s[32];
  if (threadIdx.x == 0) s[0] = 42.0f;
  out[threadIdx.x] = s[0];  // missing barrier
}
__global__ void Sum(float* out) {
  float v = threadIdx.x;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) out[threadIdx.x / 32] = v;
}
__global__ void Divergent(float* out) {
  if (threadIdx.x < 16)
    out[0] = __shfl_sync(0xffffffffu, 1.0f, 0);
  else
    __syncthreads();
}
int main(int argc, char** argv) {
  float* d;
  cudaMalloc(&d, 64 * sizeof(float));
  float h[64];
  Racy<<<1, 32>>>(d);
  cudaMemcpy(h, d, 32 * 4, cudaMemcpyDeviceToHost);
  printf("racy: out[0]=%g out[31]=%g\n", h[0], h[31]);
  Sum<<<1, 64>>>(d);
  cudaMemcpy(h, d, 8, cudaMemcpyDeviceToHost);
  printf("sum: %g %g (want 496 1520)\n", h[0], h[1]);
  Racy<<<1, 32>>>(h);  // host pointer
  printf("bad grid: %d\n", (Sum<<<dim3(1, 70000), 32>>>(d), cudaGetLastError()));
  cudaMemcpy(d, h, 8, cudaMemcpyDeviceToHost);       // wrong kind
  cudaMemcpy(h, d, 70 * 4, cudaMemcpyDeviceToHost);  // overrun
  if (argc > 1 && !strcmp(argv[1], "dead")) Divergent<<<1, 32>>>(d);
  if (argc > 1 && !strcmp(argv[1], "host")) printf("%g\n", d[0]);
  return 0;
}
