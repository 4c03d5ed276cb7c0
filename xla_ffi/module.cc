// Python module exporting the CPU handlers as capsules for jax.ffi.register_ffi_target,
// and the allocator of extension-owned host pools (host_pool.h).
#include <nanobind/nanobind.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "host_pool.h"
#include "xla/ffi/api/c_api.h"

extern "C" XLA_FFI_Error* HisparseSwapInCpu(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* HisparseBackupCpu(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* HisparseSwapInExtCpu(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* HisparseBackupExtCpu(XLA_FFI_CallFrame*);

namespace nb = nanobind;
using hisparse::HostPoolRegistry;

namespace {

constexpr size_t kAlignment = 4096;

uintptr_t AllocHostPool(size_t bytes) {
  const size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  void* p = std::aligned_alloc(kAlignment, rounded == 0 ? kAlignment : rounded);
  if (p == nullptr) throw std::bad_alloc();
  std::memset(p, 0, rounded);
  HostPoolRegistry::Get().Add(reinterpret_cast<uintptr_t>(p), bytes);
  return reinterpret_cast<uintptr_t>(p);
}

void FreeHostPool(uintptr_t address) {
  if (HostPoolRegistry::Get().Remove(address) == 0)
    throw std::invalid_argument("free_host_pool: " + std::to_string(address) + " is not a live host pool");
  std::free(reinterpret_cast<void*>(address));
}

// Copies [offset, offset + size) of a pool into bytes / from bytes (tests, debugging).
nb::bytes ReadHostPool(uintptr_t address, size_t offset, size_t size) {
  const size_t have = HostPoolRegistry::Get().Size(address);
  if (have == 0 || offset + size > have) throw std::out_of_range("read_host_pool: outside the pool");
  return nb::bytes(reinterpret_cast<const char*>(address) + offset, size);
}

void WriteHostPool(uintptr_t address, size_t offset, nb::bytes data) {
  const size_t have = HostPoolRegistry::Get().Size(address);
  if (have == 0 || offset + data.size() > have) throw std::out_of_range("write_host_pool: outside the pool");
  std::memcpy(reinterpret_cast<char*>(address) + offset, data.c_str(), data.size());
}

}  // namespace

NB_MODULE(_ffi_cpu, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["hisparse_swap_in"] = nb::capsule(reinterpret_cast<void*>(&HisparseSwapInCpu));
    d["hisparse_backup"] = nb::capsule(reinterpret_cast<void*>(&HisparseBackupCpu));
    d["hisparse_swap_in_ext"] = nb::capsule(reinterpret_cast<void*>(&HisparseSwapInExtCpu));
    d["hisparse_backup_ext"] = nb::capsule(reinterpret_cast<void*>(&HisparseBackupExtCpu));
    return d;
  });
  m.def("alloc_host_pool", &AllocHostPool, nb::arg("bytes"),
        "Allocates a zeroed, page-aligned host pool; returns its address.");
  m.def("free_host_pool", &FreeHostPool, nb::arg("address"));
  m.def("read_host_pool", &ReadHostPool, nb::arg("address"), nb::arg("offset"), nb::arg("size"));
  m.def("write_host_pool", &WriteHostPool, nb::arg("address"), nb::arg("offset"), nb::arg("data"));
}
