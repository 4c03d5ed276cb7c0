// HiSparse swap-in: the algorithm core shared by the CPU and CUDA handlers.
//
// Plain C++ on raw pointers and sizes, no XLA types, callable from host code
// and from a CUDA kernel (HISPARSE_HD). One call plans the swap-in of ONE
// request at ONE layer; the caller then copies the planned misses
// host -> device (memcpy on CPU, a block-wide copy on CUDA).
//
// Semantics (the contract; hisparse_jax/reference.py is the executable spec):
//   * A request's hot buffer has D slots plus one reserved slot (index D) that
//     holds the newest token, position seq_len - 1.
//   * seq_len <= D (fast path): slot i holds token i; no I/O; LRU unchanged.
//   * Otherwise hits keep their slots; misses take the least-recently-used
//     slots that hold no token needed this step; the newest token is served
//     from the reserved slot; each distinct missing position is copied once.
//   * New LRU order (oldest first) = untouched slots (old order) + slots just
//     filled (in victim order) + hit slots (old order). Hits go last because
//     they were just used and are most likely to be used again next step.
//   * Padding (-1) maps to row -1 and costs nothing.
//
// Source of the algorithm: HiSparse (SGLang, sgl-project/sglang PR "HiSparse",
// jit_kernel/csrc/hisparse.cuh): per-request hot buffer, hash of the top-k,
// LRU kept as a permutation of slot ids.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define HISPARSE_HD __host__ __device__
#else
#define HISPARSE_HD
#endif

namespace hisparse {

// Error codes returned (negated) by the validation and planning functions.
enum SwapInStatus : int32_t {
  kOk = 0,
  kBadSeqLen = 1,        // seq_len < 0 or > max_seq_len
  kPositionOutOfRange,   // top-k position >= seq_len or < -1
  kHostRowOutOfRange,    // host row of a needed position outside [0, H)
  kLruNotPermutation,    // LRU order of the D slots is not a permutation
  kLayerOutOfRange,      // layer index outside [0, L)
};

inline const char* StatusMessage(int32_t status) {
  switch (status) {
    case kBadSeqLen: return "seq_len is < 0 or > the host-row table width (max_seq_len)";
    case kPositionOutOfRange: return "a top-k position is >= seq_len or < -1";
    case kHostRowOutOfRange: return "a needed position has no valid host-pool row (host row outside [0, H))";
    case kLruNotPermutation: return "the LRU order is not a permutation of the D slot ids";
    case kLayerOutOfRange: return "layer index is outside [0, num_layers)";
    default: return "ok";
  }
}

// The set of positions needed this step, each with the slot serving it.
// Two implementations with one interface, chosen per device:
//   DirectPositionMap: a bitmap + an array indexed by position (CPU: O(1)
//     with no probing; memory grows with max_seq_len, kept per thread).
//   HashPositionMap: open addressing over 2K entries (CUDA: fits shared
//     memory whatever the context length).
// Insert(t) returns true the first time t is seen and sets its slot to -1.
struct DirectPositionMap {
  uint64_t* bits;    // [ceil(max_seq_len / 64)], all zero between plans
  int32_t* slot_of;  // [max_seq_len], valid where the bit is set

  HISPARSE_HD bool Insert(int32_t t) {
    const uint64_t m = uint64_t{1} << (t & 63);
    if (bits[t >> 6] & m) return false;
    bits[t >> 6] |= m;
    slot_of[t] = -1;
    return true;
  }
  HISPARSE_HD bool Contains(int32_t t) const { return (bits[t >> 6] >> (t & 63)) & 1; }
  HISPARSE_HD int32_t Slot(int32_t t) const { return slot_of[t]; }
  HISPARSE_HD void SetSlot(int32_t t, int32_t s) { slot_of[t] = s; }
  // Returns the bitmap to all zero: O(distinct), not O(max_seq_len).
  HISPARSE_HD void Clear(const int32_t* members, int32_t n) {
    for (int32_t i = 0; i < n; ++i) bits[members[i] >> 6] = 0;
  }
};

struct HashPositionMap {
  int32_t* keys;   // [capacity], -1 = empty
  int32_t* slots;  // [capacity]
  int32_t mask;    // capacity - 1, capacity a power of two >= 2K

