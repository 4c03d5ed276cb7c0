"""Pure NumPy reference of the HiSparse swap-in: the executable spec and test oracle.

Written for clarity (Python dicts and lists, one request and one layer at a
time), independently of the C++ core in ``xla_ffi/swap_in_core.h``.

Semantics per request and layer (HiSparse, SGLang ``hisparse.cuh``):
  * Batch row b serves the request in slot req_ids[b] (-1: an idle row, seq_len 0).
  * The hot buffer has D slots plus a reserved slot D for the newest token,
    position seq_len - 1. Device row of (request slot r, slot s) = r * (D + 1) + s.
  * Host row of position t = host_pages[b, t // page_size] * page_size + t % page_size.
  * The row's newest latent row (newest[b]) is written to its slot first: slot seq_len - 1 while
    seq_len <= D, else the reserved slot D.
  * seq_len <= D (fast path): slot i holds token i; no I/O; LRU unchanged.
  * Otherwise: hits keep their slots; each distinct missing position (first-appearance order) takes a
    victim slot holding no token needed this step, chosen by the eviction policy; the newest token is
    served from the reserved slot; each distinct missing position is copied once.
  * Eviction "lru" (HiSparse's): victims are the least-recently-used such slots. New LRU (oldest first)
    = untouched slots (old order) + filled slots (in the order they were taken) + hit slots (old order).
  * Eviction "clock" (second-chance CLOCK; Corbato 1968): ``lru`` is the clock ring read from the hand,
    each entry slot | 2**30 (CLOCK_REF) while the slot's reference bit is set. Hits set their bits; the
    hand skips hit slots and slots filled this step, clears a set bit and moves on, and takes a slot
    whose bit is clear; filled slots start clear. New ``lru`` = the ring read from the hand's final
    position, with the new bits.
  * Eviction "score": victims are the untouched slots whose tokens the indexer ranks lowest this step
    (``slot_scores`` compared by ``score_key``: IEEE total order, -0 before +0, subnormals kept; an empty
    slot before any score), in ascending (score, LRU position) order; a NaN score of an untouched resident
    slot is an error (on every slow-path step). LRU updated as for "lru".
  * Padding (-1) maps to row -1. Hits and misses count distinct positions; the
    newest token counts as a hit.
  * Row errors (a status code for the row, which is left unchanged with rows of -1; the other rows are
    done): a position >= seq_len or < -1, a seq_len outside [0, S], a MISSING position whose page-table
    row is outside [0, H), an LRU order that is not a permutation (slow path only), a NaN score (above),
    a request id outside [-1, R), repeated (the later row), or -1 on a row with seq_len > 0; a layer
    outside [0, L) fails every row. K > D or a newest of the wrong shape is an error of the whole call. A
    row with several defects fails either way; which code it reports may then differ from the kernel's (the
    kernel checks host rows and scores while choosing victims, before its final permutation pass).
"""

from __future__ import annotations

import math

import numpy as np

CLOCK_REF = 1 << 30  # the reference bit of a CLOCK ring entry
EMPTY_SLOT_KEY = -(1 << 31)  # the score policy's key of an empty slot: below every score


def score_key(x) -> int:
  """A float32 score as an int ordered like IEEE's total order of non-NaN floats (-0 before +0; subnormals
  kept, whatever a device's flush-to-zero mode): the score policy compares these."""
  bits = int(np.float32(x).view(np.int32))
  return bits ^ 0x7FFFFFFF if bits < 0 else bits


# Row status codes (xla_ffi/swap_in_core.h SwapInStatus): 0 = done.
OK = 0
BAD_SEQ_LEN = 1
POSITION_OUT_OF_RANGE = 2
HOST_ROW_OUT_OF_RANGE = 3
LRU_NOT_PERMUTATION = 4
LAYER_OUT_OF_RANGE = 5
BAD_REQUEST_ID = 6
BAD_SCORE = 7
BACKUP_ROW_OUT_OF_RANGE = 8
PREFETCH_STALE = 9  # a prefetch whose row's slot table or LRU order changed between start and wait (dropped)


class SwapInError(ValueError):
  """Input the kernel must reject: ``status`` is the row's status code, or None for an error of the whole call
  (the kernel returns an FFI INVALID_ARGUMENT error)."""

  def __init__(self, message: str, status: int | None = None):
    super().__init__(message)
    self.status = status


