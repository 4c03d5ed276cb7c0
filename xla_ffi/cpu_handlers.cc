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
// else its SwapInStatus (swap_in_core.h; the row is left unchanged and its rows are -1), then miss_list
// s32[B, K+1] (the CUDA handler's scratch between its plan and copy kernels; not written here). Shapes,
// dtypes and attributes that do not fit are FFI errors (bindings.h; copy_blocks is range-checked only).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "bindings.h"
#include "copy_workers.h"
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

// The longest sequence a thread plans with a DirectPositionMap (16 MiB of positions + 0.5 MiB of bits per
// thread, sized by the longest sequence it has planned, never by the page table's span); a longer one plans
// with the HashPositionMap the CUDA handler uses (O(top_k) memory, the same plan).
constexpr int64_t kMaxDirectMapPositions = int64_t{1} << 22;

// Per-thread scratch, grown once and reused: no heap allocation per call on
// the steady-state hot path.
struct Workspace {
  // Per thread: the scratch of the plan being computed.
  std::vector<int32_t> need_token, slot_of, heap_key, heap_pos;
  std::vector<uint8_t> slot_state;
  std::vector<uint64_t> bits;  // all zero between plans
  std::vector<int32_t> hash_keys, hash_slots;  // the hash map of a sequence past kMaxDirectMapPositions
  // Per request of the call (owned by the calling thread): plans kept until commit.
  std::vector<int32_t> new_lru, miss_tokens, miss_slots, misses, hits;
  std::vector<uint64_t> seen;  // request ids seen in the batch (all zero between calls)
  std::vector<int32_t> prefetch_rows;  // a prefetch row's unused rows output [K]

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

  // plan(map, scratch) with the position map for a sequence of seq_len tokens (a seq_len outside [0, the
  // page table's span] is refused by the plan before it reads the map) and this thread's plan scratch;
  // new_lru: the plan's [D] output.
  template <typename F>
  int32_t Plan(int64_t K, int64_t D, int64_t seq_len, int32_t* new_lru, F&& plan) {
    const bool direct = seq_len <= kMaxDirectMapPositions;
    ReservePlan(K, D, direct ? std::max<int64_t>(seq_len, 0) : 0);
    SwapInScratch scratch{need_token.data(), slot_state.data(), new_lru, heap_key.data(), heap_pos.data()};
    if (direct) {
      DirectPositionMap map = Map();
      return plan(map, scratch);
    }
    const int32_t capacity = HashCapacity(static_cast<int32_t>(K));
    if (static_cast<int64_t>(hash_keys.size()) < capacity) {
      hash_keys.assign(capacity, -1);  // (-1: empty; Clear leaves the first `capacity` entries so)
      hash_slots.resize(capacity);
    }
    HashPositionMap map{hash_keys.data(), hash_slots.data(), capacity - 1};
    return plan(map, scratch);
  }
};

Workspace& ThreadWorkspace() {
  thread_local Workspace ws;
  return ws;
}

// Requests per pool task: below this a request's O(K + D) plan is cheaper
// than waking another thread.
constexpr int64_t kMinRequestsPerTask = 4;

