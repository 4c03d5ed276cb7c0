// The CPU extension's own threads: the asynchronous half of the cross-layer prefetch.
//
// A prefetch start (cpu_handlers.cc) checks its call, snapshots what it reads and hands the work (plan layer
// l+1's predicted positions, stage the missing rows from the host pool) to these threads, keyed by its job;
// it returns at once, so layer l's attention and MoE run meanwhile. The prefetch wait of layer l+1 (just
// before that layer's swap-in) blocks until every task of its job is done, running queued tasks itself
// rather than sleeping (so a call never waits on a thread that has not started: the pool may be busy, or
// have no thread at all). Tasks write only their job's memory.
//
// Threads: HISPARSE_PREFETCH_THREADS (default: a quarter of the cores, 1 to 4); 0 runs every task in the
// waiting call (no overlap, same results).
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

namespace hisparse {

// The prefetch's background tasks: each plans, commits and copies some rows of one call.
class CopyWorkers {
 public:
  using Task = std::function<void()>;

  // The process's pool, created on first use and never destroyed (threads may outlive static destructors).
  static CopyWorkers& Get() {
    static CopyWorkers* workers = new CopyWorkers(DefaultThreads());
    return *workers;
  }

  // Queues tasks under `key` (their job).
  void Submit(const void* key, std::vector<Task> tasks) {
    if (tasks.empty()) return;
    std::lock_guard<std::mutex> lock(mu_);
    for (Task& t : tasks) {
      queue_.push_back(Entry{key, std::move(t)});
      ++pending_[key];
    }
    work_cv_.notify_all();
  }

  // Returns once every task submitted under `key` is done; runs the still queued ones on this thread.
  void Wait(const void* key) {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      if (pending_.find(key) == pending_.end()) return;
      auto it = std::find_if(queue_.begin(), queue_.end(), [key](const Entry& e) { return e.key == key; });
      if (it == queue_.end()) {  // the rest are running on the workers
        done_cv_.wait(lock);
        continue;
      }
      Run(it, lock);
    }
  }

  // Returns once no task of any key is queued or running (before a host pool the tasks read is freed); runs
  // the queued ones on this thread.
  void WaitAll() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!pending_.empty()) {
      if (queue_.empty()) {  // the rest are running on the workers
        done_cv_.wait(lock);
        continue;
      }
      Run(queue_.begin(), lock);
    }
  }

  int Threads() const { return threads_; }

 private:
  struct Entry {
    const void* key;
    Task task;
  };

  static int DefaultThreads() {
    if (const char* env = std::getenv("HISPARSE_PREFETCH_THREADS")) return std::clamp(std::atoi(env), 0, 64);
    const int cores = static_cast<int>(std::thread::hardware_concurrency());
    return std::clamp(cores / 4, 1, 4);
  }

  explicit CopyWorkers(int threads) : threads_(threads) {
    for (int i = 0; i < threads; ++i) std::thread([this] { Loop(); }).detach();
  }

  // With mu_ held (by `lock`): takes the queued task `it` out of the queue, runs it with mu_ released, and
  // counts it done.
  void Run(std::deque<Entry>::iterator it, std::unique_lock<std::mutex>& lock) {
    Entry e = std::move(*it);
    queue_.erase(it);
    lock.unlock();
    e.task();
    lock.lock();
    auto count = pending_.find(e.key);
    if (--count->second == 0) {
      pending_.erase(count);
      done_cv_.notify_all();
    }
  }

  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      work_cv_.wait(lock, [this] { return !queue_.empty(); });
      Run(queue_.begin(), lock);
    }
  }

  const int threads_;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<Entry> queue_;
  std::unordered_map<const void*, int64_t> pending_;  // key -> tasks queued or running
};

}  // namespace hisparse
