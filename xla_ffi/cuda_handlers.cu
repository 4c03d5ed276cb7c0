// CUDA XLA FFI handlers: HiSparse swap-in and host-pool backup.
//
// Same buffers and semantics as cpu_handlers.cc (see that file's header); the
// planning runs the shared core (swap_in_core.h) and the copies read the host
// pool directly over PCIe/NVLink-C2C (zero-copy from pinned host memory).
//
// Launch shape: one thread block per batch row (request). The block
// checks the row (layer, request id) and plans it with the scratch in shared
// memory (LRU: the whole block, BlockPlanLru; CLOCK and score: thread 0 runs
// the shared core's PlanSwapIn); a row that fails gets its status (swap_in_core.h SwapInStatus) in the
// status output, rows of -1, and no change. A good row is committed, then its
// missing rows are copied with 16-byte loads where aligned, four loads in
// flight per thread (CopyRows): by the planning block itself when the batch
// fills the device, else by a second kernel of copy_blocks blocks per row
// (MissCopyKernel; one block reading mapped host memory is latency-bound,
// ~2.4 GB/s on an H200), which reads the row's misses from the miss_list
// result the plan kernel writes.
//
// Nothing here waits for the device: no host synchronization, no allocation,
// no stream query. The handlers are declared command-buffer compatible (XLA
// may capture them in a CUDA graph); the caller reads the status with the
// step's other results (hisparse_jax.kernels.ops.check_status).
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>

#include "bindings.h"
#include "swap_in_core.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace hisparse {
namespace {

constexpr int kThreads = 256;

struct SwapInArgs {
  const int32_t* layer;
  const int32_t* top_k;
  const int32_t* seq_lens;
  const int32_t* req_ids;
  const int32_t* host_pages;
  const char* newest;
  const char* pool;
  char* hot;
  int32_t* slot_tokens;
  int32_t* lru;
  int32_t* stats;
  int32_t* rows;
  int32_t* status;  // [B]
  int32_t* miss_list;  // [B, K+1]: the row's number of misses, then their slots, for MissCopyKernel; null: none
  const float* slot_scores;  // [B, D] (eviction score), else unused
  int32_t B, K, D, R, P, page_size, L, H, eviction;
  int64_t row_bytes;
};

// Row b's request; only for rows whose request id was validated as >= 0.
__device__ RequestLayer MakeRequest(const SwapInArgs& a, int32_t b, int32_t layer) {
  const int32_t id = a.req_ids[b];
  const int64_t table = (static_cast<int64_t>(layer) * a.R + id) * a.D;
  return RequestLayer{a.top_k + static_cast<int64_t>(b) * a.K, a.K, a.seq_lens[b], a.D,
                      a.host_pages + static_cast<int64_t>(b) * a.P, a.P, a.page_size, a.H,
                      a.slot_tokens + table, a.lru + table, id * (a.D + 1), a.eviction,
                      a.slot_scores + (a.eviction == kEvictScore ? static_cast<int64_t>(b) * a.D : 0)};
}

// Row b's request id is in [-1, R), -1 only with seq_len 0, and no earlier row has it.
__device__ bool RequestIdOk(const SwapInArgs& a, int32_t b) {
  const int32_t id = a.req_ids[b];
  if (id < -1 || id >= a.R || (id < 0 && a.seq_lens[b] != 0)) return false;
  if (id < 0) return true;
  for (int32_t i = 0; i < b; ++i)
    if (a.req_ids[i] == id) return false;
  return true;
}

__device__ void CopyRow(const char* src, char* dst, int64_t bytes) {
  const bool aligned = ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) | bytes) & 15) == 0;
  if (aligned) {
    const int4* s = reinterpret_cast<const int4*>(src);
    int4* d = reinterpret_cast<int4*>(dst);
    for (int64_t i = threadIdx.x % 32; i < bytes / 16; i += 32) d[i] = s[i];
  } else {
    for (int64_t i = threadIdx.x % 32; i < bytes; i += 32) dst[i] = src[i];
  }
}

// Shared-memory layout of one block's plan (see SwapInSharedBytes).
struct BlockPlan {
  HashPositionMap map;
  SwapInScratch scratch;
  int32_t* miss_tokens;
  int32_t* miss_slots;
  int32_t* rows;  // [K] a prefetch's (unused) rows; null for the swap-in, which writes its rows output
};

// with_rows: the prefetch's layout, K more entries for the plan's rows (SwapInSharedBytes).
__device__ BlockPlan CarveShared(int32_t* smem, int32_t K, int32_t D, bool with_rows) {
  const int32_t cap = HashCapacity(K);
  int32_t* hash_keys = smem;
  int32_t* hash_slots = hash_keys + cap;
  int32_t* need_token = hash_slots + cap;
  int32_t* miss_tokens = need_token + K;
  int32_t* miss_slots = miss_tokens + K;
  int32_t* new_lru = miss_slots + K;
  int32_t* heap_pos = new_lru + D;
  int32_t* heap_key = heap_pos + K;
  int32_t* rows = with_rows ? heap_key + K : nullptr;
  uint8_t* slot_state = reinterpret_cast<uint8_t*>(heap_key + (with_rows ? 2 : 1) * K);
  for (int32_t i = threadIdx.x; i < cap; i += blockDim.x) hash_keys[i] = -1;
  __syncthreads();
  return BlockPlan{HashPositionMap{hash_keys, hash_slots, cap - 1},
                   SwapInScratch{need_token, slot_state, new_lru, heap_key, heap_pos}, miss_tokens, miss_slots, rows};
}

// ---- block-parallel LRU plan ------------------------------------------------------------------------------
// The LRU policy's plan (PlanSwapIn with kEvictLru) run by the whole block instead of thread 0: the same
// result bit for bit (rows, misses in first-appearance order, victims = the oldest untouched slots in LRU
// order, the new LRU order, the status of the first failing check in PlanSwapIn's order), each O(K + D)
// pass spread over the block's threads. Thread 0 alone spent ~2 ms per request-layer at K 2048, D 4096 on
// an H200 (dependent global loads), whatever the batch. CLOCK (a sequential hand) and the score policy (a
// heap) keep thread 0's plan.

// Shared memory of one block's parallel plan: a hash map position -> value (open addressing, 2 x capacity;
// the value is the position's first top-k index, then the slot serving it), need_token, miss_tokens,
// miss_slots (K each; with_rows: one more K for the prefetch's rows), new_lru (D), the LRU order's
// seen bits (D / 32), per-warp counts and flags, and slot_state (D bytes).
struct ParallelPlan {
  HashPositionMap map;  // the core's map (its hash and probing; keys -1 = empty); map.slots holds the value
  int32_t* val;         // = map.slots [cap]
  int32_t* need_token;
  int32_t* miss_tokens;
  int32_t* miss_slots;
  int32_t* new_lru;
  uint32_t* seen;
  int32_t* warp_counts;  // [kThreads / 32]
  int32_t* flags;        // [4]
  uint8_t* slot_state;
  int32_t* rows;
};

constexpr int32_t kNone = INT32_MAX;

size_t ParallelPlanInts(int32_t K, int32_t D, bool with_rows) {
  return 2 * static_cast<size_t>(HashCapacity(K)) + (with_rows ? 4 : 3) * static_cast<size_t>(K) + D +
         (D + 31) / 32 + kThreads / 32 + 4;
}

__device__ ParallelPlan CarveParallel(int32_t* smem, int32_t K, int32_t D, bool with_rows) {
  ParallelPlan p;
  const int32_t cap = HashCapacity(K);
  p.map = HashPositionMap{smem, smem + cap, cap - 1};
  p.val = p.map.slots;
  p.need_token = p.val + cap;
  p.miss_tokens = p.need_token + K;
  p.miss_slots = p.miss_tokens + K;
  p.rows = with_rows ? p.miss_slots + K : nullptr;
  p.new_lru = p.miss_slots + (with_rows ? 2 : 1) * K;
  p.seen = reinterpret_cast<uint32_t*>(p.new_lru + D);
  p.warp_counts = reinterpret_cast<int32_t*>(p.seen + (D + 31) / 32);
  p.flags = p.warp_counts + kThreads / 32;
  p.slot_state = reinterpret_cast<uint8_t*>(p.flags + 4);
  for (int32_t i = threadIdx.x; i < cap; i += blockDim.x) {
    p.map.keys[i] = -1;
    p.val[i] = kNone;
  }
  for (int32_t i = threadIdx.x; i < (D + 31) / 32; i += blockDim.x) p.seen[i] = 0;
  if (threadIdx.x < 4) p.flags[threadIdx.x] = 0;
  __syncthreads();
  return p;
}

