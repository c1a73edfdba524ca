// Counts the OpenMP parallel regions a process opens (libgomp's GOMP_parallel with more than one
// thread, as torch's and ATen's parallel_for call it), printed at exit. A decode step's count is the
// difference between two runs that differ only in their step count, divided by the difference:
//
//   gcc -O2 -shared -fPIC benchmarks/experiments/count_omp_regions.c -o /tmp/count_omp_regions.so -ldl
//   LD_PRELOAD=/tmp/count_omp_regions.so OMP_WAIT_POLICY=PASSIVE python -m benchmarks.step_profile \
//       --running 64 --rounds 1 --steps 1        (then --steps 201: the difference / 200; --sampled too)
//
// docs/performance.md quotes its counts: none in a batch-1 decode step (greedy or sampled), ~8 in a
// 64-row step.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>

static long regions;
typedef void (*parallel_fn)(void (*)(void*), void*, unsigned, unsigned);

void GOMP_parallel(void (*fn)(void*), void* data, unsigned threads, unsigned flags) {
  static parallel_fn real;
  if (!real) real = (parallel_fn)dlsym(RTLD_NEXT, "GOMP_parallel");
  if (threads != 1) __atomic_fetch_add(&regions, 1, __ATOMIC_RELAXED);
  real(fn, data, threads, flags);
}

__attribute__((destructor)) static void report(void) { fprintf(stderr, "OpenMP parallel regions: %ld\n", regions); }
