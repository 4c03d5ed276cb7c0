// Host pools owned by the extension (the fallback to a `pinned_host` JAX array).
//
// Python allocates one through the module (`alloc_host_pool(layers, rows,
// row_bytes)`), passes its address, geometry and serial number to the "_ext"
// handlers as attributes, and frees it when done. The handlers only accept an
// address registered here with that serial (a new pool at a freed pool's
// address has another) and exactly that geometry, so a stale or forged ref is
// an FFI error rather than a wild or misplaced access. A handler pins the
// pool while it runs (PinnedPool), and freeing it first unregisters it (new
// calls fail) and then waits for the pinned ones, so a free racing a call never
// frees memory that call still reads. One registry per extension module (CPU / CUDA).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>

namespace hisparse {

struct HostPoolEntry {
  size_t bytes = 0;  // 0: no live pool
  int64_t layers = 0, rows = 0;
  uint64_t serial = 0;
  bool live = true;  // false once Remove started: no new pin
  int64_t pins = 0;  // handlers using the pool now
};

class HostPoolRegistry {
 public:
  static HostPoolRegistry& Get() {
    static HostPoolRegistry registry;
    return registry;
  }
  // Registers a pool of layers x rows rows of bytes / (layers x rows) bytes; returns its serial number.
  uint64_t Add(uintptr_t address, size_t bytes, int64_t layers, int64_t rows) {
    std::lock_guard<std::mutex> lock(mu_);
    pools_[address] = HostPoolEntry{bytes, layers, rows, ++serial_};
    return serial_;
  }
  // Unregisters the pool (a later Pin or Find fails), waits until no handler pins it, and returns its size in
  // bytes (0 when no live pool is registered there: nothing waited for).
  size_t Remove(uintptr_t address) {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = pools_.find(address);
    if (it == pools_.end() || !it->second.live) return 0;
    it->second.live = false;
    unpinned_.wait(lock, [&] { return pools_.at(address).pins == 0; });
    const size_t bytes = pools_.at(address).bytes;
    pools_.erase(address);
    return bytes;
  }
  size_t Size(uintptr_t address) { return Find(address).bytes; }
  // The live pool at address (bytes 0 when none).
  HostPoolEntry Find(uintptr_t address) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pools_.find(address);
    return it == pools_.end() || !it->second.live ? HostPoolEntry{} : it->second;
  }
  // The live pool at address with this serial, pinned until Unpin (bytes 0, and no pin, when none).
  HostPoolEntry Pin(uintptr_t address, uint64_t serial) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pools_.find(address);
    if (it == pools_.end() || !it->second.live || it->second.serial != serial) return HostPoolEntry{};
    ++it->second.pins;
    return it->second;
  }
  void Unpin(uintptr_t address) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pools_.find(address);
    if (it != pools_.end() && --it->second.pins == 0) unpinned_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable unpinned_;
  std::unordered_map<uintptr_t, HostPoolEntry> pools_;
  uint64_t serial_ = 0;
};

// A handler's pin of a pool (HostPoolRegistry::Pin), released when it goes out of scope.
class PinnedPool {
 public:
  PinnedPool() = default;
  explicit PinnedPool(uintptr_t address) : address_(address) {}
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;
  PinnedPool& operator=(PinnedPool&& other) noexcept {
    if (this != &other) {
      Release();
      address_ = other.address_;
      other.address_ = 0;
    }
    return *this;
  }
  ~PinnedPool() { Release(); }

 private:
  void Release() {
    if (address_ != 0) HostPoolRegistry::Get().Unpin(address_);
    address_ = 0;
  }
  uintptr_t address_ = 0;
};

// [offset, offset + size) of a live pool, for the modules' read/write helpers;
// throws std::out_of_range (a Python IndexError) otherwise.
inline char* PoolRange(uintptr_t address, size_t offset, size_t size, const char* what) {
  const size_t have = HostPoolRegistry::Get().Size(address);
  if (have == 0 || offset > have || size > have - offset)
    throw std::out_of_range(std::string(what) + ": outside the pool");
  return reinterpret_cast<char*>(address) + offset;
}

// The bytes of a pool of layers x rows rows of row_bytes; throws std::invalid_argument (a Python ValueError)
// unless layers, rows >= 1 and the pool is under 2^62 bytes.
inline size_t HostPoolBytes(int64_t layers, int64_t rows, size_t row_bytes) {
  size_t bytes = 0;
  if (layers < 1 || rows < 1 ||
      __builtin_mul_overflow(static_cast<size_t>(layers), static_cast<size_t>(rows), &bytes) ||
      __builtin_mul_overflow(bytes, row_bytes, &bytes) || bytes > (size_t{1} << 62))
    throw std::invalid_argument("alloc_host_pool: layers and rows must be >= 1, and the pool under 2^62 bytes");
  return bytes;
}

}  // namespace hisparse