// Ordered block-wide compaction: emit(i, rank) for every i in [0, n) with pred(i), rank = the number of
// earlier such i; returns their count (in every thread). Every thread of the block must call it.
template <typename Pred, typename Emit>
__device__ int32_t BlockCompact(int32_t n, int32_t* warp_counts, Pred pred, Emit emit) {
  const int32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int32_t base = 0;
  for (int32_t start = 0; start < n; start += kThreads) {
    const int32_t i = start + threadIdx.x;
    const bool f = i < n && pred(i);
    const uint32_t m = __ballot_sync(0xffffffffu, f);
    if (lane == 0) warp_counts[warp] = __popc(m);
    __syncthreads();
    int32_t before = base, total = base;
    for (int32_t w = 0; w < kThreads / 32; ++w) {
      const int32_t c = warp_counts[w];
      before += w < warp ? c : 0;
      total += c;
    }
    if (f) emit(i, before + __popc(m & ((1u << lane) - 1u)));
    __syncthreads();  // warp_counts is rewritten by the next chunk
    base = total;
  }
  return base;
}

// The LRU plan of request r, by the whole block: returns the number of misses or -status (the same value
// in every thread); writes out_rows [K], p.miss_tokens / p.miss_slots, p.new_lru (slow path). *hits (every
// thread) as PlanSwapIn's. Reads r's tables only; BlockCommit applies the plan.
__device__ int32_t BlockPlanLru(const RequestLayer& r, ParallelPlan& p, int32_t* out_rows, int32_t* hits) {
  const int32_t K = r.K, D = r.D, seq_len = r.seq_len;
  if (seq_len < 0 || seq_len > MaxSeqLen(r)) return -kBadSeqLen;
  // Positions: validated, inserted, each keeping its first top-k index.
  for (int32_t k = threadIdx.x; k < K; k += kThreads) {
    const int32_t t = r.top_k[k];
    if (t < -1 || t >= seq_len) {
      p.flags[0] = 1;
      continue;
    }
    if (t < 0) continue;
    // HashPositionMap::Insert's probing, with atomics (the block inserts at once)
    for (uint32_t i = p.map.Home(t);; i = (i + 1) & static_cast<uint32_t>(p.map.mask)) {
      const int32_t prev = atomicCAS(&p.map.keys[i], -1, t);
      if (prev == -1 || prev == t) {
        atomicMin(&p.val[i], k);
        break;
      }
    }
  }
  __syncthreads();
  if (p.flags[0]) return -kPositionOutOfRange;
  const int32_t distinct = BlockCompact(
      K, p.warp_counts,
      [&](int32_t k) {
        const int32_t t = r.top_k[k];
        return t >= 0 && p.val[p.map.Find(t)] == k;
      },
      [&](int32_t k, int32_t rank) { p.need_token[rank] = r.top_k[k]; });
  if (seq_len <= D) {  // fast path: every token sits in its own slot
    for (int32_t k = threadIdx.x; k < K; k += kThreads) {
      const int32_t t = r.top_k[k];
      out_rows[k] = t < 0 ? -1 : r.row_base + t;
    }
    *hits = distinct;
    return 0;
  }
  for (int32_t i = threadIdx.x; i <= p.map.mask; i += kThreads) p.val[i] = kNone;  // now: the serving slot
  __syncthreads();
  // Hits: the lowest slot holding a needed token (a duplicated slot entry counts once).
  const int32_t newest = seq_len - 1;
  for (int32_t s = threadIdx.x; s < D; s += kThreads) {
    const int32_t t = r.slot_tokens[s];
    const int32_t f = t >= 0 && t < newest ? p.map.Find(t) : -1;
    if (f >= 0) atomicMin(&p.val[f], s);
  }
  __syncthreads();
  int32_t num_hits = 0;
  for (int32_t s0 = 0; s0 < D; s0 += kThreads) {
    const int32_t s = s0 + threadIdx.x;
    bool hit = false;
    if (s < D) {
      const int32_t t = r.slot_tokens[s];
      const int32_t f = t >= 0 && t < newest ? p.map.Find(t) : -1;
      hit = f >= 0 && p.val[f] == s;
      p.slot_state[s] = hit ? kHit : kUntouched;
    }
    num_hits += __syncthreads_count(hit);
  }
  // Misses in first-appearance order; each needs a valid host row.
  const int32_t num_misses = BlockCompact(
      distinct, p.warp_counts,
      [&](int32_t i) {
        const int32_t t = p.need_token[i];
        return t != newest && p.val[p.map.Find(t)] == kNone;
      },
      [&](int32_t i, int32_t rank) {
        const int32_t t = p.need_token[i];
        p.miss_tokens[rank] = t;
        if (HostRow(r, t) < 0) p.flags[1] = 1;
      });
  __syncthreads();
  if (p.flags[1]) return -kHostRowOutOfRange;
  // The LRU order must be a permutation of the D slots, with enough untouched slots for the misses.
  for (int32_t i = threadIdx.x; i < D; i += kThreads) {
    const int32_t s = r.lru[i];
    if (s < 0 || s >= D || (atomicOr(&p.seen[s / 32], 1u << (s % 32)) & (1u << (s % 32)))) p.flags[2] = 1;
  }
  __syncthreads();
  if (p.flags[2] || D - num_hits < num_misses) return -kLruNotPermutation;
  // Victims: the oldest untouched slots, in LRU order; each serves its miss.
  const int32_t untouched = BlockCompact(
      D, p.warp_counts, [&](int32_t i) { return p.slot_state[r.lru[i]] == kUntouched; },
      [&](int32_t i, int32_t rank) {
        if (rank >= num_misses) return;
        const int32_t s = r.lru[i];
        p.miss_slots[rank] = s;
        p.slot_state[s] = kFilled;
        p.val[p.map.Find(p.miss_tokens[rank])] = s;
      });
  __syncthreads();
  // New order: untouched (old order) | filled (victim order) | hits (old order).
  BlockCompact(D, p.warp_counts, [&](int32_t i) { return p.slot_state[r.lru[i]] == kUntouched; },
               [&](int32_t i, int32_t rank) { p.new_lru[rank] = r.lru[i]; });
  for (int32_t j = threadIdx.x; j < num_misses; j += kThreads) p.new_lru[untouched - num_misses + j] = p.miss_slots[j];
  BlockCompact(D, p.warp_counts, [&](int32_t i) { return p.slot_state[r.lru[i]] == kHit; },
               [&](int32_t i, int32_t rank) { p.new_lru[D - num_hits + rank] = r.lru[i]; });
  for (int32_t k = threadIdx.x; k < K; k += kThreads) {
    const int32_t t = r.top_k[k];
    out_rows[k] = t < 0 ? -1 : t == newest ? r.row_base + D : r.row_base + p.val[p.map.Find(t)];
  }
  __syncthreads();
  *hits = distinct - num_misses;
  return num_misses;
}

// Applies a successful BlockPlanLru (CommitSwapIn's effect), by the whole block.
__device__ void BlockCommit(const RequestLayer& r, const ParallelPlan& p, int32_t num_misses) {
  if (r.seq_len <= r.D) return;
  for (int32_t i = threadIdx.x; i < num_misses; i += kThreads) r.slot_tokens[p.miss_slots[i]] = p.miss_tokens[i];
  for (int32_t i = threadIdx.x; i < r.D; i += kThreads) r.lru[i] = p.new_lru[i];
}

// The block copies rows src_row(i) of `pool` -> dst_row(i) of `dev` for i in [0, n): flattened over 16-byte
// chunks with four independent loads in flight per thread (a load from mapped host memory crosses PCIe:
// latency, not bandwidth, bounds one warp copying one row at a time at small batches).
template <typename SrcRow, typename DstRow>
__device__ void CopyRows(const char* pool, char* dev, int64_t row_bytes, int32_t n, SrcRow src_row, DstRow dst_row) {
  const bool aligned = ((reinterpret_cast<uintptr_t>(pool) | reinterpret_cast<uintptr_t>(dev) | row_bytes) & 15) == 0;
  if (!aligned) {
    for (int64_t j = threadIdx.x; j < n * row_bytes; j += kThreads)
      dev[dst_row(static_cast<int32_t>(j / row_bytes)) * row_bytes + j % row_bytes] =
          pool[src_row(static_cast<int32_t>(j / row_bytes)) * row_bytes + j % row_bytes];
    return;
  }
  constexpr int kInFlight = 4;
  const int64_t per_row = row_bytes / 16, total = n * per_row;
  for (int64_t base = threadIdx.x; base < total; base += kInFlight * kThreads) {
    int4 v[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int64_t j = base + u * kThreads;
      if (j < total)
        v[u] = reinterpret_cast<const int4*>(pool + src_row(static_cast<int32_t>(j / per_row)) * row_bytes)[j % per_row];
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int64_t j = base + u * kThreads;
      if (j < total)
        reinterpret_cast<int4*>(dev + dst_row(static_cast<int32_t>(j / per_row)) * row_bytes)[j % per_row] = v[u];
    }
  }
}

