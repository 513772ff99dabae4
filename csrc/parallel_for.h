// ParallelFor over XLA's CPU intra-op thread pool (ffi::ThreadPool).
//
// The calling thread takes part in the work, and chunks are claimed from a
// shared counter, so the loop completes even when the pool has no free thread
// (the caller then runs every chunk itself). Work assignment never changes
// results: callers give each chunk a disjoint set of outputs.
#ifndef PZSC_CSRC_PARALLEL_FOR_H_
#define PZSC_CSRC_PARALLEL_FOR_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace pzsc {

// Number of workers (pool threads, at least 1) a ParallelFor may use.
inline int64_t NumWorkers(xla::ffi::ThreadPool& pool) {
  return std::max<int64_t>(1, pool.num_threads());
}

// Runs fn(i) for every i in [0, n); returns when all calls have finished.
template <typename Fn>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, const Fn& fn) {
  if (n <= 0) return;
  const int64_t workers = std::min<int64_t>(NumWorkers(pool), n);
  if (workers <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto state = std::make_shared<State>();
  // Late tasks find no chunk left and never touch `fn` (which may be gone).
  auto run = [state, n, &fn]() {
    for (int64_t i; (i = state->next.fetch_add(1)) < n;) {
      fn(i);
      if (state->done.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lock(state->mu);
        state->cv.notify_all();
      }
    }
  };
  for (int64_t w = 1; w < workers; ++w) pool.Schedule(decltype(run)(run));
  run();
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done.load() == n; });
}

}  // namespace pzsc

#endif  // PZSC_CSRC_PARALLEL_FOR_H_
