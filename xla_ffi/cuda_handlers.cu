// CUDA XLA FFI handlers: HiSparse swap-in and host-pool backup.
//
// Same buffers and semantics as cpu_handlers.cc (see that file's header); the
// planning runs the shared core (swap_in_core.h) and the copies read the host
// pool directly over PCIe/NVLink-C2C (zero-copy from pinned host memory).
//
// Launch shape: one thread block per batch row (request). A first kernel
// validates every row (its request id included) and reports the first error;
// the handler reads it back and returns an FFI error before any state changes
// (so a bad call loses nothing). The
// second kernel plans in thread 0 with the scratch in shared memory, then the
// whole block copies the missing rows with 16-byte loads where aligned.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

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
  uint8_t* slot_state = reinterpret_cast<uint8_t*>(heap_key + K);
  for (int32_t i = threadIdx.x; i < cap; i += blockDim.x) hash_keys[i] = -1;
  __syncthreads();
  return BlockPlan{HashPositionMap{hash_keys, hash_slots, cap - 1},
                   SwapInScratch{need_token, slot_state, new_lru, heap_key, heap_pos}, miss_tokens, miss_slots};
}

// Dry run of every request's plan (plans change nothing): error[0] = first
// failing status, error[1] = its request index.
__global__ void ValidateKernel(SwapInArgs a, int32_t* error) {
  extern __shared__ int32_t smem[];
  const int32_t layer = *a.layer;
  if (layer < 0 || layer >= a.L) {
    if (threadIdx.x == 0 && atomicCAS(&error[0], 0, kLayerOutOfRange) == 0) error[1] = blockIdx.x;
    return;
  }
  BlockPlan p = CarveShared(smem, a.K, a.D);
  if (threadIdx.x != 0) return;
  if (!RequestIdOk(a, blockIdx.x)) {
    if (atomicCAS(&error[0], 0, kBadRequestId) == 0) error[1] = blockIdx.x;
    return;
  }
  if (a.req_ids[blockIdx.x] < 0) return;
  int32_t hits = 0;
  const int32_t misses = PlanSwapIn(MakeRequest(a, blockIdx.x, layer), p.map, p.scratch,
                                    a.rows + static_cast<int64_t>(blockIdx.x) * a.K, p.miss_tokens,
                                    p.miss_slots, &hits);
  if (misses < 0 && atomicCAS(&error[0], 0, -misses) == 0) error[1] = blockIdx.x;
}

// One block per request: thread 0 plans and commits (the shared core), then the
// block's warps copy the missing rows, 16 bytes per lane per load.
__global__ void SwapInKernel(SwapInArgs a) {
  extern __shared__ int32_t smem[];
  __shared__ int32_t num_misses;
  const int32_t b = blockIdx.x;
  const int32_t layer = *a.layer;
  // An idle row (no request, or seq_len 0: all padding) costs one block that exits at once.
  if (a.req_ids[b] < 0 || a.seq_lens[b] == 0) {
    for (int32_t k = threadIdx.x; k < a.K; k += blockDim.x) a.rows[static_cast<int64_t>(b) * a.K + k] = -1;
    return;
  }
  const RequestLayer r = MakeRequest(a, b, layer);
  BlockPlan p = CarveShared(smem, a.K, a.D);
  if (threadIdx.x == 0) {
    int32_t hits = 0;
    num_misses = PlanSwapIn(r, p.map, p.scratch, a.rows + static_cast<int64_t>(b) * a.K, p.miss_tokens,
                            p.miss_slots, &hits);
    CommitSwapIn(r, p.scratch.new_lru, p.miss_tokens, p.miss_slots, num_misses);
    int32_t* counts = a.stats + (static_cast<int64_t>(layer) * a.R + a.req_ids[b]) * 2;
    counts[0] += hits;
    counts[1] += num_misses;
  }
  __syncthreads();
  const char* pool = a.pool + static_cast<int64_t>(layer) * a.H * a.row_bytes;
  char* dev = a.hot + static_cast<int64_t>(layer) * a.R * (a.D + 1) * a.row_bytes;
  if (threadIdx.x / 32 == kThreads / 32 - 1)  // the last warp places the newest row (the others take misses first)
    CopyRow(a.newest + static_cast<int64_t>(b) * a.row_bytes,
            dev + (r.row_base + NewestSlot(r.seq_len, r.D)) * a.row_bytes, a.row_bytes);
  for (int32_t i = threadIdx.x / 32; i < num_misses; i += kThreads / 32) {
    const int64_t src = HostRow(r, p.miss_tokens[i]);  // validated by the plan
    CopyRow(pool + src * a.row_bytes, dev + (r.row_base + p.miss_slots[i]) * a.row_bytes, a.row_bytes);
  }
}