// Plans request r by its policy (LRU: the whole block, BlockPlanLru; CLOCK and score: thread 0, the shared
// core's PlanSwapIn) into out_rows (null: the layout's own rows, the prefetch's) and commits a good plan.
// Returns the number of misses or -status in every thread; the misses in *miss_tokens / *miss_slots (shared
// memory) and, in thread 0, the distinct positions served from the device in *hits.
__device__ int32_t PlanAndCommit(const RequestLayer& r, int32_t* smem, bool with_rows, int32_t* out_rows,
                                 int32_t* hits, const int32_t** miss_tokens, const int32_t** miss_slots) {
  __shared__ int32_t result;
  if (r.eviction == kEvictLru) {
    ParallelPlan p = CarveParallel(smem, r.K, r.D, with_rows);
    const int32_t n = BlockPlanLru(r, p, out_rows ? out_rows : p.rows, hits);
    if (n >= 0) BlockCommit(r, p, n);
    *miss_tokens = p.miss_tokens;
    *miss_slots = p.miss_slots;
    __syncthreads();
    return n;
  }
  BlockPlan p = CarveShared(smem, r.K, r.D, with_rows);
  if (threadIdx.x == 0) {
    result = PlanSwapIn(r, p.map, p.scratch, out_rows ? out_rows : p.rows, p.miss_tokens, p.miss_slots, hits);
    if (result >= 0) CommitSwapIn(r, p.scratch.new_lru, p.miss_tokens, p.miss_slots, result);
  }
  *miss_tokens = p.miss_tokens;
  *miss_slots = p.miss_slots;
  __syncthreads();
  return result;
}

// One block per request: the block checks the row, plans it and commits a good plan (PlanAndCommit), then
// copies the missing rows, or with a.miss_list lists them there for MissCopyKernel (a row with nothing to
// copy lists 0). A bad row writes its status and changes nothing.
__global__ void SwapInKernel(SwapInArgs a) {
  extern __shared__ int32_t smem[];
  const int32_t b = blockIdx.x;
  const int32_t layer = *a.layer;
  int32_t* rows = a.rows + static_cast<int64_t>(b) * a.K;
  int32_t* miss_list = a.miss_list ? a.miss_list + static_cast<int64_t>(b) * (a.K + 1) : nullptr;
  if (miss_list && threadIdx.x == 0) miss_list[0] = 0;
  int32_t code = kOk;
  if (layer < 0 || layer >= a.L) code = kLayerOutOfRange;
  else if (!RequestIdOk(a, b)) code = kBadRequestId;
  // An idle row (no request: all padding) or a bad one costs one block that exits at once. A row of a request
  // with seq_len 0 is still planned (its positions checked), as on the CPU.
  if (code != kOk || a.req_ids[b] < 0) {
    for (int32_t k = threadIdx.x; k < a.K; k += blockDim.x) rows[k] = -1;
    if (threadIdx.x == 0) a.status[b] = code;
    return;
  }
  const RequestLayer r = MakeRequest(a, b, layer);
  int32_t hits = 0;
  const int32_t* miss_tokens;
  const int32_t* miss_slots;
  const int32_t num_misses = PlanAndCommit(r, smem, false, rows, &hits, &miss_tokens, &miss_slots);
  if (threadIdx.x == 0) {
    a.status[b] = num_misses < 0 ? -num_misses : kOk;
    if (num_misses >= 0) {
      int32_t* counts = a.stats + (static_cast<int64_t>(layer) * a.R + a.req_ids[b]) * 2;
      counts[0] += hits;
      counts[1] += num_misses;
    }
  }
  if (num_misses < 0) {  // the plan failed part-way: none of its rows is valid
    for (int32_t k = threadIdx.x; k < a.K; k += blockDim.x) rows[k] = -1;
    return;
  }
  const char* pool = a.pool + static_cast<int64_t>(layer) * a.H * a.row_bytes;
  char* dev = a.hot + static_cast<int64_t>(layer) * a.R * (a.D + 1) * a.row_bytes;
  // The last warp places the newest row (the others take misses first); seq_len 0 has none.
  if (threadIdx.x / 32 == kThreads / 32 - 1 && r.seq_len > 0)
    CopyRow(a.newest + static_cast<int64_t>(b) * a.row_bytes,
            dev + (r.row_base + NewestSlot(r.seq_len, r.D)) * a.row_bytes, a.row_bytes);
  if (miss_list) {  // MissCopyKernel copies them (the slot table now names each slot's position)
    for (int32_t i = threadIdx.x; i < num_misses; i += kThreads) miss_list[1 + i] = miss_slots[i];
    if (threadIdx.x == 0) miss_list[0] = num_misses;
    return;
  }
  CopyRows(pool, dev, a.row_bytes, num_misses, [&](int32_t i) { return HostRow(r, miss_tokens[i]); },  // validated
           [&](int32_t i) { return static_cast<int64_t>(r.row_base) + miss_slots[i]; });
}

// Block blockIdx.y of gridDim.y copies its contiguous share of n listed rows, src_row(i) of `pool` ->
// dst_row(i) of `dev`, in windows whose row indices it first works out into shared memory (each index is a
// chain of dependent global loads; computed per 16-byte chunk they would stand before every load from
// host memory, the latency this copy is bound by). Every thread of the block must call it.
template <typename SrcRow, typename DstRow>
__device__ void CopyListedRows(const char* pool, char* dev, int64_t row_bytes, int32_t n, SrcRow src_row,
                               DstRow dst_row) {
  constexpr int32_t kWindow = 512;
  __shared__ int64_t src[kWindow], dst[kWindow];
  const int32_t per_block = (n + static_cast<int32_t>(gridDim.y) - 1) / static_cast<int32_t>(gridDim.y);
  const int32_t lo = min(n, static_cast<int32_t>(blockIdx.y) * per_block), hi = min(n, lo + per_block);
  for (int32_t w = lo; w < hi; w += kWindow) {
    const int32_t m = min(kWindow, hi - w);
    for (int32_t i = threadIdx.x; i < m; i += kThreads) {
      src[i] = src_row(w + i);
      dst[i] = dst_row(w + i);
    }
    __syncthreads();
    CopyRows(pool, dev, row_bytes, m, [&](int32_t i) { return src[i]; }, [&](int32_t i) { return dst[i]; });
    __syncthreads();  // the next window rewrites src / dst
  }
}

// Grid (B, copy blocks), after SwapInKernel on the same stream: block (b, s) copies its share of row b's
// listed misses, host row of each slot's committed position -> the slot. A row listing 0 (idle, bad, all
// hits) exits at once.
__global__ void MissCopyKernel(SwapInArgs a) {
  const int32_t b = blockIdx.x;
  const int32_t* list = a.miss_list + static_cast<int64_t>(b) * (a.K + 1);
  const int32_t n = list[0];
  if (n <= 0) return;
  const int32_t layer = *a.layer;
  const RequestLayer r = MakeRequest(a, b, layer);
  const char* pool = a.pool + static_cast<int64_t>(layer) * a.H * a.row_bytes;
  char* dev = a.hot + static_cast<int64_t>(layer) * a.R * (a.D + 1) * a.row_bytes;
  CopyListedRows(pool, dev, a.row_bytes, n, [&](int32_t i) { return HostRow(r, r.slot_tokens[list[1 + i]]); },
                 [&](int32_t i) { return static_cast<int64_t>(r.row_base) + list[1 + i]; });
}

// Dynamic shared memory of CarveShared's layout: the hash map (2 x capacity), need_token, miss_tokens,
// miss_slots, heap_pos, heap_key (K each; with_rows: one more K for the prefetch's rows), new_lru (D) ints,
// and slot_state (D bytes).
// The larger of it and the parallel plan's layout (ParallelPlanInts).
size_t SwapInSharedBytes(int32_t K, int32_t D, bool with_rows) {
  const size_t serial = 2 * static_cast<size_t>(HashCapacity(K)) + (with_rows ? 6 : 5) * static_cast<size_t>(K) + D;
  return std::max(serial, ParallelPlanInts(K, D, with_rows)) * sizeof(int32_t) + D;
}

