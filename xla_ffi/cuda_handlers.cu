// CUDA XLA FFI handlers: HiSparse swap-in and host-pool backup.
//
// Same buffers and semantics as cpu_handlers.cc (see that file's header); the
// planning runs the shared core (swap_in_core.h) and the copies read the host
// pool directly over PCIe/NVLink-C2C (zero-copy from pinned host memory).
//
// Launch shape: one kernel, one thread block per batch row (request). The block
// checks the row (layer, request id) and thread 0 plans it with the scratch in
// shared memory; a row that fails gets its status (swap_in_core.h SwapInStatus) in the
// status output, rows of -1, and no change. A good row is committed, then the
// whole block copies its missing rows with 16-byte loads where aligned.
//
// Nothing here waits for the device: no host synchronization, no allocation,
// no stream query. The handlers are declared command-buffer compatible (XLA
// may capture them in a CUDA graph); the caller reads the status with the
// step's other results (hisparse_jax.kernels.ops.check_status).
#include <cuda_runtime.h>

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
  int32_t* rows;     // [B, K] (swap-in); unused by a prefetch (its rows go to shared memory)
  int32_t* status;   // [B]: swap-in status; prefetch: rows copied, or -status
  const float* slot_scores;  // [B, D] (eviction score), else unused
  int32_t B, K, D, R, P, page_size, L, H, eviction;
  int64_t row_bytes;
  bool prefetch;     // a prefetch start: predicted positions, no newest row, no stats
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
  int32_t* rows;  // [K] a prefetch's (unused) rows
};

__device__ BlockPlan CarveShared(int32_t* smem, int32_t K, int32_t D) {
  const int32_t cap = HashCapacity(K);
  int32_t* hash_keys = smem;
  int32_t* hash_slots = hash_keys + cap;
  int32_t* need_token = hash_slots + cap;
  int32_t* miss_tokens = need_token + K;
  int32_t* miss_slots = miss_tokens + K;
  int32_t* new_lru = miss_slots + K;
  int32_t* heap_pos = new_lru + D;
  int32_t* heap_key = heap_pos + K;
  int32_t* rows = heap_key + K;
  uint8_t* slot_state = reinterpret_cast<uint8_t*>(rows + K);
  for (int32_t i = threadIdx.x; i < cap; i += blockDim.x) hash_keys[i] = -1;
  __syncthreads();
  return BlockPlan{HashPositionMap{hash_keys, hash_slots, cap - 1},
                   SwapInScratch{need_token, slot_state, new_lru, heap_key, heap_pos}, miss_tokens, miss_slots, rows};
}