size_t SwapInSharedBytes(int32_t K, int32_t D) {
  return (2 * static_cast<size_t>(HashCapacity(K)) + 5 * static_cast<size_t>(K) + D) * sizeof(int32_t) + D;
}

ffi::Error CudaStatus(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorString(e));
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

// A mapped pinned word the kernels report errors through, read after a sync.
ffi::ErrorOr<int32_t*> ErrorWord(int32_t** host) {
  static thread_local int32_t* error = nullptr;
  if (error == nullptr) {
    if (auto e = CudaStatus(cudaHostAlloc(&error, 2 * sizeof(int32_t), cudaHostAllocMapped), "cudaHostAlloc");
        e.failure())
      return e;
  }
  error[0] = error[1] = 0;
  int32_t* device = nullptr;
  if (auto e = CudaStatus(cudaHostGetDevicePointer(&device, error, 0), "cudaHostGetDevicePointer"); e.failure())
    return e;
  *host = error;
  return device;
}

ffi::Error SwapIn(cudaStream_t stream, PoolView pool, int64_t page_size, int64_t eviction,
                  ffi::Buffer<ffi::F32> slot_scores, ffi::Buffer<ffi::S32> layer,
                  ffi::Buffer<ffi::S32> top_k, ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> req_ids,
                  ffi::Buffer<ffi::S32> host_pages, ffi::AnyBuffer newest, ffi::AnyBuffer hot,
                  ffi::AnyBuffer slot_tokens,
                  ffi::AnyBuffer lru, ffi::AnyBuffer stats, ffi::Result<ffi::Buffer<ffi::S32>> rows,
                  ffi::Result<ffi::AnyBuffer> hot_out, ffi::Result<ffi::AnyBuffer> slot_tokens_out,
                  ffi::Result<ffi::AnyBuffer> lru_out, ffi::Result<ffi::AnyBuffer> stats_out) {
  auto kd = top_k.dimensions();
  auto hd = hot.dimensions();
  auto pd = host_pages.dimensions();
  if (kd.size() != 2 || hd.size() != 4 || pd.size() != 2)
    return ffi::Error::InvalidArgument(
        "swap_in: expected top_k [B,K], host_pages [B,P], host_pool [L,H,W], hot [L,R,D+1,W]");
  if (page_size < 1 || page_size > INT32_MAX)
    return ffi::Error::InvalidArgument("swap_in: page_size must be in [1, 2^31)");
  if (hd[1] * hd[2] > INT32_MAX || pool.H > INT32_MAX || pd[1] * page_size > INT32_MAX)
    return ffi::Error::InvalidArgument("swap_in: a dimension exceeds int32 indexing");
  SwapInArgs a{};
  a.B = static_cast<int32_t>(kd[0]);
  a.K = static_cast<int32_t>(kd[1]);
  a.L = static_cast<int32_t>(pool.L);
  a.H = static_cast<int32_t>(pool.H);
  a.R = static_cast<int32_t>(hd[1]);
  a.D = static_cast<int32_t>(hd[2] - 1);
  a.P = static_cast<int32_t>(pd[1]);
  a.page_size = static_cast<int32_t>(page_size);
  if (hd[0] != pool.L || hd[3] != pool.W || a.D < 1 || pd[0] != kd[0] || pool.dtype != hot.element_type())
    return ffi::Error::InvalidArgument("swap_in: hot must be [L, R, D+1, W] matching host_pool [L, H, W]");
  if (a.K > a.D)
    return ffi::Error::InvalidArgument("swap_in: top_k (" + std::to_string(a.K) +
                                       ") > device_buffer_size (" + std::to_string(a.D) + ")");
  if (eviction < 0 || eviction >= kNumEvictions)
    return ffi::Error::InvalidArgument("swap_in: eviction " + std::to_string(eviction) +
                                       " is not a policy (0 lru, 1 clock, 2 score)");
  if (a.D >= kRefBit) return ffi::Error::InvalidArgument("swap_in: device_buffer_size must be < 2^30");
  a.eviction = static_cast<int32_t>(eviction);
  {
    auto sd = slot_scores.dimensions();
    if (sd.size() != 2 || sd[0] != kd[0] || sd[1] != (eviction == kEvictScore ? a.D : 0))
      return ffi::Error::InvalidArgument(eviction == kEvictScore
                                             ? "swap_in: eviction \"score\" needs slot_scores f32[B, D]"
                                             : "swap_in: slot_scores must be f32[B, 0] unless eviction is \"score\"");
  }
  a.slot_scores = slot_scores.typed_data();
  if (slot_tokens.element_count() != static_cast<size_t>(a.L) * a.R * a.D ||
      lru.element_count() != static_cast<size_t>(a.L) * a.R * a.D ||
      stats.element_count() != static_cast<size_t>(a.L) * a.R * 2 ||
      seq_lens.element_count() != static_cast<size_t>(a.B) ||
      req_ids.element_count() != static_cast<size_t>(a.B) || layer.element_count() != 1)
    return ffi::Error::InvalidArgument(
        "swap_in: expected slot_tokens/lru s32[L,R,D], stats s32[L,R,2], seq_lens/req_ids s32[B], layer s32[]");
  if (newest.element_count() != static_cast<size_t>(a.B) * pool.W || newest.element_type() != hot.element_type())
    return ffi::Error::InvalidArgument("swap_in: newest must be [B, W] of the hot buffer's dtype");
  if (a.B == 0) return ffi::Error::Success();
  a.layer = layer.typed_data();
  a.top_k = top_k.typed_data();
  a.seq_lens = seq_lens.typed_data();
  a.req_ids = req_ids.typed_data();
  a.host_pages = host_pages.typed_data();
  a.newest = static_cast<const char*>(newest.untyped_data());
  a.pool = pool.base;
  a.row_bytes = pool.W * ffi::ByteWidth(hot.element_type());
  a.slot_tokens = static_cast<int32_t*>(slot_tokens.untyped_data());
  a.lru = static_cast<int32_t*>(lru.untyped_data());

  // Validate the inputs first; nothing is modified when they are bad.
  int32_t* error = nullptr;
  auto error_dev = ErrorWord(&error);
  if (error_dev.has_error()) return error_dev.error();
  const size_t smem = SwapInSharedBytes(a.K, a.D);
  for (const void* kernel : {reinterpret_cast<const void*>(ValidateKernel), reinterpret_cast<const void*>(SwapInKernel)}) {
    if (auto e = CudaStatus(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(smem)),
                            "cudaFuncSetAttribute");
        e.failure())
      return e;
  }
  a.rows = rows->typed_data();  // the dry run already writes the (output) rows
  ValidateKernel<<<a.B, kThreads, smem, stream>>>(a, *error_dev);
  if (auto e = CudaStatus(cudaStreamSynchronize(stream), "swap_in validate"); e.failure()) return e;
  if (error[0] != kOk)
    return ffi::Error::InvalidArgument("swap_in: row " + std::to_string(error[1]) + ": " +
                                       StatusMessage(error[0]));

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
                      int64_t page_size, int64_t eviction) {
  auto pd = host_pool.dimensions();
  if (pd.size() != 3) return ffi::Error::InvalidArgument("swap_in: host_pool must be [L, H, W]");
  if (!IsByteAddressable(host_pool.element_type()))
    return ffi::Error::InvalidArgument("swap_in: host_pool dtype packs below one byte per element (unsupported)");
  if (auto e = CopyIfDistinct(stream, host_pool, host_pool_out); e.failure()) return e;
  PoolView view{static_cast<char*>(host_pool_out->untyped_data()), pd[0], pd[1], host_pool.element_type(), pd[2]};
  return SwapIn(stream, view, page_size, eviction, slot_scores, layer, top_k, seq_lens, req_ids, host_pages, newest, hot, slot_tokens,
                lru, stats, rows, hot_out, slot_tokens_out, lru_out, stats_out);
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
                         int64_t page_size, int64_t eviction, uint64_t pool_address, int64_t pool_layers,
                         int64_t pool_rows) {
  auto view = ExternalPool(pool_address, pool_layers, pool_rows, hot);
  if (view.has_error()) return view.error();
  if (auto e = CopyIfDistinct(stream, pool_token, pool_token_out); e.failure()) return e;
  return SwapIn(stream, *view, page_size, eviction, slot_scores, layer, top_k, seq_lens, req_ids, host_pages, newest, hot, slot_tokens,
                lru, stats, rows, hot_out, slot_tokens_out, lru_out, stats_out);
}