ffi::Error CudaStatus(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorString(e));
}

struct PrefetchScratch;
__global__ void PrefetchPlanKernel(SwapInArgs a, PrefetchScratch s, bool stage);

// Per-device settings are kept for device ordinals below this.
constexpr int kMaxDevices = 64;

// The calling thread's current CUDA device (the one XLA runs the handler for).
ffi::ErrorOr<int> CurrentDevice() {
  int device = 0;
  if (auto e = CudaStatus(cudaGetDevice(&device), "cudaGetDevice"); e.failure()) return e;
  if (device < 0 || device >= kMaxDevices) return ffi::Error::Internal("swap_in: device ordinal >= 64");
  return device;
}

// compute(device) for the current device, once per device: kept in cache[device] (0: not computed yet, so a
// result of 0 is computed again on the next call).
template <typename Compute>
ffi::ErrorOr<int> OncePerDevice(std::atomic<int> (&cache)[kMaxDevices], Compute compute) {
  auto device = CurrentDevice();
  if (device.has_error()) return device.error();
  int value = cache[*device].load(std::memory_order_acquire);
  if (value == 0) {
    ffi::ErrorOr<int> computed = compute(*device);
    if (computed.has_error()) return computed.error();
    value = *computed;
    cache[*device].store(value, std::memory_order_release);
  }
  return value;
}

// Once per device, the swap-in kernel (and the prefetch's plan kernel, which carves the same layout) is
// allowed the device's whole opt-in shared memory less its static shared memory (PlanAndCommit's), so that
// the steady state makes no configuration call (nothing but launches while XLA records a command
// buffer); asking for the whole opt-in amount as dynamic memory is cudaErrorInvalidValue.
// An error when a plan (K, D) needs more than the device has.
ffi::Error AllowSharedMemory(size_t smem) {
  static std::atomic<int> dynamic_limit[kMaxDevices] = {};
  auto limit = OncePerDevice(dynamic_limit, [](int device) -> ffi::ErrorOr<int> {
    int optin = 0;
    if (auto e = CudaStatus(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
                            "cudaDeviceGetAttribute");
        e.failure())
      return e;
    int limit = optin;
    for (const void* kernel : {reinterpret_cast<const void*>(SwapInKernel),
                               reinterpret_cast<const void*>(PrefetchPlanKernel)}) {
      cudaFuncAttributes attrs;
      if (auto e = CudaStatus(cudaFuncGetAttributes(&attrs, kernel), "cudaFuncGetAttributes"); e.failure())
        return e;
      const int dynamic = optin - static_cast<int>(attrs.sharedSizeBytes);
      if (auto e = CudaStatus(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic),
                              "cudaFuncSetAttribute");
          e.failure())
        return e;
      limit = std::min(limit, dynamic);
    }
    return limit;
  });
  if (limit.has_error()) return limit.error();
  if (smem > static_cast<size_t>(*limit))
    return ffi::Error::InvalidArgument("swap_in: top_k and device_buffer_size need " + std::to_string(smem) +
                                       " bytes of shared memory per block; the device allows " +
                                       std::to_string(*limit));
  return ffi::Error::Success();
}

// The current device's multiprocessor count (queried once per device).
ffi::ErrorOr<int> MultiprocessorCount() {
  static std::atomic<int> count[kMaxDevices] = {};
  return OncePerDevice(count, [](int device) -> ffi::ErrorOr<int> {
    int n = 0;
    if (auto e = CudaStatus(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device),
                            "cudaDeviceGetAttribute");
        e.failure())
      return e;
    return n;
  });
}

// copy_blocks 0: one block per row (the planning block) once the batch has a row per multiprocessor, else
// enough blocks per row for two per multiprocessor, at most 32 (the batch-1 miss copy ran at 2.4 GB/s from
// one block on an H200, against ~50 GB/s for the PCIe link).
int64_t AutoCopyBlocks(int32_t batch, int multiprocessors) {
  if (batch <= 0 || batch >= multiprocessors) return 1;
  return std::min<int64_t>(32, (2 * static_cast<int64_t>(multiprocessors) + batch - 1) / batch);
}

ffi::Error CopyIfDistinct(cudaStream_t stream, ffi::AnyBuffer src, ffi::Result<ffi::AnyBuffer> dst) {
  if (src.untyped_data() == dst->untyped_data()) return ffi::Error::Success();
  return CudaStatus(cudaMemcpyAsync(dst->untyped_data(), src.untyped_data(), src.size_bytes(),
                                    cudaMemcpyDefault, stream),
                    "swap_in copy");
}

// An extension-owned pinned pool (alloc_host_pool), viewed through its device pointer.
ffi::ErrorOr<PoolView> ExternalPool(uint64_t address, uint64_t serial, int64_t layers, int64_t rows,
                                    ffi::AnyBuffer like, PinnedPool& pin) {
  auto view = RegisteredPool(address, serial, layers, rows, like, pin);
  if (view.has_error()) return view;
  void* device = nullptr;
  if (auto e = CudaStatus(cudaHostGetDevicePointer(&device, view->base, 0), "cudaHostGetDevicePointer");
      e.failure())
    return e;
  view->base = static_cast<char*>(device);
  return view;
}

// Checks what the swap-in and the prefetch share and fills those fields of `a`: top_k [B, K], hot
// [L, R, D+1, W] matching the pool, host_pages [B, P], seq_lens / req_ids [B], slot_tokens / lru [L, R, D],
// the attributes, a status / count output of B entries.
ffi::Error FillArgs(const std::string& op, PoolView pool, int64_t page_size, int64_t eviction,
                    ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> top_k, ffi::Buffer<ffi::S32> seq_lens,
                    ffi::Buffer<ffi::S32> req_ids, ffi::Buffer<ffi::S32> host_pages, ffi::AnyBuffer hot,
                    ffi::AnyBuffer slot_tokens, ffi::AnyBuffer lru, size_t status_count, SwapInArgs& a) {
  auto kd = top_k.dimensions();
  auto hd = hot.dimensions();
  auto pd = host_pages.dimensions();
  if (kd.size() != 2 || hd.size() != 4 || pd.size() != 2)
    return ffi::Error::InvalidArgument(op +
                                       ": expected top_k [B,K], host_pages [B,P], host_pool [L,H,W], hot [L,R,D+1,W]");
  if (page_size < 1 || page_size > INT32_MAX)
    return ffi::Error::InvalidArgument(op + ": page_size must be in [1, 2^31)");
  if (hd[1] * hd[2] > INT32_MAX || pool.H > INT32_MAX || pd[1] * page_size > INT32_MAX)
    return ffi::Error::InvalidArgument(op + ": a dimension exceeds int32 indexing");
  a.B = static_cast<int32_t>(kd[0]);
  a.K = static_cast<int32_t>(kd[1]);
  a.L = static_cast<int32_t>(pool.L);
  a.H = static_cast<int32_t>(pool.H);
  a.R = static_cast<int32_t>(hd[1]);
  a.D = static_cast<int32_t>(hd[2] - 1);
  a.P = static_cast<int32_t>(pd[1]);
  a.page_size = static_cast<int32_t>(page_size);
  if (a.D < 1)
    return ffi::Error::InvalidArgument(op + ": hot [L, R, D+1, W] has D+1 = " + std::to_string(hd[2]) +
                                       ": it needs D >= 1 slots per request besides the newest token's");
  if (hd[0] != pool.L || hd[3] != pool.W || pd[0] != kd[0] || pool.dtype != hot.element_type())
    return ffi::Error::InvalidArgument(op + ": hot must be [L, R, D+1, W] matching host_pool [L, H, W]");
  if (a.K > a.D)
    return ffi::Error::InvalidArgument(op + ": top_k (" + std::to_string(a.K) + ") > device_buffer_size (" +
                                       std::to_string(a.D) + ")");
  if (eviction < 0 || eviction >= kNumEvictions)
    return ffi::Error::InvalidArgument(op + ": eviction " + std::to_string(eviction) +
                                       " is not a policy (0 lru, 1 clock, 2 score)");
  if (a.D >= kRefBit) return ffi::Error::InvalidArgument(op + ": device_buffer_size must be < 2^30");
  a.eviction = static_cast<int32_t>(eviction);
  if (slot_tokens.element_count() != static_cast<size_t>(a.L) * a.R * a.D ||
      lru.element_count() != static_cast<size_t>(a.L) * a.R * a.D ||
      seq_lens.element_count() != static_cast<size_t>(a.B) ||
      req_ids.element_count() != static_cast<size_t>(a.B) || layer.element_count() != 1)
    return ffi::Error::InvalidArgument(op +
                                       ": expected slot_tokens/lru s32[L,R,D], seq_lens/req_ids s32[B], layer s32[]");
  if (status_count != static_cast<size_t>(a.B)) return ffi::Error::InvalidArgument(op + ": status must be s32[B]");
  a.layer = layer.typed_data();
  a.top_k = top_k.typed_data();
  a.seq_lens = seq_lens.typed_data();
  a.req_ids = req_ids.typed_data();
  a.host_pages = host_pages.typed_data();
  a.pool = pool.base;
  a.row_bytes = pool.W * ffi::ByteWidth(hot.element_type());
  return ffi::Error::Success();
}