// One block per request: thread 0 checks and plans the row, commits a good plan, then the block's warps
// copy the missing rows, 16 bytes per lane per load. A bad row writes its status and changes nothing.
// A prefetch (a.prefetch) plans the predicted positions the same way, with no newest row and no stats, and
// writes the rows it copies (or -status) instead of a status.
__global__ void SwapInKernel(SwapInArgs a) {
  extern __shared__ int32_t smem[];
  __shared__ int32_t num_misses;  // < 0: the row failed with status -num_misses
  const int32_t b = blockIdx.x;
  const int32_t layer = *a.layer;
  int32_t code = kOk;
  if (layer < 0 || layer >= a.L) code = kLayerOutOfRange;
  else if (!RequestIdOk(a, b)) code = kBadRequestId;
  // An idle row (no request: all padding) or a bad one costs one block that exits at once. A row of a request
  // with seq_len 0 is still planned (its positions checked), as on the CPU.
  if (code != kOk || a.req_ids[b] < 0) {
    if (!a.prefetch)
      for (int32_t k = threadIdx.x; k < a.K; k += blockDim.x) a.rows[static_cast<int64_t>(b) * a.K + k] = -1;
    if (threadIdx.x == 0) a.status[b] = a.prefetch ? -code : code;
    return;
  }
  const RequestLayer r = MakeRequest(a, b, layer);
  BlockPlan p = CarveShared(smem, a.K, a.D);
  int32_t* rows = a.prefetch ? p.rows : a.rows + static_cast<int64_t>(b) * a.K;
  if (threadIdx.x == 0) {
    int32_t hits = 0;
    num_misses = PlanSwapIn(r, p.map, p.scratch, rows, p.miss_tokens, p.miss_slots, &hits);
    a.status[b] = a.prefetch ? num_misses : num_misses < 0 ? -num_misses : kOk;
    if (num_misses >= 0) {
      CommitSwapIn(r, p.scratch.new_lru, p.miss_tokens, p.miss_slots, num_misses);
      if (!a.prefetch) {
        int32_t* counts = a.stats + (static_cast<int64_t>(layer) * a.R + a.req_ids[b]) * 2;
        counts[0] += hits;
        counts[1] += num_misses;
      }
    }
  }
  __syncthreads();
  if (num_misses < 0) {  // the plan failed part-way: none of its rows is valid
    if (!a.prefetch)
      for (int32_t k = threadIdx.x; k < a.K; k += blockDim.x) rows[k] = -1;
    return;
  }
  const char* pool = a.pool + static_cast<int64_t>(layer) * a.H * a.row_bytes;
  char* dev = a.hot + static_cast<int64_t>(layer) * a.R * (a.D + 1) * a.row_bytes;
  // The last warp places the newest row (the others take misses first); seq_len 0 has none.
  if (!a.prefetch && threadIdx.x / 32 == kThreads / 32 - 1 && r.seq_len > 0)
    CopyRow(a.newest + static_cast<int64_t>(b) * a.row_bytes,
            dev + (r.row_base + NewestSlot(r.seq_len, r.D)) * a.row_bytes, a.row_bytes);
  for (int32_t i = threadIdx.x / 32; i < num_misses; i += kThreads / 32) {
    const int64_t src = HostRow(r, p.miss_tokens[i]);  // validated by the plan
    CopyRow(pool + src * a.row_bytes, dev + (r.row_base + p.miss_slots[i]) * a.row_bytes, a.row_bytes);
  }
}

size_t SwapInSharedBytes(int32_t K, int32_t D) {
  return (2 * static_cast<size_t>(HashCapacity(K)) + 6 * static_cast<size_t>(K) + D) * sizeof(int32_t) + D;
}

ffi::Error CudaStatus(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorString(e));
}

// Once per device, the swap-in kernel is allowed the device's whole opt-in shared memory, so that the
// steady state makes no configuration call (nothing but launches while XLA records a command buffer).
// An error when a plan (K, D) needs more than the device has.
ffi::Error AllowSharedMemory(size_t smem) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> optin[kMaxDevices] = {};  // 0: not configured yet
  int device = 0;
  if (auto e = CudaStatus(cudaGetDevice(&device), "cudaGetDevice"); e.failure()) return e;
  if (device < 0 || device >= kMaxDevices) return ffi::Error::Internal("swap_in: device ordinal >= 64");
  int limit = optin[device].load(std::memory_order_acquire);
  if (limit == 0) {
    if (auto e = CudaStatus(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
                            "cudaDeviceGetAttribute");
        e.failure())
      return e;
    if (auto e = CudaStatus(cudaFuncSetAttribute(reinterpret_cast<const void*>(SwapInKernel),
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize, limit),
                            "cudaFuncSetAttribute");
        e.failure())
      return e;
    optin[device].store(limit, std::memory_order_release);
  }
  if (smem > static_cast<size_t>(limit))
    return ffi::Error::InvalidArgument("swap_in: top_k and device_buffer_size need " + std::to_string(smem) +
                                       " bytes of shared memory per block; the device allows " +
                                       std::to_string(limit));
  return ffi::Error::Success();
}

ffi::Error CopyIfDistinct(cudaStream_t stream, ffi::AnyBuffer src, ffi::Result<ffi::AnyBuffer> dst) {
  if (src.untyped_data() == dst->untyped_data()) return ffi::Error::Success();
  return CudaStatus(cudaMemcpyAsync(dst->untyped_data(), src.untyped_data(), src.size_bytes(),
                                    cudaMemcpyDefault, stream),
                    "swap_in copy");
}