def swap_in_request(
  top_k, seq_len, host_rows, host_pool_l, hot_l, slot_tokens, lru, row_base, D, *, eviction="lru", slot_scores=None
):
  """Swap-in of one request at one layer, in place on the given NumPy views.

  Args:
    top_k: int[K] positions, -1 padding.
    seq_len: int, tokens of the request.
    host_rows: int[S] position -> host row.
    host_pool_l: T[H, W] host pool of this layer.
    hot_l: T[B*(D+1), W] hot buffers of this layer (flattened rows), modified.
    slot_tokens: int[D], modified. lru: int[D], modified.
    row_base: device row of slot 0 of this request.
    D: hot-buffer slots.
    eviction: "lru", "clock" or "score" (module docstring); slot_scores: float[D] for "score".

  Returns:
    (rows int[K], hits, misses).

  Raises:
    SwapInError: as the kernel (position out of range, bad host row, bad LRU).
  """
  K = len(top_k)
  if K > D:
    raise SwapInError(f"top_k ({K}) > device_buffer_size ({D})")
  if not 0 <= seq_len <= len(host_rows):
    raise SwapInError(f"seq_len {seq_len} outside [0, {len(host_rows)}]", BAD_SEQ_LEN)
  positions = [int(t) for t in top_k]
  for t in positions:
    if t < -1 or t >= seq_len:
      raise SwapInError(f"top-k position {t} outside [-1, {seq_len})", POSITION_OUT_OF_RANGE)
  distinct = list(dict.fromkeys(t for t in positions if t >= 0))
  if seq_len <= D:
    return np.array([-1 if t < 0 else row_base + t for t in positions], np.int32), len(distinct), 0

  newest = seq_len - 1
  H = host_pool_l.shape[0]
  entries = [int(e) for e in lru]
  ring = [e & ~CLOCK_REF if eviction == "clock" and e >= 0 else e for e in entries]
  if sorted(ring) != list(range(D)):
    raise SwapInError("LRU order is not a permutation of the slots", LRU_NOT_PERMUTATION)

  slot_of = {}
  for s in range(D):
    t = int(slot_tokens[s])
    if t in distinct and t != newest and t not in slot_of:
      slot_of[t] = s
  hit_slots = set(slot_of.values())
  misses = [t for t in distinct if t != newest and t not in slot_of]
  for t in misses:  # only rows that are read need a valid page-table entry
    if not 0 <= host_rows[t] < H:
      raise SwapInError(f"position {t} has host row {host_rows[t]} outside [0, {H})", HOST_ROW_OUT_OF_RANGE)
  old_lru = ring
  if eviction == "score":
    resident = [s for s in old_lru if s not in hit_slots and slot_tokens[s] >= 0]
    if any(math.isnan(slot_scores[s]) for s in resident):
      raise SwapInError("a resident slot's score is NaN", BAD_SCORE)
    key = {s: score_key(slot_scores[s]) if slot_tokens[s] >= 0 else EMPTY_SLOT_KEY for s in old_lru}
    candidates = sorted((key[s], i, s) for i, s in enumerate(old_lru) if s not in hit_slots)
    victims = [s for _, _, s in candidates[: len(misses)]]
  elif eviction == "clock":
    ref = {s: bool(e & CLOCK_REF) for s, e in zip(ring, entries)}
    for s in hit_slots:
      ref[s] = True
    victims, hand = [], 0
    while len(victims) < len(misses):
      s = ring[hand % D]
      hand += 1
      if s in hit_slots or s in victims:
        continue
      if ref[s]:
        ref[s] = False
      else:
        victims.append(s)
    for s in victims:
      ref[s] = False
  else:
    victims = [s for s in old_lru if s not in hit_slots][: len(misses)]
  for t, s in zip(misses, victims):
    slot_of[t] = s
    slot_tokens[s] = t
    hot_l[row_base + s] = host_pool_l[host_rows[t]]
  if eviction == "clock":
    lru[:] = [ring[(hand + j) % D] | (CLOCK_REF if ref[ring[(hand + j) % D]] else 0) for j in range(D)]
  else:
    untouched = [s for s in old_lru if s not in hit_slots and s not in victims]
    lru[:] = untouched + victims + [s for s in old_lru if s in hit_slots]

  rows = []
  for t in positions:
    if t < 0:
      rows.append(-1)
    elif t == newest:
      rows.append(row_base + D)
    else:
      rows.append(row_base + slot_of[t])
  return np.array(rows, np.int32), len(distinct) - len(misses), len(misses)


def host_rows_of(host_pages, page_size: int) -> np.ndarray:
  """int64[P * page_size] position -> host row of one page table (-1 where the page is -1)."""
  pages = np.asarray(host_pages, np.int64)
  rows = pages[:, None] * page_size + np.arange(page_size)
  return np.where(pages[:, None] < 0, -1, rows).reshape(-1)