ffi::Error SwapIn(cudaStream_t stream, PoolView pool, int64_t page_size, int64_t eviction,
                  ffi::Buffer<ffi::F32> slot_scores, ffi::Buffer<ffi::S32> layer,
                  ffi::Buffer<ffi::S32> top_k, ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> req_ids,
                  ffi::Buffer<ffi::S32> host_pages, ffi::AnyBuffer newest, ffi::AnyBuffer hot,
                  ffi::AnyBuffer slot_tokens,
                  ffi::AnyBuffer lru, ffi::AnyBuffer stats, ffi::Result<ffi::Buffer<ffi::S32>> rows,
                  ffi::Result<ffi::AnyBuffer> hot_out, ffi::Result<ffi::AnyBuffer> slot_tokens_out,
                  ffi::Result<ffi::AnyBuffer> lru_out, ffi::Result<ffi::AnyBuffer> stats_out,
                  ffi::Result<ffi::Buffer<ffi::S32>> status_out, ffi::Result<ffi::Buffer<ffi::S32>> miss_list,
                  int64_t copy_blocks) {
  if (auto e = CheckCopyBlocks(copy_blocks); e.failure()) return e;
  SwapInArgs a{};
  if (auto e = FillArgs("swap_in", pool, page_size, eviction, layer, top_k, seq_lens, req_ids, host_pages, hot,
                        slot_tokens, lru, status_out->element_count(), a);
      e.failure())
    return e;
  {
    auto sd = slot_scores.dimensions();
    if (sd.size() != 2 || sd[0] != a.B || sd[1] != (eviction == kEvictScore ? a.D : 0))
      return ffi::Error::InvalidArgument(eviction == kEvictScore
                                             ? "swap_in: eviction \"score\" needs slot_scores f32[B, D]"
                                             : "swap_in: slot_scores must be f32[B, 0] unless eviction is \"score\"");
  }
  a.slot_scores = slot_scores.typed_data();
  if (stats.element_count() != static_cast<size_t>(a.L) * a.R * 2)
    return ffi::Error::InvalidArgument("swap_in: expected stats s32[L,R,2]");
  if (newest.element_count() != static_cast<size_t>(a.B) * pool.W || newest.element_type() != hot.element_type())
    return ffi::Error::InvalidArgument("swap_in: newest must be [B, W] of the hot buffer's dtype");
  {
    auto md = miss_list->dimensions();
    if (md.size() != 2 || md[0] != a.B || md[1] != static_cast<int64_t>(a.K) + 1)
      return ffi::Error::InvalidArgument("swap_in: miss_list must be s32[B, K+1]");
  }
  if (a.B == 0) return ffi::Error::Success();
  a.newest = static_cast<const char*>(newest.untyped_data());

  const size_t smem = SwapInSharedBytes(a.K, a.D, false);
  if (auto e = AllowSharedMemory(smem); e.failure()) return e;
  if (copy_blocks == 0) {
    auto sms = MultiprocessorCount();
    if (sms.has_error()) return sms.error();
    copy_blocks = AutoCopyBlocks(a.B, *sms);
  }
  a.rows = rows->typed_data();
  a.status = status_out->typed_data();
  // Outputs XLA did not alias to their inputs start as copies of them (every row's state must come out).
  for (auto [src, dst] : {std::pair{hot, hot_out}, std::pair{slot_tokens, slot_tokens_out},
                          std::pair{lru, lru_out}, std::pair{stats, stats_out}}) {
    if (auto e = CopyIfDistinct(stream, src, dst); e.failure()) return e;
  }
  a.hot = static_cast<char*>(hot_out->untyped_data());
  a.slot_tokens = static_cast<int32_t*>(slot_tokens_out->untyped_data());
  a.lru = static_cast<int32_t*>(lru_out->untyped_data());
  a.stats = static_cast<int32_t*>(stats_out->untyped_data());
  a.miss_list = copy_blocks > 1 ? miss_list->typed_data() : nullptr;
  SwapInKernel<<<a.B, kThreads, smem, stream>>>(a);
  if (auto e = CudaStatus(cudaGetLastError(), "swap_in launch"); e.failure() || copy_blocks == 1) return e;
  MissCopyKernel<<<dim3(a.B, static_cast<unsigned>(copy_blocks)), kThreads, 0, stream>>>(a);
  return CudaStatus(cudaGetLastError(), "swap_in miss copy launch");
}

// ---- cross-layer prefetch ----------------------------------------------------------------------------------
// As on the CPU (cpu_handlers.cc), the background never writes an XLA buffer. The start, on XLA's stream,
// snapshots its inputs and each row's slot table and LRU order of the layer into the device's prefetch
// scratch, then a plan kernel on a side stream (after an event of XLA's stream) plans the predicted
// positions on the snapshot and stages the missing rows host -> scratch (the PCIe reads: what the prefetch
// hides behind layer l's compute); the wait makes XLA's stream wait for it (no host synchronization) and a
// commit kernel places each row whose tables are still the snapshot's. One prefetch per device is in flight
// (the decode view waits before it starts the next; XLA runs a device's programs in stream order), so the
// scratch is per device and the ticket output is not needed (it is zeroed).
struct PrefetchScratch {
  int32_t *layer, *top_k, *seq_lens, *req_ids, *host_pages, *old_slots, *old_lru, *new_slots, *new_lru, *counts,
      *miss_slots;
  char* staged;  // [B, K, row_bytes]
};

struct PrefetchDevice {
  cudaStream_t side = nullptr;
  cudaEvent_t ready = nullptr, done = nullptr;
  char* buffer = nullptr;
  size_t bytes = 0;
  bool pending = false;
  SwapInArgs args{};  // of the prefetch in flight (its shapes, for the wait)
  ffi::DataType dtype = ffi::DataType::INVALID;  // its hot buffer's, for the wait
  PrefetchScratch scratch{};
};

class PrefetchRegistry {
 public:
  static PrefetchRegistry& Get() {
    static PrefetchRegistry* registry = new PrefetchRegistry();  // never destroyed (no CUDA calls at exit)
    return *registry;
  }
  std::mutex mu;
  std::map<int, PrefetchDevice> devices;
};

// Carves the scratch of a (B, K, D, P, row_bytes) prefetch out of `base` (nullptr: just sizes it); returns
// the bytes it needs.
size_t CarveScratch(char* base, const SwapInArgs& a, PrefetchScratch* out) {
  size_t at = 0;
  auto ints = [&](size_t n) {
    int32_t* p = reinterpret_cast<int32_t*>(base + at);
    at += (n * sizeof(int32_t) + 15) / 16 * 16;
    return p;
  };
  const size_t B = a.B, K = a.K, D = a.D, P = a.P;
  PrefetchScratch s;
  s.layer = ints(1);
  s.top_k = ints(B * K);
  s.seq_lens = ints(B);
  s.req_ids = ints(B);
  s.host_pages = ints(B * P);
  s.old_slots = ints(B * D);
  s.old_lru = ints(B * D);
  s.new_slots = ints(B * D);
  s.new_lru = ints(B * D);
  s.counts = ints(B);
  s.miss_slots = ints(B * K);
  s.staged = base + at;
  at += B * K * static_cast<size_t>(a.row_bytes);
  if (out) *out = s;
  return at;
}

// Start, on XLA's stream: row b's validation code into counts[b] and its slot table / LRU order of the layer
// into old_* and new_* (the plan's starting point).
__global__ void PrefetchSnapshotKernel(SwapInArgs a, PrefetchScratch s) {
  const int32_t b = blockIdx.x;
  const int32_t layer = *s.layer;
  int32_t code = kOk;
  if (layer < 0 || layer >= a.L) code = kLayerOutOfRange;
  else if (!RequestIdOk(a, b)) code = kBadRequestId;
  if (threadIdx.x == 0) s.counts[b] = code;
  if (code != kOk || a.req_ids[b] < 0) return;
  const int64_t table = (static_cast<int64_t>(layer) * a.R + a.req_ids[b]) * a.D;
  for (int32_t i = threadIdx.x; i < a.D; i += blockDim.x) {
    const int64_t at = static_cast<int64_t>(b) * a.D + i;
    s.old_slots[at] = s.new_slots[at] = a.slot_tokens[table + i];
    s.old_lru[at] = s.new_lru[at] = a.lru[table + i];
  }
}