// An extension-owned pinned pool (alloc_host_pool), viewed through its device pointer.
ffi::ErrorOr<PoolView> ExternalPool(uint64_t address, int64_t layers, int64_t rows, ffi::AnyBuffer like) {
  auto view = RegisteredPool(address, layers, rows, like);
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
  if (hd[0] != pool.L || hd[3] != pool.W || a.D < 1 || pd[0] != kd[0] || pool.dtype != hot.element_type())
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
                  ffi::Result<ffi::Buffer<ffi::S32>> status_out) {
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
  if (a.B == 0) return ffi::Error::Success();
  a.newest = static_cast<const char*>(newest.untyped_data());

  const size_t smem = SwapInSharedBytes(a.K, a.D);
  if (auto e = AllowSharedMemory(smem); e.failure()) return e;
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
  SwapInKernel<<<a.B, kThreads, smem, stream>>>(a);
  return CudaStatus(cudaGetLastError(), "swap_in launch");
}

// ---- cross-layer prefetch ----------------------------------------------------------------------------------
// The prefetch kernel (SwapInKernel with a.prefetch) runs on a side stream of the device, after an event of
// XLA's stream, and records an event that the prefetch wait makes XLA's stream wait for: layer l's attention
// and MoE on XLA's stream overlap layer l+1's copies. Its small inputs (layer, top_k, seq_lens, req_ids,
// host_pages) are first copied, on XLA's stream, into a scratch buffer of the hot buffer's: XLA may reuse
// their memory for other work once the start returns. One prefetch per hot buffer is in flight at a time (the
// view waits before the next start), so each hot buffer has one scratch, one start and one done event.
struct PrefetchSlot {
  cudaEvent_t ready = nullptr, done = nullptr;
  int32_t* scratch = nullptr;
  size_t scratch_ints = 0;
  bool pending = false;
};

class PrefetchRegistry {
 public:
  static PrefetchRegistry& Get() {
    static PrefetchRegistry* registry = new PrefetchRegistry();  // never destroyed (no CUDA calls at exit)
    return *registry;
  }
  std::mutex mu;
  std::map<int, cudaStream_t> side;                           // device -> side stream
  std::map<std::pair<int, const void*>, PrefetchSlot> slots;  // (device, hot buffer) -> its prefetch
};

