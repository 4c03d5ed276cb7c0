// Host pools owned by the extension (the fallback to a `pinned_host` JAX array).
//
// Python allocates one through the module (`alloc_host_pool(layers, rows,
// row_bytes)`), passes its address, geometry and serial number to the "_ext"
// handlers as attributes, and frees it when done. The handlers only accept an
// address registered here with that serial (a new pool at a freed pool's
// address has another) and exactly that geometry, so a stale or forged ref is
// an FFI error rather than a wild or misplaced access. One registry per
// extension module (CPU / CUDA).
#pragma once

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
  // Returns the registered size in bytes, or 0 when unknown.
  size_t Remove(uintptr_t address) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pools_.find(address);
    if (it == pools_.end()) return 0;
    const size_t bytes = it->second.bytes;
    pools_.erase(it);
    return bytes;
  }
  size_t Size(uintptr_t address) { return Find(address).bytes; }
  // The live pool at address (bytes 0 when none).
  HostPoolEntry Find(uintptr_t address) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pools_.find(address);
    return it == pools_.end() ? HostPoolEntry{} : it->second;
  }

 private:
  std::mutex mu_;
  std::unordered_map<uintptr_t, HostPoolEntry> pools_;
  uint64_t serial_ = 0;
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