// Row b's request on the prefetch's snapshot (only for rows whose request id was validated as >= 0).
__device__ RequestLayer SnapshotRequest(const SwapInArgs& a, const PrefetchScratch& s, int32_t b) {
  return RequestLayer{a.top_k + static_cast<int64_t>(b) * a.K, a.K, a.seq_lens[b], a.D,
                      a.host_pages + static_cast<int64_t>(b) * a.P, a.P, a.page_size, a.H,
                      s.new_slots + static_cast<int64_t>(b) * a.D, s.new_lru + static_cast<int64_t>(b) * a.D, 0,
                      a.eviction, nullptr};
}

// Side stream: plan row b's predicted positions on its snapshot (PlanAndCommit) and list the misses; with
// stage, also stage them (else PrefetchStageKernel does, with several blocks per row).
__global__ void PrefetchPlanKernel(SwapInArgs a, PrefetchScratch s, bool stage) {
  extern __shared__ int32_t smem[];
  const int32_t b = blockIdx.x;
  if (s.counts[b] != kOk || a.req_ids[b] < 0) {  // a bad row (-status) or an idle one (0)
    if (threadIdx.x == 0) s.counts[b] = -s.counts[b];
    return;
  }
  const int32_t layer = *s.layer;
  const RequestLayer r = SnapshotRequest(a, s, b);
  int32_t hits = 0;
  const int32_t* miss_tokens;
  const int32_t* miss_slots;
  const int32_t num_misses = PlanAndCommit(r, smem, true, nullptr, &hits, &miss_tokens, &miss_slots);
  if (threadIdx.x == 0) s.counts[b] = num_misses;  // or -status
  if (num_misses <= 0) return;
  const char* pool = a.pool + static_cast<int64_t>(layer) * a.H * a.row_bytes;
  for (int32_t i = threadIdx.x; i < num_misses; i += blockDim.x) s.miss_slots[static_cast<int64_t>(b) * a.K + i] = miss_slots[i];
  if (!stage) return;
  CopyRows(pool, s.staged, a.row_bytes, num_misses, [&](int32_t i) { return HostRow(r, miss_tokens[i]); },
           [&](int32_t i) { return static_cast<int64_t>(b) * a.K + i; });
}

// Side stream, grid (B, copy blocks) after PrefetchPlanKernel: block (b, s) stages its share of row b's
// listed misses (host row of each planned slot's position on the snapshot -> its staging row), as
// MissCopyKernel does for the swap-in.
__global__ void PrefetchStageKernel(SwapInArgs a, PrefetchScratch s) {
  const int32_t b = blockIdx.x;
  const int32_t n = s.counts[b];
  if (n <= 0) return;
  const RequestLayer r = SnapshotRequest(a, s, b);
  const int32_t* slots = s.miss_slots + static_cast<int64_t>(b) * a.K;
  CopyListedRows(a.pool + static_cast<int64_t>(*s.layer) * a.H * a.row_bytes, s.staged, a.row_bytes, n,
                 [&](int32_t i) { return HostRow(r, r.slot_tokens[slots[i]]); },
                 [&](int32_t i) { return static_cast<int64_t>(b) * a.K + i; });
}

// Wait, on XLA's stream after the plan: row b's plan and staged rows into the arrays XLA hands the wait,
// if its tables are still the snapshot's (else kPrefetchStale).
__global__ void PrefetchCommitKernel(SwapInArgs a, PrefetchScratch s, int32_t* prefetched) {
  const int32_t b = blockIdx.x;
  const int32_t c = s.counts[b];
  if (c < 0 || s.req_ids[b] < 0) {
    if (threadIdx.x == 0) prefetched[b] = c;
    return;
  }
  const int32_t layer = *s.layer;
  const int64_t table = (static_cast<int64_t>(layer) * a.R + s.req_ids[b]) * a.D;
  const int64_t mine = static_cast<int64_t>(b) * a.D;
  int changed = 0;
  for (int32_t i = threadIdx.x; i < a.D; i += blockDim.x)
    changed |= a.slot_tokens[table + i] != s.old_slots[mine + i] || a.lru[table + i] != s.old_lru[mine + i];
  if (__syncthreads_or(changed)) {
    if (threadIdx.x == 0) prefetched[b] = -kPrefetchStale;
    return;
  }
  for (int32_t i = threadIdx.x; i < a.D; i += blockDim.x) {
    a.slot_tokens[table + i] = s.new_slots[mine + i];
    a.lru[table + i] = s.new_lru[mine + i];
  }
  char* dev = a.hot + (static_cast<int64_t>(layer) * a.R + s.req_ids[b]) * (a.D + 1) * a.row_bytes;
  for (int32_t i = threadIdx.x / 32; i < c; i += kThreads / 32)
    CopyRow(s.staged + (static_cast<int64_t>(b) * a.K + i) * a.row_bytes,
            dev + s.miss_slots[static_cast<int64_t>(b) * a.K + i] * a.row_bytes, a.row_bytes);
  if (threadIdx.x == 0) prefetched[b] = c;
}

ffi::Error PrefetchStart(cudaStream_t stream, PoolView pool, int64_t page_size, int64_t eviction,
                         ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> top_k, ffi::Buffer<ffi::S32> seq_lens,
                         ffi::Buffer<ffi::S32> req_ids, ffi::Buffer<ffi::S32> host_pages, ffi::AnyBuffer hot,
                         ffi::AnyBuffer slot_tokens, ffi::AnyBuffer lru, ffi::Result<ffi::Buffer<ffi::S32>> ticket) {
  SwapInArgs a{};
  if (auto e = FillArgs("prefetch", pool, page_size, eviction, layer, top_k, seq_lens, req_ids, host_pages, hot,
                        slot_tokens, lru, seq_lens.element_count(), a);
      e.failure())
    return e;
  if (eviction == kEvictScore)
    return ffi::Error::InvalidArgument("prefetch: eviction \"score\" needs this layer's scores, not known yet");
  if (ticket->element_count() != 2) return ffi::Error::InvalidArgument("prefetch: ticket must be s32[1, 2]");
  if (auto e = CudaStatus(cudaMemsetAsync(ticket->typed_data(), 0, 2 * sizeof(int32_t), stream), "ticket");
      e.failure())
    return e;
  const size_t smem = SwapInSharedBytes(a.K, a.D, true);
  if (auto e = AllowSharedMemory(smem); e.failure()) return e;
  int device = 0;
  if (auto e = CudaStatus(cudaGetDevice(&device), "cudaGetDevice"); e.failure()) return e;
  auto& reg = PrefetchRegistry::Get();
  std::lock_guard<std::mutex> lock(reg.mu);
  PrefetchDevice& d = reg.devices[device];
  if (d.side == nullptr) {
    if (auto e = CudaStatus(cudaStreamCreateWithFlags(&d.side, cudaStreamNonBlocking), "cudaStreamCreate");
        e.failure())
      return e;
    for (cudaEvent_t* ev : {&d.ready, &d.done})
      if (auto e = CudaStatus(cudaEventCreateWithFlags(ev, cudaEventDisableTiming), "cudaEventCreate"); e.failure())
        return e;
  }
  d.pending = false;
  if (a.B == 0) return ffi::Error::Success();
  auto sms = MultiprocessorCount();
  if (sms.has_error()) return sms.error();
  const int64_t copy_blocks = AutoCopyBlocks(a.B, *sms);  // staging blocks per row, as the swap-in's
  const size_t need = CarveScratch(nullptr, a, nullptr);
  if (d.bytes < need) {
    if (d.buffer != nullptr) cudaFree(d.buffer);  // synchronizes: its last prefetch is done
    d.buffer = nullptr;
    d.bytes = 0;
    if (auto e = CudaStatus(cudaMalloc(&d.buffer, need), "prefetch scratch"); e.failure()) return e;
    d.bytes = need;
  }
  PrefetchScratch& s = d.scratch;
  CarveScratch(d.buffer, a, &s);
  for (auto [dst, src, n] : {std::tuple{s.layer, a.layer, size_t{1}},
                             std::tuple{s.top_k, a.top_k, static_cast<size_t>(a.B) * a.K},
                             std::tuple{s.seq_lens, a.seq_lens, static_cast<size_t>(a.B)},
                             std::tuple{s.req_ids, a.req_ids, static_cast<size_t>(a.B)},
                             std::tuple{s.host_pages, a.host_pages, static_cast<size_t>(a.B) * a.P}}) {
    if (auto e = CudaStatus(cudaMemcpyAsync(dst, src, n * sizeof(int32_t), cudaMemcpyDeviceToDevice, stream),
                            "prefetch snapshot");
        e.failure())
      return e;
  }
  a.top_k = s.top_k;
  a.seq_lens = s.seq_lens;
  a.req_ids = s.req_ids;
  a.host_pages = s.host_pages;
  a.slot_tokens = static_cast<int32_t*>(slot_tokens.untyped_data());
  a.lru = static_cast<int32_t*>(lru.untyped_data());
  PrefetchSnapshotKernel<<<a.B, kThreads, 0, stream>>>(a, s);
  if (auto e = CudaStatus(cudaGetLastError(), "prefetch snapshot launch"); e.failure()) return e;
  a.slot_tokens = a.lru = nullptr;  // the plan works on the snapshot only
  if (auto e = CudaStatus(cudaEventRecord(d.ready, stream), "cudaEventRecord"); e.failure()) return e;
  if (auto e = CudaStatus(cudaStreamWaitEvent(d.side, d.ready, 0), "cudaStreamWaitEvent"); e.failure()) return e;
  PrefetchPlanKernel<<<a.B, kThreads, smem, d.side>>>(a, s, copy_blocks == 1);
  if (auto e = CudaStatus(cudaGetLastError(), "prefetch plan launch"); e.failure()) return e;
  if (copy_blocks > 1) {
    PrefetchStageKernel<<<dim3(a.B, static_cast<unsigned>(copy_blocks)), kThreads, 0, d.side>>>(a, s);
    if (auto e = CudaStatus(cudaGetLastError(), "prefetch stage launch"); e.failure()) return e;
  }
  if (auto e = CudaStatus(cudaEventRecord(d.done, d.side), "cudaEventRecord"); e.failure()) return e;
  d.args = a;
  d.dtype = hot.element_type();
  d.pending = true;
  return ffi::Error::Success();
}