// Shapes the swap-in and the prefetch share: top_k [B, K], hot [L, R, D+1, W] matching the pool, seq_lens /
// req_ids [B], host_pages [B, P], slot_tokens / lru s32[L, R, D], the attributes.
ffi::Error CheckPlanShapes(const char* op, const PoolView& pool_view, int64_t page_size, int64_t eviction,
                           ffi::Buffer<ffi::S32> layer_buf, ffi::Buffer<ffi::S32> top_k,
                           ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> req_ids,
                           ffi::Buffer<ffi::S32> host_pages, ffi::AnyBuffer hot, ffi::AnyBuffer slot_tokens,
                           ffi::AnyBuffer lru) {
  const std::string name(op);
  auto kd = top_k.dimensions();
  auto hd = hot.dimensions();
  if (kd.size() != 2 || hd.size() != 4)
    return ffi::Error::InvalidArgument(name + ": expected top_k [B,K], host_pool [L,H,W], hot [L,R,D+1,W]");
  const int64_t B = kd[0], K = kd[1];
  const int64_t L = pool_view.L, H = pool_view.H, W = pool_view.W;
  const int64_t R = hd[1], D = hd[2] - 1;
  if (D < 1)
    return ffi::Error::InvalidArgument(name + ": hot [L, R, D+1, W] has D+1 = " + std::to_string(hd[2]) +
                                       ": it needs D >= 1 slots per request besides the newest token's");
  if (hd[0] != L || hd[3] != W)
    return ffi::Error::InvalidArgument(name + ": hot must be [L, R, D+1, W] matching host_pool [L, H, W]");
  if (pool_view.dtype != hot.element_type())
    return ffi::Error::InvalidArgument(name + ": host_pool and hot dtypes differ");
  if (K > D)
    return ffi::Error::InvalidArgument(name + ": top_k (" + std::to_string(K) + ") > device_buffer_size (" +
                                       std::to_string(D) + ")");
  if (page_size < 1 || page_size > std::numeric_limits<int32_t>::max())
    return ffi::Error::InvalidArgument(name + ": page_size must be in [1, 2^31)");
  if (eviction < 0 || eviction >= kNumEvictions)
    return ffi::Error::InvalidArgument(name + ": eviction " + std::to_string(eviction) +
                                       " is not a policy (0 lru, 1 clock, 2 score)");
  if (D >= kRefBit) return ffi::Error::InvalidArgument(name + ": device_buffer_size must be < 2^30");
  auto pd = host_pages.dimensions();
  if (!SameDims(seq_lens, {B}) || !SameDims(req_ids, {B}) || pd.size() != 2 || pd[0] != B ||
      !SameDims(slot_tokens, {L, R, D}) || !SameDims(lru, {L, R, D}) || slot_tokens.element_type() != ffi::S32 ||
      lru.element_type() != ffi::S32 || layer_buf.element_count() != 1)
    return ffi::Error::InvalidArgument(
        name + ": expected seq_lens/req_ids s32[B], host_pages s32[B,P], slot_tokens/lru s32[L,R,D], layer s32[]");
  if (std::max({R * (D + 1), H, pd[1] * page_size, K}) > std::numeric_limits<int32_t>::max())
    return ffi::Error::InvalidArgument(name + ": a dimension exceeds int32 indexing");
  return ffi::Error::Success();
}

// One swap-in or prefetch call, its shapes checked, its outputs' state copied in (raw pointers).
struct PlanCall {
  PoolView pool;
  int64_t B, K, R, D, P, page_size, eviction;
  const int32_t *layer, *top_k, *seq_lens, *req_ids, *host_pages;
  const float* slot_scores;  // [B, D] (eviction score), else unused
  const char* newest;        // [B, W] (swap-in only)
  char* hot;
  int32_t *slot_tokens, *lru, *stats;  // stats: swap-in only
  int32_t* rows;                       // [B, K] (swap-in only)
  int32_t* status;                     // [B]
};

// Request ids: in [-1, R), -1 only on idle rows (seq_len 0); a row repeating an earlier row's id fails (rows
// of one request would race). status[b] = kOk or kBadRequestId.
void CheckRequestIds(Workspace& batch, int64_t B, int64_t R, const int32_t* ids, const int32_t* lens,
                     int32_t* status) {
  if (static_cast<int64_t>(batch.seen.size()) < (R + 63) / 64) batch.seen.resize((R + 63) / 64, 0);
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
}

// Row b's request at `layer` (its request id validated >= 0).
RequestLayer MakeRequest(const PlanCall& c, int32_t layer, int64_t b) {
  const int32_t id = c.req_ids[b];
  const int64_t table = (static_cast<int64_t>(layer) * c.R + id) * c.D;
  return RequestLayer{c.top_k + b * c.K, static_cast<int32_t>(c.K), c.seq_lens[b], static_cast<int32_t>(c.D),
                      c.host_pages + b * c.P, static_cast<int32_t>(c.P), static_cast<int32_t>(c.page_size),
                      static_cast<int32_t>(c.pool.H), c.slot_tokens + table, c.lru + table,
                      static_cast<int32_t>(id * (c.D + 1)), static_cast<int32_t>(c.eviction),
                      c.slot_scores + (c.eviction == kEvictScore ? b * c.D : 0)};
}