def swap_in(
  layer,
  top_k,
  seq_lens,
  req_ids,
  host_pages,
  newest,
  host_pool,
  hot,
  slot_tokens,
  lru,
  stats,
  slot_scores=None,
  *,
  page_size,
  eviction="lru",
):
  """Batched reference with the shapes and results of ``hisparse_jax.kernels.ops.swap_in``.

  Works on copies; returns (rows, host_pool, hot, slot_tokens, lru, stats, status) as NumPy arrays, status
  int32[B] the row codes above (a failed row is left unchanged, its rows -1). Raises SwapInError (status
  None) where the kernel returns an FFI error: K > D, newest not [B, W] of the hot buffer's dtype.
  newest None: a prefetch (no newest row written, stats unchanged; ``prefetch``).
  """
  hot = np.array(hot, copy=True)
  slot_tokens = np.array(slot_tokens, copy=True)
  lru = np.array(lru, copy=True)
  stats = np.array(stats, copy=True)
  host_pool = np.asarray(host_pool)
  L, R, D1, W = hot.shape
  D = D1 - 1
  B = len(req_ids)
  if np.shape(top_k)[1] > D:
    raise SwapInError(f"top_k ({np.shape(top_k)[1]}) > device_buffer_size ({D})")
  if newest is not None and (np.shape(newest) != (B, W) or np.asarray(newest).dtype != hot.dtype):
    raise SwapInError("newest must be [B, W] of the hot buffer's dtype")
  rows = np.full(np.shape(top_k), -1, np.int32)
  status = np.zeros(B, np.int32)
  if not 0 <= layer < L:
    status[:] = LAYER_OUT_OF_RANGE
    return rows, host_pool, hot, slot_tokens, lru, stats, status
  seen = set()
  for b, r in enumerate(int(x) for x in req_ids):
    if not -1 <= r < R or (r < 0 and seq_lens[b] != 0) or r in seen:
      status[b] = BAD_REQUEST_ID
    elif r >= 0:
      seen.add(r)
  hot_l = hot[layer].reshape(R * D1, W)
  for b, r in enumerate(int(x) for x in req_ids):
    if r < 0 or status[b]:
      continue
    try:
      rows[b], hits, misses = swap_in_request(
        np.asarray(top_k[b]),
        int(seq_lens[b]),
        host_rows_of(host_pages[b], page_size),
        host_pool[layer],
        hot_l,
        slot_tokens[layer, r],
        lru[layer, r],
        r * D1,
        D,
        eviction=eviction,
        slot_scores=None if slot_scores is None else np.asarray(slot_scores)[b],
      )
    except SwapInError as e:  # swap_in_request checks everything before it changes anything
      status[b] = e.status
      continue
    if newest is None:  # a prefetch: the rows it copied
      status[b] = -misses
      continue
    stats[layer, r] += (hits, misses)
    n = int(seq_lens[b])
    if n > 0:  # a failed row changes nothing, so the reference writes the newest rows last
      hot_l[r * D1 + (n - 1 if n <= D else D)] = newest[b]
  return rows, host_pool, hot, slot_tokens, lru, stats, status


def prefetch(
  layer, top_k, seq_lens, req_ids, host_pages, host_pool, hot, slot_tokens, lru, *, page_size, eviction="lru"
):
  """Reference of ``ops.prefetch_start`` + ``ops.prefetch_wait`` with nothing changed in between: the
  swap-in of the predicted positions top_k with no newest row and no stats (eviction "lru" or "clock").
  Works on copies; returns (hot, slot_tokens, lru, prefetched), prefetched int32[B] the rows each row
  copied (0 for an idle row), or -status for a row left unchanged (codes above)."""
  if eviction not in ("lru", "clock"):
    raise SwapInError(f"prefetch takes eviction lru or clock, not {eviction!r}")
  L, R = np.shape(slot_tokens)[:2]
  _, _, hot, slot_tokens, lru, _, status = swap_in(
    layer,
    top_k,
    seq_lens,
    req_ids,
    host_pages,
    None,
    host_pool,
    hot,
    slot_tokens,
    lru,
    np.zeros((L, R, 2), np.int32),
    page_size=page_size,
    eviction=eviction,
  )
  return hot, slot_tokens, lru, -status


def backup(layer, rows, dst, host_pool):
  """Reference of ``ops.backup``: (a copy of host_pool with ``pool[layer + i, dst[n]] = rows[i, n]`` where
  dst[n] >= 0, status int32[N]): BACKUP_ROW_OUT_OF_RANGE for a dst outside [-1, H) (not written),
  LAYER_OUT_OF_RANGE on every column when [layer, layer + Lr) is outside [0, L) (nothing written)."""
  pool = np.array(host_pool, copy=True)
  rows, dst = np.asarray(rows), np.asarray(dst)
  L, H, _ = pool.shape
  status = np.zeros(len(dst), np.int32)
  if layer < 0 or layer + rows.shape[0] > L:
    status[:] = LAYER_OUT_OF_RANGE
    return pool, status
  for n, h in enumerate(int(x) for x in dst):
    if not -1 <= h < H:
      status[n] = BACKUP_ROW_OUT_OF_RANGE
    elif h >= 0:
      pool[layer : layer + rows.shape[0], h] = rows[:, n]
  return pool, status