// Prefetch wait: XLA's stream waits for the device's prefetch in flight (no host synchronization), then the
// commit kernel places it into hot, slot_tokens and lru (aliased to the results); prefetched s32[B] as on the
// CPU (0 on every row when none is in flight).
ffi::Error PrefetchWaitImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> ticket, ffi::AnyBuffer hot,
                            ffi::AnyBuffer slot_tokens, ffi::AnyBuffer lru, ffi::AnyBuffer after,
                            ffi::Result<ffi::AnyBuffer> hot_out, ffi::Result<ffi::AnyBuffer> slot_tokens_out,
                            ffi::Result<ffi::AnyBuffer> lru_out, ffi::Result<ffi::Buffer<ffi::S32>> prefetched) {
  (void)ticket;
  (void)after;
  for (auto [src, dst] : {std::pair{hot, hot_out}, std::pair{slot_tokens, slot_tokens_out}, std::pair{lru, lru_out}}) {
    if (auto e = CopyIfDistinct(stream, src, dst); e.failure()) return e;
  }
  const size_t B = prefetched->element_count();
  if (auto e = CudaStatus(cudaMemsetAsync(prefetched->typed_data(), 0, B * sizeof(int32_t), stream), "prefetched");
      e.failure())
    return e;
  int device = 0;
  if (auto e = CudaStatus(cudaGetDevice(&device), "cudaGetDevice"); e.failure()) return e;
  auto& reg = PrefetchRegistry::Get();
  std::lock_guard<std::mutex> lock(reg.mu);
  auto it = reg.devices.find(device);
  if (it == reg.devices.end() || !it->second.pending) return ffi::Error::Success();
  PrefetchDevice& d = it->second;
  d.pending = false;
  SwapInArgs a = d.args;
  auto hd = hot.dimensions();
  if (B != static_cast<size_t>(a.B) || hd.size() != 4 || hd[0] != a.L || hd[1] != a.R || hd[2] != a.D + 1 ||
      hot.element_type() != d.dtype || hd[3] * ffi::ByteWidth(hot.element_type()) != a.row_bytes ||
      slot_tokens.element_type() != ffi::S32 || lru.element_type() != ffi::S32 || slot_tokens.element_count() != static_cast<size_t>(a.L) * a.R * a.D ||
      lru.element_count() != static_cast<size_t>(a.L) * a.R * a.D)
    return ffi::Error::InvalidArgument(
        "prefetch_wait: hot / slot_tokens / lru / prefetched do not match the device's prefetch in flight (hot "
        "T[L, R, D + 1, W] of the pool's dtype, slot_tokens / lru s32[L, R, D], prefetched s32[B])");
  if (auto e = CudaStatus(cudaStreamWaitEvent(stream, d.done, 0), "cudaStreamWaitEvent"); e.failure()) return e;
  a.hot = static_cast<char*>(hot_out->untyped_data());
  a.slot_tokens = static_cast<int32_t*>(slot_tokens_out->untyped_data());
  a.lru = static_cast<int32_t*>(lru_out->untyped_data());
  PrefetchCommitKernel<<<a.B, kThreads, 0, stream>>>(a, d.scratch, prefetched->typed_data());
  return CudaStatus(cudaGetLastError(), "prefetch commit launch");
}

// Host pool as an XLA operand (`pinned_host` memory), aliased to a result.
ffi::Error SwapInImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> top_k,
                      ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> req_ids,
                      ffi::Buffer<ffi::S32> host_pages, ffi::AnyBuffer newest, ffi::AnyBuffer host_pool,
                      ffi::AnyBuffer hot,
                      ffi::AnyBuffer slot_tokens, ffi::AnyBuffer lru, ffi::AnyBuffer stats,
                      ffi::Buffer<ffi::F32> slot_scores,
                      ffi::Result<ffi::Buffer<ffi::S32>> rows, ffi::Result<ffi::AnyBuffer> host_pool_out,
                      ffi::Result<ffi::AnyBuffer> hot_out, ffi::Result<ffi::AnyBuffer> slot_tokens_out,
                      ffi::Result<ffi::AnyBuffer> lru_out, ffi::Result<ffi::AnyBuffer> stats_out,
                      ffi::Result<ffi::Buffer<ffi::S32>> status_out, ffi::Result<ffi::Buffer<ffi::S32>> miss_list,
                      int64_t page_size, int64_t eviction, int64_t copy_blocks) {
  auto view = OperandPool("swap_in", host_pool, host_pool_out);
  if (view.has_error()) return view.error();
  if (auto e = CopyIfDistinct(stream, host_pool, host_pool_out); e.failure()) return e;
  return SwapIn(stream, *view, page_size, eviction, slot_scores, layer, top_k, seq_lens, req_ids, host_pages, newest, hot, slot_tokens,
                lru, stats, rows, hot_out, slot_tokens_out, lru_out, stats_out, status_out, miss_list, copy_blocks);
}

// Host pool owned by the extension (cudaHostAlloc, mapped); pool_token (s32[1]) orders the calls.
ffi::Error SwapInExtImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> top_k,
                         ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> req_ids,
                         ffi::Buffer<ffi::S32> host_pages, ffi::AnyBuffer newest, ffi::AnyBuffer pool_token,
                         ffi::AnyBuffer hot,
                         ffi::AnyBuffer slot_tokens, ffi::AnyBuffer lru, ffi::AnyBuffer stats,
                         ffi::Buffer<ffi::F32> slot_scores,
                         ffi::Result<ffi::Buffer<ffi::S32>> rows, ffi::Result<ffi::AnyBuffer> pool_token_out,
                         ffi::Result<ffi::AnyBuffer> hot_out, ffi::Result<ffi::AnyBuffer> slot_tokens_out,
                         ffi::Result<ffi::AnyBuffer> lru_out, ffi::Result<ffi::AnyBuffer> stats_out,
                         ffi::Result<ffi::Buffer<ffi::S32>> status_out, ffi::Result<ffi::Buffer<ffi::S32>> miss_list,
                         int64_t page_size, int64_t eviction, int64_t copy_blocks, uint64_t pool_address,
                         uint64_t pool_serial, int64_t pool_layers, int64_t pool_rows) {
  PinnedPool pin;  // until the handler returns; free_host_pool then waits for the device's queued work
  auto view = ExternalPool(pool_address, pool_serial, pool_layers, pool_rows, hot, pin);
  if (view.has_error()) return view.error();
  if (auto e = CopyIfDistinct(stream, pool_token, pool_token_out); e.failure()) return e;
  return SwapIn(stream, *view, page_size, eviction, slot_scores, layer, top_k, seq_lens, req_ids, host_pages, newest, hot, slot_tokens,
                lru, stats, rows, hot_out, slot_tokens_out, lru_out, stats_out, status_out, miss_list, copy_blocks);
}

