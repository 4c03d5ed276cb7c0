// ParallelFor over XLA's intra-op thread pool, shared by the CPU handlers.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace hisparse {

// Runs f(0..n-1) on the calling thread plus up to num_threads - 1 tasks of
// XLA's intra-op thread pool; items are handed out one at a time (requests
// differ in work). Returns once every item is done.
//
// The caller never waits for a task to start: the pool is shared by every
// device of a multi-device CPU client, and its threads may all be running
// another device's program that is blocked in a collective waiting for this
// one (waiting for our tasks to start would deadlock). The caller runs items
// until none are left, then waits only for items other threads are running.
// A task that starts late claims no item, so it never touches f (which lives
// on the caller's stack); it holds only the shared counters.
template <typename F>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, int64_t min_items_per_task, F&& f) {
  const int64_t workers = std::min<int64_t>(pool.num_threads(), n / std::max<int64_t>(min_items_per_task, 1));
  if (workers <= 1) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
  struct Counters {
    std::atomic<int64_t> next{0};  // next item to claim
    std::atomic<int64_t> done{0};  // items finished
  };
  auto counters = std::make_shared<Counters>();
  auto* fn = &f;
  auto work = [counters, fn, n] {
    for (int64_t i; (i = counters->next.fetch_add(1, std::memory_order_relaxed)) < n;) {
      (*fn)(i);
      counters->done.fetch_add(1, std::memory_order_acq_rel);
    }
  };
  for (int64_t w = 1; w < workers; ++w) {
    auto task = work;  // each task owns a copy (and so a reference to the counters)
    pool.Schedule(std::move(task));
  }
  work();
  while (counters->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

}  // namespace hisparse
