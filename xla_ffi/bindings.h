// The FFI signatures of the swap-in and backup handlers, shared by the CPU and
// CUDA registrations (which differ only in the leading context they bind).
// Buffer meanings: see the header of cpu_handlers.cc.
#pragma once

#include <utility>

#include "xla/ffi/api/ffi.h"

namespace hisparse {

template <typename Binding>
auto BindSwapIn(Binding binding) {
  namespace ffi = xla::ffi;
  return std::move(binding).template Arg<ffi::Buffer<ffi::S32>>()  // layer
      .template Arg<ffi::Buffer<ffi::S32>>()            // top_k
      .template Arg<ffi::Buffer<ffi::S32>>()            // seq_lens
      .template Arg<ffi::Buffer<ffi::S32>>()            // host_rows
      .template Arg<ffi::AnyBuffer>()                   // host_pool
      .template Arg<ffi::AnyBuffer>()                   // hot
      .template Arg<ffi::AnyBuffer>()                   // slot_tokens
      .template Arg<ffi::AnyBuffer>()                   // lru
      .template Arg<ffi::AnyBuffer>()                   // stats
      .template Ret<ffi::Buffer<ffi::S32>>()            // rows
      .template Ret<ffi::AnyBuffer>()                   // host_pool (aliased)
      .template Ret<ffi::AnyBuffer>()                   // hot (aliased)
      .template Ret<ffi::AnyBuffer>()                   // slot_tokens (aliased)
      .template Ret<ffi::AnyBuffer>()                   // lru (aliased)
      .template Ret<ffi::AnyBuffer>();                  // stats (aliased)
}

template <typename Binding>
auto BindBackup(Binding binding) {
  namespace ffi = xla::ffi;
  return std::move(binding).template Arg<ffi::Buffer<ffi::S32>>()  // layer
      .template Arg<ffi::AnyBuffer>()                   // rows
      .template Arg<ffi::Buffer<ffi::S32>>()            // dst
      .template Arg<ffi::AnyBuffer>()                   // host_pool
      .template Ret<ffi::AnyBuffer>();                  // host_pool (aliased)
}

}  // namespace hisparse