__global__ void BackupKernel(const int32_t* layer, const char* rows, const int32_t* dst, char* pool,
                             int32_t Lr, int32_t N, int32_t H, int64_t row_bytes) {
  const int32_t n = blockIdx.x, i = blockIdx.y;
  const int32_t h = dst[n];
  if (h < 0) return;
  CopyRow(rows + (static_cast<int64_t>(i) * N + n) * row_bytes,
          pool + ((static_cast<int64_t>(*layer) + i) * H + h) * row_bytes, row_bytes);
}

__global__ void ValidateBackupKernel(const int32_t* layer, const int32_t* dst, int32_t Lr, int32_t L,
                                     int32_t N, int32_t H, int32_t* error) {
  for (int32_t n = threadIdx.x; n < N; n += blockDim.x)
    if (dst[n] < -1 || dst[n] >= H) atomicCAS(&error[0], 0, 1);
  if (threadIdx.x == 0 && (*layer < 0 || *layer + Lr > L)) atomicCAS(&error[0], 0, 2);
}

ffi::Error Backup(cudaStream_t stream, PoolView pool, ffi::Buffer<ffi::S32> layer, ffi::AnyBuffer rows,
                  ffi::Buffer<ffi::S32> dst) {
  auto rd = rows.dimensions();
  if (rd.size() != 3 || pool.W != rd[2] || rows.element_type() != pool.dtype ||
      dst.element_count() != static_cast<size_t>(rd[1]) || layer.element_count() != 1)
    return ffi::Error::InvalidArgument("backup: expected rows [Lr,N,W], dst s32[N], host_pool [L,H,W] of one dtype");
  const int32_t Lr = static_cast<int32_t>(rd[0]), N = static_cast<int32_t>(rd[1]);
  if (Lr == 0 || N == 0) return ffi::Error::Success();
  int32_t* error = nullptr;
  auto error_dev = ErrorWord(&error);
  if (error_dev.has_error()) return error_dev.error();
  ValidateBackupKernel<<<1, kThreads, 0, stream>>>(layer.typed_data(), dst.typed_data(), Lr,
                                                   static_cast<int32_t>(pool.L), N,
                                                   static_cast<int32_t>(pool.H), *error_dev);
  if (auto e = CudaStatus(cudaStreamSynchronize(stream), "backup validate"); e.failure()) return e;
  if (error[0] == 1) return ffi::Error::InvalidArgument("backup: a dst row is outside [-1, H)");
  if (error[0] == 2) return ffi::Error::InvalidArgument("backup: layer range outside [0, L)");
  BackupKernel<<<dim3(N, Lr), 32, 0, stream>>>(layer.typed_data(), static_cast<const char*>(rows.untyped_data()),
                                               dst.typed_data(), pool.base, Lr, N, static_cast<int32_t>(pool.H),
                                               pool.W * ffi::ByteWidth(rows.element_type()));
  return CudaStatus(cudaGetLastError(), "backup launch");
}

