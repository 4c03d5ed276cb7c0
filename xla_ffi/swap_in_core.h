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

// Open-addressing hash of the distinct non-padding top-k positions.
// capacity is a power of two >= 2 * K; keys == -1 mark empty entries.
struct PositionHash {
  int32_t* keys;    // [capacity]
  int32_t* values;  // [capacity], index into the distinct-position list
  int32_t mask;     // capacity - 1

  HISPARSE_HD void Clear() {
    for (int32_t i = 0; i <= mask; ++i) keys[i] = -1;
  }
  HISPARSE_HD static uint32_t Mix(int32_t key) {
    // Fibonacci hashing: multiply by 2^32 / golden ratio.
    return static_cast<uint32_t>(key) * 2654435769u;
  }
  // Returns the value stored for key, inserting `fresh` if absent. *inserted
  // tells which happened.
  HISPARSE_HD int32_t FindOrInsert(int32_t key, int32_t fresh, bool* inserted) {
    uint32_t i = Mix(key) & static_cast<uint32_t>(mask);
    while (true) {
      if (keys[i] == key) { *inserted = false; return values[i]; }
      if (keys[i] == -1) {
        keys[i] = key; values[i] = fresh; *inserted = true; return fresh;
      }
      i = (i + 1) & static_cast<uint32_t>(mask);
    }
  }
  HISPARSE_HD int32_t Find(int32_t key) const {
    uint32_t i = Mix(key) & static_cast<uint32_t>(mask);
    while (true) {
      if (keys[i] == key) return values[i];
      if (keys[i] == -1) return -1;
      i = (i + 1) & static_cast<uint32_t>(mask);
    }
  }
};

HISPARSE_HD inline int32_t HashCapacity(int32_t top_k) {
  int32_t cap = 2;
  while (cap < 2 * top_k) cap <<= 1;
  return cap;
}

// Per-request scratch for one plan; sizes in elements.
struct SwapInScratch {
  PositionHash hash;      // capacity HashCapacity(K)
  int32_t* need_token;    // [K] distinct needed positions, first-appearance order
  int32_t* need_slot;     // [K] slot serving each, -1 until assigned
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
// device (the newest token included).
HISPARSE_HD inline int32_t PlanSwapIn(const RequestLayer& r, SwapInScratch& w,
                                      int32_t* out_rows, int32_t* miss_tokens,
                                      int32_t* miss_slots, int32_t* hits) {
  w.hash.Clear();
  int32_t distinct = 0;
  const int32_t newest = r.seq_len - 1;
  for (int32_t k = 0; k < r.K; ++k) {
    const int32_t t = r.top_k[k];
    if (t < 0) continue;
    bool inserted;
    w.hash.FindOrInsert(t, distinct, &inserted);
    if (inserted) {
      w.need_token[distinct] = t;
      w.need_slot[distinct] = -1;
      ++distinct;
    }
  }

  if (r.seq_len <= r.D) {  // Fast path: every token sits in its own slot.
    for (int32_t k = 0; k < r.K; ++k) {
      const int32_t t = r.top_k[k];
      out_rows[k] = t < 0 ? -1 : r.row_base + t;
    }
    *hits = distinct;
    return 0;
  }

  // Hits: slots whose token is needed.
  int32_t num_hits = 0;
  for (int32_t s = 0; s < r.D; ++s) {
    w.slot_state[s] = 0;
    const int32_t t = r.slot_tokens[s];
    if (t < 0 || t == newest) continue;
    const int32_t idx = w.hash.Find(t);
    if (idx >= 0 && w.need_slot[idx] < 0) {
      w.need_slot[idx] = s;
      w.slot_state[s] = 1;
      ++num_hits;
    }
  }

  // Misses take the least-recently-used slots that are not hits.
  int32_t num_misses = 0;
  int32_t lru_pos = 0;
  for (int32_t i = 0; i < distinct; ++i) {
    const int32_t t = w.need_token[i];
    if (t == newest || w.need_slot[i] >= 0) continue;
    while (w.slot_state[r.lru[lru_pos]] != 0) ++lru_pos;  // never runs past D: distinct - 1 <= K - 1 < D
    const int32_t s = r.lru[lru_pos++];
    w.slot_state[s] = 2;
    w.need_slot[i] = s;
    r.slot_tokens[s] = t;
    miss_tokens[num_misses] = t;
    miss_slots[num_misses] = s;
    ++num_misses;
  }

  // New LRU order: untouched (old order) + filled (victim order) + hits (old order).
  int32_t n = 0;
  for (int32_t i = 0; i < r.D; ++i)
    if (w.slot_state[r.lru[i]] == 0) w.new_lru[n++] = r.lru[i];
  for (int32_t i = 0; i < num_misses; ++i) w.new_lru[n++] = miss_slots[i];
  for (int32_t i = 0; i < r.D; ++i)
    if (w.slot_state[r.lru[i]] == 1) w.new_lru[n++] = r.lru[i];
  for (int32_t i = 0; i < r.D; ++i) r.lru[i] = w.new_lru[i];

  for (int32_t k = 0; k < r.K; ++k) {
    const int32_t t = r.top_k[k];
    if (t < 0) {
      out_rows[k] = -1;
    } else if (t == newest) {
      out_rows[k] = r.row_base + r.D;
    } else {
      out_rows[k] = r.row_base + w.need_slot[w.hash.Find(t)];
    }
  }
  *hits = distinct - num_misses;
  return num_misses;
}

}  // namespace hisparse
