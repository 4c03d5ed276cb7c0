// ParallelFor over XLA's intra-op thread pool, shared by the CPU handlers.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace hisparse {

// Runs f(0..n-1) on the calling thread plus up to num_threads - 1 tasks of
// XLA's intra-op thread pool; items are handed out one at a time (requests
// differ in work). Returns after every scheduled task has finished.
template <typename F>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, int64_t min_items_per_task, F&& f) {
  const int64_t workers = std::min<int64_t>(pool.num_threads(), n / std::max<int64_t>(min_items_per_task, 1));
  if (workers <= 1) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};
  auto work = [&] {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) f(i);
    finished.fetch_add(1, std::memory_order_acq_rel);
  };
  for (int64_t w = 1; w < workers; ++w) pool.Schedule([&work] { work(); });
  work();
  while (finished.load(std::memory_order_acquire) < workers) std::this_thread::yield();
}

}  // namespace hisparse