  HISPARSE_HD uint32_t Home(int32_t t) const {
    return (static_cast<uint32_t>(t) * 2654435769u) & static_cast<uint32_t>(mask);  // Fibonacci hashing
  }
  HISPARSE_HD int32_t Find(int32_t t) const {
    for (uint32_t i = Home(t);; i = (i + 1) & static_cast<uint32_t>(mask)) {
      if (keys[i] == t) return static_cast<int32_t>(i);
      if (keys[i] == -1) return -1;
    }
  }
  HISPARSE_HD bool Insert(int32_t t) {
    for (uint32_t i = Home(t);; i = (i + 1) & static_cast<uint32_t>(mask)) {
      if (keys[i] == t) return false;
      if (keys[i] == -1) {
        keys[i] = t;
        slots[i] = -1;
        return true;
      }
    }
  }
  HISPARSE_HD bool Contains(int32_t t) const { return Find(t) >= 0; }
  HISPARSE_HD int32_t Slot(int32_t t) const { return slots[Find(t)]; }
  HISPARSE_HD void SetSlot(int32_t t, int32_t s) { slots[Find(t)] = s; }
  HISPARSE_HD void Clear(const int32_t*, int32_t) {
    for (int32_t i = 0; i <= mask; ++i) keys[i] = -1;
  }
};

HISPARSE_HD inline int32_t HashCapacity(int32_t top_k) {
  int32_t cap = 2;
  while (cap < 2 * top_k) cap <<= 1;
  return cap;
}

// Per-request scratch for one plan; sizes in elements.
struct SwapInScratch {
  int32_t* need_token;    // [K] distinct needed positions, first-appearance order
  uint8_t* slot_state;    // [D] 0 untouched, 1 hit, 2 filled this step
  int32_t* new_lru;       // [D]
};

// Per-request view of the state of one layer.
struct RequestLayer {
  const int32_t* top_k;      // [K]
  int32_t K;
  int32_t seq_len;
  int32_t D;                  // hot-buffer slots (reserved slot excluded)
  const int32_t* host_rows;   // [max_seq_len] position -> host-pool row
  int32_t max_seq_len;
  int32_t num_host_rows;      // H
  int32_t* slot_tokens;       // [D] slot -> token position (-1 empty)
  int32_t* lru;               // [D] slot ids, oldest first
  int32_t row_base;           // device row of slot 0; reserved slot = row_base + D
};

// Checks one request before anything is modified. Returns kOk or an error.
HISPARSE_HD inline int32_t ValidateRequest(const RequestLayer& r, uint8_t* seen /*[D]*/) {
  if (r.seq_len < 0 || r.seq_len > r.max_seq_len) return kBadSeqLen;
  const bool slow = r.seq_len > r.D;
  for (int32_t k = 0; k < r.K; ++k) {
    const int32_t t = r.top_k[k];
    if (t < -1 || t >= r.seq_len) return kPositionOutOfRange;
    if (slow && t >= 0 && t != r.seq_len - 1) {
      const int32_t h = r.host_rows[t];
      if (h < 0 || h >= r.num_host_rows) return kHostRowOutOfRange;
    }
  }
  if (slow) {
    for (int32_t s = 0; s < r.D; ++s) seen[s] = 0;
    for (int32_t i = 0; i < r.D; ++i) {
      const int32_t s = r.lru[i];
      if (s < 0 || s >= r.D || seen[s]) return kLruNotPermutation;
      seen[s] = 1;
    }
  }
  return kOk;
}

// Plans the swap-in of one validated request at one layer: writes out_rows
// [K], updates slot_tokens and lru in place, and lists the misses as
// (miss_tokens[i], miss_slots[i]) for the caller to copy. Returns the number
// of misses; *hits gets the number of distinct positions served from the
// device (the newest token included). `map` must be empty on entry and is
// empty again on return. O(K + D) map operations.
template <typename PositionMap>
HISPARSE_HD int32_t PlanSwapIn(const RequestLayer& r, PositionMap& map, SwapInScratch& w,
                               int32_t* out_rows, int32_t* miss_tokens, int32_t* miss_slots,
                               int32_t* hits) {
  int32_t distinct = 0;
  for (int32_t k = 0; k < r.K; ++k) {
    const int32_t t = r.top_k[k];
    if (t >= 0 && map.Insert(t)) w.need_token[distinct++] = t;
  }

  if (r.seq_len <= r.D) {  // Fast path: every token sits in its own slot.
    for (int32_t k = 0; k < r.K; ++k) {
      const int32_t t = r.top_k[k];
      out_rows[k] = t < 0 ? -1 : r.row_base + t;
    }
    map.Clear(w.need_token, distinct);
    *hits = distinct;
    return 0;
  }

  // Hits: slots whose token is needed (a duplicated slot entry counts once).
  const int32_t newest = r.seq_len - 1;
  int32_t num_hits = 0;
  for (int32_t s = 0; s < r.D; ++s) {
    const int32_t t = r.slot_tokens[s];
    uint8_t state = 0;
    if (t >= 0 && t < newest && map.Contains(t) && map.Slot(t) < 0) {
      map.SetSlot(t, s);
      state = 1;
      ++num_hits;
    }
    w.slot_state[s] = state;
  }

  // Misses take the least-recently-used slots that are not hits. At most
  // distinct - num_hits <= K - num_hits <= D - num_hits misses, so the scan
  // never runs past the end of the LRU order.
  int32_t num_misses = 0;
  int32_t lru_pos = 0;
  for (int32_t i = 0; i < distinct; ++i) {
    const int32_t t = w.need_token[i];
    if (t == newest || map.Slot(t) >= 0) continue;
    while (w.slot_state[r.lru[lru_pos]] != 0) ++lru_pos;
    const int32_t s = r.lru[lru_pos++];
    w.slot_state[s] = 2;
    map.SetSlot(t, s);
    r.slot_tokens[s] = t;
    miss_tokens[num_misses] = t;
    miss_slots[num_misses] = s;
    ++num_misses;
  }

  // New LRU order in one pass: untouched (old order) | filled (victim order) | hits (old order).
  int32_t untouched = 0, hit_pos = r.D - num_hits;
  for (int32_t i = 0; i < r.D; ++i) {
    const int32_t s = r.lru[i];
    const uint8_t state = w.slot_state[s];
    if (state == 0) w.new_lru[untouched++] = s;
    else if (state == 1) w.new_lru[hit_pos++] = s;
  }
  for (int32_t i = 0; i < num_misses; ++i) w.new_lru[untouched + i] = miss_slots[i];
  for (int32_t i = 0; i < r.D; ++i) r.lru[i] = w.new_lru[i];

  for (int32_t k = 0; k < r.K; ++k) {
    const int32_t t = r.top_k[k];
    out_rows[k] = t < 0 ? -1 : t == newest ? r.row_base + r.D : r.row_base + map.Slot(t);
  }
  map.Clear(w.need_token, distinct);
  *hits = distinct - num_misses;
  return num_misses;
}

}  // namespace hisparse