ffi::Error PrefetchStart(cudaStream_t stream, PoolView pool, int64_t page_size, int64_t eviction,
                         ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> top_k, ffi::Buffer<ffi::S32> seq_lens,
                         ffi::Buffer<ffi::S32> req_ids, ffi::Buffer<ffi::S32> host_pages, ffi::AnyBuffer hot,
                         ffi::AnyBuffer slot_tokens, ffi::AnyBuffer lru, ffi::Result<ffi::AnyBuffer> hot_out,
                         ffi::Result<ffi::AnyBuffer> slot_tokens_out, ffi::Result<ffi::AnyBuffer> lru_out,
                         ffi::Result<ffi::Buffer<ffi::S32>> prefetched) {
  SwapInArgs a{};
  if (auto e = FillArgs("prefetch", pool, page_size, eviction, layer, top_k, seq_lens, req_ids, host_pages, hot,
                        slot_tokens, lru, prefetched->element_count(), a);
      e.failure())
    return e;
  if (eviction == kEvictScore)
    return ffi::Error::InvalidArgument("prefetch: eviction \"score\" needs this layer's scores, not known yet");
  a.prefetch = true;
  for (auto [src, dst] : {std::pair{hot, hot_out}, std::pair{slot_tokens, slot_tokens_out}, std::pair{lru, lru_out}}) {
    if (auto e = CopyIfDistinct(stream, src, dst); e.failure()) return e;
  }
  if (a.B == 0) return ffi::Error::Success();
  const size_t smem = SwapInSharedBytes(a.K, a.D);
  if (auto e = AllowSharedMemory(smem); e.failure()) return e;
  int device = 0;
  if (auto e = CudaStatus(cudaGetDevice(&device), "cudaGetDevice"); e.failure()) return e;
  auto& reg = PrefetchRegistry::Get();
  std::lock_guard<std::mutex> lock(reg.mu);
  cudaStream_t& side = reg.side[device];
  if (side == nullptr)
    if (auto e = CudaStatus(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), "cudaStreamCreate"); e.failure())
      return e;
  PrefetchSlot& slot = reg.slots[{device, hot_out->untyped_data()}];
  if (slot.ready == nullptr) {
    for (cudaEvent_t* ev : {&slot.ready, &slot.done})
      if (auto e = CudaStatus(cudaEventCreateWithFlags(ev, cudaEventDisableTiming), "cudaEventCreate"); e.failure())
        return e;
  }
  // Scratch: layer | top_k [B*K] | seq_lens [B] | req_ids [B] | host_pages [B*P].
  const size_t n_topk = static_cast<size_t>(a.B) * a.K, n_pages = static_cast<size_t>(a.B) * a.P;
  const size_t need = 1 + n_topk + 2 * static_cast<size_t>(a.B) + n_pages;
  if (slot.scratch_ints < need) {
    if (slot.scratch != nullptr) cudaFree(slot.scratch);  // its last prefetch was waited for
    slot.scratch = nullptr;
    slot.scratch_ints = 0;
    if (auto e = CudaStatus(cudaMalloc(&slot.scratch, need * sizeof(int32_t)), "prefetch scratch"); e.failure())
      return e;
    slot.scratch_ints = need;
  }
  int32_t* at = slot.scratch;
  for (auto [dst, src, n] : {std::tuple{&a.layer, a.layer, size_t{1}}, std::tuple{&a.top_k, a.top_k, n_topk},
                             std::tuple{&a.seq_lens, a.seq_lens, static_cast<size_t>(a.B)},
                             std::tuple{&a.req_ids, a.req_ids, static_cast<size_t>(a.B)},
                             std::tuple{&a.host_pages, a.host_pages, n_pages}}) {
    if (auto e = CudaStatus(cudaMemcpyAsync(at, src, n * sizeof(int32_t), cudaMemcpyDeviceToDevice, stream),
                            "prefetch snapshot");
        e.failure())
      return e;
    *dst = at;
    at += n;
  }
  a.hot = static_cast<char*>(hot_out->untyped_data());
  a.slot_tokens = static_cast<int32_t*>(slot_tokens_out->untyped_data());
  a.lru = static_cast<int32_t*>(lru_out->untyped_data());
  a.status = prefetched->typed_data();
  if (auto e = CudaStatus(cudaEventRecord(slot.ready, stream), "cudaEventRecord"); e.failure()) return e;
  if (auto e = CudaStatus(cudaStreamWaitEvent(side, slot.ready, 0), "cudaStreamWaitEvent"); e.failure()) return e;
  SwapInKernel<<<a.B, kThreads, smem, side>>>(a);
  if (auto e = CudaStatus(cudaGetLastError(), "prefetch launch"); e.failure()) return e;
  if (auto e = CudaStatus(cudaEventRecord(slot.done, side), "cudaEventRecord"); e.failure()) return e;
  slot.pending = true;
  return ffi::Error::Success();
}

// Prefetch wait: XLA's stream waits for the prefetch into this hot buffer (no host synchronization); the
// arrays it writes are aliased to the results.
ffi::Error PrefetchWaitImpl(cudaStream_t stream, ffi::AnyBuffer hot, ffi::AnyBuffer slot_tokens, ffi::AnyBuffer lru,
                            ffi::AnyBuffer prefetched, ffi::AnyBuffer after, ffi::Result<ffi::AnyBuffer> hot_out,
                            ffi::Result<ffi::AnyBuffer> slot_tokens_out, ffi::Result<ffi::AnyBuffer> lru_out,
                            ffi::Result<ffi::AnyBuffer> prefetched_out) {
  (void)after;
  int device = 0;
  if (auto e = CudaStatus(cudaGetDevice(&device), "cudaGetDevice"); e.failure()) return e;
  {
    auto& reg = PrefetchRegistry::Get();
    std::lock_guard<std::mutex> lock(reg.mu);
    auto it = reg.slots.find({device, hot.untyped_data()});
    if (it != reg.slots.end() && it->second.pending) {
      if (auto e = CudaStatus(cudaStreamWaitEvent(stream, it->second.done, 0), "cudaStreamWaitEvent"); e.failure())
        return e;
      it->second.pending = false;
    }
  }
  for (auto [src, dst] : {std::pair{hot, hot_out}, std::pair{slot_tokens, slot_tokens_out}, std::pair{lru, lru_out},
                          std::pair{prefetched, prefetched_out}}) {
    if (auto e = CopyIfDistinct(stream, src, dst); e.failure()) return e;
  }
  return ffi::Error::Success();
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
                      ffi::Result<ffi::Buffer<ffi::S32>> status_out, int64_t page_size, int64_t eviction) {
  auto view = OperandPool("swap_in", host_pool, host_pool_out);
  if (view.has_error()) return view.error();
  if (auto e = CopyIfDistinct(stream, host_pool, host_pool_out); e.failure()) return e;
  return SwapIn(stream, *view, page_size, eviction, slot_scores, layer, top_k, seq_lens, req_ids, host_pages, newest, hot, slot_tokens,
                lru, stats, rows, hot_out, slot_tokens_out, lru_out, stats_out, status_out);
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
                         ffi::Result<ffi::Buffer<ffi::S32>> status_out, int64_t page_size, int64_t eviction,
                         uint64_t pool_address, int64_t pool_layers,
                         int64_t pool_rows) {
  auto view = ExternalPool(pool_address, pool_layers, pool_rows, hot);
  if (view.has_error()) return view.error();
  if (auto e = CopyIfDistinct(stream, pool_token, pool_token_out); e.failure()) return e;
  return SwapIn(stream, *view, page_size, eviction, slot_scores, layer, top_k, seq_lens, req_ids, host_pages, newest, hot, slot_tokens,
                lru, stats, rows, hot_out, slot_tokens_out, lru_out, stats_out, status_out);
}

