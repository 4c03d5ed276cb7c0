// Python module exporting the CUDA handlers as capsules (built only where nvcc is found).
#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"

extern "C" XLA_FFI_Error* HisparseSwapInCuda(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* HisparseBackupCuda(XLA_FFI_CallFrame*);

namespace nb = nanobind;

NB_MODULE(_ffi_cuda, m) {
  m.attr("cuda_arch") = HISPARSE_CUDA_ARCH;
  m.def("registrations", []() {
    nb::dict d;
    d["hisparse_swap_in"] = nb::capsule(reinterpret_cast<void*>(&HisparseSwapInCuda));
    d["hisparse_backup"] = nb::capsule(reinterpret_cast<void*>(&HisparseBackupCuda));
    return d;
  });
}
