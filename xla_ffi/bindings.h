// The FFI signatures of the swap-in and backup handlers, shared by the CPU and
// CUDA registrations (which differ only in the leading context they bind).
// Buffer meanings: see the header of cpu_handlers.cc.
//
// Errors: what is known when the program is compiled (shapes, dtypes, attributes, the pool's registration)
// is an FFI error. What depends on the data (positions, page tables, request ids, LRU state, scores, the
// layer index) is a per-row status in the `status` result: a row whose status is not 0 is left unchanged
// (its rows are -1) and the other rows are done. The handlers never synchronize with the device for it;
// the caller reads the status when it reads its results (hisparse_jax.kernels.ops.check_status).
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "host_pool.h"
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

// The host pool as the kernels see it: [L, H] rows of W elements of dtype.
struct PoolView {
  char* base;
  int64_t L, H;
  xla::ffi::DataType dtype;
  int64_t W;
};

// The host pool passed as an XLA operand (`pinned_host` memory), viewed through its aliased result `out`
// (the caller first copies the operand there if XLA did not alias them); an error unless it is [L, H, W] of
// a whole-byte dtype. `op` names the handler in the message.
inline xla::ffi::ErrorOr<PoolView> OperandPool(const char* op, xla::ffi::AnyBuffer pool,
                                               xla::ffi::Result<xla::ffi::AnyBuffer>& out) {
  namespace ffi = xla::ffi;
  auto d = pool.dimensions();
  if (d.size() != 3) return ffi::Error::InvalidArgument(std::string(op) + ": host_pool must be [L, H, W]");
  if (!IsByteAddressable(pool.element_type()))
    return ffi::Error::InvalidArgument(std::string(op) +
                                       ": host_pool dtype packs below one byte per element (unsupported)");
  return PoolView{static_cast<char*>(out->untyped_data()), d[0], d[1], pool.element_type(), d[2]};
}

// An extension-owned pool (host_pool.h) named by its address and serial number, viewed with the dtype and
// row width of `like` (the hot buffer or the rows written); an error unless the address holds that pool,
// still live, of exactly [L, H] such rows (a pool of another geometry would be read as rows it does not
// hold; a freed pool's ref must not reach a new pool at the same address). On success `pin` holds the pool
// until the caller drops it: free_host_pool waits for it, so keep it while the pool is read or written.
inline xla::ffi::ErrorOr<PoolView> RegisteredPool(uint64_t address, uint64_t serial, int64_t layers, int64_t rows,
                                                  xla::ffi::AnyBuffer like, PinnedPool& pin) {
  namespace ffi = xla::ffi;
  auto dims = like.dimensions();
  const int64_t W = dims.size() ? dims[dims.size() - 1] : 0;
  if (!IsByteAddressable(like.element_type()))
    return ffi::Error::InvalidArgument("host pool rows: dtype packs below one byte per element (unsupported)");
  size_t need = 0;
  const bool overflow = layers < 1 || rows < 0 || W < 0 ||
                        __builtin_mul_overflow(static_cast<size_t>(layers), static_cast<size_t>(rows), &need) ||
                        __builtin_mul_overflow(need, static_cast<size_t>(W) * ffi::ByteWidth(like.element_type()),
                                               &need);
  const HostPoolEntry pool = HostPoolRegistry::Get().Pin(static_cast<uintptr_t>(address), serial);
  std::string what = "host pool at " + std::to_string(address) + " (serial " + std::to_string(serial) + ")";
  if (pool.bytes == 0)
    return ffi::Error::InvalidArgument(what + " is not a live extension pool (freed, or never allocated)");
  PinnedPool pinned(static_cast<uintptr_t>(address));
  if (overflow || pool.layers != layers || pool.rows != rows || need != pool.bytes)
    return ffi::Error::InvalidArgument(
        what + " is not a live extension pool of " + std::to_string(layers) + " x " + std::to_string(rows) +
        " rows of " + std::to_string(W) + " x " + std::to_string(ffi::ByteWidth(like.element_type())) +
        " bytes (" + std::to_string(need) + " bytes; the pool has " + std::to_string(pool.layers) + " x " +
        std::to_string(pool.rows) + " rows, " + std::to_string(pool.bytes) + " bytes)");
  pin = std::move(pinned);
  return PoolView{reinterpret_cast<char*>(address), layers, rows, like.element_type(), W};
}

// The swap-in's copy_blocks attribute: thread blocks per batch row that copy its missing rows on CUDA (0: the
// handler chooses from the batch and the device's multiprocessor count; 1: the planning block itself, no
// second kernel). The CPU handler checks the range and otherwise ignores it, and its miss_list result.
constexpr int64_t kMaxCopyBlocks = 1024;

inline xla::ffi::Error CheckCopyBlocks(int64_t copy_blocks) {
  if (copy_blocks < 0 || copy_blocks > kMaxCopyBlocks)
    return xla::ffi::Error::InvalidArgument("swap_in: copy_blocks must be in [0, " + std::to_string(kMaxCopyBlocks) +
                                            "], got " + std::to_string(copy_blocks));
  return xla::ffi::Error::Success();
}

