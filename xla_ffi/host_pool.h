// Host pools owned by the extension (the fallback to a `pinned_host` JAX array).
//
// Python allocates one through the module (`alloc_host_pool`), passes its
// address to the "_ext" handlers as an attribute, and frees it when done. The
// handlers only accept addresses registered here, with a size that covers the
// rows they will touch, so a stale or forged address is an FFI error rather
// than a wild read. One registry per extension module (CPU / CUDA).
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>

namespace hisparse {

class HostPoolRegistry {
 public:
  static HostPoolRegistry& Get() {
    static HostPoolRegistry registry;
    return registry;
  }
  void Add(uintptr_t address, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    pools_[address] = bytes;
  }
  // Returns the registered size in bytes, or 0 when unknown.
  size_t Remove(uintptr_t address) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pools_.find(address);
    if (it == pools_.end()) return 0;
    const size_t bytes = it->second;
    pools_.erase(it);
    return bytes;
  }
  size_t Size(uintptr_t address) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pools_.find(address);
    return it == pools_.end() ? 0 : it->second;
  }

 private:
  std::mutex mu_;
  std::unordered_map<uintptr_t, size_t> pools_;
};

// [offset, offset + size) of a live pool, for the modules' read/write helpers;
// throws std::out_of_range (a Python IndexError) otherwise.
inline char* PoolRange(uintptr_t address, size_t offset, size_t size, const char* what) {
  const size_t have = HostPoolRegistry::Get().Size(address);
  if (have == 0 || offset > have || size > have - offset)
    throw std::out_of_range(std::string(what) + ": outside the pool");
  return reinterpret_cast<char*>(address) + offset;
}

}  // namespace hisparse
