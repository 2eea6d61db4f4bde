#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(){
  long n=100000000;
  for(int rep=0;rep<2;rep++){
  double t=now();
  __asm__ volatile(
    "vpxord %%zmm0,%%zmm0,%%zmm0\n"
    "mov %0, %%rcx\n"
    "1:\n"
    "vpdpwssd %%zmm14,%%zmm15,%%zmm0\n vpdpwssd %%zmm14,%%zmm15,%%zmm1\n vpdpwssd %%zmm14,%%zmm15,%%zmm2\n vpdpwssd %%zmm14,%%zmm15,%%zmm3\n"
    "vpdpwssd %%zmm14,%%zmm15,%%zmm4\n vpdpwssd %%zmm14,%%zmm15,%%zmm5\n vpdpwssd %%zmm14,%%zmm15,%%zmm6\n vpdpwssd %%zmm14,%%zmm15,%%zmm7\n"
    "vpdpwssd %%zmm14,%%zmm15,%%zmm8\n vpdpwssd %%zmm14,%%zmm15,%%zmm9\n vpdpwssd %%zmm14,%%zmm15,%%zmm10\n vpdpwssd %%zmm14,%%zmm15,%%zmm11\n"
    "dec %%rcx\n jnz 1b\n" :: "r"(n) : "rcx","xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm8","xmm9","xmm10","xmm11");
  double dt=now()-t;
  printf("vpdpwssd zmm: %.2f G instr/s = %.1f GMAC/s (1 core)\n", 12.0*n/dt/1e9, 12.0*n*32/dt/1e9);
  t=now();
  __asm__ volatile(
    "mov %0, %%rcx\n"
    "1:\n"
    "vpdpbusd %%zmm14,%%zmm15,%%zmm0\n vpdpbusd %%zmm14,%%zmm15,%%zmm1\n vpdpbusd %%zmm14,%%zmm15,%%zmm2\n vpdpbusd %%zmm14,%%zmm15,%%zmm3\n"
    "vpdpbusd %%zmm14,%%zmm15,%%zmm4\n vpdpbusd %%zmm14,%%zmm15,%%zmm5\n vpdpbusd %%zmm14,%%zmm15,%%zmm6\n vpdpbusd %%zmm14,%%zmm15,%%zmm7\n"
    "vpdpbusd %%zmm14,%%zmm15,%%zmm8\n vpdpbusd %%zmm14,%%zmm15,%%zmm9\n vpdpbusd %%zmm14,%%zmm15,%%zmm10\n vpdpbusd %%zmm14,%%zmm15,%%zmm11\n"
    "dec %%rcx\n jnz 1b\n" :: "r"(n) : "rcx","xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm8","xmm9","xmm10","xmm11");
  dt=now()-t;
  printf("vpdpbusd zmm: %.2f G instr/s = %.1f GMAC/s (1 core)\n", 12.0*n/dt/1e9, 12.0*n*64/dt/1e9);
  t=now();
  __asm__ volatile(
    "mov %0, %%rcx\n"
    "1:\n"
    "vfmadd231ps %%zmm14,%%zmm15,%%zmm0\n vfmadd231ps %%zmm14,%%zmm15,%%zmm1\n vfmadd231ps %%zmm14,%%zmm15,%%zmm2\n vfmadd231ps %%zmm14,%%zmm15,%%zmm3\n"
    "vfmadd231ps %%zmm14,%%zmm15,%%zmm4\n vfmadd231ps %%zmm14,%%zmm15,%%zmm5\n vfmadd231ps %%zmm14,%%zmm15,%%zmm6\n vfmadd231ps %%zmm14,%%zmm15,%%zmm7\n"
    "vfmadd231ps %%zmm14,%%zmm15,%%zmm8\n vfmadd231ps %%zmm14,%%zmm15,%%zmm9\n vfmadd231ps %%zmm14,%%zmm15,%%zmm10\n vfmadd231ps %%zmm14,%%zmm15,%%zmm11\n"
    "dec %%rcx\n jnz 1b\n" :: "r"(n) : "rcx","xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm8","xmm9","xmm10","xmm11");
  dt=now()-t;
  printf("vfmadd231ps zmm: %.2f G instr/s = %.1f GFMA/s (1 core)\n", 12.0*n/dt/1e9, 12.0*n*16/dt/1e9);
  }
}
