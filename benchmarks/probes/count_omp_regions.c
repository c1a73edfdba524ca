// A probe, not engine code: counts the OpenMP parallel regions a process opens (libgomp's
// GOMP_parallel with more than one thread, as torch's and ATen's parallel_for call it), printed at exit.
// A decode step's count is the difference between two runs that differ only in their step count:
//
//   gcc -O2 -shared -fPIC benchmarks/probes/count_omp_regions.c -o /tmp/count_omp_regions.so -ldl
//   LD_PRELOAD=/tmp/count_omp_regions.so OMP_WAIT_POLICY=PASSIVE .venv/bin/python ...
//
// Used for docs/performance.md part 15: 0 regions per batch-1 decode step (greedy and sampled),
// ~8 per 64-row step.
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
