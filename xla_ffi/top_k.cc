// CPU XLA FFI handler: exact top-k of each row of a float32 array, for the DSA lightning indexer.
//
//   scores  f32[..., N]   (rows are all leading dimensions)
//   k       attribute i64, 1 <= k <= N
// Results: values f32[..., k], indices s32[..., k] -- the k largest values of each row in descending
// order, equal values ordered by ascending index: exactly jax.lax.top_k's result. NaN is not supported
// (the indexer's scores are finite or -inf).
//
// Why: XLA's CPU top-k sorts whole rows (O(N log N), ~20 ns per element at the indexer's k = 2048),
// which made the indexer the bulk of a long-context prefill chunk. Here each value becomes an
// order-preserving 64-bit key (float bits mapped to an unsigned order, index in the low half so that ties
// resolve to the lower index), std::nth_element finds the k largest in O(N), and only those k are
// sorted: O(N + k log k) per row, rows spread over XLA's intra-op thread pool.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace hisparse {
namespace {

// Monotone map of float32 to uint32: a < b (as floats, -inf..+inf) <=> Ordered(a) < Ordered(b).
inline uint32_t Ordered(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

inline float FromOrdered(uint32_t o) {
  const uint32_t u = (o & 0x80000000u) ? (o & 0x7fffffffu) : ~o;
  float v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}

// Larger key = larger value; among equal values the lower index has the larger key.
inline uint64_t Key(float v, uint32_t i) {
  return (static_cast<uint64_t>(Ordered(v)) << 32) | (0xffffffffu - i);
}

void TopKRow(const float* row, int64_t n, int64_t k, std::vector<uint64_t>& keys, float* values, int32_t* indices) {
  keys.resize(n);
  for (int64_t i = 0; i < n; ++i) keys[i] = Key(row[i], static_cast<uint32_t>(i));
  if (k < n) std::nth_element(keys.begin(), keys.begin() + k, keys.end(), std::greater<uint64_t>());
  std::sort(keys.begin(), keys.begin() + k, std::greater<uint64_t>());
  for (int64_t j = 0; j < k; ++j) {
    values[j] = FromOrdered(static_cast<uint32_t>(keys[j] >> 32));
    indices[j] = static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(keys[j]));
  }
}

ffi::Error TopKImpl(ffi::ThreadPool thread_pool, ffi::Buffer<ffi::F32> scores, ffi::Result<ffi::Buffer<ffi::F32>> values,
                    ffi::Result<ffi::Buffer<ffi::S32>> indices, int64_t k) {
  auto dims = scores.dimensions();
  if (dims.size() < 1) return ffi::Error::InvalidArgument("top_k: scores must have at least one dimension");
  const int64_t n = dims.back();
  if (n > std::numeric_limits<int32_t>::max())
    return ffi::Error::InvalidArgument("top_k: rows longer than 2^31 - 1");
  if (k < 1 || k > n)
    return ffi::Error::InvalidArgument("top_k: k = " + std::to_string(k) + " outside [1, " + std::to_string(n) + "]");
  const int64_t rows = n ? static_cast<int64_t>(scores.element_count()) / n : 0;
  if (static_cast<int64_t>(values->element_count()) != rows * k ||
      static_cast<int64_t>(indices->element_count()) != rows * k)
    return ffi::Error::InvalidArgument("top_k: results must be [..., k]");
  const float* in = scores.typed_data();
  float* out_v = values->typed_data();
  int32_t* out_i = indices->typed_data();
  // Rows per task: enough keys (~1M) to be worth waking a thread.
  const int64_t per_task = std::max<int64_t>(1, (1 << 20) / std::max<int64_t>(n, 1));
  ParallelFor(thread_pool, rows, per_task, [&](int64_t r) {
    thread_local std::vector<uint64_t> keys;  // per thread, grown once
    TopKRow(in + r * n, n, k, keys, out_v + r * k, out_i + r * k);
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace hisparse

XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparseTopKCpu, hisparse::TopKImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scores
                                  .Ret<ffi::Buffer<ffi::F32>>()   // values
                                  .Ret<ffi::Buffer<ffi::S32>>()   // indices
                                  .Attr<int64_t>("k"));