def random_case(rng: np.random.Generator, *, L=2, B=3, R=5, D=8, K=6, S=40, W=4, page_size=4, dtype=np.float32):
  """A random valid swap-in input (the argument list of ``swap_in``; pass it the same page_size).

  B batch rows serve distinct random request slots of R (one row idle when B < R allows); each
  gets a random seq_len in [0, S], distinct resident tokens (some empty slots) consistent with its
  KV, a random LRU permutation, a random page table into a shared pool of page_size-token pages,
  and top-k positions with padding and duplicates.
  """
  P = -(-S // page_size)
  H = (B * P + 3) * page_size
  layer = int(rng.integers(L))
  req_ids = rng.permutation(R)[:B].astype(np.int32)
  seq_lens = rng.integers(0, S + 1, B).astype(np.int32)
  if B < R and B > 1:
    req_ids[0], seq_lens[0] = -1, 0
  host_pages = rng.permutation(H // page_size)[: B * P].astype(np.int32).reshape(B, P)
  pool = (rng.standard_normal((L, H, W)) * 10).astype(dtype)
  hot = np.zeros((L, R, D + 1, W), dtype)
  slot_tokens = np.tile(np.arange(D, dtype=np.int32), (L, R, 1))
  lru = np.stack([np.stack([rng.permutation(D) for _ in range(R)]) for _ in range(L)]).astype(np.int32)
  top_k = np.full((B, K), -1, np.int32)
  for b in range(B):
    n, r = int(seq_lens[b]), int(req_ids[b])
    if r < 0:
      continue
    host_rows = host_rows_of(host_pages[b], page_size)
    for l in range(L):
      if n > D:
        resident = rng.choice(n - 1, size=min(D, n - 1), replace=False)
        tokens = np.full(D, -1, np.int32)
        tokens[: len(resident)] = resident
        tokens[rng.random(D) < 0.1] = -1
        slot_tokens[l, r] = rng.permutation(tokens)
        for s, t in enumerate(slot_tokens[l, r]):
          if t >= 0:
            hot[l, r, s] = pool[l, host_rows[t]]
        hot[l, r, D] = pool[l, host_rows[n - 1]]
      else:
        for t in range(n):
          hot[l, r, t] = pool[l, host_rows[t]]
    if n:
      top_k[b] = np.where(rng.random(K) < 0.2, -1, rng.integers(0, n, K))
  stats = np.zeros((L, R, 2), np.int32)
  newest = (rng.standard_normal((B, W)) * 10).astype(dtype)
  return [layer, top_k, seq_lens, req_ids, host_pages, newest, pool, hot, slot_tokens, lru, stats]


WORKED_EXAMPLE_PAGE_SIZE = 4


def worked_example():
  """The issue's worked example as ``swap_in`` arguments (page_size ``WORKED_EXAMPLE_PAGE_SIZE``).

  Five request slots; the batch has one row, serving request slot 4. D=4; slots 0..3 of request 4
  hold tokens [10, 3, 7, 12] in device rows 20..23; the newest token 15 (its row given as newest,
  all 7s) goes to the reserved row 24; seq_len 16; LRU oldest-first [0, 1, 2, 3]. Top-k
  [3, 15, 8, -1] -> rows [21, 24, 20, -1]; slot 0 then holds token 8, device row 20 its host row,
  LRU [2, 3, 0, 1].
  """
  L, R, D, W, S, H = 1, 5, 4, 3, 16, 32
  page = WORKED_EXAMPLE_PAGE_SIZE
  hot = np.arange(L * R * (D + 1) * W, dtype=np.float32).reshape(L, R, D + 1, W) + 1000
  slot_tokens = np.tile(np.arange(D, dtype=np.int32), (L, R, 1))
  slot_tokens[0, 4] = [10, 3, 7, 12]
  lru = np.tile(np.arange(D, dtype=np.int32), (L, R, 1))
  pool = np.arange(L * H * W, dtype=np.float32).reshape(L, H, W)
  host_pages = np.array([[5, 2, 7, 0]], np.int32)  # a non-identity page table (S / page = 4 pages)
  top_k = np.array([[3, 15, 8, -1]], np.int32)
  seq_lens = np.array([16], np.int32)
  req_ids = np.array([4], np.int32)
  stats = np.zeros((L, R, 2), np.int32)
  newest = np.full((1, W), 7, np.float32)
  assert host_pages.shape[1] * page == S
  return [0, top_k, seq_lens, req_ids, host_pages, newest, pool, hot, slot_tokens, lru, stats]
