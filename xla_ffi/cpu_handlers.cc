// CPU XLA FFI handlers: HiSparse swap-in and host-pool backup.
//
// Buffers (shapes as the Python wrappers in hisparse_jax/kernels/ops.py build them):
//   layer        s32[]              layer index l
//   top_k        s32[B, K]          top-k token positions of each batch row, -1 = padding
//   seq_lens     s32[B]             tokens of each row's request, newest at seq_len-1
//   req_ids      s32[B]             hot buffer (request slot) of each row in [0, R); -1 = idle row
//   host_pages   s32[B, P]          each row's host page table: logical page -> host-pool page
//   newest       T[B, W]            each row's newest latent row (position seq_len - 1), written to its slot
//   host_pool    T[L, H, W]         latent KV rows in host memory (H = pages x page_size)
//   hot          T[L, R, D+1, W]    hot buffers of R request slots; slot D is the reserved slot
//   slot_tokens  s32[L, R, D]       slot -> token position (-1 empty)
//   lru          s32[L, R, D]       slot ids, least recently used first
//   stats        s32[L, R, 2]       cumulative (hits, misses) per request slot
//   slot_scores  f32[B, D] / [B, 0] the indexer's score of each slot's token (eviction "score" only)
//   page_size    attribute i64      tokens per host page
//   eviction     attribute i64      the eviction policy (swap_in_core.h Eviction)
// Results: rows s32[B, K] (device row req_id*(D+1)+slot of hot[l], -1 for padding), then
// host_pool, hot, slot_tokens, lru, stats aliased to their inputs, then status s32[B]: 0 for a row done,
// else its SwapInStatus (swap_in_core.h; the row is left unchanged and its rows are -1). Shapes, dtypes
// and attributes that do not fit are FFI errors (bindings.h).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "bindings.h"
#include "parallel_for.h"
#include "swap_in_core.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace hisparse {
namespace {

// Copies src into dst unless XLA already aliased them (the donated case).
void CopyIfDistinct(ffi::AnyBuffer src, ffi::Result<ffi::AnyBuffer> dst) {
  if (src.untyped_data() != dst->untyped_data())
    std::memcpy(dst->untyped_data(), src.untyped_data(), src.size_bytes());
}

template <typename Buf>
bool SameDims(const Buf& a, std::initializer_list<int64_t> dims) {
  auto d = a.dimensions();
  if (d.size() != dims.size()) return false;
  size_t i = 0;
  for (int64_t v : dims)
    if (d[i++] != v) return false;
  return true;
}

// Per-thread scratch, grown once and reused: no heap allocation per call on
// the steady-state hot path.
struct Workspace {
  // Per thread: the scratch of the plan being computed.
  std::vector<int32_t> need_token, slot_of, heap_key, heap_pos;
  std::vector<uint8_t> slot_state;
  std::vector<uint64_t> bits;  // all zero between plans
  // Per request of the call (owned by the calling thread): plans kept until commit.
  std::vector<int32_t> new_lru, miss_tokens, miss_slots, misses, hits;
  std::vector<uint64_t> seen;  // request ids seen in the batch (all zero between calls)

