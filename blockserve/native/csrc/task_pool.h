// A thread pool for the short calls of a decode step, where OpenMP's hand-off is the problem: a
// sleeping OpenMP thread (OMP_WAIT_POLICY=PASSIVE) takes ~100 us to wake on a VM, and a spinning
// one holds its core after every region, starving the server's own threads (thread_policy.py).
//
//   run(n, f)   f(0..n-1) once each, on the calling thread and the pool's workers, returns when
//               all are done.
//
// The tasks are cut into one lane of consecutive tasks per thread (the caller's lane 0, worker i's
// lane i + 1). A thread claims its own lane's tasks in order, one at a time from that lane's
// counter, then helps the other lanes, claiming from their counters. So while every thread is
// running, each reads a contiguous span of the weights (one stream for the prefetcher) and claims
// from a cache line no other thread writes; a thread that is asleep or descheduled holds nothing
// up, its lane is taken by the others, and the caller waits only for tasks a worker has begun.
// (One shared counter over all the tasks interleaves the threads' rows and moves its line between
// the cores at every claim: a 1-row step's matmuls at two threads take ~1.4x the time, docs/cpu.md.)
//
// A worker spins for kSpinMicros after its last task (the next call of a decode step comes within
// tens of microseconds), then sleeps on a condition variable until the next call: between steps
// the pool holds no core. Which thread runs a task never changes its result (each task writes
// its own outputs), so results are the same bits at any thread count. The pool has
// at::get_num_threads() - 1 workers, started on first use and resized by the next call that
// splits when torch's count changes (the engine's thread governor); at one thread calls run
// inline and the workers stay asleep. A child of fork() starts with no workers (they were not
// copied): the first call that splits there starts its own (see after_fork_in_child).

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <memory>
#include <new>
#include <thread>
#include <vector>

#include <pthread.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define BLOCKSERVE_PAUSE() _mm_pause()
#else
#define BLOCKSERVE_PAUSE() std::this_thread::yield()
#endif

namespace blockserve {

class TaskPool;
inline TaskPool& task_pool();

class TaskPool {
 public:
  static constexpr int64_t kSpinMicros = 200;

  TaskPool() { pthread_atfork(nullptr, nullptr, [] { task_pool().after_fork_in_child(); }); }
  ~TaskPool() { resize(0); }

  // In a child of fork(): only the forking thread exists, so the worker handles name threads that
  // are not there (joining them would hang) and a lock may be held by one. The handles' memory is
  // dropped unjoined, the locks and counters start afresh; the next split starts new workers.
  void after_fork_in_child() {
    new (&workers_) std::vector<std::thread>();
    new (&call_mutex_) std::mutex();
    new (&mutex_) std::mutex();
    new (&wake_) std::condition_variable();
    stop_.store(false);
    job_.store(nullptr);
    inside_.store(0);
  }

  template <typename F>
  void run(int64_t n, const F& f) {
    const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
    if (threads <= 1 || at::in_parallel_region()) {
      for (int64_t t = 0; t < n; ++t) f(t);
      return;
    }
    std::lock_guard<std::mutex> one_call(call_mutex_);  // one job at a time (callers on other threads wait)
    resize(at::get_num_threads() - 1);
    if (lane_capacity_ < threads) {
      lanes_ = std::make_unique<Lane[]>(threads);
      lane_capacity_ = threads;
    }
    for (int64_t l = 0; l < threads; ++l) {
      lanes_[l].next.store(n * l / threads, std::memory_order_relaxed);
      lanes_[l].end = n * (l + 1) / threads;
    }
    Job job{[](const void* fn, int64_t t) { (*static_cast<const F*>(fn))(t); }, &f, lanes_.get(), threads};
    {
      std::lock_guard<std::mutex> lock(mutex_);  // a worker going to sleep cannot miss the new generation
      job_.store(&job, std::memory_order_seq_cst);
      generation_.fetch_add(1, std::memory_order_seq_cst);
    }
    wake_.notify_all();  // a cheap no-op for spinning workers; wakes sleeping ones
    job.work(0);
    while (job.done.load(std::memory_order_acquire) < n) BLOCKSERVE_PAUSE();
    job_.store(nullptr, std::memory_order_seq_cst);
    while (inside_.load(std::memory_order_seq_cst) != 0) BLOCKSERVE_PAUSE();  // no worker still holds &job
  }

