// CPU XLA FFI handlers: the argmax of each row (HisparseArgmaxCpu) or of each column of a 2-D array
// (HisparseArgmaxColumnsCpu, below) of a float32 array, for greedy decoding over the vocabulary.
//
//   x  f32[..., N]   (rows are all leading dimensions), 1 <= N < 2^31
// Result: s32[...] -- exactly jnp.argmax(x, axis=-1): the index of the row's first NaN if it holds one,
// else of its first maximum (-0.0 and +0.0 are equal; a row of -inf gives 0). Denormals compare as
// zero, as in XLA's own CPU code (both run with the CPU's denormals-are-zero mode XLA sets).
//
// Why: XLA:CPU lowers jnp.argmax to a variadic (value, index) reduction that it does not vectorize
// (5.9 ms for 32 rows of DeepSeek-V3's 129280-entry vocabulary, 54 ms for 256; here 0.43 and 5.1 ms),
// and the plain max-reductions it does vectorize may drop a NaN. Here one pass over each row takes, per
// chunk of kChunk entries, the lane-wise maximum and a lane-wise "saw a NaN" flag (both vectorize); the
// first chunk whose maximum beats every earlier chunk's holds the row's first maximum, and a second pass
// over that one chunk (still in L1) finds it. A chunk holding a NaN ends the row: its first NaN is the
// answer. Rows are spread over XLA's intra-op thread pool.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <numeric>
#include <string>
#include <vector>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace hisparse {
namespace {

constexpr int64_t kLanes = 16;    // independent accumulators: one AVX-512 register, two AVX2 ones
constexpr int64_t kChunk = 2048;  // entries per chunk: 8 KiB, still in L1 for the second pass

// kLanes floats / int32s as one value of GCC's vector extension (Clang has it too): element-wise
// operators compile to SIMD instructions of whatever width the target has (the loop below is not
// auto-vectorized otherwise: a compiler may not reorder a float max-reduction without -ffast-math).
typedef float Floats __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t Ints __attribute__((vector_size(kLanes * sizeof(int32_t))));

// The scans below are compiled for AVX-512 / AVX2 / baseline x86-64, picked at load time by the CPU.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__)
#define HISPARSE_SIMD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define HISPARSE_SIMD_CLONES
#endif

// The largest non-NaN value of x[0, n) (-inf if none) and whether x[0, n) holds a NaN.
HISPARSE_SIMD_CLONES
float ChunkMax(const float* x, int64_t n, bool* has_nan) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  Floats acc;
  Ints nan = {};
  for (int64_t j = 0; j < kLanes; ++j) acc[j] = neg_inf;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    Floats v;
    std::memcpy(&v, x + i, sizeof(v));  // an unaligned vector load
    acc = v > acc ? v : acc;            // lane-wise; a NaN compares false: never taken
    nan |= v != v;                      // lane-wise: -1 where v is NaN
  }
  float m = neg_inf;
  bool any = false;
  for (int64_t j = 0; j < kLanes; ++j) {
    m = acc[j] > m ? acc[j] : m;
    any |= nan[j] != 0;
  }
  for (; i < n; ++i) {
    m = x[i] > m ? x[i] : m;
    any |= x[i] != x[i];
  }
  *has_nan = any;
  return m;
}

int32_t ArgmaxRow(const float* x, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_start = 0;  // the first chunk whose maximum is the row's (chunk 0 for a row of -inf)
  for (int64_t start = 0; start < n; start += kChunk) {
    const int64_t len = std::min(kChunk, n - start);
    bool has_nan;
    const float m = ChunkMax(x + start, len, &has_nan);
    if (has_nan) {  // no earlier chunk held one: the first NaN is in this chunk
      for (int64_t i = start; i < start + len; ++i)
        if (x[i] != x[i]) return static_cast<int32_t>(i);
    }
    if (m > best) {  // strictly: an equal maximum in a later chunk is not the first
      best = m;
      best_start = start;
    }
  }
  const int64_t end = std::min(best_start + kChunk, n);
  for (int64_t i = best_start; i < end; ++i)
    if (x[i] == best) return static_cast<int32_t>(i);
  return static_cast<int32_t>(best_start);  // not reached: the chunk holds its maximum
}

