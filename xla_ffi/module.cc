// Python module exporting the CPU handlers as capsules for jax.ffi.register_ffi_target.
#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"

extern "C" XLA_FFI_Error* HisparseSwapInCpu(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* HisparseBackupCpu(XLA_FFI_CallFrame*);

namespace nb = nanobind;

NB_MODULE(_ffi_cpu, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["hisparse_swap_in"] = nb::capsule(reinterpret_cast<void*>(&HisparseSwapInCpu));
    d["hisparse_backup"] = nb::capsule(reinterpret_cast<void*>(&HisparseBackupCpu));
    return d;
  });
}