// The swap-in of a call: plans every row (phase 1, nothing changed: each plan validates what it reads),
// then commits the good rows' plans, places each newest row, copies the misses host -> device and counts
// hits and misses (phase 2). Row statuses as in the file header.
void RunSwapIn(ffi::ThreadPool& thread_pool, const PlanCall& c) {
  const int64_t B = c.B, K = c.K, R = c.R, D = c.D, P = c.P, H = c.pool.H;
  int32_t* status = c.status;
  int32_t* out = c.rows;
  const int32_t layer = c.layer[0];
  if (layer < 0 || layer >= c.pool.L) {
    std::fill(status, status + B, static_cast<int32_t>(kLayerOutOfRange));
    std::fill(out, out + B * K, -1);
    return;
  }
  const int32_t* ids = c.req_ids;
  Workspace& batch = ThreadWorkspace();
  batch.ReserveBatch(B, K, D, R);
  CheckRequestIds(batch, B, R, ids, c.seq_lens, status);
  const size_t row_bytes = static_cast<size_t>(c.pool.W) * ffi::ByteWidth(c.pool.dtype);
  auto request = [&](int64_t b) { return MakeRequest(c, layer, b); };

  // Phase 1: plan every request without touching any state.
  ParallelFor(thread_pool, B, kMinRequestsPerTask, [&](int64_t b) {
    batch.misses[b] = batch.hits[b] = 0;
    if (ids[b] < 0 || status[b] != kOk) {  // an idle row (all padding), or a bad request id
      std::fill(out + b * K, out + (b + 1) * K, -1);
      return;
    }
    const int32_t misses = ThreadWorkspace().Plan(K, D, c.seq_lens[b], batch.new_lru.data() + b * D,
                                                  [&](auto& map, SwapInScratch& scratch) {
      return PlanSwapIn(request(b), map, scratch, out + b * K, batch.miss_tokens.data() + b * K,
                        batch.miss_slots.data() + b * K, &batch.hits[b]);
    });
    if (misses < 0) {
      status[b] = -misses;
      std::fill(out + b * K, out + (b + 1) * K, -1);
      return;
    }
    batch.misses[b] = misses;
  });

  // Phase 2: commit the good rows' plans, place each newest row, copy the missing rows host -> device.
  const char* pool = c.pool.base + static_cast<size_t>(layer) * H * row_bytes;
  char* dev = c.hot + static_cast<size_t>(layer) * R * (D + 1) * row_bytes;
  int32_t* counts = c.stats + static_cast<int64_t>(layer) * R * 2;
  ParallelFor(thread_pool, B, kMinRequestsPerTask, [&](int64_t b) {
    if (ids[b] < 0 || status[b] != kOk) return;
    const RequestLayer r = request(b);
    const int32_t misses = batch.misses[b];
    const int32_t* miss_tokens = batch.miss_tokens.data() + b * K;
    const int32_t* miss_slots = batch.miss_slots.data() + b * K;
    CommitSwapIn(r, batch.new_lru.data() + b * D, miss_tokens, miss_slots, misses);
    for (int32_t i = 0; i < misses; ++i)  // host rows validated by the plan
      std::memcpy(dev + (r.row_base + miss_slots[i]) * row_bytes, pool + HostRow(r, miss_tokens[i]) * row_bytes,
                  row_bytes);
    if (r.seq_len > 0)
      std::memcpy(dev + (r.row_base + NewestSlot(r.seq_len, r.D)) * row_bytes, c.newest + b * row_bytes, row_bytes);
    counts[ids[b] * 2] += batch.hits[b];
    counts[ids[b] * 2 + 1] += misses;
  });
}