// Prefetch start over a `pinned_host` pool operand, aliased to a result.
ffi::Error PrefetchStartImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> top_k,
                             ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> req_ids,
                             ffi::Buffer<ffi::S32> host_pages, ffi::AnyBuffer host_pool, ffi::AnyBuffer hot,
                             ffi::AnyBuffer slot_tokens, ffi::AnyBuffer lru, ffi::Result<ffi::AnyBuffer> host_pool_out,
                             ffi::Result<ffi::AnyBuffer> hot_out, ffi::Result<ffi::AnyBuffer> slot_tokens_out,
                             ffi::Result<ffi::AnyBuffer> lru_out, ffi::Result<ffi::Buffer<ffi::S32>> prefetched,
                             int64_t page_size, int64_t eviction) {
  auto view = OperandPool("prefetch", host_pool, host_pool_out);
  if (view.has_error()) return view.error();
  if (auto e = CopyIfDistinct(stream, host_pool, host_pool_out); e.failure()) return e;
  return PrefetchStart(stream, *view, page_size, eviction, layer, top_k, seq_lens, req_ids, host_pages, hot,
                       slot_tokens, lru, hot_out, slot_tokens_out, lru_out, prefetched);
}

// Prefetch start over an extension-owned pinned pool; pool_token (s32[1]) is aliased to the result.
ffi::Error PrefetchStartExtImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> top_k,
                                ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> req_ids,
                                ffi::Buffer<ffi::S32> host_pages, ffi::AnyBuffer pool_token, ffi::AnyBuffer hot,
                                ffi::AnyBuffer slot_tokens, ffi::AnyBuffer lru,
                                ffi::Result<ffi::AnyBuffer> pool_token_out, ffi::Result<ffi::AnyBuffer> hot_out,
                                ffi::Result<ffi::AnyBuffer> slot_tokens_out, ffi::Result<ffi::AnyBuffer> lru_out,
                                ffi::Result<ffi::Buffer<ffi::S32>> prefetched, int64_t page_size, int64_t eviction,
                                uint64_t pool_address, int64_t pool_layers, int64_t pool_rows) {
  auto view = ExternalPool(pool_address, pool_layers, pool_rows, hot);
  if (view.has_error()) return view.error();
  if (auto e = CopyIfDistinct(stream, pool_token, pool_token_out); e.failure()) return e;
  return PrefetchStart(stream, *view, page_size, eviction, layer, top_k, seq_lens, req_ids, host_pages, hot,
                       slot_tokens, lru, hot_out, slot_tokens_out, lru_out, prefetched);
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
                         uint64_t pool_address, int64_t pool_layers, int64_t pool_rows) {
  auto view = ExternalPool(pool_address, pool_layers, pool_rows, rows);
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