// Prefetch start over a `pinned_host` pool operand, aliased to a result.
ffi::Error PrefetchStartImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> top_k,
                             ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> req_ids,
                             ffi::Buffer<ffi::S32> host_pages, ffi::AnyBuffer host_pool, ffi::AnyBuffer hot,
                             ffi::AnyBuffer slot_tokens, ffi::AnyBuffer lru, ffi::Result<ffi::AnyBuffer> host_pool_out,
                             ffi::Result<ffi::Buffer<ffi::S32>> ticket, int64_t page_size, int64_t eviction) {
  auto view = OperandPool("prefetch", host_pool, host_pool_out);
  if (view.has_error()) return view.error();
  if (auto e = CopyIfDistinct(stream, host_pool, host_pool_out); e.failure()) return e;
  return PrefetchStart(stream, *view, page_size, eviction, layer, top_k, seq_lens, req_ids, host_pages, hot,
                       slot_tokens, lru, ticket);
}

// Prefetch start over an extension-owned pinned pool; pool_token (s32[1]) is aliased to the result.
ffi::Error PrefetchStartExtImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> top_k,
                                ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> req_ids,
                                ffi::Buffer<ffi::S32> host_pages, ffi::AnyBuffer pool_token, ffi::AnyBuffer hot,
                                ffi::AnyBuffer slot_tokens, ffi::AnyBuffer lru,
                                ffi::Result<ffi::AnyBuffer> pool_token_out, ffi::Result<ffi::Buffer<ffi::S32>> ticket,
                                int64_t page_size, int64_t eviction, uint64_t pool_address,
                                uint64_t pool_serial, int64_t pool_layers,
                                int64_t pool_rows) {
  PinnedPool pin;  // until the handler returns; free_host_pool then waits for the device's queued work
  auto view = ExternalPool(pool_address, pool_serial, pool_layers, pool_rows, hot, pin);
  if (view.has_error()) return view.error();
  if (auto e = CopyIfDistinct(stream, pool_token, pool_token_out); e.failure()) return e;
  return PrefetchStart(stream, *view, page_size, eviction, layer, top_k, seq_lens, req_ids, host_pages, hot,
                       slot_tokens, lru, ticket);
}

// Grid (N, max(Lr, 1)): block (n, i) copies column n of layer layer + i (none when Lr is 0); blocks i = 0
// write the column's status.
__global__ void BackupKernel(const int32_t* layer, const char* rows, const int32_t* dst, char* pool,
                             int32_t Lr, int32_t L, int32_t N, int32_t H, int64_t row_bytes, int32_t* status) {
  const int32_t n = blockIdx.x, i = blockIdx.y;
  const int32_t first = *layer, h = dst[n];
  const int32_t code = first < 0 || first > L - Lr ? kLayerOutOfRange
                       : h < -1 || h >= H          ? kBackupRowOutOfRange
                                                   : kOk;
  if (i == 0 && threadIdx.x == 0) status[n] = code;
  if (code != kOk || h < 0 || i >= Lr) return;
  CopyRow(rows + (static_cast<int64_t>(i) * N + n) * row_bytes,
          pool + ((static_cast<int64_t>(first) + i) * H + h) * row_bytes, row_bytes);
}

ffi::Error Backup(cudaStream_t stream, PoolView pool, ffi::Buffer<ffi::S32> layer, ffi::AnyBuffer rows,
                  ffi::Buffer<ffi::S32> dst, ffi::Result<ffi::Buffer<ffi::S32>> status) {
  auto rd = rows.dimensions();
  if (rd.size() != 3 || pool.W != rd[2] || rows.element_type() != pool.dtype ||
      dst.element_count() != static_cast<size_t>(rd[1]) || status->element_count() != static_cast<size_t>(rd[1]) ||
      layer.element_count() != 1)
    return ffi::Error::InvalidArgument(
        "backup: expected rows [Lr,N,W], dst and status s32[N], host_pool [L,H,W] of one dtype");
  if (pool.L > INT32_MAX || pool.H > INT32_MAX || rd[0] > INT32_MAX || rd[1] > INT32_MAX)
    return ffi::Error::InvalidArgument("backup: a dimension exceeds int32 indexing");
  const int32_t Lr = static_cast<int32_t>(rd[0]), N = static_cast<int32_t>(rd[1]);
  if (N == 0) return ffi::Error::Success();
  BackupKernel<<<dim3(N, Lr > 0 ? Lr : 1), 32, 0, stream>>>(layer.typed_data(), static_cast<const char*>(rows.untyped_data()),
                                               dst.typed_data(), pool.base, Lr, static_cast<int32_t>(pool.L), N,
                                               static_cast<int32_t>(pool.H),
                                               pool.W * ffi::ByteWidth(rows.element_type()), status->typed_data());
  return CudaStatus(cudaGetLastError(), "backup launch");
}

ffi::Error BackupImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> layer, ffi::AnyBuffer rows,
                      ffi::Buffer<ffi::S32> dst, ffi::AnyBuffer host_pool,
                      ffi::Result<ffi::AnyBuffer> host_pool_out, ffi::Result<ffi::Buffer<ffi::S32>> status) {
  auto view = OperandPool("backup", host_pool, host_pool_out);
  if (view.has_error()) return view.error();
  if (auto e = CopyIfDistinct(stream, host_pool, host_pool_out); e.failure()) return e;
  return Backup(stream,
                *view,
                layer, rows, dst, status);
}

ffi::Error BackupExtImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> layer, ffi::AnyBuffer rows,
                         ffi::Buffer<ffi::S32> dst, ffi::AnyBuffer pool_token,
                         ffi::Result<ffi::AnyBuffer> pool_token_out, ffi::Result<ffi::Buffer<ffi::S32>> status,
                         uint64_t pool_address, uint64_t pool_serial, int64_t pool_layers, int64_t pool_rows) {
  PinnedPool pin;  // until the handler returns; free_host_pool then waits for the device's queued work
  auto view = ExternalPool(pool_address, pool_serial, pool_layers, pool_rows, rows, pin);
  if (view.has_error()) return view.error();
  if (auto e = CopyIfDistinct(stream, pool_token, pool_token_out); e.failure()) return e;
  return Backup(stream, *view, layer, rows, dst, status);
}

}  // namespace
}  // namespace hisparse

#define HISPARSE_CUDA_BIND ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()
// Stream-ordered work only (kernels, async copies), no allocation, no synchronization: XLA may record the
// handlers into a command buffer (CUDA graph).
#define HISPARSE_CUDA_TRAITS \
  { ffi::Traits::kCmdBufferCompatible }

XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparseSwapInCuda, hisparse::SwapInImpl, hisparse::BindSwapIn(HISPARSE_CUDA_BIND),
                              HISPARSE_CUDA_TRAITS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparseBackupCuda, hisparse::BackupImpl, hisparse::BindBackup(HISPARSE_CUDA_BIND),
                              HISPARSE_CUDA_TRAITS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparseSwapInExtCuda, hisparse::SwapInExtImpl,
                              hisparse::BindExternalPool(hisparse::BindSwapIn(HISPARSE_CUDA_BIND)), HISPARSE_CUDA_TRAITS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparseBackupExtCuda, hisparse::BackupExtImpl,
                              hisparse::BindExternalPool(hisparse::BindBackup(HISPARSE_CUDA_BIND)), HISPARSE_CUDA_TRAITS);

// The prefetch handlers use a side stream and events (their overlap with XLA's stream is the point): not
// command-buffer compatible, so XLA runs them outside any CUDA graph it captures.
XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparsePrefetchStartCuda, hisparse::PrefetchStartImpl,
                              hisparse::BindPrefetchStart(HISPARSE_CUDA_BIND));
XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparsePrefetchStartExtCuda, hisparse::PrefetchStartExtImpl,
                              hisparse::BindExternalPool(hisparse::BindPrefetchStart(HISPARSE_CUDA_BIND)));
XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparsePrefetchWaitCuda, hisparse::PrefetchWaitImpl,
                              hisparse::BindPrefetchWait(HISPARSE_CUDA_BIND));