ffi::Error SwapIn(ffi::ThreadPool& thread_pool, PoolView pool_view, int64_t page_size, int64_t eviction,
                  ffi::Buffer<ffi::F32> slot_scores, ffi::Buffer<ffi::S32> layer_buf, ffi::Buffer<ffi::S32> top_k,
                  ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> req_ids,
                  ffi::Buffer<ffi::S32> host_pages, ffi::AnyBuffer newest, ffi::AnyBuffer hot,
                  ffi::AnyBuffer slot_tokens, ffi::AnyBuffer lru, ffi::AnyBuffer stats,
                  ffi::Result<ffi::Buffer<ffi::S32>> rows,
                  ffi::Result<ffi::AnyBuffer> hot_out, ffi::Result<ffi::AnyBuffer> slot_tokens_out,
                  ffi::Result<ffi::AnyBuffer> lru_out, ffi::Result<ffi::AnyBuffer> stats_out,
                  ffi::Result<ffi::Buffer<ffi::S32>> status_out) {
  if (auto e = CheckPlanShapes("swap_in", pool_view, page_size, eviction, layer_buf, top_k, seq_lens, req_ids,
                               host_pages, hot, slot_tokens, lru);
      e.failure())
    return e;
  const int64_t B = top_k.dimensions()[0], K = top_k.dimensions()[1];
  if (!SameDims(*status_out, {B})) return ffi::Error::InvalidArgument("swap_in: status must be s32[B]");
  const int64_t L = pool_view.L, W = pool_view.W, R = hot.dimensions()[1], D = hot.dimensions()[2] - 1;
  if (!SameDims(slot_scores, {B, eviction == kEvictScore ? D : 0}))
    return ffi::Error::InvalidArgument(eviction == kEvictScore
                                           ? "swap_in: eviction \"score\" needs slot_scores f32[B, D]"
                                           : "swap_in: slot_scores must be f32[B, 0] unless eviction is \"score\"");
  if (!SameDims(stats, {L, R, 2}) || stats.element_type() != ffi::S32)
    return ffi::Error::InvalidArgument("swap_in: expected stats s32[L,R,2]");
  if (!SameDims(newest, {B, W}) || newest.element_type() != hot.element_type())
    return ffi::Error::InvalidArgument("swap_in: newest must be [B, W] of the hot buffer's dtype");

  // ---- data: a bad row gets a status and is left unchanged; the others are done ------------------------
  // Outputs XLA did not alias to their inputs start as copies of them (every row's state must come out).
  CopyIfDistinct(hot, hot_out);
  CopyIfDistinct(slot_tokens, slot_tokens_out);
  CopyIfDistinct(lru, lru_out);
  CopyIfDistinct(stats, stats_out);
  RunSwapIn(thread_pool,
            PlanCall{pool_view, B, K, R, D, host_pages.dimensions()[1], page_size, eviction, layer_buf.typed_data(),
                   top_k.typed_data(), seq_lens.typed_data(), req_ids.typed_data(), host_pages.typed_data(),
                   slot_scores.typed_data(), static_cast<const char*>(newest.untyped_data()),
                   static_cast<char*>(hot_out->untyped_data()), static_cast<int32_t*>(slot_tokens_out->untyped_data()),
                   static_cast<int32_t*>(lru_out->untyped_data()), static_cast<int32_t*>(stats_out->untyped_data()),
                   rows->typed_data(), status_out->typed_data()});
  return ffi::Error::Success();
}

// ---- cross-layer prefetch -------------------------------------------------------------------------------
// The start snapshots what it reads (top-k, seq_lens, request ids, page tables, and each row's slot table and
// LRU order of the layer) and queues the work on the copy threads (copy_workers.h): plan the predicted
// positions on the snapshot, copy the missing rows from the host pool into the job's own staging memory. The
// wait (on XLA's thread) takes the job by its ticket, finishes it, and commits each row into the arrays XLA
// hands it: the planned slot table and LRU order and the staged rows into the hot buffer, if the row's slot
// table and LRU order are still the snapshot's (else the row's prefetch is dropped: kPrefetchStale). So the
// background never writes an XLA buffer, whatever XLA copies or frees between the two calls.
struct PrefetchJob {
  PoolView pool;
  int64_t B, K, R, D, P, page_size, eviction;
  int32_t layer;
  size_t row_bytes;
  std::vector<int32_t> top_k, seq_lens, req_ids, host_pages;
  std::vector<int32_t> old_slots, old_lru;  // [B, D] the snapshot the plan started from
  std::vector<int32_t> new_slots, new_lru;  // [B, D] the plan's result
  std::vector<int32_t> counts;              // [B] rows staged (>= 0), or -status; 0 for an idle row
  std::vector<int32_t> miss_slots;          // [B, K] the slot of each staged row
  std::vector<std::vector<char>> rows;      // [B] staged rows, counts[b] x row_bytes
};

