// Python module exporting the CPU handlers as capsules for jax.ffi.register_ffi_target,
// and the allocator of extension-owned host pools (host_pool.h).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include <chrono>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

#include "copy_workers.h"
#include "host_pool.h"
#include "swap_in_core.h"
#include "xla/ffi/api/c_api.h"

extern "C" XLA_FFI_Error* HisparseSwapInCpu(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* HisparseTopKCpu(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* HisparseArgmaxCpu(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* HisparseArgmaxColumnsCpu(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* HisparseBackupCpu(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* HisparseSwapInExtCpu(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* HisparseBackupExtCpu(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* HisparsePrefetchStartCpu(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* HisparsePrefetchStartExtCpu(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* HisparsePrefetchWaitCpu(XLA_FFI_CallFrame*);

namespace nb = nanobind;
using hisparse::HostPoolRegistry;

namespace {

constexpr size_t kAlignment = 4096;

// (address, serial number) of a new pool.
std::pair<uintptr_t, uint64_t> AllocHostPool(int64_t layers, int64_t rows, size_t row_bytes) {
  const size_t bytes = hisparse::HostPoolBytes(layers, rows, row_bytes);
  const size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  void* p = std::aligned_alloc(kAlignment, rounded);  // bytes >= 1 (HostPoolBytes)
  if (p == nullptr) throw std::bad_alloc();
  std::memset(p, 0, rounded);
  const uintptr_t address = reinterpret_cast<uintptr_t>(p);
  return {address, HostPoolRegistry::Get().Add(address, bytes, layers, rows)};
}

// Unregisters the pool (later calls naming it fail), waits for the handlers using it now and then for the
// prefetch tasks they queued (which read it), and frees it. Called without the GIL.
void FreeHostPool(uintptr_t address) {
  if (HostPoolRegistry::Get().Remove(address) == 0)
    throw std::invalid_argument("free_host_pool: " + std::to_string(address) + " is not a live host pool");
  hisparse::CopyWorkers::Get().WaitAll();
  std::free(reinterpret_cast<void*>(address));
}

nb::bytes ReadHostPool(uintptr_t address, size_t offset, size_t size) {
  return nb::bytes(hisparse::PoolRange(address, offset, size, "read_host_pool"), size);
}

void WriteHostPool(uintptr_t address, size_t offset, nb::bytes data) {
  std::memcpy(hisparse::PoolRange(address, offset, data.size(), "write_host_pool"), data.c_str(), data.size());
}

// Benchmark reference: the same row copies the swap-in makes, as a bare memcpy
// loop between two raw buffers (e.g. a pool's and a hot buffer's
// unsafe_buffer_pointer()). Returns seconds. No bounds checks: benchmarks only.
double CopyRowsSeconds(uintptr_t src, uintptr_t dst, size_t row_bytes,
                       nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig> src_rows,
                       nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig> dst_rows) {
  if (src_rows.shape(0) != dst_rows.shape(0)) throw std::invalid_argument("copy_rows: length mismatch");
  const int64_t* s = src_rows.data();
  const int64_t* d = dst_rows.data();
  const size_t n = src_rows.shape(0);
  auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < n; ++i)
    std::memcpy(reinterpret_cast<char*>(dst) + d[i] * row_bytes, reinterpret_cast<const char*>(src) + s[i] * row_bytes,
                row_bytes);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

NB_MODULE(_ffi_cpu, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["hisparse_swap_in"] = nb::capsule(reinterpret_cast<void*>(&HisparseSwapInCpu));
    d["hisparse_backup"] = nb::capsule(reinterpret_cast<void*>(&HisparseBackupCpu));
    d["hisparse_swap_in_ext"] = nb::capsule(reinterpret_cast<void*>(&HisparseSwapInExtCpu));
    d["hisparse_backup_ext"] = nb::capsule(reinterpret_cast<void*>(&HisparseBackupExtCpu));
    d["hisparse_prefetch_start"] = nb::capsule(reinterpret_cast<void*>(&HisparsePrefetchStartCpu));
    d["hisparse_prefetch_start_ext"] = nb::capsule(reinterpret_cast<void*>(&HisparsePrefetchStartExtCpu));
    d["hisparse_prefetch_wait"] = nb::capsule(reinterpret_cast<void*>(&HisparsePrefetchWaitCpu));
    d["hisparse_top_k"] = nb::capsule(reinterpret_cast<void*>(&HisparseTopKCpu));
    d["hisparse_argmax"] = nb::capsule(reinterpret_cast<void*>(&HisparseArgmaxCpu));
    d["hisparse_argmax_columns"] = nb::capsule(reinterpret_cast<void*>(&HisparseArgmaxColumnsCpu));
    return d;
  });
  m.def("alloc_host_pool", &AllocHostPool, nb::arg("layers"), nb::arg("rows"), nb::arg("row_bytes"),
        "Allocates a zeroed, page-aligned host pool of layers x rows rows; returns (address, serial number).");
  m.def("free_host_pool", &FreeHostPool, nb::arg("address"), nb::call_guard<nb::gil_scoped_release>());
  m.def("read_host_pool", &ReadHostPool, nb::arg("address"), nb::arg("offset"), nb::arg("size"));
  m.def("write_host_pool", &WriteHostPool, nb::arg("address"), nb::arg("offset"), nb::arg("data"));
  m.def("status_message", [](int32_t code) { return std::string(hisparse::StatusMessage(code)); }, nb::arg("code"),
        "The text of a swap-in / backup status code (swap_in_core.h SwapInStatus; 'ok' for 0 or unknown).");
  m.attr("num_statuses") = hisparse::kNumStatuses;
  m.def("prefetch_threads", []() { return hisparse::CopyWorkers::Get().Threads(); },
        "The copy threads of the cross-layer prefetch (HISPARSE_PREFETCH_THREADS; 0: copies run in the wait).");
  m.def("copy_rows_seconds", &CopyRowsSeconds, nb::arg("src"), nb::arg("dst"), nb::arg("row_bytes"),
        nb::arg("src_rows"), nb::arg("dst_rows"), "Benchmark reference: a bare memcpy loop over rows.");
}