ffi::Error ArgmaxImpl(ffi::ThreadPool thread_pool, ffi::Buffer<ffi::F32> x, ffi::Result<ffi::Buffer<ffi::S32>> index) {
  auto dims = x.dimensions();
  if (dims.size() < 1) return ffi::Error::InvalidArgument("argmax: x must have at least one dimension");
  const int64_t n = dims.back();
  if (n < 1 || n > std::numeric_limits<int32_t>::max())
    return ffi::Error::InvalidArgument("argmax: rows of " + std::to_string(n) + " entries; need 1 .. 2^31 - 1");
  const int64_t rows = static_cast<int64_t>(x.element_count()) / n;
  if (static_cast<int64_t>(index->element_count()) != rows)
    return ffi::Error::InvalidArgument("argmax: the result must hold one index per row");
  const float* in = x.typed_data();
  int32_t* out = index->typed_data();
  // Rows per task: ~256K entries (1 MiB) per task is worth waking a thread.
  const int64_t per_task = std::max<int64_t>(1, (int64_t{1} << 18) / n);
  ParallelFor(thread_pool, rows, per_task, [&](int64_t r) { out[r] = ArgmaxRow(in + r * n, n); });
  return ffi::Error::Success();
}

// ------------------------------------------------------------------------------------ argmax over columns
// x f32[N, C] -> s32[C]: jnp.argmax(x, axis=0), for logits held vocabulary-major ([vocab, batch]: XLA:CPU
// computes the output projection 15-20% faster that way at batch 8-64). Row-major x is one flat array in
// which entry k is (row k / C, column k % C); a period of L = lcm(C, 16) entries maps each of its L lanes
// to one column, so kLanes-wide vectors stepping L entries at a time keep, per lane, the largest value and
// the flat index of its first occurrence, and the flat index of the first NaN. The lanes of a column (and
// the entries past the last whole period) are then combined: the first NaN's row if any, else the smallest
// row holding the maximum (-0.0 equals +0.0; a column of -inf gives 0).

constexpr int64_t kMaxPeriod = 4096;  // lanes kept per scan (C of 1 .. 256 and any multiple of 16 up to it)

// Per lane over x[begin, end) (whole periods of 16 * nv entries, nv = NV when NV > 0): val / idx the largest
// non-NaN value and the flat index of its first occurrence (-1: none above -inf), nan the flat index of the
// first NaN (-1: none); each 16 * nv long (plain arrays: the vectors live in this frame, which the compiler
// aligns). A fixed NV (the batch buckets up to 64 columns) keeps the accumulators in registers.
template <int64_t NV>
HISPARSE_SIMD_CLONES void ScanPeriods(const float* x, int64_t begin, int64_t end, int64_t nv, float* val_out,
                                      int32_t* idx_out, int32_t* nan_out) {
  constexpr int64_t kSlots = NV > 0 ? NV : kMaxPeriod / kLanes;
  if (NV > 0) nv = NV;
  Floats val[kSlots];
  Ints idx[kSlots], nan[kSlots];
  Ints iota;
  for (int64_t j = 0; j < kLanes; ++j) iota[j] = static_cast<int32_t>(j);
  const Floats neg_inf = Floats{} - std::numeric_limits<float>::infinity();
  const Ints none = Ints{} - 1;
  for (int64_t v = 0; v < nv; ++v) {
    val[v] = neg_inf;
    idx[v] = none;
    nan[v] = none;
  }
  for (int64_t base = begin; base < end; base += kLanes * nv) {
    for (int64_t v = 0; v < nv; ++v) {
      const int64_t off = base + kLanes * v;
      Floats xv;
      std::memcpy(&xv, x + off, sizeof(xv));
      const Ints k = iota + static_cast<int32_t>(off);
      // Masks are -1 / 0 per lane; blends as bit operations (GCC scalarizes a ternary on these).
      const Ints gt = xv > val[v];  // strictly: a lane keeps its first maximum; a NaN compares false
      val[v] = gt ? xv : val[v];
      idx[v] = (k & gt) | (idx[v] & ~gt);
      const Ints first_nan = ~(xv == xv) & (nan[v] >> 31);  // NaN here, none before (nan[v] still -1)
      nan[v] = (k & first_nan) | (nan[v] & ~first_nan);
    }
  }
  std::memcpy(val_out, val, nv * sizeof(Floats));
  std::memcpy(idx_out, idx, nv * sizeof(Ints));
  std::memcpy(nan_out, nan, nv * sizeof(Ints));
}