 private:
  // Tasks [next, end) of one lane not claimed yet; each lane on its own cache line.
  struct alignas(64) Lane {
    std::atomic<int64_t> next{0};
    int64_t end = 0;
  };

  struct Job {
    void (*call)(const void*, int64_t);
    const void* fn;
    Lane* lanes;
    int64_t count;                             // lanes
    alignas(64) std::atomic<int64_t> done{0};  // tasks finished, added once per thread and job

    // Lane `first`'s tasks, then every other lane's, in order.
    void work(int64_t first) {
      int64_t finished = 0;
      for (int64_t i = 0; i < count; ++i) {
        Lane& lane = lanes[(first + i) % count];
        for (int64_t t; (t = lane.next.fetch_add(1, std::memory_order_relaxed)) < lane.end; ++finished) call(fn, t);
      }
      if (finished > 0) done.fetch_add(finished, std::memory_order_release);
    }
  };

  void resize(int64_t workers) {
    if (static_cast<int64_t>(workers_.size()) == workers) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_.store(true);
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
    workers_.clear();
    stop_.store(false);
    for (int64_t i = 0; i < workers; ++i) workers_.emplace_back([this, i] { loop(i + 1); });
  }

  void loop(int64_t lane) {
    uint64_t seen = generation_.load();
    for (;;) {
      // Spin on the generation for kSpinMicros, then sleep until it moves (or stop).
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
      for (int spins = 1; generation_.load(std::memory_order_acquire) == seen && !stop_.load(); ++spins) {
        if (spins % 256 == 0 && std::chrono::steady_clock::now() > until) {
          std::unique_lock<std::mutex> lock(mutex_);
          wake_.wait(lock, [&] { return generation_.load() != seen || stop_.load(); });
          break;
        }
        BLOCKSERVE_PAUSE();
      }
      if (stop_.load()) return;
      seen = generation_.load();
      inside_.fetch_add(1, std::memory_order_seq_cst);
      if (Job* job = job_.load(std::memory_order_seq_cst)) job->work(lane % job->count);
      inside_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  std::mutex call_mutex_, mutex_;
  std::condition_variable wake_;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> generation_{0};  // moved under mutex_, read while spinning
  std::atomic<bool> stop_{false};
  std::atomic<Job*> job_{nullptr};
  std::atomic<int64_t> inside_{0};
  std::unique_ptr<Lane[]> lanes_;  // the current job's, reused (one job at a time)
  int64_t lane_capacity_ = 0;
};

// The process's pool: the one module's kernels (matmuls, decode attention) share it. Its static is
// a GNU unique symbol (nm: `u`), which the dynamic linker binds to one instance process-wide, so a
// second build of the module in one process (-mno-avx512f, in tests) hands its tasks to the same workers.
inline TaskPool& task_pool() {
  static TaskPool pool;
  return pool;
}

// body(begin, end) over [0, n) in ranges, run on task_pool(): n / min_per_task ranges (rounded up),
// and where that is more than one, rounded up to a multiple of the thread count with the items
// shared evenly, so no thread is left with a short last range while the others wait (a 144-group
// matmul in ranges of 113 ran as 113 + 31 on two threads: 1.6x the balanced time).
template <typename F>
void for_each_range(int64_t n, int64_t min_per_task, const F& body) {
  int64_t tasks = (n + min_per_task - 1) / min_per_task;
  if (const int64_t threads = at::get_num_threads(); tasks > 1 && threads > 1)
    tasks = std::min(n, (tasks + threads - 1) / threads * threads);
  const int64_t per_task = (n + tasks - 1) / tasks;
  task_pool().run((n + per_task - 1) / per_task,
                  [&](int64_t t) { body(t * per_task, std::min(n, (t + 1) * per_task)); });
}

}  // namespace blockserve
