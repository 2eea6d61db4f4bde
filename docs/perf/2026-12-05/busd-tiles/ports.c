#include <stdio.h>
#include <time.h>
#include <stdint.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int32_t buf[64] __attribute__((aligned(64)));
#define B(r,off) "vpbroadcastd " #off "(%1),%%zmm" #r "\n vpdpbusd %%zmm" #r ",%%zmm15,%%zmm" #r "\n"
int main(){
  long n=100000000;
  for(int rep=0;rep<2;rep++){
  double t=now();
  // broadcast into a reg then dpbusd (1:1)
  __asm__ volatile(
    "mov %0, %%rcx\n"
    "1:\n"
    "vpbroadcastd 0(%1),%%zmm20\n vpdpbusd %%zmm20,%%zmm15,%%zmm0\n"
    "vpbroadcastd 4(%1),%%zmm21\n vpdpbusd %%zmm21,%%zmm15,%%zmm1\n"
    "vpbroadcastd 8(%1),%%zmm22\n vpdpbusd %%zmm22,%%zmm15,%%zmm2\n"
    "vpbroadcastd 12(%1),%%zmm23\n vpdpbusd %%zmm23,%%zmm15,%%zmm3\n"
    "vpbroadcastd 16(%1),%%zmm24\n vpdpbusd %%zmm24,%%zmm15,%%zmm4\n"
    "vpbroadcastd 20(%1),%%zmm25\n vpdpbusd %%zmm25,%%zmm15,%%zmm5\n"
    "vpbroadcastd 24(%1),%%zmm26\n vpdpbusd %%zmm26,%%zmm15,%%zmm6\n"
    "vpbroadcastd 28(%1),%%zmm27\n vpdpbusd %%zmm27,%%zmm15,%%zmm7\n"
    "dec %%rcx\n jnz 1b\n" :: "r"(n), "r"(buf) : "rcx","memory");
  double dt=now()-t;
  printf("bcast+dpbusd: %.2f G dpbusd/s\n", 8.0*n/dt/1e9);
  t=now();
  __asm__ volatile(
    "mov %0, %%rcx\n"
    "1:\n"
    "vpdpbusd 0(%1)%{1to16%},%%zmm15,%%zmm0\n"
    "vpdpbusd 4(%1)%{1to16%},%%zmm15,%%zmm1\n"
    "vpdpbusd 8(%1)%{1to16%},%%zmm15,%%zmm2\n"
    "vpdpbusd 12(%1)%{1to16%},%%zmm15,%%zmm3\n"
    "vpdpbusd 16(%1)%{1to16%},%%zmm15,%%zmm4\n"
    "vpdpbusd 20(%1)%{1to16%},%%zmm15,%%zmm5\n"
    "vpdpbusd 24(%1)%{1to16%},%%zmm15,%%zmm6\n"
    "vpdpbusd 28(%1)%{1to16%},%%zmm15,%%zmm7\n"
    "dec %%rcx\n jnz 1b\n" :: "r"(n), "r"(buf) : "rcx","memory");
  dt=now()-t;
  printf("embedded bcast dpbusd: %.2f G dpbusd/s\n", 8.0*n/dt/1e9);
  t=now();
  __asm__ volatile(
    "mov %0, %%rcx\n"
    "1:\n"
    "vmovdqa64 %%zmm0,%%zmm16\n vpdpbusd %%zmm14,%%zmm15,%%zmm16\n vmovdqa64 %%zmm16,%%zmm0\n"
    "vmovdqa64 %%zmm1,%%zmm17\n vpdpbusd %%zmm14,%%zmm15,%%zmm17\n vmovdqa64 %%zmm17,%%zmm1\n"
    "vmovdqa64 %%zmm2,%%zmm18\n vpdpbusd %%zmm14,%%zmm15,%%zmm18\n vmovdqa64 %%zmm18,%%zmm2\n"
    "vmovdqa64 %%zmm3,%%zmm19\n vpdpbusd %%zmm14,%%zmm15,%%zmm19\n vmovdqa64 %%zmm19,%%zmm3\n"
    "vmovdqa64 %%zmm4,%%zmm20\n vpdpbusd %%zmm14,%%zmm15,%%zmm20\n vmovdqa64 %%zmm20,%%zmm4\n"
    "vmovdqa64 %%zmm5,%%zmm21\n vpdpbusd %%zmm14,%%zmm15,%%zmm21\n vmovdqa64 %%zmm21,%%zmm5\n"
    "vmovdqa64 %%zmm6,%%zmm22\n vpdpbusd %%zmm14,%%zmm15,%%zmm22\n vmovdqa64 %%zmm22,%%zmm6\n"
    "vmovdqa64 %%zmm7,%%zmm23\n vpdpbusd %%zmm14,%%zmm15,%%zmm23\n vmovdqa64 %%zmm23,%%zmm7\n"
    "dec %%rcx\n jnz 1b\n" :: "r"(n), "r"(buf) : "rcx","memory");
  dt=now()-t;
  printf("mov+dpbusd+mov: %.2f G dpbusd/s\n", 8.0*n/dt/1e9);
  t=now();
  __asm__ volatile(
    "mov %0, %%rcx\n"
    "1:\n"
    "vpdpbusd %%zmm14,%%zmm15,%%zmm0\n vpandd %%zmm14,%%zmm13,%%zmm24\n"
    "vpdpbusd %%zmm14,%%zmm15,%%zmm1\n vpsrlw $4,%%zmm13,%%zmm25\n"
    "vpdpbusd %%zmm14,%%zmm15,%%zmm2\n vpunpcklbw %%zmm14,%%zmm13,%%zmm26\n"
    "vpdpbusd %%zmm14,%%zmm15,%%zmm3\n vpandd %%zmm14,%%zmm13,%%zmm27\n"
    "vpdpbusd %%zmm14,%%zmm15,%%zmm4\n vpsrlw $4,%%zmm13,%%zmm28\n"
    "vpdpbusd %%zmm14,%%zmm15,%%zmm5\n vpunpcklwd %%zmm14,%%zmm13,%%zmm29\n"
    "vpdpbusd %%zmm14,%%zmm15,%%zmm6\n"
    "vpdpbusd %%zmm14,%%zmm15,%%zmm7\n"
    "dec %%rcx\n jnz 1b\n" :: "r"(n), "r"(buf) : "rcx","memory");
  dt=now()-t;
  printf("8 dpbusd + 6 alu(and,srl,unpck): %.2f G dpbusd/s\n", 8.0*n/dt/1e9);
  }
}