// Jobs by ticket, from the start to the wait that takes them. A ticket never waited for (a program that
// stopped between the two) is dropped once kMaxPendingJobs newer ones exist.
class PrefetchJobs {
 public:
  static PrefetchJobs& Get() {
    static PrefetchJobs* jobs = new PrefetchJobs();
    return *jobs;
  }
  int64_t Add(std::shared_ptr<PrefetchJob> job) {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t ticket = ++last_;
    jobs_[ticket] = std::move(job);
    while (jobs_.size() > kMaxPendingJobs) jobs_.erase(jobs_.begin());
    return ticket;
  }
  std::shared_ptr<PrefetchJob> Take(int64_t ticket) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = jobs_.find(ticket);
    if (it == jobs_.end()) return nullptr;
    auto job = std::move(it->second);
    jobs_.erase(it);
    return job;
  }

 private:
  static constexpr size_t kMaxPendingJobs = 4096;
  std::mutex mu_;
  int64_t last_ = 0;
  std::map<int64_t, std::shared_ptr<PrefetchJob>> jobs_;
};

// Rows [begin, end) of a prefetch job: plan the predicted positions on the snapshot, stage the misses.
void PrefetchRows(PrefetchJob& job, int64_t begin, int64_t end) {
  const int64_t K = job.K, D = job.D;
  const char* pool = job.pool.base + static_cast<size_t>(job.layer) * job.pool.H * job.row_bytes;
  Workspace& ws = ThreadWorkspace();
  ws.ReserveBatch(1, K, D, job.R);
  if (static_cast<int64_t>(ws.prefetch_rows.size()) < K) ws.prefetch_rows.resize(K);
  for (int64_t b = begin; b < end; ++b) {
    if (job.counts[b] != kOk || job.req_ids[b] < 0) {  // a bad request id (its status), or an idle row (0)
      job.counts[b] = -job.counts[b];
      continue;
    }
    const RequestLayer r{job.top_k.data() + b * K, static_cast<int32_t>(K), job.seq_lens[b],
                         static_cast<int32_t>(D), job.host_pages.data() + b * job.P, static_cast<int32_t>(job.P),
                         static_cast<int32_t>(job.page_size), static_cast<int32_t>(job.pool.H),
                         job.new_slots.data() + b * D, job.new_lru.data() + b * D, 0,
                         static_cast<int32_t>(job.eviction), nullptr};
    int32_t hits = 0;
    int32_t* slots = job.miss_slots.data() + b * K;
    const int32_t misses = ws.Plan(K, D, r.seq_len, ws.new_lru.data(), [&](auto& map, SwapInScratch& scratch) {
      return PlanSwapIn(r, map, scratch, ws.prefetch_rows.data(), ws.miss_tokens.data(), slots, &hits);
    });
    job.counts[b] = misses;  // or -status: the row is left alone
    if (misses < 0) continue;
    CommitSwapIn(r, ws.new_lru.data(), ws.miss_tokens.data(), slots, misses);  // into the job's copy
    std::vector<char>& staged = job.rows[b];
    staged.resize(static_cast<size_t>(misses) * job.row_bytes);
    for (int32_t i = 0; i < misses; ++i)  // host rows validated by the plan
      std::memcpy(staged.data() + i * job.row_bytes, pool + HostRow(r, ws.miss_tokens[i]) * job.row_bytes,
                  job.row_bytes);
  }
}

// Requests per prefetch task.
constexpr int64_t kPrefetchRowsPerTask = 4;