template <typename Binding>
auto BindSwapIn(Binding binding) {
  namespace ffi = xla::ffi;
  return std::move(binding).template Arg<ffi::Buffer<ffi::S32>>()  // layer
      .template Arg<ffi::Buffer<ffi::S32>>()            // top_k
      .template Arg<ffi::Buffer<ffi::S32>>()            // seq_lens
      .template Arg<ffi::Buffer<ffi::S32>>()            // req_ids
      .template Arg<ffi::Buffer<ffi::S32>>()            // host_pages
      .template Arg<ffi::AnyBuffer>()                   // newest
      .template Arg<ffi::AnyBuffer>()                   // host_pool
      .template Arg<ffi::AnyBuffer>()                   // hot
      .template Arg<ffi::AnyBuffer>()                   // slot_tokens
      .template Arg<ffi::AnyBuffer>()                   // lru
      .template Arg<ffi::AnyBuffer>()                   // stats
      .template Arg<ffi::Buffer<ffi::F32>>()            // slot_scores (score policy [B, D], else [B, 0])
      .template Ret<ffi::Buffer<ffi::S32>>()            // rows
      .template Ret<ffi::AnyBuffer>()                   // host_pool (aliased)
      .template Ret<ffi::AnyBuffer>()                   // hot (aliased)
      .template Ret<ffi::AnyBuffer>()                   // slot_tokens (aliased)
      .template Ret<ffi::AnyBuffer>()                   // lru (aliased)
      .template Ret<ffi::AnyBuffer>()                   // stats (aliased)
      .template Ret<ffi::Buffer<ffi::S32>>()            // status [B] (SwapInStatus per row; 0 = done)
      .template Ret<ffi::Buffer<ffi::S32>>()            // miss_list [B, K+1] (CUDA's scratch; CPU: unused)
      .template Attr<int64_t>("page_size")              // tokens per host page
      .template Attr<int64_t>("eviction")               // an Eviction (swap_in_core.h)
      .template Attr<int64_t>("copy_blocks");           // CUDA: blocks per row copying its misses; 0 = auto
}

// Prefetch start: a swap-in of predicted positions with no newest row and no stats, planned and staged in the
// background; the ticket names it for the prefetch wait, which commits it. hot, slot_tokens and lru are read
// for their shapes and the plan's snapshot only.
template <typename Binding>
auto BindPrefetchStart(Binding binding) {
  namespace ffi = xla::ffi;
  return std::move(binding).template Arg<ffi::Buffer<ffi::S32>>()  // layer
      .template Arg<ffi::Buffer<ffi::S32>>()            // top_k (predicted)
      .template Arg<ffi::Buffer<ffi::S32>>()            // seq_lens
      .template Arg<ffi::Buffer<ffi::S32>>()            // req_ids
      .template Arg<ffi::Buffer<ffi::S32>>()            // host_pages
      .template Arg<ffi::AnyBuffer>()                   // host_pool
      .template Arg<ffi::AnyBuffer>()                   // hot
      .template Arg<ffi::AnyBuffer>()                   // slot_tokens
      .template Arg<ffi::AnyBuffer>()                   // lru
      .template Ret<ffi::AnyBuffer>()                   // host_pool (aliased)
      .template Ret<ffi::Buffer<ffi::S32>>()            // ticket [2]
      .template Attr<int64_t>("page_size")
      .template Attr<int64_t>("eviction");
}

// Prefetch wait: the ticket's prefetch committed into hot, slot_tokens and lru (aliased to the results) and
// its per-row counts; `after` only orders the call.
template <typename Binding>
auto BindPrefetchWait(Binding binding) {
  namespace ffi = xla::ffi;
  return std::move(binding).template Arg<ffi::Buffer<ffi::S32>>()  // ticket [2]
      .template Arg<ffi::AnyBuffer>()                        // hot
      .template Arg<ffi::AnyBuffer>()                        // slot_tokens
      .template Arg<ffi::AnyBuffer>()                        // lru
      .template Arg<ffi::AnyBuffer>()                        // after (not read)
      .template Ret<ffi::AnyBuffer>()                        // hot (aliased)
      .template Ret<ffi::AnyBuffer>()                        // slot_tokens (aliased)
      .template Ret<ffi::AnyBuffer>()                        // lru (aliased)
      .template Ret<ffi::Buffer<ffi::S32>>();                // prefetched [B]: rows placed, or -status
}

template <typename Binding>
auto BindBackup(Binding binding) {
  namespace ffi = xla::ffi;
  return std::move(binding).template Arg<ffi::Buffer<ffi::S32>>()  // layer
      .template Arg<ffi::AnyBuffer>()                   // rows
      .template Arg<ffi::Buffer<ffi::S32>>()            // dst
      .template Arg<ffi::AnyBuffer>()                   // host_pool
      .template Ret<ffi::AnyBuffer>()                   // host_pool (aliased)
      .template Ret<ffi::Buffer<ffi::S32>>();           // status [N] (SwapInStatus per column; 0 = written)
}

// The "_ext" variants: the host-pool operand is an s32[1] ordering token and
// the pool itself is named by attributes (see host_pool.h).
template <typename Binding>
auto BindExternalPool(Binding binding) {
  return std::move(binding)
      .template Attr<uint64_t>("pool_address")
      .template Attr<uint64_t>("pool_serial")
      .template Attr<int64_t>("pool_layers")
      .template Attr<int64_t>("pool_rows");
}

}  // namespace hisparse
