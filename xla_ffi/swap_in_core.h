// HiSparse swap-in: the algorithm core shared by the CPU and CUDA handlers.
//
// Plain C++ on raw pointers and sizes, no XLA types, callable from host code
// and from a CUDA kernel (HISPARSE_HD). One call plans the swap-in of ONE
// request at ONE layer; the caller then copies the planned misses
// host -> device (memcpy on CPU, a block-wide copy on CUDA).
//
// Semantics (the contract; hisparse_jax/kernels/reference.py is the executable spec):
//   * A request's hot buffer has D slots plus one reserved slot (index D) that
//     holds the newest token, position seq_len - 1.
//   * seq_len <= D (fast path): slot i holds token i; no I/O; LRU unchanged.
//   * Otherwise hits keep their slots; each distinct missing position (in
//     first-appearance order) takes a victim slot holding no token needed this
//     step, chosen by the eviction policy (below); the newest token is served
//     from the reserved slot; each distinct missing position is copied once.
//   * Eviction policies (the `eviction` attribute; victims in the order taken):
//       kEvictLru   the least-recently-used slots. New LRU order (oldest first)
//                   = untouched slots (old order) + slots just filled (victim
//                   order) + hit slots (old order): hits go last because they
//                   were just used and are most likely to be used again.
//       kEvictClock second-chance CLOCK. The `lru` array is the clock ring read
//                   from the hand; an entry is slot | kRefBit when the slot's
//                   reference bit is set. Hits set their bit; the hand skips
//                   hits and slots filled this step, clears a set bit and
//                   passes, and evicts a slot whose bit is clear; filled slots
//                   start with a clear bit. New array = the ring read from the
//                   hand's new position (a rotation), with the new bits.
//       kEvictScore the slots whose tokens the indexer ranks lowest this step
//                   (slot_scores, one float per slot, compared in IEEE total
//                   order: -0 < +0, subnormals kept; an empty slot first; ties
//                   go to the older slot in LRU order; a NaN score is an
//                   error). Victims in ascending (score, LRU position); the LRU
//                   order is updated as kEvictLru's.
//   * Padding (-1) maps to row -1 and costs nothing.
//   * The newest token's latent row (computed this step) is written by the handler
//     to its slot: its own slot seq_len - 1 while seq_len <= D, else the reserved
//     slot D (NewestSlot) -- so that XLA never writes the hot buffer in a decode
//     step (an XLA update of a buffer an aliased custom call then takes is not done
//     in place: it copies the whole hot buffer).
//
// Source of the algorithm: HiSparse (SGLang, sgl-project/sglang PR "HiSparse",
// jit_kernel/csrc/hisparse.cuh): per-request hot buffer, hash of the top-k,
// LRU kept as a permutation of slot ids.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define HISPARSE_HD __host__ __device__
#else
#define HISPARSE_HD
#endif