  void ReservePlan(int64_t K, int64_t D, int64_t S) {
    if (static_cast<int64_t>(need_token.size()) < K) {
      need_token.resize(K);
      heap_key.resize(K);
      heap_pos.resize(K);
    }
    if (static_cast<int64_t>(slot_state.size()) < D) slot_state.resize(D);
    if (static_cast<int64_t>(slot_of.size()) < S) {
      slot_of.resize(S);
      bits.resize((S + 63) / 64, 0);
    }
  }
  void ReserveBatch(int64_t B, int64_t K, int64_t D, int64_t R) {
    if (static_cast<int64_t>(seen.size()) < (R + 63) / 64) seen.resize((R + 63) / 64, 0);
    if (static_cast<int64_t>(misses.size()) < B) {
      misses.resize(B);
      hits.resize(B);
    }
    if (static_cast<int64_t>(new_lru.size()) < B * D) new_lru.resize(B * D);
    if (static_cast<int64_t>(miss_tokens.size()) < B * K) {
      miss_tokens.resize(B * K);
      miss_slots.resize(B * K);
    }
  }
  DirectPositionMap Map() { return DirectPositionMap{bits.data(), slot_of.data()}; }
};

Workspace& ThreadWorkspace() {
  thread_local Workspace ws;
  return ws;
}

// Requests per pool task: below this a request's O(K + D) plan is cheaper
// than waking another thread.
constexpr int64_t kMinRequestsPerTask = 4;

ffi::Error SwapIn(ffi::ThreadPool& thread_pool, PoolView pool_view, int64_t page_size, int64_t eviction,
                  ffi::Buffer<ffi::F32> slot_scores, ffi::Buffer<ffi::S32> layer_buf, ffi::Buffer<ffi::S32> top_k,
                  ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> req_ids,
                  ffi::Buffer<ffi::S32> host_pages, ffi::AnyBuffer newest, ffi::AnyBuffer hot,
                  ffi::AnyBuffer slot_tokens, ffi::AnyBuffer lru, ffi::AnyBuffer stats,
                  ffi::Result<ffi::Buffer<ffi::S32>> rows,
                  ffi::Result<ffi::AnyBuffer> hot_out, ffi::Result<ffi::AnyBuffer> slot_tokens_out,
                  ffi::Result<ffi::AnyBuffer> lru_out, ffi::Result<ffi::AnyBuffer> stats_out,
                  ffi::Result<ffi::Buffer<ffi::S32>> status_out) {
  // ---- shapes --------------------------------------------------------------
  auto kd = top_k.dimensions();
  auto hd = hot.dimensions();
  if (kd.size() != 2 || hd.size() != 4)
    return ffi::Error::InvalidArgument(
        "swap_in: expected top_k [B,K], host_pool [L,H,W], hot [L,R,D+1,W]");
  const int64_t B = kd[0], K = kd[1];
  const int64_t L = pool_view.L, H = pool_view.H, W = pool_view.W;
  const int64_t R = hd[1], D = hd[2] - 1;
  if (hd[0] != L || hd[3] != W || D < 1)
    return ffi::Error::InvalidArgument("swap_in: hot must be [L, R, D+1, W] matching host_pool [L, H, W]");
  if (pool_view.dtype != hot.element_type())
    return ffi::Error::InvalidArgument("swap_in: host_pool and hot dtypes differ");
  if (K > D)
    return ffi::Error::InvalidArgument("swap_in: top_k (" + std::to_string(K) +
                                       ") > device_buffer_size (" + std::to_string(D) + ")");
  if (page_size < 1 || page_size > std::numeric_limits<int32_t>::max())
    return ffi::Error::InvalidArgument("swap_in: page_size must be in [1, 2^31)");
  if (eviction < 0 || eviction >= kNumEvictions)
    return ffi::Error::InvalidArgument("swap_in: eviction " + std::to_string(eviction) +
                                       " is not a policy (0 lru, 1 clock, 2 score)");
  if (D >= kRefBit) return ffi::Error::InvalidArgument("swap_in: device_buffer_size must be < 2^30");
  if (!SameDims(slot_scores, {B, eviction == kEvictScore ? D : 0}))
    return ffi::Error::InvalidArgument(eviction == kEvictScore
                                           ? "swap_in: eviction \"score\" needs slot_scores f32[B, D]"
                                           : "swap_in: slot_scores must be f32[B, 0] unless eviction is \"score\"");
  auto pd = host_pages.dimensions();
  if (!SameDims(seq_lens, {B}) || !SameDims(req_ids, {B}) || pd.size() != 2 || pd[0] != B ||
      !SameDims(slot_tokens, {L, R, D}) || !SameDims(lru, {L, R, D}) ||
      !SameDims(stats, {L, R, 2}) || slot_tokens.element_type() != ffi::S32 ||
      lru.element_type() != ffi::S32 || stats.element_type() != ffi::S32 ||
      layer_buf.element_count() != 1)
    return ffi::Error::InvalidArgument(
        "swap_in: expected seq_lens/req_ids s32[B], host_pages s32[B,P], slot_tokens/lru s32[L,R,D], "
        "stats s32[L,R,2], layer s32[]");
  const int64_t P = pd[1];
  if (!SameDims(newest, {B, W}) || newest.element_type() != hot.element_type())
    return ffi::Error::InvalidArgument("swap_in: newest must be [B, W] of the hot buffer's dtype");
  if (std::max({R * (D + 1), H, P * page_size, K}) > std::numeric_limits<int32_t>::max())
    return ffi::Error::InvalidArgument("swap_in: a dimension exceeds int32 indexing");
  if (!SameDims(*status_out, {B}))
    return ffi::Error::InvalidArgument("swap_in: status must be s32[B]");

  // ---- data: a bad row gets a status and is left unchanged; the others are done ------------------------
  // Outputs XLA did not alias to their inputs start as copies of them (every row's state must come out).
  CopyIfDistinct(hot, hot_out);
  CopyIfDistinct(slot_tokens, slot_tokens_out);
  CopyIfDistinct(lru, lru_out);
  CopyIfDistinct(stats, stats_out);
  int32_t* status = status_out->typed_data();
  int32_t* out = rows->typed_data();
  const int32_t layer = layer_buf.typed_data()[0];
  if (layer < 0 || layer >= L) {
    std::fill(status, status + B, static_cast<int32_t>(kLayerOutOfRange));
    std::fill(out, out + B * K, -1);
    return ffi::Error::Success();
  }
  const int32_t* ids = req_ids.typed_data();
  const int32_t* lens = seq_lens.typed_data();

  // Request ids: in [-1, R), -1 only on idle rows; a row repeating an earlier row's id fails (rows of one
  // request would race).
  Workspace& batch = ThreadWorkspace();
  batch.ReserveBatch(B, K, D, R);
  for (int64_t b = 0; b < B; ++b) {
    const int32_t id = ids[b];
    bool ok = id >= -1 && id < R && (id >= 0 || lens[b] == 0);
    if (ok && id >= 0) {
      uint64_t& word = batch.seen[id >> 6];
      const uint64_t bit = uint64_t{1} << (id & 63);
      ok = !(word & bit);
      word |= bit;
    }
    status[b] = ok ? kOk : kBadRequestId;
  }
  for (int64_t b = 0; b < B; ++b)
    if (ids[b] >= 0 && ids[b] < R) batch.seen[ids[b] >> 6] = 0;

  const size_t row_bytes = static_cast<size_t>(W) * ffi::ByteWidth(hot.element_type());
  auto request = [&](int64_t b, int32_t* slots, int32_t* order) {
    const int64_t table = (static_cast<int64_t>(layer) * R + ids[b]) * D;
    return RequestLayer{top_k.typed_data() + b * K, static_cast<int32_t>(K), lens[b],
                        static_cast<int32_t>(D), host_pages.typed_data() + b * P,
                        static_cast<int32_t>(P), static_cast<int32_t>(page_size),
                        static_cast<int32_t>(H), slots + table, order + table,
                        static_cast<int32_t>(ids[b] * (D + 1)), static_cast<int32_t>(eviction),
                        slot_scores.typed_data() + (eviction == kEvictScore ? b * D : 0)};
  };

  // Phase 1: plan every request without touching any state (each plan validates what it reads).
  int32_t* in_slots = static_cast<int32_t*>(slot_tokens_out->untyped_data());
  int32_t* in_order = static_cast<int32_t*>(lru_out->untyped_data());
  ParallelFor(thread_pool, B, kMinRequestsPerTask, [&](int64_t b) {
    batch.misses[b] = batch.hits[b] = 0;
    if (ids[b] < 0 || status[b] != kOk) {  // an idle row (all padding), or a bad request id
      std::fill(out + b * K, out + (b + 1) * K, -1);
      return;
    }
    Workspace& ws = ThreadWorkspace();
    ws.ReservePlan(K, D, P * page_size);
    SwapInScratch scratch{ws.need_token.data(), ws.slot_state.data(), batch.new_lru.data() + b * D,
                          ws.heap_key.data(), ws.heap_pos.data()};
    DirectPositionMap map = ws.Map();
    const int32_t misses = PlanSwapIn(request(b, in_slots, in_order), map, scratch, out + b * K,
                                      batch.miss_tokens.data() + b * K, batch.miss_slots.data() + b * K,
                                      &batch.hits[b]);
    if (misses < 0) {
      status[b] = -misses;
      std::fill(out + b * K, out + (b + 1) * K, -1);
      return;
    }
    batch.misses[b] = misses;
  });

  // Phase 2: commit the good rows' plans, place each newest row, copy the missing rows host -> device.
  const char* pool = pool_view.base + static_cast<size_t>(layer) * H * row_bytes;
  char* dev = static_cast<char*>(hot_out->untyped_data()) +
              static_cast<size_t>(layer) * R * (D + 1) * row_bytes;
  int32_t* slots = static_cast<int32_t*>(slot_tokens_out->untyped_data());
  int32_t* order = static_cast<int32_t*>(lru_out->untyped_data());
  int32_t* counts = static_cast<int32_t*>(stats_out->untyped_data()) + static_cast<int64_t>(layer) * R * 2;
  ParallelFor(thread_pool, B, kMinRequestsPerTask, [&](int64_t b) {
    if (ids[b] < 0 || status[b] != kOk) return;
    const RequestLayer r = request(b, slots, order);
    const int32_t misses = batch.misses[b];
    const int32_t* miss_tokens = batch.miss_tokens.data() + b * K;
    const int32_t* miss_slots = batch.miss_slots.data() + b * K;
    CommitSwapIn(r, batch.new_lru.data() + b * D, miss_tokens, miss_slots, misses);
    if (r.seq_len > 0)
      std::memcpy(dev + (r.row_base + NewestSlot(r.seq_len, r.D)) * row_bytes,
                  static_cast<const char*>(newest.untyped_data()) + b * row_bytes, row_bytes);
    for (int32_t i = 0; i < misses; ++i) {
      const int64_t src = HostRow(r, miss_tokens[i]);  // validated by the plan
      std::memcpy(dev + (r.row_base + miss_slots[i]) * row_bytes, pool + src * row_bytes, row_bytes);
    }
    counts[ids[b] * 2] += batch.hits[b];
    counts[ids[b] * 2 + 1] += misses;
  });
  return ffi::Error::Success();
}

// Host pool as an XLA operand (a `pinned_host` JAX array), aliased to a result.
ffi::Error SwapInImpl(ffi::ThreadPool thread_pool, ffi::Buffer<ffi::S32> layer,
                      ffi::Buffer<ffi::S32> top_k, ffi::Buffer<ffi::S32> seq_lens,
                      ffi::Buffer<ffi::S32> req_ids, ffi::Buffer<ffi::S32> host_pages, ffi::AnyBuffer newest,
                      ffi::AnyBuffer host_pool, ffi::AnyBuffer hot, ffi::AnyBuffer slot_tokens,
                      ffi::AnyBuffer lru, ffi::AnyBuffer stats, ffi::Buffer<ffi::F32> slot_scores,
                      ffi::Result<ffi::Buffer<ffi::S32>> rows,
                      ffi::Result<ffi::AnyBuffer> host_pool_out, ffi::Result<ffi::AnyBuffer> hot_out,
                      ffi::Result<ffi::AnyBuffer> slot_tokens_out, ffi::Result<ffi::AnyBuffer> lru_out,
                      ffi::Result<ffi::AnyBuffer> stats_out, ffi::Result<ffi::Buffer<ffi::S32>> status_out,
                      int64_t page_size, int64_t eviction) {
  auto pd = host_pool.dimensions();
  if (pd.size() != 3) return ffi::Error::InvalidArgument("swap_in: host_pool must be [L, H, W]");
  if (!IsByteAddressable(host_pool.element_type()))
    return ffi::Error::InvalidArgument("swap_in: host_pool dtype packs below one byte per element (unsupported)");
  CopyIfDistinct(host_pool, host_pool_out);
  PoolView view{static_cast<char*>(host_pool_out->untyped_data()), pd[0], pd[1],
                host_pool.element_type(), pd[2]};
  return SwapIn(thread_pool, view, page_size, eviction, slot_scores, layer, top_k, seq_lens, req_ids, host_pages,
                newest, hot,
                slot_tokens, lru, stats, rows, hot_out, slot_tokens_out, lru_out, stats_out, status_out);
}

// Host pool owned by the extension; `pool_token` (s32[1], aliased) orders the calls that touch it.
ffi::Error SwapInExtImpl(ffi::ThreadPool thread_pool, ffi::Buffer<ffi::S32> layer,
                         ffi::Buffer<ffi::S32> top_k, ffi::Buffer<ffi::S32> seq_lens,
                         ffi::Buffer<ffi::S32> req_ids, ffi::Buffer<ffi::S32> host_pages, ffi::AnyBuffer newest,
                         ffi::AnyBuffer pool_token, ffi::AnyBuffer hot, ffi::AnyBuffer slot_tokens,
                         ffi::AnyBuffer lru, ffi::AnyBuffer stats, ffi::Buffer<ffi::F32> slot_scores,
                         ffi::Result<ffi::Buffer<ffi::S32>> rows,
                         ffi::Result<ffi::AnyBuffer> pool_token_out, ffi::Result<ffi::AnyBuffer> hot_out,
                         ffi::Result<ffi::AnyBuffer> slot_tokens_out, ffi::Result<ffi::AnyBuffer> lru_out,
                         ffi::Result<ffi::AnyBuffer> stats_out, ffi::Result<ffi::Buffer<ffi::S32>> status_out,
                         int64_t page_size, int64_t eviction, uint64_t pool_address,
                         int64_t pool_layers, int64_t pool_rows) {
  auto view = RegisteredPool(pool_address, pool_layers, pool_rows, hot);
  if (view.has_error()) return view.error();
  CopyIfDistinct(pool_token, pool_token_out);
  return SwapIn(thread_pool, *view, page_size, eviction, slot_scores, layer, top_k, seq_lens, req_ids, host_pages,
                newest, hot,
                slot_tokens, lru, stats, rows, hot_out, slot_tokens_out, lru_out, stats_out, status_out);
}

// Backup: host_pool[layer + i, dst[n]] = rows[i, n] for every n with dst[n] >= 0.
//   layer s32[], rows T[Lr, N, W], dst s32[N], host_pool T[L, H, W] (aliased to the result); status s32[N]:
//   kBackupRowOutOfRange for a dst outside [-1, H) (that column is skipped), kLayerOutOfRange on every column
//   when [layer, layer + Lr) is outside [0, L) (nothing is written).
ffi::Error Backup(PoolView pool_view, ffi::Buffer<ffi::S32> layer_buf, ffi::AnyBuffer rows,
                  ffi::Buffer<ffi::S32> dst, ffi::Result<ffi::Buffer<ffi::S32>> status_out) {
  auto rd = rows.dimensions();
  if (rd.size() != 3 || layer_buf.element_count() != 1)
    return ffi::Error::InvalidArgument("backup: expected layer s32[], rows [Lr,N,W], host_pool [L,H,W]");
  const int64_t Lr = rd[0], N = rd[1], W = rd[2];
  const int64_t L = pool_view.L, H = pool_view.H;
  if (pool_view.W != W || rows.element_type() != pool_view.dtype)
    return ffi::Error::InvalidArgument("backup: rows and host_pool differ in row width or dtype");
  if (!SameDims(dst, {N}) || !SameDims(*status_out, {N}))
    return ffi::Error::InvalidArgument("backup: dst and status must be s32[N] with N = rows.shape[1]");
  int32_t* status = status_out->typed_data();
  const int64_t layer = layer_buf.typed_data()[0];
  if (layer < 0 || layer + Lr > L) {
    std::fill(status, status + N, static_cast<int32_t>(kLayerOutOfRange));
    return ffi::Error::Success();
  }
  const int32_t* d = dst.typed_data();
  for (int64_t n = 0; n < N; ++n) status[n] = d[n] < -1 || d[n] >= H ? kBackupRowOutOfRange : kOk;
  const size_t row_bytes = static_cast<size_t>(W) * ffi::ByteWidth(rows.element_type());
  const char* src = static_cast<const char*>(rows.untyped_data());
  for (int64_t i = 0; i < Lr; ++i)
    for (int64_t n = 0; n < N; ++n)
      if (d[n] >= 0 && status[n] == kOk)
        std::memcpy(pool_view.base + ((layer + i) * H + d[n]) * row_bytes, src + (i * N + n) * row_bytes,
                    row_bytes);
  return ffi::Error::Success();
}

// Backup into a host pool passed as an XLA operand, aliased to the result.
ffi::Error BackupImpl(ffi::Buffer<ffi::S32> layer, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> dst,
                      ffi::AnyBuffer host_pool, ffi::Result<ffi::AnyBuffer> host_pool_out,
                      ffi::Result<ffi::Buffer<ffi::S32>> status_out) {
  auto pd = host_pool.dimensions();
  if (pd.size() != 3) return ffi::Error::InvalidArgument("backup: host_pool must be [L, H, W]");
  if (!IsByteAddressable(host_pool.element_type()))
    return ffi::Error::InvalidArgument("backup: host_pool dtype packs below one byte per element (unsupported)");
  CopyIfDistinct(host_pool, host_pool_out);
  return Backup(PoolView{static_cast<char*>(host_pool_out->untyped_data()), pd[0], pd[1],
                         host_pool.element_type(), pd[2]},
                layer, rows, dst, status_out);
}

// Backup into an extension-owned host pool; pool_token (s32[1]) is aliased to the result.
ffi::Error BackupExtImpl(ffi::Buffer<ffi::S32> layer, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> dst,
                         ffi::AnyBuffer pool_token, ffi::Result<ffi::AnyBuffer> pool_token_out,
                         ffi::Result<ffi::Buffer<ffi::S32>> status_out, uint64_t pool_address, int64_t pool_layers,
                         int64_t pool_rows) {
  auto view = RegisteredPool(pool_address, pool_layers, pool_rows, rows);
  if (view.has_error()) return view.error();
  CopyIfDistinct(pool_token, pool_token_out);
  return Backup(*view, layer, rows, dst, status_out);
}

}  // namespace
}  // namespace hisparse

XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparseSwapInCpu, hisparse::SwapInImpl,
                              hisparse::BindSwapIn(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparseBackupCpu, hisparse::BackupImpl,
                              hisparse::BindBackup(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparseSwapInExtCpu, hisparse::SwapInExtImpl,
                              hisparse::BindExternalPool(
                                  hisparse::BindSwapIn(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())));

XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparseBackupExtCpu, hisparse::BackupExtImpl,
                              hisparse::BindExternalPool(hisparse::BindBackup(ffi::Ffi::Bind())));