ffi::Error ArgmaxColumns(ffi::ThreadPool& thread_pool, ffi::Buffer<ffi::F32>& x,
                         ffi::Result<ffi::Buffer<ffi::S32>>& index) {
  auto dims = x.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("argmax over columns: x must be [rows, columns]");
  const int64_t n = dims[0], c = dims[1];
  if (n < 1 || c < 1 || n * c > std::numeric_limits<int32_t>::max())
    return ffi::Error::InvalidArgument("argmax over columns: x of " + std::to_string(n) + " x " + std::to_string(c) +
                                       " entries; need 1 .. 2^31 - 1 in all, at least one row and column");
  if (static_cast<int64_t>(index->element_count()) != c)
    return ffi::Error::InvalidArgument("argmax over columns: the result must hold one index per column");
  const float* in = x.typed_data();
  int32_t* out = index->typed_data();
  const int64_t total = n * c;
  const int64_t period = c / std::gcd(c, kLanes) * kLanes;  // lcm(c, kLanes)
  const int64_t nv = period <= kMaxPeriod ? period / kLanes : 0;  // 0: every entry takes the scalar pass
  const int64_t periods = nv ? total / period : 0;
  // Pieces of whole periods, ~256K entries (1 MiB) each, scanned in parallel and combined in order.
  const int64_t pieces = periods ? std::clamp<int64_t>(periods * period >> 18, 1, 64) : 0;
  const int64_t lanes = nv * kLanes;  // = period when nv > 0
  std::vector<float> val(pieces * lanes);
  std::vector<int32_t> idx(pieces * lanes), nan(pieces * lanes);
  auto scan = nv == 1 ? &ScanPeriods<1> : nv == 2 ? &ScanPeriods<2> : nv == 4 ? &ScanPeriods<4> : &ScanPeriods<0>;
  ParallelFor(thread_pool, pieces, 1, [&](int64_t i) {
    scan(in, periods * i / pieces * period, periods * (i + 1) / pieces * period, nv, &val[i * lanes],
         &idx[i * lanes], &nan[i * lanes]);
  });
  std::vector<float> best(c, -std::numeric_limits<float>::infinity());
  std::vector<int64_t> best_row(c, 0), nan_row(c, n);  // nan_row n: no NaN
  auto offer = [&](int64_t k, float v) {  // entry k (row k / c, column k % c), v not NaN
    const int64_t col = k % c, row = k / c;
    if (v > best[col] || (v == best[col] && row < best_row[col])) {
      best[col] = v;
      best_row[col] = row;
    }
  };
  for (int64_t i = 0; i < pieces * lanes; ++i) {
    if (idx[i] >= 0) offer(idx[i], val[i]);
    if (nan[i] >= 0) nan_row[nan[i] % c] = std::min<int64_t>(nan_row[nan[i] % c], nan[i] / c);
  }
  for (int64_t k = periods * period; k < total; ++k) {  // past the last whole period (or all, for nv = 0)
    if (in[k] != in[k])
      nan_row[k % c] = std::min(nan_row[k % c], k / c);
    else
      offer(k, in[k]);
  }
  for (int64_t col = 0; col < c; ++col)
    out[col] = static_cast<int32_t>(nan_row[col] < n ? nan_row[col] : best_row[col]);
  return ffi::Error::Success();
}

ffi::Error ArgmaxColumnsImpl(ffi::ThreadPool thread_pool, ffi::Buffer<ffi::F32> x,
                             ffi::Result<ffi::Buffer<ffi::S32>> index) {
  try {  // its per-column and per-piece vectors: a failed allocation must not unwind through XLA's C ABI
    return ArgmaxColumns(thread_pool, x, index);
  } catch (const std::bad_alloc&) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted, "argmax over columns: out of host memory");
  }
}

}  // namespace
}  // namespace hisparse

XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparseArgmaxCpu, hisparse::ArgmaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x
                                  .Ret<ffi::Buffer<ffi::S32>>());  // index

XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparseArgmaxColumnsCpu, hisparse::ArgmaxColumnsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [rows, columns]
                                  .Ret<ffi::Buffer<ffi::S32>>());  // index [columns]