// Prefetch start: layer `layer`'s swap-in of the PREDICTED positions top_k (the previous layer's top-k) with
// no newest row and no stats, queued for the copy threads; ticket s64 as s32[2] (low, high word) names the
// job for PrefetchWait. Checks the shapes, the layer and the request ids here; reads slot_tokens / lru (not
// returned: the wait commits into its own operands).
ffi::Error PrefetchStart(PoolView pool_view, int64_t page_size, int64_t eviction, ffi::Buffer<ffi::S32> layer_buf,
                         ffi::Buffer<ffi::S32> top_k, ffi::Buffer<ffi::S32> seq_lens,
                         ffi::Buffer<ffi::S32> req_ids, ffi::Buffer<ffi::S32> host_pages, ffi::AnyBuffer hot,
                         ffi::AnyBuffer slot_tokens, ffi::AnyBuffer lru, ffi::Result<ffi::Buffer<ffi::S32>> ticket) {
  if (auto e = CheckPlanShapes("prefetch", pool_view, page_size, eviction, layer_buf, top_k, seq_lens, req_ids,
                               host_pages, hot, slot_tokens, lru);
      e.failure())
    return e;
  auto job = std::make_shared<PrefetchJob>();
  const int64_t B = top_k.dimensions()[0];
  job->counts.assign(B, 0);
  if (eviction == kEvictScore)
    return ffi::Error::InvalidArgument("prefetch: eviction \"score\" needs this layer's scores, not known yet");
  if (ticket->element_count() != 2) return ffi::Error::InvalidArgument("prefetch: ticket must be s32[1, 2]");
  const int64_t K = top_k.dimensions()[1], P = host_pages.dimensions()[1];
  const int64_t R = hot.dimensions()[1], D = hot.dimensions()[2] - 1;
  PrefetchJob& j = *job;
  j.pool = pool_view;
  j.B = B, j.K = K, j.R = R, j.D = D, j.P = P, j.page_size = page_size, j.eviction = eviction;
  j.layer = layer_buf.typed_data()[0];
  j.row_bytes = static_cast<size_t>(pool_view.W) * ffi::ByteWidth(pool_view.dtype);
  if (j.layer < 0 || j.layer >= pool_view.L) {
    std::fill(j.counts.begin(), j.counts.end(), -static_cast<int32_t>(kLayerOutOfRange));
  } else {
    j.top_k.assign(top_k.typed_data(), top_k.typed_data() + B * K);
    j.seq_lens.assign(seq_lens.typed_data(), seq_lens.typed_data() + B);
    j.req_ids.assign(req_ids.typed_data(), req_ids.typed_data() + B);
    j.host_pages.assign(host_pages.typed_data(), host_pages.typed_data() + B * P);
    CheckRequestIds(ThreadWorkspace(), B, R, j.req_ids.data(), j.seq_lens.data(), j.counts.data());
    j.old_slots.assign(B * D, -1);
    j.old_lru.assign(B * D, 0);
    const int32_t* slots = static_cast<const int32_t*>(slot_tokens.untyped_data());
    const int32_t* order = static_cast<const int32_t*>(lru.untyped_data());
    for (int64_t b = 0; b < B; ++b) {
      if (j.counts[b] != kOk || j.req_ids[b] < 0) continue;
      const int64_t table = (static_cast<int64_t>(j.layer) * R + j.req_ids[b]) * D;
      std::memcpy(j.old_slots.data() + b * D, slots + table, D * sizeof(int32_t));
      std::memcpy(j.old_lru.data() + b * D, order + table, D * sizeof(int32_t));
    }
    j.new_slots = j.old_slots;
    j.new_lru = j.old_lru;
    j.miss_slots.assign(B * K, -1);
    j.rows.resize(B);
  }
  const int64_t id = PrefetchJobs::Get().Add(job);
  ticket->typed_data()[0] = static_cast<int32_t>(id & 0xffffffff);
  ticket->typed_data()[1] = static_cast<int32_t>(id >> 32);
  if (j.layer < 0 || j.layer >= pool_view.L) return ffi::Error::Success();
  std::vector<CopyWorkers::Task> tasks;
  for (int64_t begin = 0; begin < B; begin += kPrefetchRowsPerTask)
    tasks.push_back([job, begin, end = std::min(B, begin + kPrefetchRowsPerTask)] { PrefetchRows(*job, begin, end); });
  CopyWorkers::Get().Submit(job.get(), std::move(tasks));
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
                      ffi::Result<ffi::Buffer<ffi::S32>> /*miss_list*/, int64_t page_size, int64_t eviction,
                      int64_t copy_blocks) {
  if (auto e = CheckCopyBlocks(copy_blocks); e.failure()) return e;
  auto view = OperandPool("swap_in", host_pool, host_pool_out);
  if (view.has_error()) return view.error();
  CopyIfDistinct(host_pool, host_pool_out);
  return SwapIn(thread_pool, *view, page_size, eviction, slot_scores, layer, top_k, seq_lens, req_ids, host_pages,
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
                         ffi::Result<ffi::Buffer<ffi::S32>> /*miss_list*/, int64_t page_size, int64_t eviction,
                         int64_t copy_blocks, uint64_t pool_address, uint64_t pool_serial, int64_t pool_layers,
                         int64_t pool_rows) {
  if (auto e = CheckCopyBlocks(copy_blocks); e.failure()) return e;
  PinnedPool pin;  // held until the handler returns: free_host_pool waits for it
  auto view = RegisteredPool(pool_address, pool_serial, pool_layers, pool_rows, hot, pin);
  if (view.has_error()) return view.error();
  CopyIfDistinct(pool_token, pool_token_out);
  return SwapIn(thread_pool, *view, page_size, eviction, slot_scores, layer, top_k, seq_lens, req_ids, host_pages,
                newest, hot,
                slot_tokens, lru, stats, rows, hot_out, slot_tokens_out, lru_out, stats_out, status_out);
}

// Prefetch start over a host pool passed as an XLA operand, aliased to a result (so that the next backup of
// the pool is ordered after this call).
ffi::Error PrefetchStartImpl(ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> top_k,
                             ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> req_ids,
                             ffi::Buffer<ffi::S32> host_pages, ffi::AnyBuffer host_pool, ffi::AnyBuffer hot,
                             ffi::AnyBuffer slot_tokens, ffi::AnyBuffer lru,
                             ffi::Result<ffi::AnyBuffer> host_pool_out, ffi::Result<ffi::Buffer<ffi::S32>> ticket,
                             int64_t page_size, int64_t eviction) {
  auto view = OperandPool("prefetch", host_pool, host_pool_out);
  if (view.has_error()) return view.error();
  CopyIfDistinct(host_pool, host_pool_out);
  return PrefetchStart(*view, page_size, eviction, layer, top_k, seq_lens, req_ids, host_pages, hot, slot_tokens,
                       lru, ticket);
}

// Prefetch start over an extension-owned host pool; pool_token (s32[1]) is aliased to the result.
ffi::Error PrefetchStartExtImpl(ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> top_k,
                                ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> req_ids,
                                ffi::Buffer<ffi::S32> host_pages, ffi::AnyBuffer pool_token, ffi::AnyBuffer hot,
                                ffi::AnyBuffer slot_tokens, ffi::AnyBuffer lru,
                                ffi::Result<ffi::AnyBuffer> pool_token_out, ffi::Result<ffi::Buffer<ffi::S32>> ticket,
                                int64_t page_size, int64_t eviction, uint64_t pool_address,
                                uint64_t pool_serial, int64_t pool_layers,
                                int64_t pool_rows) {
  PinnedPool pin;  // held until the handler returns: free_host_pool waits for it
  auto view = RegisteredPool(pool_address, pool_serial, pool_layers, pool_rows, hot, pin);
  if (view.has_error()) return view.error();
  CopyIfDistinct(pool_token, pool_token_out);
  return PrefetchStart(*view, page_size, eviction, layer, top_k, seq_lens, req_ids, host_pages, hot, slot_tokens,
                       lru, ticket);
}

// Prefetch wait: finishes the job of `ticket` (running its queued tasks here) and commits each of its rows
// into hot, slot_tokens and lru (aliased to the results) if the row's slot table and LRU order of the layer
// are still those the plan started from; prefetched s32[B]: the rows placed, 0 for an idle row or without a
// job (an unknown ticket), -status for a row left alone (kPrefetchStale: its tables changed meanwhile).
// `after` is not read: it orders the wait after the work the prefetch overlaps.
ffi::Error PrefetchWaitImpl(ffi::Buffer<ffi::S32> ticket, ffi::AnyBuffer hot, ffi::AnyBuffer slot_tokens,
                            ffi::AnyBuffer lru, ffi::AnyBuffer after, ffi::Result<ffi::AnyBuffer> hot_out,
                            ffi::Result<ffi::AnyBuffer> slot_tokens_out, ffi::Result<ffi::AnyBuffer> lru_out,
                            ffi::Result<ffi::Buffer<ffi::S32>> prefetched) {
  (void)after;
  if (ticket.element_count() != 2) return ffi::Error::InvalidArgument("prefetch_wait: ticket must be s32[1, 2]");
  CopyIfDistinct(hot, hot_out);
  CopyIfDistinct(slot_tokens, slot_tokens_out);
  CopyIfDistinct(lru, lru_out);
  const int64_t id = static_cast<int64_t>(static_cast<uint32_t>(ticket.typed_data()[0])) |
                     (static_cast<int64_t>(ticket.typed_data()[1]) << 32);
  auto job = PrefetchJobs::Get().Take(id);
  int32_t* count = prefetched->typed_data();
  std::fill(count, count + prefetched->element_count(), 0);
  if (job == nullptr) return ffi::Error::Success();
  CopyWorkers::Get().Wait(job.get());
  const PrefetchJob& j = *job;
  auto hd = hot.dimensions();
  if (!SameDims(*prefetched, {j.B}) || hd.size() != 4 || hd[0] != j.pool.L || hd[1] != j.R || hd[2] != j.D + 1 ||
      hd[3] != j.pool.W || hot.element_type() != j.pool.dtype || slot_tokens.element_type() != ffi::S32 ||
      lru.element_type() != ffi::S32 || !SameDims(slot_tokens, {hd[0], j.R, j.D}) || !SameDims(lru, {hd[0], j.R, j.D}))
    return ffi::Error::InvalidArgument(
        "prefetch_wait: hot / slot_tokens / lru / prefetched do not match the prefetch_start of the ticket (hot "
        "T[L, R, D + 1, W] of the pool's dtype, slot_tokens / lru s32[L, R, D], prefetched s32[B])");
  if (j.layer < 0 || j.layer >= j.pool.L) {  // the start found the layer out of range
    std::copy(j.counts.begin(), j.counts.end(), count);
    return ffi::Error::Success();
  }
  int32_t* slots = static_cast<int32_t*>(slot_tokens_out->untyped_data());
  int32_t* order = static_cast<int32_t*>(lru_out->untyped_data());
  char* dev = static_cast<char*>(hot_out->untyped_data()) + static_cast<size_t>(j.layer) * j.R * (j.D + 1) * j.row_bytes;
  const size_t table_bytes = j.D * sizeof(int32_t);
  for (int64_t b = 0; b < j.B; ++b) {
    const int32_t c = j.counts[b];
    if (c < 0 || j.req_ids[b] < 0) {
      count[b] = c;
      continue;
    }
    const int64_t table = (static_cast<int64_t>(j.layer) * j.R + j.req_ids[b]) * j.D;
    if (std::memcmp(slots + table, j.old_slots.data() + b * j.D, table_bytes) != 0 ||
        std::memcmp(order + table, j.old_lru.data() + b * j.D, table_bytes) != 0) {
      count[b] = -kPrefetchStale;
      continue;
    }
    std::memcpy(slots + table, j.new_slots.data() + b * j.D, table_bytes);
    std::memcpy(order + table, j.new_lru.data() + b * j.D, table_bytes);
    const char* staged = j.rows[b].data();
    for (int32_t i = 0; i < c; ++i)
      std::memcpy(dev + (static_cast<int64_t>(j.req_ids[b]) * (j.D + 1) + j.miss_slots[b * j.K + i]) * j.row_bytes,
                  staged + i * j.row_bytes, j.row_bytes);
    count[b] = c;
  }
  return ffi::Error::Success();
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
  auto view = OperandPool("backup", host_pool, host_pool_out);
  if (view.has_error()) return view.error();
  CopyIfDistinct(host_pool, host_pool_out);
  return Backup(*view,
                layer, rows, dst, status_out);
}

// Backup into an extension-owned host pool; pool_token (s32[1]) is aliased to the result.
ffi::Error BackupExtImpl(ffi::Buffer<ffi::S32> layer, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> dst,
                         ffi::AnyBuffer pool_token, ffi::Result<ffi::AnyBuffer> pool_token_out,
                         ffi::Result<ffi::Buffer<ffi::S32>> status_out, uint64_t pool_address,
                         uint64_t pool_serial, int64_t pool_layers,
                         int64_t pool_rows) {
  PinnedPool pin;  // held until the handler returns: free_host_pool waits for it
  auto view = RegisteredPool(pool_address, pool_serial, pool_layers, pool_rows, rows, pin);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparsePrefetchStartCpu, hisparse::PrefetchStartImpl,
                              hisparse::BindPrefetchStart(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparsePrefetchStartExtCpu, hisparse::PrefetchStartExtImpl,
                              hisparse::BindExternalPool(
                                  hisparse::BindPrefetchStart(ffi::Ffi::Bind())));

XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparsePrefetchWaitCpu, hisparse::PrefetchWaitImpl,
                              hisparse::BindPrefetchWait(ffi::Ffi::Bind()));