namespace hisparse {

// Per-row status codes: returned (negated) by the validation and planning functions, and written by the
// handlers to their status output (0 for a row done, else why the row was left unchanged).
enum SwapInStatus : int32_t {
  kOk = 0,
  kBadSeqLen = 1,        // seq_len < 0 or > max_seq_len
  kPositionOutOfRange,   // top-k position >= seq_len or < -1
  kHostRowOutOfRange,    // host row of a needed position outside [0, H)
  kLruNotPermutation,    // LRU order of the D slots is not a permutation
  kLayerOutOfRange,      // layer index outside [0, L)
  kBadRequestId,         // request (hot-buffer) id outside [-1, R), repeated, or -1 with seq_len > 0
  kBadScore,             // score policy: a resident slot's score is NaN
  kBackupRowOutOfRange,  // backup: a destination host row outside [-1, H)
  kPrefetchStale,        // prefetch: the row's slot table or LRU order changed between start and wait
};
constexpr int32_t kNumStatuses = kPrefetchStale + 1;

// Eviction policies (the handlers' `eviction` attribute).
enum Eviction : int32_t { kEvictLru = 0, kEvictClock = 1, kEvictScore = 2 };
constexpr int32_t kNumEvictions = 3;

// CLOCK: the reference bit of an entry of the `lru` array (slot ids are < 2^30).
constexpr int32_t kRefBit = int32_t{1} << 30;

inline const char* StatusMessage(int32_t status) {
  switch (status) {
    case kBadSeqLen: return "seq_len is < 0 or > the host page table's span (pages x page_size)";
    case kPositionOutOfRange: return "a top-k position is >= seq_len or < -1";
    case kHostRowOutOfRange: return "a position to swap in has no valid host-pool row (host row outside [0, H))";
    case kBadRequestId:
      return "a request id is outside [-1, R), appears twice in the batch, or is -1 (idle row) with seq_len > 0";
    case kLruNotPermutation:
      return "the LRU order is not a permutation of the D slot ids (CLOCK: ids | reference bit 2^30)";
    case kLayerOutOfRange: return "layer index is outside [0, num_layers)";
    case kBadScore: return "a resident slot's score is NaN (eviction \"score\")";
    case kBackupRowOutOfRange: return "a backup destination host row is outside [-1, H)";
    case kPrefetchStale:
      return "the row's slot table or LRU order changed between prefetch start and wait (prefetch dropped)";
    case kOk: return "ok";
    default: return "not a status code (prefetch_wait reports a row's status negated)";
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
  uint8_t* slot_state;    // [D] kUntouched / kHit / kFilled in the low bits | the flags below
  int32_t* new_lru;       // [D] the LRU order to commit (slow path only)
  int32_t* heap_key;      // [K] score policy: the victims' (ScoreKey, LRU position) max-heap
  int32_t* heap_pos;      // [K]
};

// slot_state values (low two bits) and flags.
constexpr uint8_t kUntouched = 0, kHit = 1, kFilled = 2, kStateMask = 3;
constexpr uint8_t kSeen = 4;        // met in the final pass over the LRU array (permutation check)
constexpr uint8_t kRefCleared = 8;  // CLOCK: the hand cleared this slot's reference bit this step
constexpr uint8_t kWalked = 16;     // score policy: met in the walk over the LRU order

// Per-request view of the state of one layer.
struct RequestLayer {
  const int32_t* top_k;       // [K]
  int32_t K;
  int32_t seq_len;
  int32_t D;                  // hot-buffer slots (reserved slot excluded)
  const int32_t* host_pages;  // [num_pages] logical page -> host-pool page (the page table)
  int32_t num_pages;
  int32_t page_size;          // tokens per page; position t lives in page t / page_size
  int32_t num_host_rows;      // H
  int32_t* slot_tokens;       // [D] slot -> token position (-1 empty)
  int32_t* lru;               // [D] slot ids, oldest first (CLOCK: the ring from the hand, | kRefBit)
  int32_t row_base;           // device row of slot 0; reserved slot = row_base + D
  int32_t eviction;           // an Eviction
  const float* slot_scores;   // [D] score policy: the indexer's score of each slot's token; else unused
};

// A float score's bits as an int32 ordered like the floats (IEEE total order of non-NaN values: -0 before
// +0, subnormals kept): comparing keys, not floats, gives the same victims on every device whatever its
// flush-to-zero mode (XLA's CPU threads flush subnormals). An empty slot has the key below every score.
constexpr int32_t kEmptySlotKey = INT32_MIN;
HISPARSE_HD inline int32_t ScoreKey(uint32_t bits) {
  return static_cast<int32_t>(bits ^ ((bits >> 31) ? 0x7fffffffu : 0u));
}
HISPARSE_HD inline bool IsNaNBits(uint32_t bits) { return (bits & 0x7fffffffu) > 0x7f800000u; }
HISPARSE_HD inline uint32_t FloatBits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
#endif
}

// (key, LRU position) a before b: the score policy's victim order.
HISPARSE_HD inline bool ScoreBefore(int32_t a, int32_t pa, int32_t b, int32_t pb) {
  return a < b || (a == b && pa < pb);
}

HISPARSE_HD inline void SwapKeys(int32_t* key, int32_t* pos, int32_t i, int32_t j) {
  const int32_t ks = key[i];
  key[i] = key[j];
  key[j] = ks;
  const int32_t ps = pos[i];
  pos[i] = pos[j];
  pos[j] = ps;
}

// Restores the max-heap property (the root = the key LAST in victim order) below node i of an n-entry heap.
HISPARSE_HD inline void SiftDown(int32_t* score, int32_t* pos, int32_t n, int32_t i) {
  for (;;) {
    const int32_t l = 2 * i + 1, r = l + 1;
    int32_t top = i;
    if (l < n && ScoreBefore(score[top], pos[top], score[l], pos[l])) top = l;
    if (r < n && ScoreBefore(score[top], pos[top], score[r], pos[r])) top = r;
    if (top == i) return;
    SwapKeys(score, pos, i, top);
    i = top;
  }
}

// Victim slots for n misses, written to victims[0..n), marked kFilled in slot_state; returns kOk or the
// status of the corrupt input met (an LRU array that is not a permutation, a NaN score of an untouched
// resident slot: checked on every slow-path plan). O(D) for LRU and CLOCK (the hand passes each slot at
// most twice), O(D log n) for the score policy.
HISPARSE_HD inline int32_t ChooseVictims(const RequestLayer& r, uint8_t* slot_state, SwapInScratch& w,
                                         int32_t n, int32_t* victims, int32_t* clock_hand) {
  const int32_t D = r.D;
  const int32_t* lru = r.lru;
  if (r.eviction == kEvictClock) {
    int32_t hand = 0, taken = 0;
    while (taken < n) {
      // A valid ring yields the n victims within two laps: the first clears every untouched slot's bit.
      // (2 * D < 2^31: D < kRefBit.)
      if (hand >= 2 * D) return kLruNotPermutation;
      const int32_t e = lru[hand % D];
      const int32_t s = e & ~kRefBit;
      ++hand;
      if (e < 0 || s >= D) return kLruNotPermutation;
      const uint8_t st = slot_state[s];
      if ((st & kStateMask) != kUntouched) continue;  // needed this step, or filled on this lap
      if ((e & kRefBit) && !(st & kRefCleared)) {
        slot_state[s] = st | kRefCleared;  // second chance
        continue;
      }
      slot_state[s] = kFilled;
      victims[taken++] = s;
    }
    *clock_hand = hand % D;
    return kOk;
  }
  if (r.eviction == kEvictScore) {
    int32_t* hs = w.heap_key;
    int32_t* hp = w.heap_pos;
    int32_t size = 0;
    for (int32_t i = 0; i < D; ++i) {
      const int32_t s = lru[i];
      if (s < 0 || s >= D || (slot_state[s] & kWalked)) return kLruNotPermutation;
      const uint8_t st = slot_state[s];
      slot_state[s] = st | kWalked;
      if ((st & kStateMask) != kUntouched) continue;
      const uint32_t bits = FloatBits(r.slot_scores[s]);
      int32_t score = kEmptySlotKey;
      if (r.slot_tokens[s] >= 0) {
        if (IsNaNBits(bits)) return kBadScore;  // checked whether or not this step has a miss
        score = ScoreKey(bits);
      }
      if (n == 0) continue;
      if (size < n) {  // grow the heap: sift the new key up
        int32_t j = size++;
        hs[j] = score;
        hp[j] = i;
        while (j > 0) {
          const int32_t parent = (j - 1) / 2;
          if (!ScoreBefore(hs[parent], hp[parent], hs[j], hp[j])) break;
          SwapKeys(hs, hp, j, parent);
          j = parent;
        }
      } else if (ScoreBefore(score, i, hs[0], hp[0])) {
        hs[0] = score;
        hp[0] = i;
        SiftDown(hs, hp, size, 0);
      }
    }
    if (size < n) return kLruNotPermutation;  // fewer free slots than misses: not a valid order
    for (int32_t end = size - 1; end > 0; --end) {  // heap sort: ascending victim order
      SwapKeys(hs, hp, 0, end);
      SiftDown(hs, hp, end, 0);
    }
    for (int32_t i = 0; i < n; ++i) {
      const int32_t s = lru[hp[i]];
      slot_state[s] = (slot_state[s] & ~kStateMask) | kFilled;
      victims[i] = s;
    }
    return kOk;
  }
  int32_t lru_pos = 0, taken = 0;  // LRU: the oldest non-hit slots
  while (taken < n) {
    if (lru_pos >= D) return kLruNotPermutation;
    const int32_t s = lru[lru_pos++];
    if (s < 0 || s >= D) return kLruNotPermutation;
    if ((slot_state[s] & kStateMask) == kUntouched) {
      slot_state[s] = kFilled;
      victims[taken++] = s;
    }
  }
  return kOk;
}

// Host-pool row of position t (0 <= t < num_pages * page_size): page_table[t / page_size] *
// page_size + t % page_size, or -1 when that row is outside [0, H). 64-bit arithmetic: a corrupt
// page id never wraps into range.
HISPARSE_HD inline int64_t HostRow(const RequestLayer& r, int32_t t) {
  const int64_t page = r.host_pages[t / r.page_size];
  const int64_t row = page * r.page_size + t % r.page_size;
  return (page < 0 || row >= r.num_host_rows) ? -1 : row;
}

// Slot of the newest token (position seq_len - 1, seq_len >= 1).
HISPARSE_HD inline int32_t NewestSlot(int32_t seq_len, int32_t D) { return seq_len <= D ? seq_len - 1 : D; }

// Tokens the page table spans: the largest valid seq_len.
HISPARSE_HD inline int64_t MaxSeqLen(const RequestLayer& r) {
  return static_cast<int64_t>(r.num_pages) * r.page_size;
}

// Plans the swap-in of one request at one layer WITHOUT modifying its state,
// validating everything it reads, so that a batch can be checked whole before
// any request is changed. Writes out_rows [K], the misses as (miss_tokens[i],
// miss_slots[i]) and, on the slow path, the new LRU order in w.new_lru.
// Returns the number of misses (>= 0) or -status for invalid input; *hits gets
// the distinct positions served from the device (the newest token included).
// `map` must be empty on entry and is empty again on return. O(K + D).
template <typename PositionMap>
HISPARSE_HD int32_t PlanSwapIn(const RequestLayer& r, PositionMap& map_ref, SwapInScratch& w,
                               int32_t* out_rows, int32_t* miss_tokens, int32_t* miss_slots,
                               int32_t* hits) {
  // Locals, not fields read through references: the byte stores to slot_state
  // may alias anything, which would otherwise force a reload of every field in
  // every loop iteration.
  PositionMap map = map_ref;
  const int32_t K = r.K, D = r.D, seq_len = r.seq_len, row_base = r.row_base;
  const int32_t* top_k = r.top_k;
  const int32_t* slot_tokens = r.slot_tokens;
  const int32_t* lru = r.lru;
  int32_t* need_token = w.need_token;
  uint8_t* slot_state = w.slot_state;
  int32_t* new_lru = w.new_lru;

  if (seq_len < 0 || seq_len > MaxSeqLen(r)) return -kBadSeqLen;
  int32_t distinct = 0;
  int32_t status = kOk;
  for (int32_t k = 0; k < K; ++k) {
    const int32_t t = top_k[k];
    if (t < -1 || t >= seq_len) {
      status = kPositionOutOfRange;
      break;
    }
    if (t >= 0 && map.Insert(t)) need_token[distinct++] = t;
  }
  if (status != kOk) {
    map.Clear(need_token, distinct);
    return -status;
  }

  if (seq_len <= D) {  // Fast path: every token sits in its own slot.
    for (int32_t k = 0; k < K; ++k) {
      const int32_t t = top_k[k];
      out_rows[k] = t < 0 ? -1 : row_base + t;
    }
    map.Clear(need_token, distinct);
    *hits = distinct;
    return 0;
  }

  // Hits: slots whose token is needed (a duplicated slot entry counts once).
  const int32_t newest = seq_len - 1;
  int32_t num_hits = 0;
  for (int32_t s = 0; s < D; ++s) {
    const int32_t t = slot_tokens[s];
    uint8_t state = 0;
    if (t >= 0 && t < newest && map.Contains(t) && map.Slot(t) < 0) {
      map.SetSlot(t, s);
      state = 1;
      ++num_hits;
    }
    slot_state[s] = state;
  }

  // Misses, in first-appearance order; only rows that are read need a valid host row.
  int32_t num_misses = 0;
  for (int32_t i = 0; i < distinct; ++i) {
    const int32_t t = need_token[i];
    if (t == newest || map.Slot(t) >= 0) continue;
    if (HostRow(r, t) < 0) {
      status = kHostRowOutOfRange;
      break;
    }
    miss_tokens[num_misses++] = t;
  }
  int32_t hand = 0;
  if (status == kOk) status = ChooseVictims(r, slot_state, w, num_misses, miss_slots, &hand);
  if (status == kOk)
    for (int32_t i = 0; i < num_misses; ++i) map.SetSlot(miss_tokens[i], miss_slots[i]);

  // The array to commit, in one pass that also checks the old one is a permutation.
  //   LRU / score: untouched (old order) | filled (victim order) | hits (old order).
  //   CLOCK: the ring read from the new hand position, hits' bits set, filled and passed bits cleared.
  if (status == kOk) {
    const bool clock = r.eviction == kEvictClock;
    int32_t untouched = 0, hit_pos = D - num_hits;
    for (int32_t i = 0; i < D; ++i) {
      const int32_t e = lru[i];
      const int32_t s = clock ? (e & ~kRefBit) : e;
      if (e < 0 || s >= D || (slot_state[s] & kSeen)) {
        status = kLruNotPermutation;
        break;
      }
      const uint8_t st = slot_state[s];
      slot_state[s] = st | kSeen;
      const uint8_t state = st & kStateMask;
      if (clock) {
        const bool ref = state == kHit || (state == kUntouched && (e & kRefBit) && !(st & kRefCleared));
        new_lru[(i - hand + D) % D] = s | (ref ? kRefBit : 0);
      } else if (state == kUntouched) {
        new_lru[untouched++] = s;
      } else if (state == kHit) {
        new_lru[hit_pos++] = s;
      }
    }
    if (status == kOk) {
      if (!clock)
        for (int32_t i = 0; i < num_misses; ++i) new_lru[untouched + i] = miss_slots[i];
      for (int32_t k = 0; k < K; ++k) {
        const int32_t t = top_k[k];
        out_rows[k] = t < 0 ? -1 : t == newest ? row_base + D : row_base + map.Slot(t);
      }
    }
  }
  map.Clear(need_token, distinct);
  if (status != kOk) return -status;
  *hits = distinct - num_misses;
  return num_misses;
}

// Applies a successful slow-path plan: the filled slots take their tokens and
// the LRU order is replaced. (The fast path has nothing to commit.)
HISPARSE_HD inline void CommitSwapIn(const RequestLayer& r, const int32_t* new_lru,
                                     const int32_t* miss_tokens, const int32_t* miss_slots,
                                     int32_t num_misses) {
  if (r.seq_len <= r.D) return;
  for (int32_t i = 0; i < num_misses; ++i) r.slot_tokens[miss_slots[i]] = miss_tokens[i];
  for (int32_t i = 0; i < r.D; ++i) r.lru[i] = new_lru[i];
}

}  // namespace hisparse
