// Python module exporting the CUDA handlers as capsules (built only where nvcc is found),
// and the allocator of extension-owned pinned host pools (host_pool.h): the fallback for
// GPUs where XLA does not hand a `pinned_host` operand to a custom call as a host pointer.
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

#include "host_pool.h"
#include "xla/ffi/api/c_api.h"

extern "C" XLA_FFI_Error* HisparseSwapInCuda(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* HisparseBackupCuda(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* HisparseSwapInExtCuda(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* HisparseBackupExtCuda(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* HisparsePrefetchStartCuda(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* HisparsePrefetchStartExtCuda(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* HisparsePrefetchWaitCuda(XLA_FFI_CallFrame*);

namespace nb = nanobind;
using hisparse::HostPoolRegistry;

namespace {

void Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// Pinned, mapped (device-readable over PCIe / NVLink-C2C), portable across contexts.
// (address, serial number) of a new pool.
std::pair<uintptr_t, uint64_t> AllocPinnedHostPool(int64_t layers, int64_t rows, size_t row_bytes) {
  const size_t bytes = hisparse::HostPoolBytes(layers, rows, row_bytes);
  void* p = nullptr;
  Check(cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable), "cudaHostAlloc");  // bytes >= 1
  std::memset(p, 0, bytes);
  const uintptr_t address = reinterpret_cast<uintptr_t>(p);
  return {address, HostPoolRegistry::Get().Add(address, bytes, layers, rows)};
}

// Unregisters the pool (later calls naming it fail), waits for the handlers using it now, then for every
// device's queued work (their kernels read and write it after the handlers return), and frees it. Called
// without the GIL.
void FreePinnedHostPool(uintptr_t address) {
  if (HostPoolRegistry::Get().Remove(address) == 0)
    throw std::invalid_argument("free_host_pool: " + std::to_string(address) + " is not a live host pool");
  int current = 0, devices = 0;
  Check(cudaGetDevice(&current), "cudaGetDevice");
  Check(cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
  for (int d = 0; d < devices; ++d) {
    Check(cudaSetDevice(d), "cudaSetDevice");
    Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
  Check(cudaSetDevice(current), "cudaSetDevice");
  Check(cudaFreeHost(reinterpret_cast<void*>(address)), "cudaFreeHost");
}

nb::bytes ReadHostPool(uintptr_t address, size_t offset, size_t size) {
  return nb::bytes(hisparse::PoolRange(address, offset, size, "read_host_pool"), size);
}

void WriteHostPool(uintptr_t address, size_t offset, nb::bytes data) {
  std::memcpy(hisparse::PoolRange(address, offset, data.size(), "write_host_pool"), data.c_str(), data.size());
}

}  // namespace

NB_MODULE(_ffi_cuda, m) {
  m.attr("cuda_arch") = HISPARSE_CUDA_ARCH;
  m.def("registrations", []() {
    nb::dict d;
    d["hisparse_swap_in"] = nb::capsule(reinterpret_cast<void*>(&HisparseSwapInCuda));
    d["hisparse_backup"] = nb::capsule(reinterpret_cast<void*>(&HisparseBackupCuda));
    d["hisparse_swap_in_ext"] = nb::capsule(reinterpret_cast<void*>(&HisparseSwapInExtCuda));
    d["hisparse_backup_ext"] = nb::capsule(reinterpret_cast<void*>(&HisparseBackupExtCuda));
    d["hisparse_prefetch_start"] = nb::capsule(reinterpret_cast<void*>(&HisparsePrefetchStartCuda));
    d["hisparse_prefetch_start_ext"] = nb::capsule(reinterpret_cast<void*>(&HisparsePrefetchStartExtCuda));
    d["hisparse_prefetch_wait"] = nb::capsule(reinterpret_cast<void*>(&HisparsePrefetchWaitCuda));
    return d;
  });
  m.def("alloc_host_pool", &AllocPinnedHostPool, nb::arg("layers"), nb::arg("rows"), nb::arg("row_bytes"),
        "Allocates a zeroed pinned, mapped host pool (cudaHostAlloc) of layers x rows rows; returns (address, "
        "serial number).");
  m.def("free_host_pool", &FreePinnedHostPool, nb::arg("address"), nb::call_guard<nb::gil_scoped_release>());
  m.def("read_host_pool", &ReadHostPool, nb::arg("address"), nb::arg("offset"), nb::arg("size"));
  m.def("write_host_pool", &WriteHostPool, nb::arg("address"), nb::arg("offset"), nb::arg("data"));
}