ffi::Error BackupImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> layer, ffi::AnyBuffer rows,
                      ffi::Buffer<ffi::S32> dst, ffi::AnyBuffer host_pool,
                      ffi::Result<ffi::AnyBuffer> host_pool_out) {
  auto pd = host_pool.dimensions();
  if (pd.size() != 3) return ffi::Error::InvalidArgument("backup: host_pool must be [L, H, W]");
  if (!IsByteAddressable(host_pool.element_type()))
    return ffi::Error::InvalidArgument("backup: host_pool dtype packs below one byte per element (unsupported)");
  if (auto e = CopyIfDistinct(stream, host_pool, host_pool_out); e.failure()) return e;
  return Backup(stream,
                PoolView{static_cast<char*>(host_pool_out->untyped_data()), pd[0], pd[1], host_pool.element_type(), pd[2]},
                layer, rows, dst);
}

ffi::Error BackupExtImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> layer, ffi::AnyBuffer rows,
                         ffi::Buffer<ffi::S32> dst, ffi::AnyBuffer pool_token,
                         ffi::Result<ffi::AnyBuffer> pool_token_out, uint64_t pool_address, int64_t pool_layers,
                         int64_t pool_rows) {
  auto view = ExternalPool(pool_address, pool_layers, pool_rows, rows);
  if (view.has_error()) return view.error();
  if (auto e = CopyIfDistinct(stream, pool_token, pool_token_out); e.failure()) return e;
  return Backup(stream, *view, layer, rows, dst);
}

}  // namespace
}  // namespace hisparse

#define HISPARSE_CUDA_BIND ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparseSwapInCuda, hisparse::SwapInImpl, hisparse::BindSwapIn(HISPARSE_CUDA_BIND));
XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparseBackupCuda, hisparse::BackupImpl, hisparse::BindBackup(HISPARSE_CUDA_BIND));
XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparseSwapInExtCuda, hisparse::SwapInExtImpl,
                              hisparse::BindExternalPool(hisparse::BindSwapIn(HISPARSE_CUDA_BIND)));
XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparseBackupExtCuda, hisparse::BackupExtImpl,
                              hisparse::BindExternalPool(hisparse::BindBackup(HISPARSE_CUDA_BIND)));
