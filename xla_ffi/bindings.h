// The FFI signatures of the swap-in and backup handlers, shared by the CPU and
// CUDA registrations (which differ only in the leading context they bind).
// Buffer meanings: see the header of cpu_handlers.cc.
#pragma once

#include <utility>

#include "xla/ffi/api/ffi.h"

namespace hisparse {

// KV rows are moved as whole bytes: dtypes XLA packs below one byte per element
// (int4, fp4, ...) would make `W * ByteWidth` wrong, so the handlers reject them.
inline bool IsByteAddressable(xla::ffi::DataType t) {
  using xla::ffi::DataType;
  switch (t) {
    case DataType::INVALID:
    case DataType::TOKEN:
    case DataType::S1:
    case DataType::S2:
    case DataType::S4:
    case DataType::U1:
    case DataType::U2:
    case DataType::U4:
    case DataType::F4E2M1FN:
      return false;
    default:
      return true;
  }
}

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

// The "_ext" variants: the host-pool operand is an s32[1] ordering token and
// the pool itself is named by attributes (see host_pool.h).
template <typename Binding>
auto BindExternalPool(Binding binding) {
  return std::move(binding)
      .template Attr<uint64_t>("pool_address")
      .template Attr<int64_t>("pool_layers")
      .template Attr<int64_t>("pool_rows");
}

}  // namespace hisparse
